"""``kvrouter bench ingest`` at a small size: its output contract (not its speed), and that
both publication shapes give the same canonical events (the index does not depend on how an
engine groups its blocks into events)."""

from __future__ import annotations

import json
import subprocess

from tests.benches import bench_refused
from tests.procs import KVROUTER


def test_bench_ingest_prints_cpu_figures_for_both_shapes() -> None:
    done = subprocess.run(
        [KVROUTER, "bench", "ingest", "--requests", "3", "--tokens", "1000", "--reps", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout[-2000:]
    out = json.loads(lines[0])
    assert out["bench"] == "ingest"
    mock, step = out["per_block"], out["step"]
    assert mock["engine_blocks"] == step["engine_blocks"] == 3 * (1000 // 64 * 4)
    assert mock["events_per_request"] == 1000 // 64 * 4 and step["events_per_request"] == 1
    assert mock["canonical_blocks"] == 3 * (1000 // 64)
    for figures in (mock, step):
        for key in ("stored_us_per_engine_block", "removed_us_per_engine_block"):
            assert figures[key] > 0, key
    assert mock["events_digest"] == step["events_digest"]


def test_bench_ingest_refuses_zero_rounds() -> None:
    # a best of no rounds has no figures (it failed reading one it never took)
    assert bench_refused("ingest", "--reps", "0").endswith("argument --reps: must be >= 1, got 0")
