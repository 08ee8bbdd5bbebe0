"""``kvrouter bench overload`` as real processes (mock replicas, the router, real HTTP):
driven past saturation with admission on, every request is either served whole or refused
with 429 and ``Retry-After``; none is lost. Speed is the benchmark's to report, not this
test's to assert."""

from __future__ import annotations

import json
import subprocess
import sys


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
