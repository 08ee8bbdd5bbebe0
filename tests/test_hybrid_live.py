"""A router in front of hybrid mock replicas, told nothing about the model: it learns that the
model is hybrid and where the engines checkpoint from their KV events, directly over ZMQ and
through publishers and Redis, and predicts every request's usable hit as the engine reports
it (real HTTP, ZMQ, Redis and the official openai client)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import openai

from router.core.hashing import hash_prompt, root_hash
from router.core.types import ReplicaKey
from router.events.ingest import EndpointSpec
from router.mock.server import MockSettings
from router.publisher.publisher import Publisher, PublisherSettings
from router.service.app import STATE
from router.service.config import build_settings
from router.service.state import RouterState
from router.store.base import ReplicaInfo
from router.store.redis_store import RedisStore
from router.store.schema import KeySchema
from tests.backends import metric_sample as _sample
from tests.backends import start_mock, start_router
from tests.ports import free_port
from tests.waiting import eventually

B = 64
MODEL = "m"
GRID = 4  # the engines checkpoint every 4 router blocks (256 tokens) and at prompt ends
# the kimi-k3 engine model with a grid small enough for short prompts
PROFILE = f"""
name = "hybrid-small"
block_size = 64
kv_blocks = 20000
hybrid = true
checkpoint = "every_n"
checkpoint_interval_tokens = {GRID * B}
checkpoint_prompt_end = true
state_checkpoint_blocks = 40.0

