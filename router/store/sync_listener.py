"""What ``IndexSync`` (router/store/sync.py) tells the rest of the router as it follows
the store: a replica registered (``replica_up``, again on every change of its
registration), a replica gone with the keys it had (``replica_down``), and a load sample
of a replica key stamped with when it was taken by the follower's clock (``load``).
``LoadTrackerListener`` feeds these to a ``LoadTracker``; ``NullListener`` drops them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from router.core.load import EngineReport, LoadTracker
from router.core.types import ReplicaKey
from router.store.base import LoadSample, ReplicaInfo


class SyncListener(Protocol):
    """Told about fleet membership and load as the follower learns them."""

    def replica_up(self, info: ReplicaInfo) -> None: ...

    def replica_down(self, replica: str, keys: Sequence[ReplicaKey]) -> None: ...

    def load(self, key: ReplicaKey, sample: LoadSample, now: float) -> None:
        """``now``: when the sample was taken, by the follower's ``clock``."""
        ...


class NullListener:
    def replica_up(self, info: ReplicaInfo) -> None:
        return None

    def replica_down(self, replica: str, keys: Sequence[ReplicaKey]) -> None:
        return None

    def load(self, key: ReplicaKey, sample: LoadSample, now: float) -> None:
        return None


class LoadTrackerListener:
    """Feeds a ``LoadTracker``: replicas appear/disappear, engine reports stamped ``now``."""

    def __init__(self, load: LoadTracker) -> None:
        self.tracker = load

    def replica_up(self, info: ReplicaInfo) -> None:
        for key in info.replica_keys():
            self.tracker.add_replica(key)

    def replica_down(self, replica: str, keys: Sequence[ReplicaKey]) -> None:
        for key in keys:
            self.tracker.remove_replica(key)

    def load(self, key: ReplicaKey, sample: LoadSample, now: float) -> None:
        report = EngineReport(sample.running, sample.waiting, sample.kv_usage, now)
        self.tracker.engine_report(key, report)
