"""``kvrouter bench stalls`` runs its router, feeds and load generator and reports the loop's
lag, the collector's pauses and the requests it served (figures are not asserted:
performance is measured, not tested)."""

from __future__ import annotations

from tests.benches import bench_json


def test_bench_stalls_runs_a_small_load_and_reports_every_figure() -> None:
    result = bench_json(
        "stalls", "--replicas", "1", "--feeds", "1", "--batches", "40", "--rate", "200",
        "--concurrency", "2", timeout=60,
    )  # fmt: skip
    assert result["bench"] == "stalls" and result["gc_setup"] == "serve"
    assert result["ticks"] > 0 and result["lag_max_ms"] >= result["lag_p50_ms"] >= 0
    assert {"gc0", "gc1", "gc2"} <= result.keys()
    assert result["kv_entries"] > 0  # the feed's events reached the router's index
    requests = result["requests"]
    assert requests["requests"] > 0 and not requests["errors"], requests
