"""``kvrouter bench admit`` runs and prints its one JSON object (figures are not asserted:
performance is measured, not tested)."""

from __future__ import annotations

from tests.benches import bench_json


def test_bench_admit_prints_its_figures() -> None:
    result = bench_json("admit", "--requests", "30", "--rounds", "2", "--unique")
    assert result["bench"] == "admit" and result["unique_prompts"] is True
    assert result["replicas"] == 4 and result["prompt_tokens"] > 300
    for key in ("parse_us", "prompt_us", "route_us", "metrics_us", "memo_hit_us"):
        assert result[key] > 0, key
