"""``kvrouter bench listener`` at a small size: its output contract (every request routed by
some worker, each mode's runs and medians), not its figures."""

from __future__ import annotations

from router.bench.listener_bench import MODES, per_worker
from tests.benches import bench_json


def test_per_worker_sums_the_ok_requests_of_each_worker() -> None:
    page = (
        "# TYPE kvrouter_requests_total counter\n"
        'kvrouter_requests_total{worker="0",model="m",replica="b0",outcome="ok"} 3.0\n'
        'kvrouter_requests_total{worker="0",model="m",replica="b1",outcome="ok"} 4.0\n'
        'kvrouter_requests_total{worker="0",model="m",replica="b1",outcome="timeout"} 9.0\n'
        'kvrouter_requests_total{worker="1",model="m",replica="b0",outcome="ok"} 5.0\n'
    )
    assert per_worker(page) == {"0": 7.0, "1": 5.0}


def test_bench_listener_counts_every_request_per_worker() -> None:
    out = bench_json(
        "listener", "--runs", "1", "--requests", "40", "--warmup", "4", "--concurrency", "4"
    )
    assert out["bench"] == "listener" and out["workers"] == 2
    for mode in MODES:
        (run,) = out[mode]["runs"]
        assert run["failed"] == 0 and sum(run["per_worker"]) == 40, out
        assert 0.5 <= run["max_share"] <= 1 and out[mode]["max_share_median"] == run["max_share"]
