"""Every policy on small hand-made cases, the load tracker, and the routing step."""

from __future__ import annotations

import random

import pytest

from router.core.errors import NoReplicaAvailable
from router.core.index import PrefixIndex
from router.core.load import CostModel, EngineReport, LoadTracker, LoadView
from router.core.policies import (
    POLICY_NAMES,
    Candidate,
    Dynamo,
    LlmD,
    Ours,
    PrebleE2,
    RoundRobin,
    SGLangCacheAware,
    make_policy,
)
from router.core.routing import RoutingEngine
from router.core.routing_settings import BusyThresholds, RoutingSettings
from router.core.slo import SloTier
from router.core.types import Kind, PrefixMatch, ReplicaKey, RouteRequest

A, B, C = ReplicaKey("a"), ReplicaKey("b"), ReplicaKey("c")
RNG = random.Random(0)


def req(tokens: int = 1024, block: int = 64, hashes: list[int] | None = None) -> RouteRequest:
    return RouteRequest("r1", "m", tokens, hashes or [], block)


def cand(key: ReplicaKey, kv: int = 0, usable: int | None = None, **load: object) -> Candidate:
    u = kv if usable is None else usable
    return Candidate(key, PrefixMatch(kv, kv, kv, u), LoadView(**load))  # type: ignore[arg-type]


def test_policy_names_are_the_documented_ones() -> None:
    assert set(POLICY_NAMES) == {
        "round_robin",
        "random",
        "least_loaded",
        "longest_prefix",
        "dynamo",
        "sglang",
        "llmd",
        "preble",
        "vllm_kv_aware",
        "vllm_cache_aware",
        "ours",
    }
    for name in POLICY_NAMES:
        d = make_policy(name).choose(req(), [cand(A), cand(B)], 0.0, random.Random(1))
        assert d.policy == name and d.replica in (A, B) and len(d.ranking) == 1
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")
    with pytest.raises(ValueError, match="no parameter"):
        make_policy("dynamo", {"bogus": 1})
    assert make_policy("ours", {"cost": {"chunk_tokens": 512}}).cost.chunk_tokens == 512  # type: ignore[attr-defined]


def test_round_robin_cycles_in_stable_order() -> None:
    rr = RoundRobin()
    picks = [rr.choose(req(), [cand(C), cand(A), cand(B)], 0, RNG).replica for _ in range(4)]
    assert picks == [A, B, C, A]


def test_least_loaded_and_longest_prefix() -> None:
    cs = [cand(A, kv=2, in_flight=5), cand(B, kv=8, in_flight=9), cand(C, kv=0, in_flight=1)]
    assert make_policy("least_loaded").choose(req(), cs, 0, RNG).replica == C
    d = make_policy("longest_prefix").choose(req(), cs, 0, RNG)
    assert d.replica == B and d.kv_tokens == 8 * 64


def test_dynamo_cost_formula() -> None:
    dyn = Dynamo()
    r = req(tokens=640)  # 10 blocks
    a = Candidate(A, PrefixMatch(6, 4, 6, 6), LoadView(in_flight_prompt_tokens=640))
    cost, terms = dyn.cost(r, a)
    # overlap = 4*1.0 + 2*0.75 = 5.5 ; prefill = 10 - 5.5 ; decode = 10 in flight + 10 new
    assert terms == {"prefill_blocks": 4.5, "decode_blocks": 20.0, "overlap": 5.5}
    assert cost == pytest.approx(24.5)
    b = cand(B, kv=0)  # cost 10 + 10 = 20 -> wins despite no overlap
    assert dyn.choose(r, [a, b], 0, RNG).replica == B
    # With a high temperature both get picked sometimes.
    hot = Dynamo(temperature=10.0)
    seen = {hot.choose(r, [a, b], 0, random.Random(s)).replica for s in range(50)}
    assert seen == {A, B}


def test_sglang_cache_aware_branches() -> None:
    pol = SGLangCacheAware()
    r = req(tokens=640)
    # Imbalanced (40 - 2 > 32 and 40 > 1.1*2): shortest queue even with a full match on A.
    cs = [cand(A, kv=10, in_flight=40), cand(B, in_flight=2)]
    assert pol.choose(r, cs, 0, RNG).replica == B
    # Balanced and match rate 0.6 > 0.5: best match.
    cs = [cand(A, kv=6, in_flight=3), cand(B, in_flight=2)]
    assert pol.choose(r, cs, 0, RNG).replica == A
    # Balanced, rate 0.3 <= 0.5: smallest cache.
    cs = [
        Candidate(A, PrefixMatch(3, 3, 3, 3), LoadView(), cached_blocks=500),
        Candidate(B, PrefixMatch(), LoadView(), cached_blocks=10),
    ]
    assert pol.choose(r, cs, 0, RNG).replica == B


