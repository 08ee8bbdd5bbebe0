"""Engine load reports that stop coming are dropped, not kept for good: a replica whose
metrics page became unreachable would otherwise keep its last KV usage forever, and with it
stay over ``busy.max_kv_usage`` (out of routing) or carry the KV-pressure term."""

from __future__ import annotations

import asyncio

import pytest

from router.core.load import EngineReport, LoadTracker
from router.core.routing import BusyThresholds
from router.core.types import ReplicaKey
from router.service.app import STATE
from router.service.config import build_settings
from router.service.state import RouterState
from tests.backends import Backend, kimi_model_table, start_router
from tests.waiting import eventually

A, B = ReplicaKey("a"), ReplicaKey("b")
MODEL = "kimi-test"


def test_a_report_older_than_the_bound_is_dropped_from_views_and_columns() -> None:
    t = LoadTracker()
    t.add_replica(A)
    t.add_replica(B)
    t.columns([A, B])  # mirrored: the array path must see the drop too
    t.engine_report(A, EngineReport(running=3, waiting=7, kv_usage=0.97, at=0.0))
    t.engine_report(B, EngineReport(running=1, waiting=0, kv_usage=0.5, at=8.0))
    busy = BusyThresholds(max_kv_usage=0.9)
    assert busy.busy(t.view(A, 5.0)) and float(t.columns([A, B]).kv_usage[0]) == 0.97
    assert t.forget_stale_reports(10.0, 10.0) == []  # at the bound: kept
    assert t.forget_stale_reports(10.5, 10.0) == [A]
    view = t.view(A, 10.5)
    assert view.engine is None and view.kv_usage == 0.0 and not busy.busy(view)
    cols = t.columns([A, B])
    assert list(cols.kv_usage) == [0.0, 0.5] and not busy.busy(cols)[0]
    assert t.view(B, 10.5).engine is not None  # a fresh one stays
    t.engine_report(A, EngineReport(running=0, waiting=0, kv_usage=0.2, at=11.0))
    assert t.view(A, 11.0).kv_usage == pytest.approx(0.2)  # reports count again as they come


async def test_the_service_drops_a_report_that_stopped_coming() -> None:
    backend = await Backend("b0", [MODEL]).start()
    settings = build_settings(
        {
            "server": {"health_interval_s": 0, "engine_metrics_interval_s": 0.05},
            "replicas": [{"url": backend.url, "model": MODEL, "name": backend.name}],
            "models": {MODEL: kimi_model_table()},
        }
    )
    running, _url = await start_router(settings)
    state: RouterState = running.app[STATE]
    (key,) = [ep.key for ep in state.registry.endpoints()]
    loop = asyncio.get_running_loop()
    try:
        # the last report of a replica whose page then stopped answering
        state.load.engine_report(key, EngineReport(2, 5, 0.97, at=loop.time()))
        assert state.load.view(key, loop.time()).kv_usage == pytest.approx(0.97)
        # housekeeping (every second) drops it once 10 scrape intervals (0.5 s) passed
        await eventually(lambda: state.load.view(key, loop.time()).engine is None, timeout=5)
        assert state.load.view(key, loop.time()).kv_usage == 0.0
    finally:
        await running.cleanup()
        await backend.stop()
