"""Engine load reports that stop coming are dropped, not kept for good: a replica whose
metrics page became unreachable would otherwise keep its last KV usage forever, and with it
stay over ``busy.max_kv_usage`` (out of routing) or carry the KV-pressure term."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web

from router.core.load import EngineReport, LoadTracker
from router.core.routing_settings import BusyThresholds
from router.core.types import ReplicaKey
from router.service.app import STATE
from router.service.config import build_settings
from router.service.state import RouterState
from tests.backends import Backend, kimi_model_table, start_router
from tests.ports import free_port
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


def _engine_page(running: int, queries: float, hits: float) -> str:
    """A vLLM metrics page of one engine rank with its load gauges and prefix-cache
    counters."""
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0"}} {running}\n'
        '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0"} 0\n'
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.1\n'
        "# TYPE vllm:prefix_cache_queries counter\n"
        f'vllm:prefix_cache_queries_total{{engine="0"}} {queries}\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        f'vllm:prefix_cache_hits_total{{engine="0"}} {hits}\n'
    )


async def _page_server(text: str) -> tuple[web.AppRunner, str, list[int]]:
    """A metrics page on loopback: (runner, its URL, [times it was fetched])."""
    fetched = [0]

    async def handler(_: web.Request) -> web.Response:
        fetched[0] += 1
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/metrics", fetched


async def test_a_replica_with_a_publisher_and_a_metrics_url_follows_its_publisher(
    redis_url: str, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica configured with ``metrics_url`` whose publisher also reports it through
    Redis: two sources of the same figures, which interleaved made the exported engine
    counters step back (a reset to Prometheus) and the load view flip. The publisher's
    reports win while they come; the router's own scrape is dropped for that replica, and
    a warning names it once."""
    from router.store.redis_store import RedisStore
    from router.store.schema import KeySchema
    from tests.test_publisher_e2e import _engine, _publisher

    # distinct figures per source, so the test sees which one the router follows
    pub_runner, pub_url, _ = await _page_server(_engine_page(3, 100.0, 50.0))
    own_runner, own_url, own_fetched = await _page_server(_engine_page(9, 1000.0, 900.0))
    settings = build_settings(
        {
            "server": {
                "redis_url": redis_url,
                "redis_key_prefix": key_prefix,
                "health_interval_s": 0,
                "engine_metrics_interval_s": 0.05,
            },
            "replicas": [
                {"url": "http://127.0.0.1:9", "model": "m", "name": "rx", "metrics_url": own_url}
            ],
            "models": {"m": {"block_size": 32}},
        }
    )
    store = RedisStore.from_url(redis_url, KeySchema(key_prefix, stream_shards=8))
    eng = await _engine(16, 7)
    pub = _publisher(store, "rx", eng, metrics_url=pub_url)
    caplog.set_level(logging.WARNING)
    router, _url = await start_router(settings)
    state: RouterState = router.app[STATE]
    key = ReplicaKey("rx")
    loop = asyncio.get_running_loop()
    seen: list[tuple[object, object]] = []

    def observed() -> tuple[object, object]:
        view = state.load.view(key, loop.time()).engine
        return state.fleet.engine_prefix_cache.get(key), view.running if view else None

    try:
        await pub.start()
        await eventually(lambda: observed() == ((100.0, 50.0), 3))
        # the router's scrape goes on (five more fetches of its page): the figures stay the
        # publisher's at every look
        until = own_fetched[0] + 5

        def five_more_scrapes() -> bool:
            seen.append(observed())
            return own_fetched[0] >= until

        await eventually(five_more_scrapes)
        seen.append(observed())
        assert set(seen) == {((100.0, 50.0), 3)}
        named = [
            r for r in caplog.records if "rx" in r.getMessage() and "metrics_url" in r.getMessage()
        ]
        assert len(named) == 1, [r.getMessage() for r in caplog.records]
    finally:
        await pub.stop()
        await router.cleanup()
        await store.close()
        await eng.pub.close()
        await pub_runner.cleanup()
        await own_runner.cleanup()


def test_a_change_of_source_never_steps_the_exported_counters_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The two feeds of one replica key (router/service/engine_sources.py): the scrape's
    reports are dropped while the publisher's come; when the source changes, counters the
    new source read before the old one's last are not exported (the copy stays monotonic),
    but a decrease that lasts (the engine restarted) is exported once the window passed."""
    from router.service.engine_sources import PUBLISHER, SCRAPE
    from router.service.engines import EngineFeed
    from router.store.base import LoadSample

    state = RouterState(
        build_settings(
            {
                "server": {"engine_metrics_interval_s": 1.0},  # a 10 s window
                "replicas": [{"url": "http://127.0.0.1:9", "model": MODEL, "name": "rx"}],
                "models": {MODEL: kimi_model_table()},
            }
        )
    )
    key = ReplicaKey("rx")
    scrape, publisher = EngineFeed(state, source=SCRAPE), EngineFeed(state, source=PUBLISHER)

    def sample(running: int, queries: float, hits: float) -> LoadSample:
        return LoadSample(running, 0, 0.1, 0.0, queries, hits)

    def shown(now: float) -> tuple[object, object]:
        view = state.load.view(key, now).engine
        return state.fleet.engine_prefix_cache.get(key), view.running if view else None

    caplog.set_level(logging.WARNING)
    scrape.load(key, sample(9, 1000.0, 900.0), 0.0)  # the scrape came first (start-up)
    assert shown(0.0) == ((1000.0, 900.0), 9)
    publisher.load(key, sample(3, 990.0, 890.0), 0.5)  # read before the scrape's last
    assert shown(0.5) == ((1000.0, 900.0), 3)
    scrape.load(key, sample(9, 1010.0, 910.0), 0.6)  # the publisher's now: dropped
    scrape.load(key, sample(9, 1020.0, 920.0), 0.7)
    assert shown(0.7) == ((1000.0, 900.0), 3)
    publisher.load(key, sample(3, 1005.0, 905.0), 1.0)
    assert shown(1.0) == ((1005.0, 905.0), 3)
    publisher.load(key, sample(3, 5.0, 1.0), 2.0)  # the engine restarted, inside the window
    assert shown(2.0) == ((1005.0, 905.0), 3)
    publisher.load(key, sample(3, 5.0, 1.0), 11.0)  # past it: the engine's own reset
    assert shown(11.0) == ((5.0, 1.0), 3)
    scrape.load(key, sample(9, 20.0, 10.0), 21.0)  # the publisher's last is exactly 10 s old
    assert shown(21.0) == ((5.0, 1.0), 3)
    scrape.load(key, sample(9, 20.0, 10.0), 21.5)  # it stopped: the scrape follows the key
    assert shown(21.5) == ((20.0, 10.0), 9)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "replica rx" in warned[0] and "metrics_url" in warned[0]
