"""Which replicas may take a request: healthy, not draining, and not busy while some replica
is not (:class:`~router.core.routing_settings.BusyThresholds`). In both shapes the routing
step uses, with the same errors when none is left: (replica, load) pairs
(:func:`filter_candidates`) and a bool mask over load columns (:func:`eligible_columns`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from router.core.errors import NoReplicaAvailable
from router.core.load import LoadColumns, LoadTracker, LoadView
from router.core.routing_settings import BusyThresholds
from router.core.types import ReplicaKey


def none_up(replicas: int, drained: int) -> NoReplicaAvailable:
    """The error when none of ``replicas`` is healthy and not draining, ``drained`` of them
    healthy but draining: it names what keeps them out (a drain is not a failure)."""
    if not drained:
        return NoReplicaAvailable("no healthy replica is available")
    failing = replicas - drained
    rest = f", the other {failing} unhealthy" if failing else ""
    return NoReplicaAvailable(
        f"no replica is available: {drained} of {replicas} draining (no new requests){rest}"
    )


def filter_candidates(
    replicas: Sequence[ReplicaKey], load: LoadTracker, busy: BusyThresholds, now: float
) -> list[tuple[ReplicaKey, LoadView]]:
    """Healthy, non-draining replicas, the busy ones dropped while others remain."""
    up: list[tuple[ReplicaKey, LoadView]] = []
    drained = 0
    for r in replicas:
        v = load.view(r, now)
        if v.healthy and not v.draining:
            up.append((r, v))
        elif v.healthy:
            drained += 1
    if not up:
        raise none_up(len(replicas), drained)
    if not busy.enabled:
        return up
    free = [(r, v) for r, v in up if not busy.busy(v)]
    if free:
        return free
    if busy.reject_when_all_busy:
        raise NoReplicaAvailable("every replica is over its busy threshold", busy=True)
    return up


def eligible_columns(load: LoadColumns, busy: BusyThresholds) -> np.ndarray:
    """``filter_candidates`` on columns: a bool mask of the healthy, non-draining replicas,
    the busy ones dropped while others remain (the same errors when none is left)."""
    healthy = load.healthy > 0
    up: np.ndarray = healthy & (load.draining == 0)
    if not up.any():
        raise none_up(len(up), int(np.count_nonzero(healthy)))
    if busy.enabled:
        free = up & ~busy.busy(load)
        if free.any():
            return free  # type: ignore[no-any-return]
        if busy.reject_when_all_busy:
            raise NoReplicaAvailable("every replica is over its busy threshold", busy=True)
    return up
