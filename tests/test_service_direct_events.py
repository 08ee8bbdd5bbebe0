"""Single-router mode without Redis: replicas configured with ``zmq`` feed the router's
index directly; the second request of a prefix is routed to the replica that cached it and
the engine confirms the hit (real HTTP, real ZMQ, official openai client)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import openai
from aiohttp import web

from router.core.hashing import hash_prompt, root_hash
from router.core.types import ReplicaKey
from router.mock.server import MockSettings
from router.mock.server import create_app as create_mock
from router.service.app import STATE
from router.service.config import build_settings
from router.store.local_redis import free_port
from tests.backends import start_router

B = 64


async def eventually(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.03)


async def test_router_follows_engine_events_without_redis() -> None:
    runners, replicas = [], []
    try:
        for i in range(3):
            zmq, replay, port = free_port(), free_port(), free_port()
            s = MockSettings(
                model="m", replica=f"r{i}", block_size=B, engine_block_size=16,
                zmq_endpoint=f"tcp://127.0.0.1:{zmq}", replay_endpoint=f"tcp://127.0.0.1:{replay}",
            )  # fmt: skip
            runner = web.AppRunner(create_mock(s))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            replicas.append(
                {"url": f"http://127.0.0.1:{port}", "model": "m", "name": f"r{i}",
                 "zmq": s.zmq_endpoint, "zmq_replay": s.replay_endpoint}
            )  # fmt: skip
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
