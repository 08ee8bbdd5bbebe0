"""Requests an engine serves without reading its prefix cache (vLLM 0.34: prompt logprobs
asked, ``SamplingParams.skip_reading_prefix_cache``): the router predicts no reuse for them
on any replica, the mock replica reuses nothing for them as vLLM does, and the blocks they
compute are cached all the same (real HTTP, ZMQ events and the openai client)."""

from __future__ import annotations

import random
from typing import Any

import openai

from router.core.hashing import hash_prompt, root_hash
from router.core.types import ReplicaKey
from router.service.app import STATE
from router.service.config import build_settings
from tests.backends import start_mock_fleet, start_router
from tests.waiting import eventually

B = 64
MODEL = "m"


async def test_prompt_logprobs_requests_are_predicted_and_served_without_reuse() -> None:
    runners: list[Any] = []
    try:
        replicas = await start_mock_fleet(2, runners, model=MODEL, block_size=B)
        settings = build_settings(
            {"replicas": replicas, "models": {MODEL: {"block_size": B, "policy": "ours"}}}
        )
        router, url = await start_router(settings)
        runners.append(router)
        state = router.app[STATE]
        rng = random.Random(4)
        prompt = [rng.randrange(1, 50_000) for _ in range(20 * B + 7)]
        hashes = hash_prompt(prompt, B, root_hash(MODEL)).hashes
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        try:

            async def send(**extra: Any) -> tuple[int, int, str]:
                reply = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=2, **extra
                )
                details = reply.usage.prompt_tokens_details if reply.usage else None
                assert details is not None and details.cached_tokens is not None
                decision = state.recent_decisions(1)[0]
                return decision["usable_tokens"], details.cached_tokens, decision["replica"]

            _, cached, first = await send()
            assert cached == 0
            owner = ReplicaKey.parse(first)

            def indexed() -> bool:
                return state.index.match(hashes).get(owner).kv_blocks == len(hashes)

            await eventually(indexed)
            for extra in (
                {"extra_body": {"prompt_logprobs": 1}},
                {"echo": True, "logprobs": 1},
            ):
                predicted, cached, _ = await send(**extra)
                assert (predicted, cached) == (0, 0), extra
            # their blocks were cached where they ran; without logprobs echo reads the cache
            predicted, cached, _ = await send(echo=True)
            assert predicted == cached == len(hashes) * B
        finally:
            await client.close()
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
