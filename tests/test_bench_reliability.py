"""``kvrouter bench reliability`` reads each answer as every other bench does
(router/demo/replay.py ``read_answer``): TTFT at the first event that carries a token, TPOT
to the last token, a stream without a token or its usage not an answer. It took TTFT at the
first byte of any chunk and counted any stream that reached ``[DONE]``. Scripted replicas
over loopback HTTP, driven by the bench's own load loop (``_load``)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from router.bench import reliability_bench
from tests.scripted_replica import DONE, GAP_S, Script, event, scripted_replica, token, usage

USAGE = usage(8, 3)


async def _load_one(script: Script) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The bench's load loop, one worker, for (about) one request, against a replica that
    writes its stream with ``script``; with the request bodies the replica received."""
    bodies: list[dict[str, Any]] = []

    async with scripted_replica(script, bodies) as url:
        res = await reliability_bench._load([url], 1, 0.01, 8, 3)
    return res, bodies


async def test_ttft_is_the_first_token_not_the_first_byte() -> None:
    async def script(resp: web.StreamResponse) -> None:
        await resp.write(b": keep-alive\n\n")
        await resp.write(event({"id": "c", "choices": [], "usage": None}))
        await resp.write(token(""))
        await asyncio.sleep(GAP_S)  # the replica's prefill
        await resp.write(token("a") + token("b c", "length") + USAGE + DONE)

    res, bodies = await _load_one(script)
    assert res["errors"] == {}, res
    assert len(res["ttft"]) == len(bodies) >= 1
    assert min(res["ttft"]) >= GAP_S, res  # the old reading: the keep-alive's byte
    assert bodies[0]["stream_options"] == {"include_usage": True}


async def test_tpot_is_timed_to_the_last_token_not_done() -> None:
    async def script(resp: web.StreamResponse) -> None:
        await resp.write(token("a") + token("b") + token("c", "length"))
        await asyncio.sleep(GAP_S)  # after the last token: the usage and the end
        await resp.write(USAGE + DONE)

    res, _ = await _load_one(script)
    assert res["errors"] == {}, res
    summary = reliability_bench._summary(res, 1.0)
    # two intervals after the first token, both before the pause
    assert summary["tpot_p50_ms"] * 2 <= summary["total_p50_ms"] - GAP_S * 1e3 / 2, summary


async def test_a_stream_without_a_token_or_its_usage_is_an_error() -> None:
    async def no_token(resp: web.StreamResponse) -> None:
        await resp.write(event({"id": "c", "choices": [{"index": 0, "text": ""}]}) + DONE)

    async def no_usage(resp: web.StreamResponse) -> None:
        await resp.write(token("a") + token("b", "length") + DONE)

    for script, error in ((no_token, "stream ended without a token"),
                          (no_usage, "stream ended without its usage chunk")):  # fmt: skip
        res, bodies = await _load_one(script)
        assert res["ttft"] == [] and res["errors"] == {error: len(bodies)}, res
