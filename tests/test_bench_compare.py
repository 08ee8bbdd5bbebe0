"""The paired comparison ``kvrouter bench live`` reports as ``versus`` (router/demo/compare.py):
ratios of ours' figures over a peer's, with a bootstrap interval over the shared requests."""

from __future__ import annotations

import random

import pytest

from router.core.slo import SloTargets
from router.demo.compare import FIGURES, paired
from router.demo.replay import Outcome


def _run(seed: int, n: int = 400, e2e_scale: float = 1.0, fail: int = 0) -> list[Outcome]:
    """``n`` answered requests of a fixed workload (``seed``), every E2E's decode part times
    ``e2e_scale``; the first ``fail`` failed."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ttft = rng.uniform(0.05, 1.0)
        decode = rng.uniform(0.5, 4.0) * e2e_scale
        ok = i >= fail
        out.append(Outcome(ok, ttft, 1000, output_tokens=64, e2e_s=ttft + decode))
    return out


def test_the_same_runs_compare_as_equal_with_no_spread() -> None:
    runs = [_run(1), _run(2)]
    got = paired(runs, runs, SloTargets())
    assert got["pairs"] == 800
    for name in FIGURES:
        assert got[name] == {"ratio": 1.0, "ci95": [1.0, 1.0]}, name


def test_a_slower_decode_shows_in_e2e_and_tpot_and_not_in_ttft() -> None:
    ours = [_run(1, e2e_scale=1.2), _run(2, e2e_scale=1.2)]
    peer = [_run(1), _run(2)]
    got = paired(ours, peer, SloTargets())
    assert got["ttft_p90_ms"]["ratio"] == 1.0
    assert got["e2e_p90_ms"]["ratio"] == pytest.approx(1.2, abs=0.03)
    lo, hi = got["e2e_p90_ms"]["ci95"]
    assert 1.0 < lo <= got["e2e_p90_ms"]["ratio"] <= hi < 1.3
    assert got["tpot_p90_ms"]["ratio"] == pytest.approx(1.2, abs=1e-3)  # TPOT is decode / 63


def test_failed_requests_are_misses_in_goodput_and_absent_from_latencies() -> None:
    slo = SloTargets.flat(ttft_s=10.0, tpot_s=10.0)  # everything answered meets it
    ours = [_run(1, n=100, fail=20)]
    peer = [_run(1, n=100)]
    got = paired(ours, peer, slo)
    assert got["goodput"]["ratio"] == 0.8
    assert got["goodput"]["ci95"][1] < 1.0  # the peer answered every pair ours failed
    assert got["ttft_p90_ms"]["ratio"] is not None


def test_runs_pair_in_order_and_unequal_ones_are_not_compared() -> None:
    slo = SloTargets()
    assert paired([_run(1, n=10)], [_run(1, n=12)], slo) == {}
    assert paired([], [_run(1)], slo) == {}
    # a third run of ours without a partner is left out
    assert paired([_run(1), _run(2), _run(3)], [_run(1), _run(2)], slo)["pairs"] == 800


def test_the_interval_is_the_same_for_the_same_runs() -> None:
    ours, peer = [_run(1, e2e_scale=1.1)], [_run(4)]
    assert paired(ours, peer, SloTargets()) == paired(ours, peer, SloTargets())