[cost]
step_overhead_s = 0.002
prefill_s_per_token = 1e-6
decode_s_per_seq = 1e-4
"""


async def _mock(tmp_path: Path, i: int, runners: list[Any]) -> tuple[MockSettings, str]:
    profile = tmp_path / "hybrid-small.toml"
    profile.write_text(PROFILE)
    s = MockSettings(
        model=MODEL, replica=f"r{i}", profile=str(profile), block_size=B, engine_block_size=16,
        zmq_endpoint=f"tcp://127.0.0.1:{free_port()}",
        replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
    )  # fmt: skip
    runner, url = await start_mock(s)
    runners.append(runner)
    return s, url


async def _sessions(url: str, state: RouterState, keys: list[ReplicaKey]) -> list[tuple[int, int]]:
    """Eight two-turn sessions sharing a system prompt, one request at a time; before each
    request the router's index has caught up with the engines (the previous prompt's end
    checkpoint is in). Returns (predicted usable, engine-reported cached) per request."""
    rng = random.Random(3)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    system = [rng.randrange(1, 50_000) for _ in range(6 * B + 10)]
    rows = []
    try:
        for _ in range(8):
            context = system + [rng.randrange(1, 50_000) for _ in range(rng.randrange(400, 1500))]
            for _ in range(2):
                reply = await client.completions.create(model=MODEL, prompt=context, max_tokens=2)
                details = reply.usage.prompt_tokens_details if reply.usage else None
                assert details is not None and details.cached_tokens is not None
                decision = state.recent_decisions(1)[0]
                tokens = len(context)
                rows.append((min(decision["usable_tokens"], tokens - 1), details.cached_tokens))
                hashes = hash_prompt(context, B, root_hash(MODEL)).hashes
                owner = ReplicaKey.parse(decision["replica"])
                assert owner in keys

                # the engine keeps the prompt's state before its last token
                end = (tokens - 1) // B

                def caught_up(h: list[int] = hashes, k: ReplicaKey = owner, e: int = end) -> bool:
                    return state.index.match(h, hybrid=True).get(k).usable_blocks == e

                await eventually(caught_up)
                context = context + [
                    rng.randrange(1, 50_000) for _ in range(rng.randrange(90, 700))
                ]
    finally:
        await client.close()
    return rows


async def _metrics(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        return await resp.text()


async def test_direct_mode_learns_the_layout_and_predicts_every_hit(tmp_path: Path) -> None:
    runners: list[Any] = []
    try:
        replicas = []
        for i in range(2):
            s, base = await _mock(tmp_path, i, runners)
            replicas.append(
                {"url": base, "model": MODEL, "name": f"r{i}", "zmq": s.zmq_endpoint,
                 "zmq_replay": s.replay_endpoint}
            )  # fmt: skip
        settings = build_settings(
            {"replicas": replicas, "models": {MODEL: {"block_size": B, "policy": "ours"}}}
        )
        router, url = await start_router(settings)
        runners.append(router)
        state = router.app[STATE]
        engine = state.engines[MODEL]
        assert not engine.layout.hybrid
        rows = await _sessions(url, state, [ReplicaKey("r0"), ReplicaKey("r1")])
        assert rows == [(cached, cached) for _, cached in rows], rows
        assert sum(cached for _, cached in rows) > 0
        assert engine.layout.hybrid and engine.layout.hybrid_source == "engine"
        assert (engine.layout.interval_blocks, engine.layout.interval_source) == (GRID, "engine")
        state.layouts.check()
        page = await _metrics(url)
        assert _sample(page, "kvrouter_model_hybrid", model=MODEL, source="engine") == 1
        assert _sample(page, "kvrouter_model_state_interval_blocks", model=MODEL) == GRID
        assert _sample(page, "kvrouter_model_engine_block_blocks", model=MODEL) == 1
        assert _sample(page, "kvrouter_model_layout_mismatch", model=MODEL, field="hybrid") == 0
        count = _sample(page, "kvrouter_prediction_error_ratio_count", model=MODEL)
        exact = _sample(page, "kvrouter_prediction_error_ratio_bucket", model=MODEL, le="0.0")
        below = _sample(page, "kvrouter_prediction_error_ratio_bucket", model=MODEL, le="-0.005")
        assert count == len(rows) and exact == len(rows) and below == 0
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


async def test_redis_mode_learns_it_through_the_registry(
    tmp_path: Path, redis_url: str, key_prefix: str
) -> None:
    """Publishers learn the grid and register it; the router reads hybrid-ness from the state
    entries in Redis and the grid from the registrations. Its configuration names a wrong
    grid: used for speculation (off here), reported as a mismatch."""
    runners: list[Any] = []
    publishers: list[Publisher] = []
    stores: list[RedisStore] = []
    schema = KeySchema(key_prefix, stream_shards=2)
    try:
        for i in range(2):
            s, base = await _mock(tmp_path, i, runners)
            info = ReplicaInfo(f"r{i}", url=base, model=MODEL, block_size=B)
            store = RedisStore.from_url(redis_url, schema)
            stores.append(store)
            pub = Publisher(
                PublisherSettings(
                    info,
                    (EndpointSpec(s.zmq_endpoint, s.replay_endpoint),),
                    heartbeat_s=0.2,
                    lease_ttl_s=2.0,
                ),
                store,
            )
            await pub.start()
            publishers.append(pub)
        settings = build_settings(
            {
                "server": {"redis_url": redis_url, "redis_key_prefix": key_prefix,
                           "redis_stream_shards": 2},
                "models": {MODEL: {"block_size": B, "policy": "ours", "state_interval_blocks": 3,
                                   "speculative_ttl_s": 0.0}},
            }
        )  # fmt: skip
        router, url = await start_router(settings)
        runners.append(router)
        state = router.app[STATE]
        await eventually(lambda: len(state.registry.keys_for(MODEL)) == 2)
        rows = await _sessions(url, state, [ReplicaKey("r0"), ReplicaKey("r1")])
        assert rows == [(cached, cached) for _, cached in rows], rows
        engine = state.engines[MODEL]
        assert engine.layout.hybrid and engine.layout.hybrid_source in ("engine", "registry")
        await eventually(lambda: engine.learned_interval == (GRID, "registry"))
        assert engine.layout.interval_blocks == 3  # configured: it wins, and is reported
        # publishers that saw checkpoints registered it, those that saw enough (32) the grid
        assert any(p.grid.checkpoints for p in publishers)
        await eventually(
            lambda: all(p.info.publishes_state == (p.grid.checkpoints > 0) for p in publishers)
        )
        assert {p.info.state_interval_blocks for p in publishers} <= {0, GRID}
        [report] = state.layouts.check()
        assert set(report.mismatches) == {"state_interval_blocks"}
        page = await _metrics(url)
        field = "state_interval_blocks"
        assert _sample(page, "kvrouter_model_layout_mismatch", model=MODEL, field=field) == 1
        assert _sample(page, "kvrouter_model_state_interval_blocks", source="config") == 3
    finally:
        for runner in reversed(runners[-1:]):
            await runner.cleanup()
        for pub in publishers:
            await pub.stop()
        for runner in runners[:-1]:
            await runner.cleanup()
        for store in stores:
            await store.close()
