"""A full + sliding-window model end to end: mock replicas running the gpt-oss profile's
engine model (window KV freed as the window slides, a prefix served only where the window
before its end is cached) publish their window blocks as vLLM does (a ``sliding_window``
group over ZMQ); the router, told nothing about the model, derives where windows are
complete and predicts every request's usable hit as the engine grants it (real HTTP, the
openai client). Memory is tight, so windows of earlier prompts are evicted while their
full-attention KV stays: branches inside them are predicted short, as served. One replica,
so where requests go, and so what its cache evicts, does not depend on the machine's speed
(with two, the policy's load reading moved requests and, on a loaded machine, no window was
evicted under a branch)."""

from __future__ import annotations

import random
from typing import Any

import openai

from router.core.hashing import hash_prompt, root_hash
from router.core.types import ReplicaKey
from router.service.app import STATE
from router.service.config import build_settings
from tests.backends import events_applied, metric_sample, start_mock_fleet, start_router
from tests.waiting import eventually

B = 64
MODEL = "m"
NOT_INDEXED = "kvrouter_events_blocks_not_indexed_total"


async def test_sliding_window_hits_are_predicted_as_the_engine_grants_them() -> None:
    runners: list[Any] = []
    try:
        replicas = await start_mock_fleet(
            1, runners, model=MODEL, block_size=B, profile="gpt-oss-120b",
            engine_block_size=16, kv_blocks=100,
        )  # fmt: skip
        settings = build_settings(
            {"replicas": replicas, "models": {MODEL: {"block_size": B, "policy": "ours"}}}
        )
        router, url = await start_router(settings)
        applied = events_applied(router.app, [r.app for r in runners])
        runners.append(router)
        state = router.app[STATE]
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        rng = random.Random(7)
        system = [rng.randrange(1, 50_000) for _ in range(6 * B + 9)]
        rows = []
        cut = 0  # requests whose full-attention KV the window rule shortens on a replica
        try:
            contexts: list[list[int]] = []
            for turn in range(30):
                if contexts and turn % 3 == 2:  # a branch inside an earlier prompt
                    base = rng.choice(contexts)
                    context = base[: rng.randrange(len(base) // 2, len(base))]
                else:
                    context = list(system)
                context = context + [
                    rng.randrange(1, 50_000) for _ in range(rng.randrange(600, 1500))
                ]
                hashes = hash_prompt(context, B, root_hash(MODEL)).hashes
                held = state.index.match(hashes, hybrid=True).items()
                cut += any(m.kv_blocks > m.usable_blocks for _, m in held)
                reply = await client.completions.create(model=MODEL, prompt=context, max_tokens=2)
                details = reply.usage.prompt_tokens_details if reply.usage else None
                assert details is not None and details.cached_tokens is not None
                decision = state.recent_decisions(1)[0]
                rows.append(
                    (min(decision["usable_tokens"], len(context) - 1), details.cached_tokens)
                )
                contexts.append(context)
                owner = ReplicaKey.parse(decision["replica"])

                def caught_up(h: list[int] = hashes, k: ReplicaKey = owner) -> bool:
                    if not applied():
                        return False
                    found = state.index.match(h, hybrid=True).get(k)
                    return found.kv_blocks == len(h) and found.usable_blocks == len(h)

                await eventually(caught_up)
        finally:
            await client.close()
        assert rows == [(cached, cached) for _, cached in rows], rows
        assert state.engines[MODEL].layout.hybrid  # learned from the window checkpoints
        # every window block the engines published was placed (none left unindexed)
        page = state.metrics.render().decode()
        for replica in ("r0",):
            for reason in ("unknown_window", "unmapped_offload", "unknown_parent"):
                sample = metric_sample(
                    page, NOT_INDEXED, replica=replica, reason=reason
                )  # fmt: skip
                assert sample == 0.0, (replica, reason, sample)
        assert sum(cached for _, cached in rows) > 0 and cut > 0, cut
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
