"""``kvrouter bench pods`` as real processes (3 ``kvrouter serve`` pods, a private Redis, a
mock fleet with publishers): the JSON contract, and one pod SIGKILLed mid-run: the others
stop counting it, and no client request is lost beyond those in flight on that pod."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytestmark = pytest.mark.xdist_group("bench_pods")

ROW_KEYS = {"ok", "failed", "hit", "ttft_mean_ms", "ttft_p90_ms", "tpot_p90_ms", "goodput"}


def test_one_pod_killed_mid_run() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench", "pods", "--pods", "3", "--replicas", "2",
         "--requests", "30", "--speedup", "4", "--time-scale", "0.1", "--stale-s", "0.5",
         "--rows", "pods_shared", "--kill-one-at", "1.0", "--json"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    row = doc["pods_shared"]
    assert set(row) >= ROW_KEYS, ROW_KEYS - set(row)
    kill = row["kill"]
    print("killed pod dropped by the others after", kill["dropped_after_s"], "s")
    assert kill["dropped_after_s"] is not None  # both survivors stopped counting it
    assert row["ok"] + row["failed"] == doc["requests"] == 30
    assert row["failed"] <= kill["in_flight_on_killed"], row.get("errors")
    assert row["exchange"]["snapshots_sent_per_s"] > 0


def test_repeats_combine_as_the_live_bench_combines_them() -> None:
    """A row's repeats are combined as ``kvrouter bench live --repeat`` combines its runs
    (router/bench/measure.py ``median_row``). ``_combined`` kept the first repeat's value of
    every figure but five (E2E, TTFT p50 / p99, the exchange and Redis rates, ``wall_s``),
    summed ``ok`` and ``failed`` but not ``requests``, and took ``statistics.median`` over a
    NaN (a repeat without a streamed answer has no TTFT mean), which depends on the order."""
    from router.bench.pods_bench import _combined

    nan = math.nan

    def run(ttft_mean: float, e2e: float, sent: float) -> dict[str, object]:
        return {"requests": 10, "ok": 9, "failed": 1, "hit": 0.5, "goodput": 0.9,
                "ttft_mean_ms": ttft_mean, "ttft_p90_ms": 400.0, "tpot_p90_ms": 10.0,
                "e2e_p90_ms": e2e, "pods": 3, "exchange": {"snapshots_sent_per_s": sent},
                "errors": ["502"]}  # fmt: skip

    runs = [run(nan, 100.0, 1.0), run(300.0, 200.0, 2.0), run(500.0, 900.0, 3.0)]
    row = _combined(runs)
    assert row == _combined(runs[::-1]) == _combined(runs[1:] + runs[:1])
    assert row["ttft_mean_ms"] == 400.0  # the repeats that have one
    assert row["e2e_p90_ms"] == 200.0 and row["exchange"] == {"snapshots_sent_per_s": 2.0}
    assert (row["requests"], row["ok"], row["failed"]) == (30, 27, 3)
    assert row["runs"] == 3 and row["spread"]["e2e_p90_ms"] == [100.0, 900.0]
    assert row["pods"] == 3 and row["errors"] == ["502"]
