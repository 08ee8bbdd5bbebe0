"""``kvrouter bench pods`` as real processes (3 ``kvrouter serve`` pods, a private Redis, a
mock fleet with publishers): the JSON contract, and one pod SIGKILLed mid-run: the others
stop counting it, and no client request is lost beyond those in flight on that pod."""

from __future__ import annotations

import json
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
