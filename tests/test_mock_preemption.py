"""KV pressure on the mock replica as on vLLM 0.34: requests are admitted on their prompt,
decoding grows block by block, and when the blocks run out the latest admitted request is
preempted and recomputed (sim/engine.py). Clients see nothing of it but time: every answer
is whole; the engine counts ``vllm:num_preemptions_total`` as vLLM does."""

from __future__ import annotations

import asyncio

import aiohttp
import openai

from router.mock.server import MockSettings
from tests.backends import metric_sample, start_mock
from tests.procs import token_prompt


async def test_requests_outgrowing_the_cache_are_preempted_and_answered_whole() -> None:
    # 8 blocks of 16 tokens: each request's prompt (2 blocks) fits beside the other's, but
    # both answers together (2 x 6 blocks by their last token) do not. (The answers must
    # overlap: at a twentieth of real time one ended before a loaded machine sent the other.)
    runner, url = await start_mock(
        MockSettings(model="m", block_size=16, kv_blocks=8, time_scale=0.5)
    )
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    try:

        async def ask(seed: int) -> tuple[bool, int]:
            stream = await client.completions.create(
                model="m",
                prompt=token_prompt(seed, 32),
                max_tokens=60,
                stream=True,
                stream_options={"include_usage": True},
            )
            text = ""
            usage = None
            async for chunk in stream:
                text += "".join(c.text for c in chunk.choices)
                usage = chunk.usage or usage
            assert usage is not None
            return bool(text), usage.completion_tokens

        answers = await asyncio.gather(ask(1), ask(2))
        assert answers == [(True, 60), (True, 60)]
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as r:
            page = await r.text()
        assert (metric_sample(page, "vllm:num_preemptions_total", model_name="m") or 0) >= 1
    finally:
        await client.close()
        await runner.cleanup()
