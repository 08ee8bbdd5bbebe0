"""``kvrouter bench reliability`` reads each answer as every other bench does
(router/demo/replay.py ``read_answer``): TTFT at the first event that carries a token, TPOT
to the last token, a stream without a token or its usage not an answer. It took TTFT at the
first byte of any chunk and counted any stream that reached ``[DONE]``. Scripted replicas
over loopback HTTP, driven by the bench's own load loop (``_load``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from router.bench import reliability_bench
from tests.ports import free_port

GAP_S = 0.3  # a pause the scripted replica takes (a lower bound only: never flaky)
Script = Callable[[web.StreamResponse], Awaitable[None]]


def _event(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _token(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return _event({"id": "c", "object": "text_completion", "choices": [choice]})


USAGE = _event({"id": "c", "choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 3}})
DONE = b"data: [DONE]\n\n"


async def _load_one(script: Script) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The bench's load loop, one worker, for (about) one request, against a replica that
    writes its stream with ``script``; with the request bodies the replica received."""
    bodies: list[dict[str, Any]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await script(resp)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        res = await reliability_bench._load([f"http://127.0.0.1:{port}"], 1, 0.01, 8, 3)
    finally:
        await runner.cleanup()
    return res, bodies


async def test_ttft_is_the_first_token_not_the_first_byte() -> None:
    async def script(resp: web.StreamResponse) -> None:
        await resp.write(b": keep-alive\n\n")
        await resp.write(_event({"id": "c", "choices": [], "usage": None}))
        await resp.write(_token(""))
        await asyncio.sleep(GAP_S)  # the replica's prefill
        await resp.write(_token("a") + _token("b c", "length") + USAGE + DONE)

    res, bodies = await _load_one(script)
    assert res["errors"] == {}, res
    assert len(res["ttft"]) == len(bodies) >= 1
    assert min(res["ttft"]) >= GAP_S, res  # the old reading: the keep-alive's byte
    assert bodies[0]["stream_options"] == {"include_usage": True}


async def test_tpot_is_timed_to_the_last_token_not_done() -> None:
    async def script(resp: web.StreamResponse) -> None:
        await resp.write(_token("a") + _token("b") + _token("c", "length"))
        await asyncio.sleep(GAP_S)  # after the last token: the usage and the end
        await resp.write(USAGE + DONE)

    res, _ = await _load_one(script)
    assert res["errors"] == {}, res
    summary = reliability_bench._summary(res, 1.0)
    # two intervals after the first token, both before the pause
    assert summary["tpot_p50_ms"] * 2 <= summary["total_p50_ms"] - GAP_S * 1e3 / 2, summary


async def test_a_stream_without_a_token_or_its_usage_is_an_error() -> None:
    async def no_token(resp: web.StreamResponse) -> None:
        await resp.write(_event({"id": "c", "choices": [{"index": 0, "text": ""}]}) + DONE)

    async def no_usage(resp: web.StreamResponse) -> None:
        await resp.write(_token("a") + _token("b", "length") + DONE)

    for script, error in ((no_token, "stream ended without a token"),
                          (no_usage, "stream ended without its usage chunk")):  # fmt: skip
        res, bodies = await _load_one(script)
        assert res["ttft"] == [] and res["errors"] == {error: len(bodies)}, res