def test_llmd_weighted_scorers() -> None:
    report = EngineReport(running=1, waiting=4, kv_usage=0.9, at=0.0)
    a = Candidate(A, PrefixMatch(10, 10, 10, 10), LoadView(engine=report, engine_age_s=0.1))
    b = Candidate(B, PrefixMatch(), LoadView(engine=EngineReport(1, 0, 0.1, 0.0), engine_age_s=0.1))
    d = LlmD().choose(req(tokens=640), [a, b], 0, RNG)
    # A: 3*1 + 2*0 + 2*0.1 = 3.2 ; B: 0 + 2*1 + 2*0.9 = 3.8
    assert d.replica == B and d.score == pytest.approx(3.8)
    assert d.terms == {"prefix": 0.0, "queue": 1.0, "kv": pytest.approx(0.9)}


def test_preble_exploit_or_explore() -> None:
    r = req(tokens=640)
    cs = [cand(A, kv=6, in_flight=9), cand(B, in_flight=0)]
    assert PrebleE2().choose(r, cs, 0, RNG).replica == A  # 384 cached > 256 missed
    cs = [cand(A, kv=4, in_flight=9), cand(B, in_flight=0)]
    assert PrebleE2().choose(r, cs, 0, RNG).replica == B  # 256 cached < 384 missed


def test_ours_uses_usable_prefix_and_weighs_queue() -> None:
    ours = Ours(cost=CostModel(prefill_s_per_token=1e-4, prefill_s_per_token_ctx=0.0))
    r = req(tokens=64 * 100)
    # A has a long KV match but no state checkpoint (hybrid): nothing usable.
    a = cand(A, kv=90, usable=0)
    b = cand(B, kv=50, usable=48)
    d = ours.choose(r, [a, b], 0, RNG)
    assert d.replica == B and d.usable_tokens == 48 * 64 and d.kv_tokens == 50 * 64
    assert d.terms["prefill"] == pytest.approx((6400 - 48 * 64) * 1e-4)
    # A queue on B large enough flips the choice (prefill seconds weigh w_prefill = 12,
    # queued seconds 1: B's 3,328 uncached tokens cost 4.0 s against A's 7.7 s, so it takes
    # more than 3.7 s of queue on B).
    b_busy = cand(B, kv=50, usable=48, queued_prefill_tokens=60_000, prefilling=3)
    assert ours.choose(r, [a, b_busy], 0, RNG).replica == A
    # KV pressure above the threshold is penalised.
    full = LoadView(engine=EngineReport(0, 0, 0.99, 0.0), engine_age_s=0.0)
    t = ours.terms(r, Candidate(C, PrefixMatch(), full))
    assert t["kv"] == pytest.approx(ours.kv_pressure_s * 0.9, rel=1e-6)


def test_load_tracker_lifecycle() -> None:
    lt = LoadTracker()
    lt.dispatch("x", A, prompt_tokens=1000, cached_tokens=600)
    v = lt.view(A, 0.0)
    assert (v.in_flight, v.prefilling, v.queued_prefill_tokens) == (1, 1, 400)
    lt.first_token("x")
    lt.first_token("x")  # idempotent
    v = lt.view(A, 0.0)
    assert (v.prefilling, v.decoding, v.queued_prefill_tokens, v.decode_context_tokens) == (
        0,
        1,
        0,
        1000,
    )
    lt.complete("x")
    lt.complete("x")
    assert lt.view(A, 0.0) == LoadView()
    lt.engine_report(A, EngineReport(2, 3, 0.5, at=10.0))
    v = lt.view(A, 12.5)
    assert v.engine_age_s == 2.5 and v.waiting(max_age_s=5) == 3 and v.waiting(max_age_s=1) == 0


