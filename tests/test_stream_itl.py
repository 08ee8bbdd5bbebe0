"""``kvrouter_itl_seconds`` counts the gaps between a stream's token-carrying events only, as
vLLM's ``vllm:inter_token_latency_seconds`` does (vllm/v1/metrics/stats.py
``IterationStats.update_from_output``: one gap per engine output after the first): not the
gap before the usage chunk (the router's own ``include_usage`` or the client's) nor before
``data: [DONE]``. Real router on loopback, a tests/backends.py engine that lets its events
out one at a time, each after the router booked the one before."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest

from router.service.config import build_settings
from tests.backends import Backend, kimi_model_table, metric_sample, start_router
from tests.waiting import eventually

MODEL = "kimi-test"
TOKENS = 4


@dataclass
class Fleet:
    url: str
    backend: Backend
    pace: asyncio.Semaphore

    async def count(self, name: str) -> float:
        async with aiohttp.ClientSession() as http, http.get(self.url + "/metrics") as r:
            page = await r.text()
        return metric_sample(page, name, model=MODEL) or 0.0

    async def reached(self, name: str, want: float) -> bool:
        return await self.count(name) == want


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    pace = asyncio.Semaphore(0)
    backend = await Backend("b0", [MODEL], chunks=TOKENS, pace=pace).start()
    settings = build_settings(
        {
            "replicas": [{"url": backend.url, "model": MODEL, "name": "b0"}],
            "models": {MODEL: kimi_model_table(context_length=100_000)},
        }
    )
    running, url = await start_router(settings)
    try:
        yield Fleet(url, backend, pace)
    finally:
        await running.cleanup()
        await backend.stop()


@pytest.mark.parametrize("client_usage", [False, True], ids=["router_usage", "client_usage"])
async def test_itl_counts_only_the_gaps_between_tokens(fleet: Fleet, client_usage: bool) -> None:
    body: dict[str, object] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Why is the sky blue?"}],
        "max_tokens": TOKENS,
        "stream": True,
    }
    if client_usage:
        body["stream_options"] = {"include_usage": True}
    ttft = "kvrouter_ttft_seconds_count"
    itl = "kvrouter_itl_seconds_count"
    async with (
        aiohttp.ClientSession() as http,
        http.post(fleet.url + "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200
        reading = asyncio.ensure_future(resp.read())
        # each token leaves the engine once the router booked the one before: one read each
        await eventually(lambda: fleet.reached(ttft, 1))
        for gaps in range(1, TOKENS):
            fleet.pace.release()
            await eventually(lambda g=gaps: fleet.reached(itl, g))  # type: ignore[misc]
        # then the usage chunk, then [DONE], in reads of their own after the last token's
        fleet.pace.release()
        fleet.pace.release()
        raw = await reading
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert sum(bool(c["choices"]) for c in chunks) == TOKENS
    assert any(c.get("usage") for c in chunks) == client_usage
    # the whole stream was relayed (its end after every read): no gap but the tokens' counts
    assert await fleet.count(itl) == TOKENS - 1
    assert await fleet.count(ttft) == 1


@pytest.mark.parametrize(
    "event, token",
    [
        (b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n', True),
        (b"data: [DONE]\n\n", False),
        (b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3}}\n\n', False),
        (b'data: {"choices": [ ], "usage": {}}\n\n', False),  # (spaced JSON)
        (b'data: {"choices":[{"delta":{"content":"\\"choices\\":[]"}}]}\n\n', True),
        (b"event: ping\ndata: {}\n\n", False),
        (b'event: content_block_delta\ndata: {"delta":{"text":"hi"}}\n\n', True),
        (b'event: response.output_text.delta\ndata: {"delta":"hi"}\n\n', True),
        (b'event: message_delta\ndata: {"usage":{}}\n\n', False),
        (b": keep-alive\n\n", False),
        (b'data: {"choices":[{"delta":{}}]}\r\n\r\n', True),
    ],
)
def test_token_lines_judge_an_event_alike_however_the_reads_cut_it(
    event: bytes, token: bool
) -> None:
    """Whole (the one-event read's fast path) or cut at any byte, an event is judged the
    same: whether its data carries output tokens."""
    from router.service.answers import TokenLines

    assert TokenLines().token_ended(event) is token
    for cut in range(1, len(event)):
        lines = TokenLines()
        assert (lines.token_ended(event[:cut]) or lines.token_ended(event[cut:])) is token, cut
