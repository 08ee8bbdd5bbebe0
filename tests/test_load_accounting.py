"""Load accounting as the policies read it: the router's own counts, its peers', a failing
replica's phantom requests and the engines' own reports, combined without cancelling each
other out, the same on the per-candidate and the array path."""

from __future__ import annotations

import random

import pytest

from router.core.index import PrefixIndex
from router.core.load import EngineReport, LoadTracker
from router.core.policies import Ours
from router.core.routing import RoutingEngine, RoutingSettings
from router.core.types import ReplicaKey, RouteRequest

A, B = ReplicaKey("a"), ReplicaKey("b")
NOW = 100.0


def _engine(load: LoadTracker, keys: tuple[ReplicaKey, ...], columnar: bool) -> RoutingEngine:
    index = PrefixIndex()
    for key in keys:
        index.add_replica(key)
        load.add_replica(key)
    settings = RoutingSettings(block_size=16)
    return RoutingEngine(index, load, Ours(), settings, columnar_min=1 if columnar else 10**9)


@pytest.mark.parametrize("columnar", [False, True])
def test_a_fresh_engine_queue_does_not_cancel_a_failing_replicas_phantom_load(
    columnar: bool,
) -> None:
    """Phantom requests (LoadTracker.set_penalty) are no request the engine queues: its
    reported ``waiting`` beyond the router's requests counts other routers' traffic, which
    the phantoms must not explain away. Both replicas report the same queue; the failing one
    must cost more."""
    load = LoadTracker()
    keys = (A, B)
    engine = _engine(load, keys, columnar)
    for key in keys:
        load.engine_report(key, EngineReport(running=4, waiting=10, kv_usage=0.5, at=NOW))
    load.set_penalty(A, 6, 6 * 4096)  # three failures in a row, two phantoms each
    request = RouteRequest("q", "m", 2000, [], 16)
    queues = {}
    for key in keys:
        decision = engine.route(request, (key,), NOW, random.Random(0))
        queues[key] = decision.terms["queue"]
    assert queues[A] > queues[B]
    assert engine.route(request, keys, NOW, random.Random(0)).replica == B
