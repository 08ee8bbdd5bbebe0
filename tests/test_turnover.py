"""Cache turnover: the index counts what engines evict, the meter turns the counts (and what
the router sends) into each replica's cache horizon and eviction risk, and ``ours`` sends
new prefixes away from caches that turn over fast (router/core/turnover.py)."""

from __future__ import annotations

import math
import random

import pytest

from router.core.index import PrefixIndex
from router.core.load import LoadTracker, LoadView
from router.core.policies import Candidate, Ours
from router.core.routing import RoutingEngine
from router.core.routing_settings import RoutingSettings
from router.core.turnover import CacheTurnover
from router.core.types import Kind, PrefixMatch, ReplicaKey, RouteRequest, Tier

A, B = ReplicaKey("a"), ReplicaKey("b")


def test_the_index_counts_gpu_kv_blocks_removed_by_events() -> None:
    index = PrefixIndex()
    index.store(A, [1, 2, 3, 4])
    index.store(B, [1, 2])
    index.store(A, [9], Tier.CPU)
    index.store(A, [7], kind=Kind.STATE)
    index.remove(A, [3, 4, 5])  # 5 was never stored: not an eviction
    index.remove(A, [9], Tier.CPU)  # host tier: not the GPU cache's turnover
    index.remove(A, [7], kind=Kind.STATE)
    index.remove(A, [1])  # shared with B: still A's eviction
    assert index.evicted_blocks(A) == 3
    assert index.evicted_blocks(B) == 0
    assert index.evicted_blocks(ReplicaKey("unknown")) == 0
    index.clear_replica(A)  # a cleared cache starts counting again
    assert index.evicted_blocks(A) == 0
    index.store(A, [1])
    index.remove(A, [1])
    assert index.evicted_blocks(A) == 1


def _meter_with(rate: float, held: int, seconds: float, step: float = 5.0) -> CacheTurnover:
    meter = CacheTurnover(interval_s=step, window_s=60.0)
    evicted = 0.0
    t = 0.0
    while t <= seconds:
        count = int(evicted)
        meter.sample(t, [A], lambda _k, c=count: c, lambda _k: held)  # type: ignore[misc]
        t += step
        evicted += rate * step
    return meter


def test_the_horizon_is_cached_blocks_over_the_eviction_rate() -> None:
    meter = _meter_with(rate=10.0, held=1000, seconds=600)
    assert meter.horizon_s(A) == pytest.approx(100.0, rel=0.02)
    assert meter.horizon_s(B) == math.inf  # never sampled


def test_a_cache_that_evicts_nothing_has_an_infinite_horizon() -> None:
    assert _meter_with(rate=0.0, held=1000, seconds=600).horizon_s(A) == math.inf
    # less than a block a window is not turnover either
    assert _meter_with(rate=0.01, held=1000, seconds=600).horizon_s(A) == math.inf
    one = CacheTurnover()
    one.sample(0.0, [A], lambda _k: 50, lambda _k: 10)  # one sample: no rate yet
    assert one.horizon_s(A) == math.inf


def test_the_rate_follows_a_change_within_its_window() -> None:
    meter = CacheTurnover(interval_s=5.0, window_s=60.0)
    count = 0
    for i in range(200):  # 700 s evicting 20 blocks/s, then nothing for 300 s
        meter.sample(i * 5.0, [A], lambda _k, c=count: c, lambda _k: 1000)  # type: ignore[misc]
        if i == 139:
            assert meter.horizon_s(A) == pytest.approx(50.0, rel=0.01)
        count += 100 if i < 140 else 0
    assert meter.horizon_s(A) > 100 * 50.0  # five windows later the rate has faded


def test_a_cleared_count_restarts_the_meter_and_risks_follow_samples() -> None:
    meter = CacheTurnover(interval_s=1.0, window_s=10.0, reuse_window_s=100.0)
    counts = {A: 0, B: 0}
    keys = (A, B)
    for t in range(60):
        counts[A] += 50
        meter.sample(float(t), keys, counts.__getitem__, lambda _k: 500)
    first = meter.risks(keys)  # A: horizon 10 s; B evicts nothing
    assert first[0] == pytest.approx(math.exp(-0.1), rel=0.01) and first[1] == 0.0
    assert meter.risks(keys) is first  # cached until the next sample
    counts[A] = 0  # the replica's cache was cleared: its count restarts
    meter.sample(60.0, keys, counts.__getitem__, lambda _k: 500)
    assert meter.risks(keys)[0] == 0.0
    assert not meter.due(60.5) and meter.due(61.0)
    with pytest.raises(ValueError):
        CacheTurnover(interval_s=0.0)


