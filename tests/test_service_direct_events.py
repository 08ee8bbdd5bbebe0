"""Single-router mode without Redis: replicas configured with ``zmq`` feed the router's
index directly; the second request of a prefix is routed to the replica that cached it and
the engine confirms the hit (real HTTP, real ZMQ, official openai client)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import openai
from aiohttp import web

from router.core.hashing import hash_prompt, root_hash
from router.core.types import ReplicaKey
from router.mock.server import MockSettings
from router.mock.server import create_app as create_mock
from router.service.app import STATE
from router.service.config import build_settings
from tests.backends import metric_sample as _sample
from tests.backends import start_router
from tests.ports import free_port
from tests.waiting import eventually

B = 64


async def _mocks(n: int, runners: list[web.AppRunner]) -> list[dict[str, Any]]:
    """``n`` mock replicas (real HTTP + ZMQ events) as router ``[[replicas]]`` tables with
    ``zmq`` and ``metrics_url``; their runners are appended to ``runners``."""
    replicas = []
    for i in range(n):
        zmq, replay, port = free_port(), free_port(), free_port()
        s = MockSettings(
            model="m", replica=f"r{i}", block_size=B, engine_block_size=16,
            zmq_endpoint=f"tcp://127.0.0.1:{zmq}", replay_endpoint=f"tcp://127.0.0.1:{replay}",
        )  # fmt: skip
        runner = web.AppRunner(create_mock(s))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        base = f"http://127.0.0.1:{port}"
        replicas.append(
            {"url": base, "model": "m", "name": f"r{i}", "zmq": s.zmq_endpoint,
             "zmq_replay": s.replay_endpoint, "metrics_url": f"{base}/metrics"}
        )  # fmt: skip
    return replicas


async def test_router_follows_engine_events_without_redis() -> None:
    runners: list[web.AppRunner] = []
    try:
        replicas = [
            {k: v for k, v in r.items() if k != "metrics_url"} for r in await _mocks(3, runners)
        ]
        settings = build_settings(
            {"replicas": replicas, "models": {"m": {"block_size": B, "policy": "ours"}}}
        )
        router, url = await start_router(settings)
        runners.append(router)
        state = router.app[STATE]
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        rng = random.Random(7)
        prompt = [rng.randrange(1, 50_000) for _ in range(20 * B + 5)]
        hashes = hash_prompt(prompt, B, root_hash("m")).hashes
        first = await client.completions.create(model="m", prompt=prompt, max_tokens=2)
        # The engine's KV events reach the router's index over ZMQ.
        await eventually(lambda: state.index.match(hashes).longest() == 20)
        owner = next(k for k, m in state.index.match(hashes).items() if m.kv_blocks == 20)
        assert first.usage.prompt_tokens == len(prompt)
        follow = prompt + [rng.randrange(1, 50_000) for _ in range(3 * B)]
        second = await client.completions.create(model="m", prompt=follow, max_tokens=2)
        details = second.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens == 20 * B
        last = state.recent_decisions(1)[0]
        assert last["replica"] == str(owner) and last["usable_tokens"] == 20 * B
        assert owner in {ReplicaKey(f"r{i}") for i in range(3)}
        await client.close()
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_router_scrapes_engine_metrics_and_exports_real_and_predicted_hits() -> None:
    """``metrics_url``: the router reads the replicas' own load and prefix-cache counters (no
    publisher, no Redis) and exports them beside its per-replica predictions."""
    import aiohttp

    runners: list[web.AppRunner] = []
    try:
        replicas = await _mocks(2, runners)
        settings = build_settings(
            {
                "server": {"engine_metrics_interval_s": 0.1, "admin_token": "t"},
                "replicas": replicas,
                "models": {"m": {"block_size": B, "engine_block_size": 16, "policy": "ours"}},
            }
        )
        router, url = await start_router(settings)
        runners.append(router)
        state = router.app[STATE]
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        rng = random.Random(11)
        prompt = [rng.randrange(1, 50_000) for _ in range(10 * B)]
        hashes = hash_prompt(prompt, B, root_hash("m")).hashes
        await client.completions.create(model="m", prompt=prompt, max_tokens=2)
        await eventually(lambda: state.index.match(hashes).longest() == 10)
        for _ in range(3):  # the same prefix again: the router predicts, the engine confirms
            await client.completions.create(model="m", prompt=prompt + [7] * B, max_tokens=2)
        await client.close()
        owner = str(state.recent_decisions(1)[0]["replica"])
        owner_metrics = next(rep["metrics_url"] for rep in replicas if rep["name"] == owner)
        async with aiohttp.ClientSession() as http:

            async def page(at: str) -> str:
                async with http.get(at) as resp:
                    return await resp.text()

            engine = await page(owner_metrics)  # traffic has stopped: the counters are final
            engine_hits = _sample(engine, "vllm:prefix_cache_hits_total")
            engine_queries = _sample(engine, "vllm:prefix_cache_queries_total")
            assert engine_hits is not None and engine_hits >= 3 * 10 * B
            deadline = asyncio.get_running_loop().time() + 10
            while True:  # the router's copy catches up within a few scrape rounds
                mine = await page(f"{url}/metrics")
                hits = _sample(
                    mine, "kvrouter_engine_prefix_cache_hits_tokens_total", replica=owner
                )
                if hits == engine_hits or asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.05)
        assert hits == engine_hits
        queries = _sample(mine, "kvrouter_engine_prefix_cache_queries_tokens_total", replica=owner)
        assert queries == engine_queries
        predicted = _sample(mine, "kvrouter_replica_predicted_hit_tokens_total", replica=owner)
        sent = _sample(mine, "kvrouter_replica_prompt_tokens_total", replica=owner)
        # the router's prediction matches the engine's count up to what an engine always
        # recomputes per request: the prompt's last token, with the whole engine block (16
        # tokens here) it falls in where the whole prompt was cached (vLLM's hit rule)
        assert predicted is not None and abs(predicted - engine_hits) <= 3 * 16
        assert sent is not None and sent >= 3 * 11 * B
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{url}/admin/replicas", headers={"Authorization": "Bearer t"}) as resp,
        ):
            listed = {r["replica"]: r for r in (await resp.json())["replicas"]}
        mine = listed[owner]
        assert mine["source"] == "static"
        assert mine["engine"] is not None and mine["engine"]["age_s"] >= 0
        assert mine["engine_prefix_cache_hit_ratio"] == round(engine_hits / engine_queries, 4)
        # and the engine's load reports reach the load tracker (used by the ours policy)
        assert state.load.view(ReplicaKey(owner), 0).engine is not None
    finally:
        for runner in runners:
            await runner.cleanup()
