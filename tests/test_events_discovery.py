"""A replica asked where it publishes its KV events (``zmq = "auto"``): vLLM 0.34's
``GET /kv_event_sources`` answer read into endpoints (router/events/discovery.py), and a router
following mock replicas found that way, over real HTTP and ZMQ."""

from __future__ import annotations

import random
from typing import Any

import pytest

from router.core.errors import ConfigError
from router.core.hashing import hash_prompt, root_hash
from router.core.types import ReplicaKey
from router.events.discovery import NoEventSources, event_sources
from router.events.endpoints import EndpointSpec
from router.mock.server import MockSettings
from router.service.app import STATE
from router.service.config import build_settings
from tests.backends import start_mock, start_router
from tests.ports import free_port
from tests.waiting import eventually

B = 64
MODEL = "m"


def _config(endpoint: str, replay: str | None = None, **extra: Any) -> dict[str, Any]:
    """One rank's ``KVEventsConfig`` as vLLM 0.34 serialises it."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": replay,
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
        "topic": "",
        **extra,
    }


def test_bound_addresses_become_the_replicas_and_ranks_come_in_order() -> None:
    answer = {
        "1": _config("tcp://*:5558", "tcp://*:5560", topic="kv"),
        "0": _config("tcp://0.0.0.0:5557", "tcp://0.0.0.0:5559", topic="kv"),
    }
    assert event_sources(answer, "http://10.0.0.7:8000") == (
        EndpointSpec("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5559", "kv", 0),
        EndpointSpec("tcp://10.0.0.7:5558", "tcp://10.0.0.7:5560", "kv", 1),
    )
    v6 = event_sources({"0": _config("tcp://[::]:5557")}, "http://[fd00::7]:8000")
    assert v6 == (EndpointSpec("tcp://[fd00::7]:5557", None, "", 0),)
    named = event_sources({"0": _config("tcp://10.1.1.1:5557")}, "http://vllm-0:8000")
    assert named[0].endpoint == "tcp://10.1.1.1:5557"  # an explicit host is where it binds


@pytest.mark.parametrize(
    "answer,needle",
    [
        ({}, "publishes no KV events"),
        ([], "not a JSON object"),
        ({"0": _config("tcp://*:5557", publisher="null")}, "publisher 'null'"),
        ({"0": _config("tcp://*:0")}, "expected tcp://HOST:PORT"),
        ({"x": _config("tcp://*:5557")}, "rank 'x'"),
        ({"0": {"publisher": "zmq"}}, "no endpoint"),
    ],
)
def test_answers_without_a_followable_endpoint_say_why(answer: Any, needle: str) -> None:
    with pytest.raises(NoEventSources, match=None) as info:
        event_sources(answer, "http://h:8000")
    assert needle in str(info.value)


def test_auto_names_its_replay_endpoint_itself() -> None:
    rep = {"url": "http://h:1", "model": MODEL, "zmq": "auto", "zmq_replay": "tcp://h:2"}
    with pytest.raises(ConfigError, match="names it itself"):
        build_settings({"replicas": [rep]})


async def test_a_router_follows_the_events_of_replicas_it_asked() -> None:
    """Two mock replicas binding ``tcp://*:PORT`` as vLLM does by default, and one with events
    off; the router is configured with their URLs and ``zmq = "auto"`` only. It follows the
    two, predicts a repeated prompt's hit as the engine reports it, and keeps asking the
    third without harm."""
    import openai

    runners: list[Any] = []
    try:
        replicas = []
        for i in range(3):
            port, replay = free_port(), free_port()
            s = MockSettings(
                model=MODEL, replica=f"r{i}", block_size=B,
                zmq_endpoint=f"tcp://*:{port}" if i < 2 else "",
                replay_endpoint=f"tcp://*:{replay}" if i < 2 else "",
            )  # fmt: skip
            runner, base = await start_mock(s)
            runners.append(runner)
            # the third serves another model here: it is asked, never routed to
            model = MODEL if i < 2 else "other"
            replicas.append({"url": base, "model": model, "name": f"r{i}", "zmq": "auto"})
        settings = build_settings(
            {"replicas": replicas, "models": {MODEL: {"block_size": B, "policy": "ours"}}}
        )
        router, url = await start_router(settings)
        runners.append(router)
        state = router.app[STATE]
        rng = random.Random(9)
        prompt = [rng.randrange(1, 50_000) for _ in range(12 * B + 3)]
        hashes = hash_prompt(prompt, B, root_hash(MODEL)).hashes
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        try:
            await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            owner = ReplicaKey.parse(state.recent_decisions(1)[0]["replica"])

            def indexed() -> bool:  # through events only: speculation is not a real entry
                return state.index.match(hashes).get(owner).kv_blocks == len(hashes) and (
                    state.index.stats().speculative_entries == 0
                )

            await eventually(indexed)
            reply = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            details = reply.usage.prompt_tokens_details if reply.usage else None
            decision = state.recent_decisions(1)[0]
            assert details is not None and decision["replica"] == str(owner)
            assert decision["usable_tokens"] == details.cached_tokens == len(hashes) * B
            assert state.index.replica_size(ReplicaKey("r2"))[0] == 0  # nothing to follow
        finally:
            await client.close()
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


async def test_the_publisher_sidecar_asks_its_engine_too() -> None:
    """``kvrouter publish --zmq auto --url URL``: the endpoints its engine names, a replica
    answering late included (asked again until it answers)."""
    import argparse

    from aiohttp import web

    from router.publisher.cli import _endpoints

    asked = 0

    async def sources(_: web.Request) -> web.Response:
        nonlocal asked
        asked += 1
        if asked == 1:
            return web.json_response({})  # events not on yet: asked again (after 1 s)
        return web.json_response({"0": _config("tcp://*:6001", "tcp://*:6002")})

    app = web.Application()
    app.router.add_get("/kv_event_sources", sources)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        args = argparse.Namespace(
            zmq=["auto"], replay=None, url=f"http://127.0.0.1:{port}", replica="p0",
            dp_ranks=[0], topic="",
        )  # fmt: skip
        assert await _endpoints(args) == (
            EndpointSpec("tcp://127.0.0.1:6001", "tcp://127.0.0.1:6002", "", 0),
        )
        assert asked == 2
        with pytest.raises(ValueError, match="needs --url"):
            await _endpoints(argparse.Namespace(**{**vars(args), "url": ""}))
    finally:
        await runner.cleanup()


async def test_a_replica_that_moves_its_event_ports_is_followed_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``zmq = "auto"``: the replica restarts publishing on other ports (vLLM's ``tcp://*:0``
    is resolved to a port the OS picks anew; an operator changed the ports or the dp size).
    The router asks it again, forgets what the old endpoints said and follows the new ones.
    Before, it asked once: the old engine's blocks stayed indexed and the new engine's were
    never seen."""
    from aiohttp import web

    from router.events import discovery
    from router.events.model import EngineBlockStored
    from router.events.zmq_pub import KVEventPublisher

    monkeypatch.setattr(discovery, "SOURCES_RECHECK_S", 0.1)

    def engine() -> KVEventPublisher:
        pub = KVEventPublisher(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
        pub.start()
        return pub

    def sources(pub: KVEventPublisher) -> dict[str, Any]:
        return {"0": _config(pub.endpoint, pub.replay_endpoint)}

    pub = engine()
    answer = sources(pub)

    async def kv_event_sources(_: web.Request) -> web.Response:
        return web.json_response(answer)

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/kv_event_sources", kv_event_sources)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", free_port())
    await site.start()
    base = f"http://127.0.0.1:{site._port}"
    replica = {"url": base, "model": MODEL, "name": "r0", "zmq": "auto"}
    settings = build_settings({"replicas": [replica], "models": {MODEL: {"block_size": B}}})
    router, _ = await start_router(settings)
    state = router.app[STATE]
    rng = random.Random(3)
    key = ReplicaKey("r0")

    def blocks(tokens: list[int]) -> int:
        return state.index.match(hash_prompt(tokens, B, root_hash(MODEL)).hashes).get(key).kv_blocks

    async def stored(pub: KVEventPublisher, tokens: list[int]) -> None:
        """Published until indexed (ZMQ's slow joiner drops the first ones)."""

        async def indexed() -> bool:
            await pub.publish([EngineBlockStored((rng.getrandbits(63),), None, tuple(tokens), B)])
            return blocks(tokens) == 1

        await eventually(indexed)

    try:
        a = [rng.randrange(1, 50_000) for _ in range(B)]
        await stored(pub, a)
        await pub.close()  # the engine restarts on other ports
        pub = engine()
        answer = sources(pub)
        b = [rng.randrange(1, 50_000) for _ in range(B)]
        await stored(pub, b)
        assert blocks(a) == 0
    finally:
        await router.cleanup()
        await runner.cleanup()
        await pub.close()


