"""``kvrouter bench faults`` with a replica whose streams fail after their first token
(``break-stream``, ``error-event``): the run reports the client failures, what the bad
replica received after the first 2 s and when it was ejected (figures are not asserted:
performance is measured, not tested)."""

from __future__ import annotations

import pytest

from tests.benches import bench_json


@pytest.mark.parametrize("mode", ["break-stream", "error-event"])
def test_bench_faults_reports_a_stream_fault_and_the_ejection(mode: str) -> None:
    result = bench_json(
        "faults", "--scenarios", mode, "--policy", "round_robin", "--rate", "20",
        "--duration", "2", "--max-tokens", "2", timeout=90,
    )  # fmt: skip
    (row,) = result["scenarios"]
    assert row["scenario"] == f"fault {mode}" and row["router_alive"], row
    assert row["streams"] > 0 and row["requests"] > row["streams"], row
    # its first streams fail by construction (a token reached the client first)
    assert row["failed"] > 0 and 0 < row["failed_share"] <= 1, row
    assert row["bad_received_after_2s"] >= 0, row
    # round_robin sends it every third request until 3 failures in a row eject it
    assert row["ejections"] >= 1 and row["ejected_after_s"] >= 0, row
