"""``kvrouter bench overload`` as real processes (mock replicas, the router, real HTTP):
driven past saturation with admission on, every request is either served whole or refused
with 429 and ``Retry-After``; none is lost. Speed is the benchmark's to report, not this
test's to assert."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.benches import bench_refused


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
    from router.core.slo import SloTargets
    from router.demo.overload_bench import Result, summarize

    ttfts = [0.1, 0.2, 0.3, 0.4]
    served = [Result(1, 200, ttft_s=t, elapsed_s=t + 0.9, output_tokens=10) for t in ttfts]
    refused = [Result(1, 429, retry_after=True, elapsed_s=t) for t in ttfts]
    row = summarize(served + refused, SloTargets(), [100] * 8)
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
