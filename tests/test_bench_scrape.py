"""``kvrouter bench scrape`` runs its router and mocks and reports the page's size and the
loop's lag around scrapes (figures are not asserted: performance is measured, not tested)."""

from __future__ import annotations

from tests.benches import bench_json


def test_bench_scrape_reports_every_figure() -> None:
    result = bench_json("scrape", "--entries", "8", "--models", "2", "--scrapes", "2")
    assert result["bench"] == "scrape" and result["entries"] == 8
    # every entry was sent requests: its per-replica series are on the page
    assert result["series"] > 8 * 9 and result["bytes_per_entry"] > 0
    assert result["scrape_ms_max"] >= result["scrape_ms_p50"] > 0
    assert result["lag_ms_max"] >= result["lag_ms_p50"] >= 0 and result["idle_lag_ms"] >= 0
