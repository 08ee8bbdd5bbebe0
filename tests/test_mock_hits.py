"""The mock replica's prefix-cache hits as vLLM 0.34 grants them, over real HTTP: the hit is
a whole number of engine blocks (``find_longest_cache_hit`` looks for blocks), at most
``(N - 1) // engine_block`` of them (``Request.get_max_cache_hit_length``: the last token is
recomputed, and with it the whole engine block it falls in), of the full engine blocks the
engine cached. ``usage.prompt_tokens_details.cached_tokens`` reports it."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from router.mock.server import MockSettings
from tests.backends import start_mock

B = 64  # the router's block


@pytest.fixture
async def mock() -> AsyncIterator[Callable[..., Any]]:
    runners: list[web.AppRunner] = []
    sessions: list[aiohttp.ClientSession] = []

    async def start(engine_block: int) -> Callable[[list[int]], Any]:
        settings = MockSettings(model="m", block_size=B, engine_block_size=engine_block)
        runner, url = await start_mock(settings)
        runners.append(runner)
        session = aiohttp.ClientSession()
        sessions.append(session)

        async def cached(prompt: list[int]) -> int:
            body = {"model": "m", "prompt": prompt, "max_tokens": 2}
            async with session.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                usage = (await r.json())["usage"]
            assert usage["prompt_tokens"] == len(prompt)
            return int(usage["prompt_tokens_details"]["cached_tokens"])

        return cached

    yield start
    for session in sessions:
        await session.close()
    for runner in runners:
        await runner.cleanup()


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


def vllm_hit(cached_engine_blocks: int, prompt_tokens: int, engine_block: int) -> int:
    """vLLM 0.34's hit in tokens (full attention): the cached engine blocks, at most
    ``(N - 1) // engine_block`` of them."""
    return min(cached_engine_blocks, (prompt_tokens - 1) // engine_block) * engine_block


@pytest.mark.parametrize("engine_block", [16, B])
async def test_a_block_aligned_prompt_sent_again_recomputes_its_last_engine_block(
    mock: Callable[..., Any], engine_block: int
) -> None:
    cached = await mock(engine_block)
    prompt = _prompt(1, 2 * B)  # every block full: all of it cached after the first
    assert await cached(prompt) == 0
    again = await cached(prompt)
    assert again == vllm_hit(2 * B // engine_block, len(prompt), engine_block)
    assert again % engine_block == 0 and again < len(prompt) - 1


async def test_engine_blocks_coarser_than_the_routers_are_hit_whole_or_not_at_all(
    mock: Callable[..., Any],
) -> None:
    engine_block = 2 * B
    cached = await mock(engine_block)
    short = _prompt(2, B + 5)  # one router block, no full engine block: nothing cached
    assert await cached(short) == 0
    assert await cached(short) == vllm_hit(0, len(short), engine_block) == 0
    longer = _prompt(3, 3 * B + 5)  # one full engine block (two router blocks) and a half
    assert await cached(longer) == 0
    assert await cached(longer) == vllm_hit(1, len(longer), engine_block) == 2 * B
