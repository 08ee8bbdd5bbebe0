"""``kvrouter_index_event_lag_seconds``: the router's wall clock when it applies a replica's
index events minus the time carried with them, per replica key.

* Direct ZMQ (``[[replicas]] zmq``): the engine's ``KVEventBatch.ts``.
* Redis (``server.redis_url``): the change-stream entry's time (its ID is the Redis server's
  wall clock in milliseconds at ``XADD``; the entries carry no other time), i.e. how long the
  publisher's write took to reach this router's index.

Real ZMQ, a real redis-server, real HTTP; the gauge used to be declared and never set.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import openai
from aiohttp import web

from router.core.index import PrefixIndex
from router.core.types import BlocksStored, ReplicaKey
from router.events.direct import DirectEvents
from router.events.encode import encode_batch
from router.events.ingest import EndpointSpec
from router.events.model import EngineBatch, EngineBlockStored
from router.events.zmq_pub import KVEventPublisher
from router.mock.server import MockSettings
from router.mock.server import create_app as create_mock
from router.service.app import INDEX_SYNC, STATE
from router.service.config import build_settings
from router.store.base import ReplicaInfo
from router.store.redis_store import RedisStore
from router.store.schema import KeySchema
from router.store.sync import IndexSync
from router.store.writer import StoreWriter
from tests.backends import start_router
from tests.ports import free_port
from tests.waiting import eventually

LAG = "kvrouter_index_event_lag_seconds"


def lag_series(text: str) -> dict[str, float]:
    """replica label -> value of the lag gauge on a /metrics page."""
    out = {}
    for line in text.splitlines():
        if line.startswith(LAG + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('replica="')[1].split('"')[0]] = float(value)
    return out


async def scrape(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        return lag_series(await r.text())


def stored(tokens: list[int], be: int = 16) -> EngineBlockStored:
    hashes = tuple(
        hash(tuple(tokens[: (i + 1) * be])) & (2**63 - 1) for i in range(len(tokens) // be)
    )
    return EngineBlockStored(hashes, None, tuple(tokens), be)


# ---------------------------------------------------------------------------- direct ZMQ


async def test_direct_events_lag_is_wall_clock_minus_the_batch_ts() -> None:
    pub = KVEventPublisher(f"tcp://127.0.0.1:{free_port()}")
    lag: dict[str, float] = {}
    direct = DirectEvents(PrefixIndex(), event_lag=lag)
    direct.add_replica("eng", "m", 32, [EndpointSpec(pub.endpoint)])
    await direct.start()
    try:
        await asyncio.sleep(0.2)  # ZMQ slow joiner
        rng = random.Random(3)
        old = encode_batch(
            EngineBatch(time.time() - 12.0, (stored([rng.randrange(9999) for _ in range(64)]),))
        )
        await pub.publish_raw(old)
        await eventually(lambda: "eng" in lag)
        assert 12.0 <= lag["eng"] < 14.0, lag
        await pub.publish([stored([rng.randrange(9999) for _ in range(64)])])  # ts = now
        await eventually(lambda: lag["eng"] < 12.0)
        assert 0.0 <= lag["eng"] < 2.0, lag
    finally:
        await direct.stop()
        await pub.close()


async def _mock(i: int, runners: list[Any]) -> dict[str, Any]:
    zmq, port = free_port(), free_port()
    s = MockSettings(
        model="m", replica=f"r{i}", block_size=64, engine_block_size=16,
        zmq_endpoint=f"tcp://127.0.0.1:{zmq}",
    )  # fmt: skip
    runner = web.AppRunner(create_mock(s))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    runners.append(runner)
    return {"url": f"http://127.0.0.1:{port}", "model": "m", "name": f"r{i}", "zmq": s.zmq_endpoint}


async def test_router_exports_event_lag_of_direct_zmq_replicas() -> None:
    runners: list[Any] = []
    try:
        replicas = [await _mock(i, runners) for i in range(2)]
        settings = build_settings({"replicas": replicas, "models": {"m": {"block_size": 64}}})
        router, url = await start_router(settings)
        runners.append(router)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        await asyncio.sleep(0.2)  # ZMQ slow joiner
        rng = random.Random(5)
        for _ in range(2):
            prompt = [rng.randrange(1, 50_000) for _ in range(10 * 64)]
            await client.completions.create(model="m", prompt=prompt, max_tokens=1)
        await client.close()
        state = router.app[STATE]
        await eventually(lambda: bool(state.event_lag_s))
        got = await scrape(url)
        assert got and set(got) <= {"r0", "r1"}, got
        assert all(0.0 <= v < 5.0 for v in got.values()), got
    finally:
        for r in runners:
            await r.cleanup()


# ---------------------------------------------------------------------------- Redis


async def test_index_sync_lag_is_wall_clock_minus_the_stream_entry_time(
    redis_url: str, key_prefix: str
) -> None:
    store = RedisStore.from_url(redis_url, KeySchema(key_prefix, stream_shards=2))
    info = ReplicaInfo("a", url="http://a", model="m", dp_ranks=(0, 1))
    await store.register(info, owner="pub-a", lease_ttl_s=30)
    writer = StoreWriter(store, info.replica_keys())
    await writer.flush()
    lag: dict[str, float] = {}
    ahead: Callable[[], float] = lambda: time.time() + 30.0  # noqa: E731  (router clock 30 s ahead)
    sync = IndexSync(
        store, PrefixIndex(), event_lag=lag, wall_clock=ahead, audit_interval_s=0.1, block_s=0.05
    )
    try:
        async with sync:
            assert lag == {}  # a bootstrap snapshot carries no event time
            writer.add(ReplicaKey("a", 1), [BlocksStored((1, 2, 3))])
            await writer.flush()
            await eventually(lambda: "a#dp1" in lag)
            assert 30.0 <= lag["a#dp1"] < 32.0, lag
            assert "a" not in lag  # rank 0 had no events
            await store.deregister("a")
            await eventually(lambda: not lag)  # a replica that left has no lag series
    finally:
        await store.close()


async def test_router_exports_event_lag_of_redis_replicas(redis_url: str, key_prefix: str) -> None:
    schema = KeySchema(key_prefix, stream_shards=2)
    publisher_side = RedisStore.from_url(redis_url, schema)
    runners: list[Any] = []
    try:
        settings = build_settings(
            {
                "server": {
                    "redis_url": redis_url,
                    "redis_key_prefix": key_prefix,
                    "redis_stream_shards": 2,
                },
                "models": {"m": {"block_size": 16}},
            }
        )
        router, url = await start_router(settings)
        runners.append(router)
        await asyncio.wait_for(router.app[INDEX_SYNC].ready.wait(), 10)
        info = ReplicaInfo("a", url="http://127.0.0.1:9", model="m", block_size=16)
        await publisher_side.register(info, owner="pub-a", lease_ttl_s=30)
        writer = StoreWriter(publisher_side, info.replica_keys())
        await writer.flush()
        state = router.app[STATE]
        await eventually(lambda: state.registry.find("a") != [])
        writer.add(ReplicaKey("a"), [BlocksStored(tuple(range(100, 120)))])
        await writer.flush()
        await eventually(lambda: "a" in state.event_lag_s)
        got = await scrape(url)
        assert set(got) == {"a"} and 0.0 <= got["a"] < 5.0, got
    finally:
        for r in runners:
            await r.cleanup()
        await publisher_side.close()


async def test_an_idle_replica_holds_its_last_lag_and_a_late_one_rewrites_it() -> None:
    """What ``KVRouterIndexEventLag`` must tell apart (deploy/k8s/base/prometheus-rules.yaml
    asks for a lag over 2 s that ``changes`` within 5 min). The gauge is set when a batch is
    applied and holds while nothing comes. ``idle``: its last batch came 9 s late, then
    nothing: every scrape shows the same 9 s, which says nothing of now. ``late``: a batch
    3 s late between scrapes: over 2 s, and a new value at each scrape."""
    pubs = {n: KVEventPublisher(f"tcp://127.0.0.1:{free_port()}") for n in ("idle", "late")}
    settings = build_settings({
        "replicas": [{"url": "http://127.0.0.1:9", "model": "m", "name": n, "zmq": p.endpoint}
                     for n, p in pubs.items()],
        "models": {"m": {"block_size": 64}},
    })  # fmt: skip
    router, url = await start_router(settings)
    rng = random.Random(7)

    async def send(name: str, late_s: float) -> None:
        block = stored([rng.randrange(9999) for _ in range(64)])
        batch = EngineBatch(time.time() - late_s, (block,))
        await pubs[name].publish_raw(encode_batch(batch))

    try:
        lag = router.app[STATE].event_lag_s

        async def subscribed(name: str, late_s: float) -> bool:
            await send(name, late_s)  # (again until one gets through: ZMQ's slow joiner)
            return name in lag

        await eventually(lambda: subscribed("idle", 9.0), interval=0.1)
        await eventually(lambda: subscribed("late", 3.0), interval=0.1)
        scrapes = []
        for _ in range(4):
            before = lag["late"]
            await send("late", 3.0)
            await eventually(lambda: lag["late"] != before)  # noqa: B023
            scrapes.append(await scrape(url))
        # (the first scrape may still see a copy of idle's batch that was on its way)
        idle = [s["idle"] for s in scrapes[1:]]
        assert len(set(idle)) == 1 and 9.0 <= idle[0] < 11.0, scrapes
        late = [s["late"] for s in scrapes]
        assert len(set(late)) == len(late) and all(3.0 <= v < 5.0 for v in late), scrapes
    finally:
        await router.cleanup()
        for p in pubs.values():
            await p.close()