def test_risks_compare_with_the_calmest_cache() -> None:
    meter = CacheTurnover(interval_s=1.0, window_s=10.0, reuse_window_s=100.0)
    c = ReplicaKey("c")
    counts = {A: 0, B: 0, c: 0}
    keys = (A, B, c)
    for t in range(100):
        counts[A] += 50  # horizon 10 s
        counts[B] += 10  # horizon 50 s
        counts[c] += 10
        meter.sample(float(t), keys, counts.__getitem__, lambda _k: 500)
    assert meter.horizon_s(A) == pytest.approx(10.0, rel=0.01)
    assert meter.horizon_s(B) == pytest.approx(50.0, rel=0.01)
    # the chance of reuse lost at 10 s beyond what is lost at 50 s
    assert meter.risk(A) == pytest.approx(math.exp(-0.1) - math.exp(-0.5), rel=0.01)
    assert meter.risk(B) == meter.risk(c) == 0.0  # alike: no difference
    assert list(meter.risks(keys)) == [meter.risk(A), 0.0, 0.0]


def test_what_the_router_sends_counts_before_the_engine_reports_it() -> None:
    """Between samples the blocks this router sends raise a full cache's turnover at once,
    so the replica that looked calmest does not take every new prefix until the next one."""
    meter = CacheTurnover(interval_s=5.0, window_s=60.0, reuse_window_s=300.0)
    counts = {A: 0, B: 0}
    keys = (A, B)
    for t in range(0, 600, 5):  # both evict 10 blocks a second out of 1,000
        counts[A] += 50
        counts[B] += 50
        meter.sample(float(t), keys, counts.__getitem__, lambda _k: 1000)
    risks = meter.risks(keys)
    assert list(risks) == [0.0, 0.0]
    meter.dispatched(A, 2400)  # 40 blocks a second over the window: 4x its eviction rate
    assert meter.horizon_s(A) == pytest.approx(25.0, rel=0.05)
    assert meter.risk(A) == pytest.approx(math.exp(-25 / 300) - math.exp(-100 / 300), rel=0.05)
    assert risks[0] == meter.risk(A)  # the array handed out is updated in place
    meter.dispatched(ReplicaKey("unknown"), 100)  # never sampled: nothing to update
    calm = CacheTurnover()
    calm.sample(0.0, [A], lambda _k: 0, lambda _k: 10)
    calm.sample(10.0, [A], lambda _k: 0, lambda _k: 10)
    calm.dispatched(A, 10_000)  # a cache with room evicts nothing, whatever it is sent
    assert calm.risk(A) == 0.0


def _cand(key: ReplicaKey, kv: int, risk: float) -> Candidate:
    return Candidate(key, PrefixMatch(kv, kv, kv, kv), LoadView(), 100, risk)


def test_ours_sends_a_new_prefix_away_from_a_cache_that_turns_over_fast() -> None:
    # both hold the 2,048-token system prompt; the rest (6,000 tokens) is new either way
    request = RouteRequest("x", "m", 8_000, [], 64, None, 100)
    fast, calm = _cand(A, 32, risk=0.5), _cand(B, 32, risk=0.0)
    ours = Ours()
    assert ours.choose(request, [fast, calm], 0.0, random.Random(0)).replica == B
    assert ours.choose(request, [calm, fast], 0.0, random.Random(0)).replica == B
    terms = ours.terms(request, fast)
    assert terms["eviction"] == pytest.approx(terms["prefill"] * (0.5 - ours.eviction_risk_floor))
    # below the floor the term is 0 and the caches' sizes and the rng break the tie
    alike = [_cand(A, 32, ours.eviction_risk_floor), _cand(B, 32, 0.0)]
    assert ours.terms(request, alike[0])["eviction"] == 0.0
    picks = {ours.choose(request, alike, 0.0, random.Random(s)).replica for s in range(20)}
    assert picks == {A, B}
    # a long cached prefix still wins over a calm cache: the term prices only new blocks
    hit = RouteRequest("y", "m", 8_000, [], 64, None, 100)
    assert ours.choose(hit, [_cand(A, 120, 0.5), calm], 0.0, random.Random(0)).replica == A


def test_the_routing_engine_measures_turnover_from_removed_events() -> None:
    index, load = PrefixIndex(), LoadTracker()
    keys = (A, B)
    system = list(range(1, 33))
    for key in keys:
        index.add_replica(key)
        load.add_replica(key)
        index.store(key, system)
    engine = RoutingEngine(index, load, Ours(), RoutingSettings(block_size=64))
    request = RouteRequest("q", "m", 8_000, [*system, 1000, 1001], 64)
    churn = 10_000
    for t in range(0, 300, 5):  # A evicts 20 blocks a second (stored, then removed)
        blocks = list(range(churn, churn + 100))
        index.store(A, blocks)
        index.remove(A, blocks)
        churn += 100
        engine.candidates(request, keys, float(t))
    risks = {c.replica: c.eviction_risk for c in engine.candidates(request, keys, 300.0)}
    assert risks[B] == 0.0
    assert risks[A] > 0.9  # 32 blocks held, 20 evicted a second: gone in under 2 s
    assert engine.route(request, keys, 300.0, random.Random(0)).replica == B
    # what it sends counts at once: B has room, so sending there risks nothing
    decision = engine.route(request, keys, 300.0, random.Random(0))
    engine.dispatched(request, decision, 300.0)
    assert engine.turnover.risk(B) == 0.0