def test_routing_engine_filters_and_speculates() -> None:
    idx, lt = PrefixIndex(), LoadTracker()
    hashes = list(range(1, 11))
    idx.store(A, hashes[:8])
    idx.store(A, [hashes[7]], kind=Kind.STATE)
    settings = RoutingSettings(
        block_size=64,
        hybrid=True,
        state_interval_blocks=4,
        speculative_ttl_s=5.0,
        busy=BusyThresholds(max_in_flight=1),
    )
    eng = RoutingEngine(idx, lt, make_policy("ours"), settings)
    r = RouteRequest("q1", "m", 640, hashes, 64)
    d = eng.route(r, [A, B], 0.0, random.Random(0))
    assert d.replica == A and d.usable_tokens == 512
    eng.dispatched(r, d, 0.0)
    # A is now busy (1 in flight): the next request goes to B even though A matches.
    r2 = RouteRequest("q2", "m", 640, hashes, 64)
    d2 = eng.route(r2, [A, B], 0.1, random.Random(0))
    assert d2.replica == B and d2.usable_tokens == 0
    eng.dispatched(r2, d2, 0.1)
    # B got speculative entries (KV + state grid) for the blocks it was sent; the prompt's
    # own checkpoint ends before its last token (block 9 of this 10-block prompt)
    assert idx.match(hashes, hybrid=True, now=1.0).get(B).usable_blocks == 9
    assert idx.match(hashes, hybrid=True, now=6.0).get(B).usable_blocks == 0
    lt.set_draining(A, True)
    lt.set_health(B, False)
    with pytest.raises(NoReplicaAvailable):
        eng.route(r, [A, B], 7.0, random.Random(0))
    lt.set_draining(A, False)
    strict = RoutingEngine(
        idx,
        lt,
        make_policy("ours"),
        RoutingSettings(busy=BusyThresholds(max_in_flight=1, reject_when_all_busy=True)),
    )
    with pytest.raises(NoReplicaAvailable) as exc:
        strict.route(r, [A], 7.0, random.Random(0))
    assert exc.value.busy


def test_ours_breaks_exact_ties_towards_the_smallest_cache() -> None:
    r = req(tokens=640)
    idle = [
        Candidate(A, PrefixMatch(), LoadView(), cached_blocks=900),
        Candidate(B, PrefixMatch(), LoadView(), cached_blocks=10),
        Candidate(C, PrefixMatch(), LoadView(), cached_blocks=500),
    ]
    for seed in range(10):
        d = Ours().choose(r, idle, 0.0, random.Random(seed))
        assert d.replica == B and set(d.ranking) == {A, C}
    # Among equally small caches the rng decides, so both get picked.
    even = [Candidate(A, PrefixMatch(), LoadView()), Candidate(B, PrefixMatch(), LoadView())]
    assert {Ours().choose(r, even, 0.0, random.Random(s)).replica for s in range(20)} == {A, B}


@pytest.mark.parametrize(
    "params",
    [
        {"tpot_target_s": 0.0},  # every request: ZeroDivisionError
        {"tpot_target_s": -0.1},  # interference negative: decoding replicas preferred
        {"w_prefill": -12.0},  # a cache miss rewarded
        {"w_interference": float("nan")},  # every score NaN: the first replica always wins
        {"report_max_age_s": float("nan")},
        {"foreign_waiting_tokens": -4096},
        {"host_hit_value": -0.5},
        {"cost": {"chunk_tokens": 0}},  # ZeroDivisionError in steps_for
        {"cost": {"prefill_s_per_token": -2.5e-5}},
        {"cost": {"decode_s_per_seq": float("inf")}},
        # a TTFT target of 0: ZeroDivisionError; infinite or NaN: the array path's miss
        # term NaN where the per-candidate path's is 0 (two decisions for one request)
        {"ttft_tiers": (SloTier(None, 0.0),)},
        {"ttft_tiers": (SloTier(8192, 2.0), SloTier(None, float("inf")))},
        {"ttft_tiers": (SloTier(None, float("nan")),)},
        {"ttft_tiers": (SloTier(32768, 5.0), SloTier(8192, 2.0))},  # tier_for: 5 s for all
    ],
)
def test_ours_refuses_parameters_that_break_or_invert_its_cost(params: dict[str, object]) -> None:
    """A policy file's or config's parameters reach every request's score: a value that
    divides by zero, goes NaN or turns a cost into a reward is refused when the policy is
    built (``kvrouter serve --check``, ``--policy-file``), not met by every request."""
    with pytest.raises(ValueError, match="must be"):
        make_policy("ours", params)


@pytest.mark.parametrize(
    ("name", "key", "value"),
    [
        ("llmd", "kv_weight", float("nan")),
        ("dynamo", "prefill_load_scale", -1.0),
        ("sglang", "cache_threshold", float("inf")),
        ("vllm_kv_aware", "host_credit", float("nan")),
        ("vllm_cache_aware", "balance_abs_threshold", -5),
    ],
)
def test_a_baselines_odd_parameter_is_refused_by_name(name: str, key: str, value: float) -> None:
    """A NaN, negative or infinite weight or threshold makes every score it enters rank
    candidates arbitrarily (comparisons with NaN are all false): refused, naming the key,
    as ``ours``' own are; a time may be infinite (never)."""
    with pytest.raises(ValueError, match=key):
        make_policy(name, {key: value})
    assert make_policy("llmd", {"report_max_age_s": float("inf")}) is not None
