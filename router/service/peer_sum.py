"""The load other routers have in flight, from every source, summed into one tracker.

Two sources report the requests of other routers on the same replicas: the other worker
processes of this pod (router/service/load_share.py, over unix sockets) and the other pods
(router/service/pod_exchange.py, through Redis). Each hands its latest view to
:meth:`PeerSum.update` under its own name; the tracker's peer load
(:meth:`~router.core.load.LoadTracker.set_peer_load`) is always the field-wise sum of the
sources' latest views, so one source's round never erases another's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from aiohttp import web

from router.core.load import NO_PEER_LOAD, LoadTracker, PeerLoad, summed_load
from router.core.types import ReplicaKey
from router.service.keys import STATE


def summed(answers: Iterable[dict[ReplicaKey, PeerLoad]]) -> dict[ReplicaKey, PeerLoad]:
    """Several views as one: per replica, the sum of what each reported."""
    per_key: dict[ReplicaKey, list[PeerLoad]] = {}
    for answer in answers:
        for key, load in answer.items():
            per_key.setdefault(key, []).append(load)
    return {key: summed_load(loads) for key, loads in per_key.items()}


class PeerSum:
    """The sources' latest views (by source name) and what was applied to ``load``."""

    def __init__(self, load: LoadTracker) -> None:
        self.load = load
        self.sources: dict[str, dict[ReplicaKey, PeerLoad]] = {}
        self.applied: set[ReplicaKey] = set()

    def update(self, source: str, view: dict[ReplicaKey, PeerLoad]) -> None:
        """Replace ``source``'s view (empty: it reports nothing) and apply the new sum."""
        if view:
            self.sources[source] = view
        elif self.sources.pop(source, None) is None:
            return
        total = next(iter(self.sources.values())) if len(self.sources) == 1 else {}
        if len(self.sources) > 1:
            total = summed(self.sources.values())
        load = self.load
        for key in self.applied - total.keys():
            load.set_peer_load(key, NO_PEER_LOAD)
        for key, peer in total.items():
            load.set_peer_load(key, peer)
        self.applied = set(total)


PEER_SUM: Final = web.AppKey("peer_sum", PeerSum)


def peer_sum(app: web.Application) -> PeerSum:
    """The app's :class:`PeerSum`, made on first call (call it before the app starts)."""
    got = app.get(PEER_SUM)
    if got is None:
        got = app[PEER_SUM] = PeerSum(app[STATE].load)
    return got