async def test_a_publisher_follows_its_engine_to_the_ports_it_moved_to(
    monkeypatch: pytest.MonkeyPatch, private_redis: Any
) -> None:
    """``kvrouter publish --zmq auto``: the engine (a mock replica binding ``tcp://*:PORT``)
    restarts publishing on other ports, its cache new. The publisher asks it again, forgets
    the old engine's blocks in the store (as for a restart found by seq) and follows the new
    endpoints. Before, it asked once at start: the old blocks stayed in Redis for as long
    as the sidecar ran and the new engine's were never published."""
    import aiohttp
    from aiohttp import web

    from router.core.index import PrefixIndex
    from router.events import discovery
    from router.mock.server import create_app
    from router.publisher.publisher import Publisher, PublisherSettings
    from router.store.base import ReplicaInfo
    from router.store.redis_store import RedisStore
    from router.store.schema import KeySchema
    from router.store.sync import IndexSync

    monkeypatch.setattr(discovery, "SOURCES_RECHECK_S", 0.1)
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    async def engine() -> web.AppRunner:
        s = MockSettings(
            model=MODEL, replica="p0", block_size=B, time_scale=0.05,
            zmq_endpoint=f"tcp://*:{free_port()}", replay_endpoint=f"tcp://*:{free_port()}",
        )  # fmt: skip
        runner = web.AppRunner(create_app(s))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    rng = random.Random(5)
    key = ReplicaKey("p0")
    index = PrefixIndex()

    def blocks(tokens: list[int]) -> int:
        return index.match(hash_prompt(tokens, B, root_hash(MODEL)).hashes).get(key).kv_blocks

    async def cached(http: aiohttp.ClientSession, tokens: list[int]) -> None:
        body = {"model": MODEL, "prompt": tokens, "max_tokens": 1}
        async with http.post(f"{base}/v1/completions", json=body) as resp:
            assert resp.status == 200
        await eventually(lambda: blocks(tokens) == len(tokens) // B)

    store = RedisStore.from_url(private_redis.url, KeySchema("pm"))
    reader = RedisStore.from_url(private_redis.url, KeySchema("pm"))
    eng = await engine()
    info = ReplicaInfo("p0", url=base, model=MODEL, block_size=B)
    settings = PublisherSettings(
        info, await discovery.ask(base, "p0"), heartbeat_s=0.1, lease_ttl_s=1.0,
        ask_sources=True,
    )  # fmt: skip
    try:
        async with (
            aiohttp.ClientSession() as http,
            Publisher(settings, store) as pub,
            IndexSync(reader, index, audit_interval_s=0.1, block_s=0.05),
        ):
            a = [rng.randrange(1, 50_000) for _ in range(4 * B)]
            await cached(http, a)
            await eng.cleanup()  # the engine restarts on other ports, its cache empty
            eng = await engine()
            await eventually(lambda: blocks(a) == 0)
            b = [rng.randrange(1, 50_000) for _ in range(4 * B)]
            await cached(http, b)
            assert pub.ingest.stats.lost_batches == 0
    finally:
        await eng.cleanup()
        await store.close()
        await reader.close()


async def test_a_publisher_registers_the_ranks_its_engine_names(
    monkeypatch: pytest.MonkeyPatch, private_redis: Any
) -> None:
    """``--zmq auto`` against a data-parallel engine: the replica is registered with the
    ranks the engine names (two here), so routers read and route to each; the engine then
    restarts with one rank on other ports, and the registration follows (the second rank's
    keys dropped). Before, it was registered with ``--dp-ranks`` (rank 0 by default):
    routers never read the second rank's blocks, and a dp size that changed was not seen."""
    from aiohttp import web

    from router.core.index import PrefixIndex
    from router.events import discovery
    from router.events.model import EngineBlockStored
    from router.events.zmq_pub import KVEventPublisher
    from router.publisher.publisher import Publisher, PublisherSettings
    from router.store.base import ReplicaInfo
    from router.store.redis_store import RedisStore
    from router.store.schema import KeySchema
    from router.store.sync import IndexSync

    monkeypatch.setattr(discovery, "SOURCES_RECHECK_S", 0.1)

    def rank() -> KVEventPublisher:
        pub = KVEventPublisher(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
        pub.start()
        return pub

    ranks = [rank(), rank()]

    async def kv_event_sources(_: web.Request) -> web.Response:
        return web.json_response(
            {str(i): _config(p.endpoint, p.replay_endpoint) for i, p in enumerate(ranks)}
        )

    app = web.Application()
    app.router.add_get("/kv_event_sources", kv_event_sources)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    base = f"http://127.0.0.1:{port}"
    rng = random.Random(7)
    index = PrefixIndex()

    def blocks(tokens: list[int], dp: int) -> int:
        hashes = hash_prompt(tokens, B, root_hash(MODEL)).hashes
        return index.match(hashes).get(ReplicaKey("p0", dp)).kv_blocks

    async def stored(dp: int) -> list[int]:
        """Published on rank ``dp`` until indexed (ZMQ's slow joiner drops the first)."""
        tokens = [rng.randrange(1, 50_000) for _ in range(B)]

        async def indexed() -> bool:
            event = EngineBlockStored((rng.getrandbits(63),), None, tuple(tokens), B)
            await ranks[dp].publish([event], dp)
            return blocks(tokens, dp) == 1

        await eventually(indexed)
        return tokens

    store = RedisStore.from_url(private_redis.url, KeySchema("pr"))
    reader = RedisStore.from_url(private_redis.url, KeySchema("pr"))
    info = ReplicaInfo("p0", url=base, model=MODEL, block_size=B)  # dp_ranks (0,)
    settings = PublisherSettings(
        info, await discovery.ask(base, "p0"), heartbeat_s=0.1, lease_ttl_s=1.0,
        ask_sources=True,
    )  # fmt: skip
    sync = IndexSync(reader, index, audit_interval_s=0.1, block_s=0.05)
    try:
        async with Publisher(settings, store), sync:
            await eventually(lambda: "p0" in sync.infos)
            assert sync.infos["p0"].dp_ranks == (0, 1)
            a = await stored(1)
            for pub in ranks:  # the engine restarts with one rank, on other ports
                await pub.close()
            ranks[:] = [rank()]
            await eventually(lambda: sync.infos["p0"].dp_ranks == (0,))
            assert blocks(a, 1) == 0
            await stored(0)
    finally:
        await runner.cleanup()
        for pub in ranks:
            await pub.close()
        await store.close()
        await reader.close()
