"""``kvrouter bench instructions`` counts a router's instructions per request under valgrind
(figures are not asserted: performance is measured, not tested)."""

from __future__ import annotations

import shutil

import pytest

from tests.benches import bench_json


@pytest.mark.benchmark  # the router under valgrind: most of a minute (pytest -m benchmark)
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
def test_bench_instructions_counts_kvrouter() -> None:
    result = bench_json(
        "instructions",
        "--without-peer",
        "--requests",
        "10",
        "--warmup",
        "2",
        "--connections",
        "2",
        timeout=600,
    )
    assert result["bench"] == "instructions"
    assert result["kvrouter"]["failed_requests"] == 0
    # a proxied request costs far more than nothing, and far less than a second of CPU
    assert 10_000 < result["kvrouter"]["instructions_per_request"] < 1_000_000_000
    assert result["vllm_router"] == {"skipped": "--without-peer"}
