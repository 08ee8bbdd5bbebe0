"""``kvrouter bench overload`` as real processes (mock replicas, the router, real HTTP):
driven past saturation with admission on, every request is either served whole or refused
with 429 and ``Retry-After``; none is lost. Speed is the benchmark's to report, not this
test's to assert."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from router.core.slo import SloTargets
from router.demo.overload_bench import summarize
from tests.benches import bench_refused
from tests.scripted_replica import GAP_S, Script, event, scripted_replica, token, usage


def test_overload_loses_nothing_and_refuses_with_retry_after() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench", "overload", "--requests", "40",
         "--replicas", "1", "--speedup", "4", "--time-scale", "0.05", "--rows", "slo",
         "--json"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    row = doc["rows"]["slo"]
    assert row["requests"] == 40
    # every request accounted for: served whole, or refused with Retry-After
    assert row["lost"] == 0, row["errors"]
    assert row["served"] + row["refused"] == 40
    assert row["refused"] > 0, "the fleet was not driven past saturation"
    assert row["refused_with_retry_after"] == row["refused"]
    assert set(row["refusal_codes"]) <= {"slo_deadline", "slo_queue_full"}
    assert set(row["slo_attainment"]) == {"priority", "default", "flex"}


def test_overload_percentiles_are_nearest_rank_as_every_other_figure() -> None:
    """The overload rows' TTFT / TPOT / refusal percentiles are the same function as the
    live bench's and the simulator's (router.bench.measure.percentile, nearest rank), not
    numpy's interpolation: TTFTs 100, 200, 300, 400 ms have p50 300, not 250."""
    from router.bench.measure import percentile
    from router.demo.overload_bench import Result
    from router.demo.replay import Outcome

    ttfts = [0.1, 0.2, 0.3, 0.4]
    served = [
        Result(
            1, 200, elapsed_s=t + 0.9, answer=Outcome(True, t, 100, e2e_s=t + 0.9, output_tokens=10)
        )
        for t in ttfts
    ]
    refused = [Result(1, 429, retry_after=True, elapsed_s=t) for t in ttfts]
    row = summarize(served + refused, SloTargets())
    assert row["ttft_ms_p50"] == percentile([t * 1e3 for t in ttfts], 50) == 300.0
    assert row["ttft_ms_p90"] == 400.0
    assert row["refusal_latency_ms_p50"] == 300.0 and row["refusal_latency_ms_max"] == 400.0
    assert row["tpot_ms_p90"] == 100.0


def test_overload_refuses_a_profile_it_cannot_load_before_starting_a_fleet(
    tmp_path: Path,
) -> None:
    # each mock replica refused it on its own: a traceback naming a replica that exited
    assert "no profile" in bench_refused("overload", "--profile", "no-such-profile")
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert "a profile needs a name" in bench_refused("overload", "--profile", str(empty))


# -- the overload bench's client times a stream as the live bench's does (router/demo/replay.py)

USAGE = usage(100, 3)


async def _overload_one(script: Script) -> Any:
    """The overload bench's result for one request answered over loopback HTTP by a replica
    that writes its stream with ``script``."""
    from router.demo.overload_bench import _one

    async with scripted_replica(script) as url, aiohttp.ClientSession() as session:
        return await _one(session, url + "/v1/completions", b'{"prompt": [1], "stream": true}', 1)


async def test_overload_ttft_is_the_first_token_not_a_first_event_without_one() -> None:
    """A stream may open with an event that carries no token (a usage-only chunk, an empty
    text); the overload bench took TTFT at the first ``data:`` line whatever it carried,
    where the live bench (router/demo/replay.py ``_has_token``) waits for a token."""

    async def script(resp: web.StreamResponse) -> None:
        await resp.write(b": keep-alive\n\n")
        await resp.write(event({"id": "c", "choices": [], "usage": None}))
        await resp.write(token(""))
        await asyncio.sleep(GAP_S)  # the replica's prefill
        await resp.write(token("a") + token("b c", "length") + USAGE + b"data: [DONE]\n\n")

    r = await _overload_one(script)
    row = summarize([r], SloTargets())
    assert row["served"] == 1, row
    assert row["ttft_ms_p50"] >= GAP_S * 1e3, row


async def test_overload_tpot_is_timed_to_the_last_token_not_done() -> None:
    """TPOT runs from the first token to the last (router.core.slo, vLLM's
    ``IterationStats.update_from_finished_request``); the overload bench timed it to
    ``[DONE]``: a wait after the last token for the usage chunk counted as decoding."""

    async def script(resp: web.StreamResponse) -> None:
        await resp.write(token("a") + token("b") + token("c", "length"))
        await asyncio.sleep(GAP_S)  # after the last token: the usage and the end
        await resp.write(USAGE + b"data: [DONE]\n\n")

    r = await _overload_one(script)
    row = summarize([r], SloTargets())
    assert row["served"] == 1, row
    # the last token came well before the end (GAP_S / 2: the client may read the last token
    # later after its write than it reads the end after its own), so its two intervals
    # after the first token end that much before the stream did
    decoding_s = row["tpot_ms_p90"] * 2 / 1e3
    assert decoding_s <= r.elapsed_s - row["ttft_ms_p50"] / 1e3 - GAP_S / 2, (row, r)
