"""``kvrouter bench route`` runs both candidate shapes on each fleet size and reports that
they decided alike (figures are not asserted: performance is measured, not tested)."""

from __future__ import annotations

from tests.benches import bench_json


def test_bench_route_prints_both_paths_and_they_agree() -> None:
    result = bench_json("route", "--replicas", "3,40", "--requests", "25", "--rounds", "1")
    assert result["bench"] == "route"
    sizes = [f["replicas"] for f in result["fleets"]]
    assert sizes == [3, 40]
    for fleet in result["fleets"]:
        assert fleet["per_candidate_us"] > 0 and fleet["arrays_us"] > 0
        assert fleet["same_decisions"] is True
        assert fleet["pd_decode_per_candidate_us"] > 0 and fleet["pd_decode_arrays_us"] > 0
        assert fleet["same_pd_decisions"] is True
    assert [f["default"] for f in result["fleets"]] == ["per_candidate", "arrays"]
