"""The figures' definitions held the same wherever a figure is made: the replay client's
timing of a stream (router/demo/replay.py) against a scripted replica on loopback, the live
summary and its medians of runs (router/demo/figures.py, router/bench/measure.py) and the
simulator's summary (sim/metrics.py), with hand-computed expectations."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from router.bench.measure import median_row, percentile
from router.core.slo import SloTargets
from router.demo.figures import combine_runs, summarize
from router.demo.replay import Outcome, TraceRequest, _one
from sim.metrics import RequestRecord
from sim.metrics import summarize as sim_summarize
from tests.ports import free_port
from tests.scripted_replica import GAP_S, Script, scripted_replica, token, usage

USAGE = usage(100, 3)


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[[Script], Awaitable[Outcome]]]:
    """``await scripted(script)``: the replay client's outcome for one request answered by a
    replica that writes its stream with ``script``."""
    req = TraceRequest(0.0, 100, 3, b'{"prompt": [1], "stream": true}')

    async def run(script: Script) -> Outcome:
        async with scripted_replica(script) as url, aiohttp.ClientSession() as session:
            return await _one(session, url + "/v1/completions", req)

    yield run


async def test_ttft_is_timed_at_the_first_token_not_an_empty_first_event(
    scripted: Callable[[Script], Awaitable[Outcome]],
) -> None:
    """A stream may open with an event that carries no token (a role-only or empty-text
    chunk, as some servers and routers send at once); TTFT is when the first token came."""

    async def script(resp: web.StreamResponse) -> None:
        await resp.write(b": keep-alive\n\n")
        await resp.write(token(""))
        await asyncio.sleep(GAP_S)  # the replica's prefill
        await resp.write(token("a") + token("b c", "length") + USAGE + b"data: [DONE]\n\n")

    out = await scripted(script)
    assert out.ok and out.output_tokens == 3
    assert out.ttft_s >= GAP_S, out


async def test_a_first_token_that_ends_the_answer_is_timed_without_text(
    scripted: Callable[[Script], Awaitable[Outcome]],
) -> None:
    async def script(resp: web.StreamResponse) -> None:
        await asyncio.sleep(GAP_S)
        await resp.write(token("", "stop") + USAGE + b"data: [DONE]\n\n")

    out = await scripted(script)
    assert out.ok and out.ttft_s >= GAP_S


async def test_a_stream_cut_before_its_done_event_is_a_failure(
    scripted: Callable[[Script], Awaitable[Outcome]],
) -> None:
    """A stream that ends without ``data: [DONE]`` (a router that relays a replica's broken
    stream by closing its own) is not an answer: counted as one it would meet the TPOT half
    with no usage to judge it by."""

    async def script(resp: web.StreamResponse) -> None:
        await resp.write(token("a"))

    out = await scripted(script)
    assert not out.ok and out.error
    figures = summarize([out], SloTargets())
    assert (figures["ok"], figures["failed"], figures["goodput"]) == (0, 1, 0.0)


async def test_a_complete_stream_is_timed_and_counted(
    scripted: Callable[[Script], Awaitable[Outcome]],
) -> None:
    async def script(resp: web.StreamResponse) -> None:
        await asyncio.sleep(GAP_S)
        await resp.write(token("a") + token("b c", "length") + USAGE + b"data: [DONE]\n\n")

    out = await scripted(script)
    assert out.ok and (out.prompt_tokens, out.output_tokens) == (100, 3)
    assert GAP_S <= out.ttft_s <= out.e2e_s


async def test_a_stream_without_its_usage_is_a_failure(
    scripted: Callable[[Script], Awaitable[Outcome]],
) -> None:
    """Every replayed request asks for ``stream_options.include_usage``: a stream that ends
    without the usage chunk (a router that drops ``stream_options`` or the chunk) has no
    prompt or output length to judge it by. Counted as an answer it would be judged against
    the shortest prompt tier's TTFT target, meet the TPOT half with no TPOT at all and add
    nothing to the hit's denominator; it is a failure instead, as a cut stream is."""

    async def script(resp: web.StreamResponse) -> None:
        await resp.write(token("a") + token("b c", "length") + b"data: [DONE]\n\n")

    out = await scripted(script)
    assert not out.ok and "usage" in out.error, out
    figures = summarize([out], SloTargets())
    assert (figures["ok"], figures["failed"], figures["goodput"]) == (0, 1, 0.0)


def _record(i: int, ttft_s: float) -> RequestRecord:
    r = RequestRecord(f"r{i}", 0.0, 100, 0)
    r.first, r.finish, r.output = ttft_s, ttft_s + 1.0, 11
    return r


def test_simulator_and_live_percentiles_are_the_same_function() -> None:
    """The simulator's ``ttft_ms_p50`` sits beside the live bench's ``ttft_p50_ms``
    (``kvrouter bench live``'s ``sim``): both nearest rank. TTFTs 100, 200, 300, 400 ms:
    p50 is 300 (the live bench's) whatever interpolation would give (250)."""
    ttfts = [0.1, 0.2, 0.3, 0.4]
    sim = sim_summarize([_record(i, t) for i, t in enumerate(ttfts)], [1.0], ["a"])
    live = summarize([Outcome(True, t, 100, e2e_s=t + 1.0, output_tokens=11) for t in ttfts])
    ms = [t * 1e3 for t in ttfts]
    assert live["ttft_p50_ms"] == percentile(ms, 50) == 300.0
    assert sim["ttft_ms_p50"] == live["ttft_p50_ms"]
    assert sim["ttft_ms_p90"] == live["ttft_p90_ms"] == 400.0


