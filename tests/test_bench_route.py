"""``kvrouter bench route`` runs both candidate shapes on each fleet size and reports that
they decided alike (figures are not asserted: performance is measured, not tested)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_route_prints_both_paths_and_they_agree() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench", "route"]
        + ["--replicas", "3,40", "--requests", "25", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["bench"] == "route"
    sizes = [f["replicas"] for f in result["fleets"]]
    assert sizes == [3, 40]
    for fleet in result["fleets"]:
        assert fleet["per_candidate_us"] > 0 and fleet["arrays_us"] > 0
        assert fleet["same_decisions"] is True
    assert [f["default"] for f in result["fleets"]] == ["per_candidate", "arrays"]