def test_a_run_without_a_figure_leaves_the_median_of_the_others() -> None:
    """A run with no answered request has no TTFT (NaN): the median of runs is the median of
    the runs that have one, whatever their order (``statistics.median`` sorts NaN anywhere)."""
    nan = math.nan
    for values in ([nan, 100.0, 200.0], [100.0, nan, 200.0], [100.0, 200.0, nan]):
        runs = [
            {"requests": 1, "ok": int(v == v), "failed": int(v != v), "ttft_p90_ms": v}
            for v in values
        ]
        row = combine_runs(runs)
        assert row["ttft_p90_ms"] == 150.0, values
        assert row["spread"]["ttft_p90_ms"] == [100.0, 200.0], values
    assert math.isnan(median_row([{"x": nan}, {"x": nan}])["x"])  # no run has it


@pytest.mark.parametrize(
    "event",
    [b"data: Internal Server Error\n\n", b'data: "a string"\n\n', b"data: [1, 2]\n\n"],
)
async def test_a_malformed_event_fails_its_request_not_the_replay(
    scripted: Callable[[Script], Awaitable[Outcome]], event: bytes
) -> None:
    """A router that writes something other than a JSON object into a stream fails that
    request: the replay (and the bench around it, with every run so far) goes on."""

    async def script(resp: web.StreamResponse) -> None:
        await resp.write(token("a") + event + USAGE + b"data: [DONE]\n\n")

    out = await scripted(script)
    assert not out.ok and "malformed" in out.error, out


async def test_an_error_body_that_is_not_text_fails_its_request_not_the_replay() -> None:
    """A refusal whose body does not decode is a failed request like any other."""

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=502, body=b"\xff\xfe bad gateway", charset="utf-8")

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    req = TraceRequest(0.0, 100, 3, b'{"prompt": [1], "stream": true}')
    try:
        async with aiohttp.ClientSession() as session:
            out = await _one(session, f"http://127.0.0.1:{port}/v1/completions", req)
    finally:
        await runner.cleanup()
    assert not out.ok and out.error.startswith("HTTP 502"), out


async def test_tpot_is_timed_to_the_last_token_not_the_streams_end(
    scripted: Callable[[Script], Awaitable[Outcome]],
) -> None:
    """vLLM times TPOT from the first token to the last (vllm/v1/metrics/stats.py
    ``IterationStats.update_from_finished_request``), the simulator too (its finish is its
    last token), and the router's SLO metric (router.service.answer_relay ``count_slo``).
    The live replay timed it to the stream's ``[DONE]``: a wait after the last token for the
    usage chunk counted as decoding, here ``GAP_S`` over 2 tokens."""

    async def script(resp: web.StreamResponse) -> None:
        await resp.write(token("a") + token("b") + token("c", "length"))
        await asyncio.sleep(GAP_S)  # after the last token: the usage and the end
        await resp.write(USAGE + b"data: [DONE]\n\n")

    out = await scripted(script)
    assert out.ok and out.output_tokens == 3
    # the last token came well before the end (not GAP_S exactly: the client may read the
    # last token later after its write than it reads the end after its own)
    assert out.e2e_s - out.last_s >= GAP_S / 2, out
    assert out.tpot_s() == (out.last_s - out.ttft_s) / 2, out


def test_a_head_to_heads_percentiles_are_the_live_figures_function() -> None:
    """``kvrouter bench live``'s paired bootstrap (router/demo/compare.py) takes its
    percentiles with the live figures' nearest rank (router.bench.measure), over the known
    values of each resample (NaN: a failed request, an answer of one token's TPOT)."""
    import numpy as np

    from router.demo.compare import _figure

    rng = np.random.default_rng(3)
    rows = rng.exponential(100.0, size=(50, 37))
    rows[rng.random(rows.shape) < 0.2] = math.nan
    rows[7] = math.nan  # a resample without a figure
    for q in (50.0, 90.0, 99.0):
        got = _figure(rows, q)
        for row, value in zip(rows, got, strict=True):
            known = [v for v in row.tolist() if v == v]
            assert (value == percentile(known, q)) if known else math.isnan(value)


def test_the_ttft_mean_is_over_the_streamed_answers_alone() -> None:
    """An answer not streamed has no TTFT (NaN): the mean is the streamed answers' (what
    ``kvrouter bench pods`` reports too; it took the mean over every answer, NaN with one
    answer not streamed), NaN when none streamed."""
    streamed = Outcome(True, 0.2, 100, e2e_s=1.0, output_tokens=3)
    whole = Outcome(True, prompt_tokens=100, e2e_s=2.0, output_tokens=3)
    assert summarize([streamed, whole])["ttft_mean_ms"] == 200.0
    assert math.isnan(summarize([whole])["ttft_mean_ms"])
