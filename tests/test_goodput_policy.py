"""Goodput routing in the core: the decode weight the load tracker keeps, ``ours``'
interference term, session hints, and the ``vllm_kv_aware`` baseline."""

from __future__ import annotations

import math
import random

import pytest

from router.core.disagg import Disaggregator
from router.core.index import PrefixIndex
from router.core.load import (
    EXPECTED_OUTPUT_TOKENS,
    CostModel,
    LoadTracker,
    LoadView,
    decode_weight,
)
from router.core.policies import Candidate, Ours, VllmKvAware
from router.core.routing import RoutingEngine
from router.core.routing_settings import RoutingSettings
from router.core.session import SessionTable
from router.core.types import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    Kind,
    PrefixMatch,
    ReplicaKey,
    RouteRequest,
    Tier,
)

A, B, C = ReplicaKey("a"), ReplicaKey("b"), ReplicaKey("c")


def rng() -> random.Random:
    return random.Random(0)


# ---------------------------------------------------------------------------- decode weight


def test_decode_weight_is_one_over_the_intervals_of_the_answer() -> None:
    assert decode_weight(2) == 1.0
    assert decode_weight(11) == pytest.approx(0.1)
    assert decode_weight(1) == 1.0  # no interval: the weight of the most fragile
    assert decode_weight(None) == pytest.approx(1 / (EXPECTED_OUTPUT_TOKENS - 1))


def test_the_tracker_counts_a_requests_weight_from_dispatch_to_completion() -> None:
    t = LoadTracker()
    t.dispatch("short", A, 1000, 0, max_output_tokens=3)
    t.dispatch("long", A, 1000, 0, max_output_tokens=101)
    assert t.view(A, 0.0).decode_weight == pytest.approx(0.5 + 0.01)
    t.first_token("short")  # still in flight: its decode is what a prefill would stall
    assert t.view(A, 0.0).decode_weight == pytest.approx(0.51)
    t.complete("short")
    assert t.view(A, 0.0).decode_weight == pytest.approx(0.01)
    t.complete("long")
    assert t.view(A, 0.0).decode_weight == 0.0  # no rounding residue once idle
    t.dispatch("again", A, 10, 0, max_output_tokens=5)
    (weight,) = t.columns((A,)).decode_weight
    assert weight == t.view(A, 0.0).decode_weight == 0.25


# ---------------------------------------------------------------------------- ours


def _cand(key: ReplicaKey, kv: int = 0, weight: float = 0.0, **load: int) -> Candidate:
    return Candidate(key, PrefixMatch(kv, kv, kv, kv), LoadView(**load, decode_weight=weight))


def test_a_long_uncached_prefill_goes_where_it_stalls_fewest_short_answers() -> None:
    request = RouteRequest("x", "m", 32_000, [], 64, None, 500)
    # the same load on both, but A runs answers of 2-3 tokens and B answers of 1,000
    a = _cand(A, weight=2.0, decoding=4, decode_context_tokens=8000)
    b = _cand(B, weight=0.004, decoding=4, decode_context_tokens=8000)
    chosen = Ours().choose(request, [a, b], 0.0, rng())
    assert chosen.replica == B
    blind = Ours(w_interference=0.0)
    assert (
        blind.choose(request, [a, b], 0.0, rng()).score
        == blind.choose(request, [b, a], 0.0, rng()).score
    )  # without the term A and B tie
    ours = Ours()
    stall = ours.term_values(request, a)[0] * 2.0 / ours.tpot_target_s
    assert ours.terms(request, a)["interference"] == pytest.approx(stall)


def test_an_engine_report_counts_until_the_next_one_is_due_and_fetched() -> None:
    """Engines report every second; the queue they report counts until the next report
    is due plus its fetch (not only for exactly a second, which would drop it out for the
    length of every fetch), and no longer than 1.5 s."""
    from router.core.load import EngineReport

    request = RouteRequest("x", "m", 1_000, [], 64, None, 100)
    ours = Ours()

    def queue(age: float) -> float:
        report = EngineReport(running=0, waiting=4, kv_usage=0.0, at=0.0)
        c = Candidate(A, PrefixMatch(0, 0, 0, 0), LoadView(engine=report, engine_age_s=age))
        return ours.terms(request, c)["queue"]

    assert queue(1.2) == queue(0.1) > 0.0  # 4 requests of other routers' queued there
    assert queue(1.6) == 0.0


def test_a_cache_hit_still_goes_to_its_cache_next_to_short_answers() -> None:
    request = RouteRequest("x", "m", 32_000, [], 64, None, 500)
    a = _cand(A, kv=490, weight=2.0, decoding=4)  # holds 31,360 of the 32,000 tokens
    b = _cand(B, weight=0.0, decoding=4)
    assert Ours().choose(request, [a, b], 0.0, rng()).replica == A


def test_a_new_session_leaves_a_hot_prefix_whose_decode_batch_is_slow() -> None:
    request = RouteRequest("x", "m", 8_000, [], 64, None, 500)
    # A holds half the prompt and decodes 120 long conversations; B is nearly idle
    a = _cand(A, kv=62, decoding=120, decode_context_tokens=120 * 40_000)
    b = _cand(B, decoding=2, decode_context_tokens=2 * 1_000)
    assert Ours().choose(request, [a, b], 0.0, rng()).replica == B
    assert Ours(w_batch=0.0).choose(request, [a, b], 0.0, rng()).replica == A
    ours = Ours()
    cost = ours.cost
    joined = cost.decode_step_s(120, 120 * 40_000) + 120 * cost.decode_step_s(1, 8_000)
    assert ours.terms(request, a)["batch"] == pytest.approx(500 * joined)
    idle = _cand(C)
    assert ours.terms(request, idle)["batch"] == 0.0  # only what differs between replicas


def test_a_request_sampling_many_sequences_prices_them_all_in_the_batch() -> None:
    """``n`` sequences of one prompt (RL rollouts) each grow the steps of the sequences
    already decoding; an idle replica still prices nothing."""
    one = RouteRequest("x", "m", 8_000, [], 64, None, 500)
    many = one._replace(samples=16)
    a = _cand(A, kv=62, decoding=40, decode_context_tokens=40 * 40_000)
    b = _cand(B, decoding=10, decode_context_tokens=10 * 1_000)
    ours = Ours()
    cost = ours.cost
    step = cost.decode_step_s(40, 40 * 40_000)
    assert ours.terms(many, a)["batch"] == pytest.approx(
        500 * (step + 40 * cost.decode_step_s(16, 16 * 8_000))
    )
    assert ours.terms(many, a)["batch"] > ours.terms(one, a)["batch"]
    assert ours.terms(many, _cand(C))["batch"] == 0.0
    # a batch of 3 prompts (8,000 tokens in all), 2 samples each: 6 sequences
    batch = one._replace(samples=2, prompts=3)
    assert ours.terms(batch, b)["batch"] == pytest.approx(
        500 * (cost.decode_step_s(10, 10_000) + 10 * cost.decode_step_s(6, 16_000))
    )


def test_the_batch_term_fades_once_every_replica_has_prefill_queued() -> None:
    """Spreading decode batches gives up cache hits: free while some replica has no prefill
    queued, paid by every queued request once none has."""
    request = RouteRequest("x", "m", 8_000, [], 64, None, 500)
    load = {"decoding": 120, "decode_context_tokens": 120 * 40_000}
    a = _cand(A, kv=62, queued_prefill_tokens=2_000, **load)
    b = _cand(B, decoding=2, queued_prefill_tokens=2_000)
    assert Ours().choose(request, [a, b], 0.0, rng()).replica == A
    b_idle = _cand(B, decoding=2)
    assert Ours().choose(request, [a, b_idle], 0.0, rng()).replica == B


def test_a_request_leaves_its_cache_where_waiting_would_miss_its_ttft_target() -> None:
    """The cache holder has seconds of prefill queued: waiting there misses the request's
    own TTFT target (5 s for a prompt of 8k-32k tokens) where an idle replica meets it by
    prefilling the prompt. ``w_prefill`` alone charges that prefill at fleet cost and
    waited (r2264 of the bundled Mooncake trace at 1x: 5.02 s, its one TTFT miss); the
    ``miss`` term prices the request's own SLO. It fades, as ``batch`` does, once every
    replica has prefill queued: the compute a miss avoided takes then makes others miss."""
    request = RouteRequest("x", "m", 17_395, [], 64, None, 73)
    cost = CostModel(prefill_s_per_token=4e-5)  # the dense-70b profile's: 0.7 s of prefill
    ours = Ours(cost=cost)
    holder = _cand(A, kv=264, decoding=1, queued_prefill_tokens=165_000)
    idle = _cand(B)
    late, fresh = ours.terms(request, holder), ours.terms(request, idle)
    assert 6.0 < late["prefill"] + late["queue"] + late["decode"] < 12 * fresh["prefill"]
    assert late["miss"] == 1.0 and fresh["miss"] == 0.0
    assert ours.choose(request, [holder, idle], 0.0, rng()).replica == B
    blind = Ours(cost=cost, w_miss=0.0)
    assert blind.choose(request, [holder, idle], 0.0, rng()).replica == A
    busy = _cand(B, queued_prefill_tokens=2_000)
    assert ours.choose(request, [holder, busy], 0.0, rng()).replica == A
    # the ramp: 0 at the target, 1 at (1 + miss_margin) x the target
    short = RouteRequest("x", "m", 4_000, [], 64, None, 73)  # the 2 s tier
    for wait_s, miss in ((1.9, 0.0), (2.2, 0.5), (2.5, 1.0)):
        tokens = _tokens_of_prefill(ours, wait_s - ours.terms(short, _cand(C))["prefill"])
        terms = ours.terms(short, _cand(C, queued_prefill_tokens=tokens))
        assert terms["prefill"] + terms["queue"] + terms["decode"] == pytest.approx(
            wait_s, abs=0.01
        )
        assert terms["miss"] == pytest.approx(miss, abs=0.03)


def _tokens_of_prefill(ours: Ours, seconds: float) -> int:
    """The queued prompt tokens whose prefill (and the steps it takes) lasts ``seconds``."""
    request = RouteRequest("q", "m", 4_000, [], 64, None, 73)
    lo, hi = 0, 10_000_000
    while lo < hi:
        mid = (lo + hi) // 2
        t = ours.terms(request, _cand(C, queued_prefill_tokens=mid))
        if t["queue"] + t["decode"] < seconds:
            lo = mid + 1
        else:
            hi = mid
    return lo


def test_the_ttft_targets_come_from_the_models_slo() -> None:
    """``ttft_tiers`` is the model's SLO (the service and the simulator set it), so a
    policy_params table cannot give the policy other targets than the metrics judge by."""
    from router.core.slo import SloTier

    with pytest.raises(ValueError, match=r"\[slo\]"):
        Ours(ttft_tiers=((8192, 2.0),))  # type: ignore[arg-type]
    strict = Ours(ttft_tiers=(SloTier(None, 0.3),))
    request = RouteRequest("x", "m", 17_395, [], 64, None, 73)
    assert strict.terms(request, _cand(B))["miss"] == 1.0  # 0.45 s of prefill: past 0.36 s
    assert Ours().terms(request, _cand(B))["miss"] == 0.0


# ---------------------------------------------------------------------------- session hints


def _engine(policy: object, ttl: float = 600.0) -> RoutingEngine:
    index, load = PrefixIndex(), LoadTracker()
    for key in (A, B, C):
        index.add_replica(key)
        load.add_replica(key)
    return RoutingEngine(index, load, policy, RoutingSettings(block_size=4, session_ttl_s=ttl))  # type: ignore[arg-type]


def _turn(rid: str, chain: list[int], session: str | None = "s") -> RouteRequest:
    return RouteRequest(rid, "m", 4 * len(chain) + 2, chain, 4, session, 64)


def test_a_sessions_next_turn_is_credited_to_its_last_replica_before_events_arrive() -> None:
    engine = _engine(Ours())
    first = _turn("t1", list(range(1, 201)))
    decision = engine.route(first, (A, B, C), 0.0, rng())
    engine.dispatched(first, decision, 0.0)
    engine.load.complete("t1")  # answered; the engine's KV events have not come yet
    second = _turn("t2", list(range(1, 251)))
    again = engine.route(second, (A, B, C), 5.0, rng())
    assert again.replica == decision.replica
    assert again.usable_tokens == 200 * 4  # the previous prompt, as if indexed
    # without the session id: nothing is known
    cold = engine.route(_turn("t3", list(range(1, 251)), session=None), (A, B, C), 5.0, rng())
    assert cold.usable_tokens == 0


def test_an_edited_conversation_or_an_old_session_gets_no_credit() -> None:
    engine = _engine(Ours(), ttl=60.0)
    first = _turn("t1", list(range(1, 201)))
    engine.dispatched(first, engine.route(first, (A, B, C), 0.0, rng()), 0.0)
    edited = _turn("t2", [*range(1, 150), *range(1000, 1100)])
    assert engine.route(edited, (A, B, C), 1.0, rng()).usable_tokens == 0
    extended = _turn("t3", list(range(1, 251)))
    assert engine.route(extended, (A, B, C), 61.0, rng()).usable_tokens == 0  # expired


def test_a_hint_is_not_a_pin_a_busy_replica_loses_the_session() -> None:
    engine = _engine(Ours())
    first = _turn("t1", list(range(1, 21)))
    decision = engine.route(first, (A, B, C), 0.0, rng())
    engine.dispatched(first, decision, 0.0)
    engine.load.complete("t1")
    for i in range(40):  # the session's replica fills with long prefills
        engine.load.dispatch(f"bg{i}", decision.replica, 50_000, 0)
    second = _turn("t2", list(range(1, 26)))
    assert engine.route(second, (A, B, C), 1.0, rng()).replica != decision.replica


def _credit(engine: RoutingEngine, request: RouteRequest, key: ReplicaKey, now: float) -> int:
    got = engine.candidates(request, (A, B, C), now)
    assert isinstance(got, list)
    return next(c.match.usable_blocks for c in got if c.replica == key)


def test_a_hint_does_not_outlive_the_cache_it_credits() -> None:
    """A replica whose cache was cleared (AllCleared, a resync), or that left the fleet and
    came back (a restart), holds nothing of the session's previous turn: no credit."""
    for lose in ("all_cleared", "re_added"):
        engine = _engine(Ours())
        first = _turn("t1", list(range(1, 21)))
        decision = engine.route(first, (A, B, C), 0.0, rng())
        engine.dispatched(first, decision, 0.0)
        engine.load.complete("t1")
        second = _turn("t2", list(range(1, 26)))
        assert _credit(engine, second, decision.replica, 1.0) == 20
        if lose == "all_cleared":
            engine.index.apply(EventBatch(decision.replica, [AllCleared()]))
        else:
            engine.index.remove_replica(decision.replica)
            engine.index.add_replica(decision.replica)
        assert _credit(engine, second, decision.replica, 2.0) == 0, lose
        # the session's next dispatch binds it again
        engine.dispatched(second, engine.route(second, (A, B, C), 3.0, rng()), 3.0)
        third = _turn("t3", list(range(1, 31)))
        assert max(_credit(engine, third, k, 4.0) for k in (A, B, C)) == 25


def test_a_hint_covers_the_event_lag_and_lapses_when_the_events_come() -> None:
    """Credited until the engine reports the previous prompt stored; from then on the index
    alone tells, so blocks the engine evicted since are credited to nobody (a hint that
    outlived its blocks sent later turns to a replica without them: under cache pressure
    the simulator's goodput on the agentic generator, 8 x 2,048 blocks at 1x, went from
    91 to 98.5 %, docs/benchmarks.md)."""
    for hybrid in (False, True):
        settings = RoutingSettings(block_size=4, session_ttl_s=600.0, hybrid=hybrid)
        index, load = PrefixIndex(), LoadTracker()
        for key in (A, B, C):
            index.add_replica(key)
            load.add_replica(key)
        engine = RoutingEngine(index, load, Ours(), settings)
        chain = list(range(1, 21))
        first = _turn("t1", chain)
        decision = engine.route(first, (A, B, C), 0.0, rng())
        engine.dispatched(first, decision, 0.0)
        engine.load.complete("t1")
        second = _turn("t2", list(range(1, 26)))
        assert _credit(engine, second, decision.replica, 1.0) == 20, hybrid  # the lag
        kind = Kind.STATE if hybrid else Kind.KV
        stored = [BlocksStored(tuple(chain))]
        if hybrid:
            stored.append(BlocksStored((chain[-1],), kind=Kind.STATE))
        index.apply(EventBatch(decision.replica, stored))
        assert _credit(engine, second, decision.replica, 2.0) == 20, hybrid  # the index's
        index.apply(EventBatch(decision.replica, [BlocksRemoved(tuple(chain[10:]))]))
        if hybrid:
            index.apply(EventBatch(decision.replica, [BlocksRemoved((chain[-1],), kind=kind)]))
        assert _credit(engine, second, decision.replica, 3.0) == (0 if hybrid else 10), hybrid


def test_an_approximate_prompts_hint_credits_for_its_whole_life() -> None:
    """No event names a block of a prompt hashed approximately: its hint is all there is."""
    engine = _engine(Ours())
    first = _turn("t1", list(range(1, 21)))
    decision = engine.route(first, (A, B, C), 0.0, rng())
    engine.dispatched(first, decision, 0.0, exact=False)
    engine.index.apply(EventBatch(decision.replica, [BlocksStored((900, 901))]))
    assert _credit(engine, _turn("t2", list(range(1, 26))), decision.replica, 9.0) == 20


def test_a_hint_for_a_prompt_already_indexed_awaits_nothing() -> None:
    """The previous prompt's blocks were indexed before it was sent (an engine reports a
    block once): nothing is awaited, the index tells, and an eviction shows at once."""
    engine = _engine(Ours())
    chain = list(range(1, 21))
    engine.index.apply(EventBatch(A, [BlocksStored(tuple(chain))]))
    first = _turn("t1", chain)
    decision = engine.route(first, (A, B, C), 0.0, rng())
    assert decision.replica == A
    engine.dispatched(first, decision, 0.0)
    assert not engine.index.awaits(A, chain[-1])
    engine.index.apply(EventBatch(A, [BlocksRemoved(tuple(chain))]))
    assert _credit(engine, _turn("t2", list(range(1, 26))), A, 1.0) == 0


def test_two_withdrawn_turns_of_a_session_leave_its_last_served_hint() -> None:
    """Two turns of one session in flight on a replica that refuses both (no other to
    retry on), their refusals handled in the order they were sent: the session's hint is
    its last served turn's again. (The second's undo gave back the first's hint, itself
    withdrawn: the session credited the replica with a prompt it never took, for the
    hint's whole TTL, since no engine event would ever settle it.)"""
    engine = _engine(Ours())
    served = _turn("t1", list(range(1, 21)))
    decision = engine.route(served, (A, B, C), 0.0, rng())
    engine.dispatched(served, decision._replace(replica=A), 0.0)
    engine.load.complete("t1")
    first, second = _turn("t2", list(range(1, 31))), _turn("t3", list(range(1, 41)))
    refused = [
        (engine.dispatched(first, decision._replace(replica=B), 1.0), "t2"),
        (engine.dispatched(second, decision._replace(replica=B), 1.5), "t3"),
    ]
    for dispatch, request_id in refused:
        engine.withdraw(dispatch)
        engine.load.complete(request_id)
    assert engine.sessions is not None
    hint = engine.sessions.get("s", 2.0)
    assert hint is not None and (hint.replica, hint.blocks) == (A, 20), hint
    later = _turn("t4", list(range(1, 51)))
    assert _credit(engine, later, B, 2.0) == 0
    assert _credit(engine, later, A, 2.0) == 20


def test_a_refused_resend_does_not_bring_back_a_settled_hints_credit() -> None:
    """A served turn's hint settled (its events came) and the engine evicted its blocks
    since: no credit. The same turn sent again to that replica awaits its last block anew;
    the replica refuses it, so its hint goes and the served turn's comes back, which must
    not find the refused resend's await and credit the evicted blocks again until the
    session's TTL (the engine never reports a block of a prompt it refused)."""
    engine = _engine(Ours())
    chain = list(range(1, 21))
    served = _turn("t1", chain)
    decision = engine.route(served, (A, B, C), 0.0, rng())._replace(replica=A)
    engine.dispatched(served, decision, 0.0)
    engine.load.complete("t1")
    engine.index.apply(EventBatch(A, [BlocksStored(tuple(chain))]))  # settled
    engine.index.apply(EventBatch(A, [BlocksRemoved(tuple(chain))]))  # evicted since
    later = _turn("t3", list(range(1, 26)))
    assert _credit(engine, later, A, 1.0) == 0
    refused = engine.dispatched(_turn("t2", chain), decision, 2.0)
    assert _credit(engine, later, A, 2.5) == 20  # the resend's own hint, while in flight
    engine.withdraw(refused)
    engine.load.complete("t2")
    assert _credit(engine, later, A, 3.0) == 0


def test_baselines_do_not_read_hints_and_the_table_is_bounded() -> None:
    assert _engine(VllmKvAware()).sessions is None
    assert _engine(Ours(uses_session_hints=False)).sessions is None
    assert _engine(Ours(), ttl=0.0).sessions is None
    table = SessionTable(ttl_s=10.0, max_sessions=2)
    for i, key in enumerate((A, B, C)):
        table.record(f"s{i}", key, [i + 1], float(i))
    assert len(table) == 2 and table.get("s0", 2.0) is None  # least recently used dropped
    table.forget(C)
    assert table.get("s2", 2.0) is None and table.get("s1", 2.0) is not None


# ---------------------------------------------------------------------------- vllm_kv_aware


def _vcand(key: ReplicaKey, gpu: int = 0, host: int = 0, kv: int = 0, **load: int) -> Candidate:
    kv = max(kv, host, gpu)
    return Candidate(key, PrefixMatch(kv, gpu, max(host, gpu), kv), LoadView(**load))


def test_vllm_kv_aware_cost_is_new_plus_active_prefill_times_batch() -> None:
    policy = VllmKvAware()
    request = RouteRequest("x", "m", 1000, [], 16)
    # 40 GPU blocks = 640 tokens credited: 360 new; 500 prefilling there; 3 in flight
    a = _vcand(A, gpu=40, queued_prefill_tokens=500, prefilling=1, decoding=2, in_flight=3)
    assert policy.new_prefill_tokens(request, a) == 360
    assert policy.cost(request, a) == ((360 + 500) * 4, 860)
    # a host continuation is credited at 0.8, a disk one at 0.3 (rounded up)
    b = _vcand(B, gpu=10, host=30)
    assert policy.new_prefill_tokens(request, b) == math.ceil(1000 - (10 + 20 * 0.8) * 16)
    c = _vcand(C, gpu=10, kv=30)
    assert policy.new_prefill_tokens(request, c) == math.ceil(1000 - (10 + 20 * 0.3) * 16)
    # the last prompt token is never credited: a full GPU match still leaves one token
    full = _vcand(A, gpu=63)
    assert policy.new_prefill_tokens(RouteRequest("x", "m", 1008, [], 16), full) == 16
    chosen = policy.choose(request, [a, b, c], 0.0, rng())
    assert chosen.replica == B  # 584 new tokens on an idle replica
    assert chosen.terms["new_prefill_tokens"] == 584.0


def test_vllm_kv_aware_breaks_ties_by_order_and_zero_cost_by_load() -> None:
    policy = VllmKvAware()
    request = RouteRequest("x", "m", 1000, [], 16)
    tied = [_vcand(B, gpu=5, in_flight=1), _vcand(A, gpu=5, in_flight=1)]
    assert policy.choose(request, tied, 0.0, rng()).replica == B
    assert policy.choose(request, list(reversed(tied)), 0.0, rng()).replica == A


def test_vllm_kv_aware_session_affinity_pins_while_fresh() -> None:
    policy = VllmKvAware(session_ttl_s=30.0)
    request = RouteRequest("x", "m", 1000, [], 16, "s")
    idle = [_vcand(A), _vcand(B)]
    assert policy.choose(request, idle, 0.0, rng()).replica == A
    busy_a = [_vcand(A, queued_prefill_tokens=10_000, in_flight=9), _vcand(B)]
    pinned = policy.choose(request, busy_a, 10.0, rng())
    assert pinned.replica == A and pinned.terms["sticky"] == 1.0  # a hard pin
    assert policy.choose(request, busy_a, 45.0, rng()).replica == B  # expired: rebound
    gone = policy.choose(request, [_vcand(A), _vcand(C)], 50.0, rng())  # B left: rebound
    assert gone.replica == A and gone.terms["sticky"] == 0.0
    assert policy.choose(request, [_vcand(C), _vcand(A)], 51.0, rng()).replica == A


def test_vllm_kv_aware_with_temperature_samples_among_candidates() -> None:
    policy = VllmKvAware(temperature=1e9)  # nearly uniform
    request = RouteRequest("x", "m", 1000, [], 16)
    cands = [_vcand(A, gpu=60), _vcand(B), _vcand(C)]
    r = random.Random(3)
    seen = {policy.choose(request, cands, 0.0, r).replica for _ in range(60)}
    assert seen == {A, B, C}
    assert VllmKvAware().choose(request, cands, 0.0, r).replica == A


def test_index_tiers_feed_the_vllm_kv_aware_credit() -> None:
    index = PrefixIndex()
    index.add_replica(A)
    chain = list(range(1, 41))
    index.store(A, chain[:10], Tier.GPU)
    index.store(A, chain[10:], Tier.CPU)
    match = index.match(chain).get(A)
    assert match is not None
    cand = Candidate(A, match, LoadView())
    request = RouteRequest("x", "m", 40 * 16 + 8, chain, 16)
    expected = math.ceil(request.prompt_tokens - (10 + 30 * 0.8) * 16)
    assert VllmKvAware().new_prefill_tokens(request, cand) == expected


def test_vllm_kv_aware_accounts_its_own_new_prefill_estimate_as_active_work() -> None:
    """vllm-router adds the request's ``new_prefill_tokens`` (its credited estimate) to the
    chosen replica's ``active_prefill_tokens`` (src/policies/kv_aware.rs:
    ``manager.begin_prefill(&target, new_prefill_tokens)``), which the next request's cost
    reads. A hybrid prompt cached as KV without a state checkpoint is credited there (the
    peer knows no hybrid rule), as a host-tier prefix is at 0.8: the model of it must
    queue that estimate, not the prompt beyond kvrouter's usable prefix."""
    index, load = PrefixIndex(), LoadTracker()
    for key in (A, B):
        index.add_replica(key)
        load.add_replica(key)
    chain = list(range(1, 41))
    index.store(A, chain[:10], Tier.GPU)
    index.store(A, chain[10:], Tier.CPU)  # host continuation of 30 blocks
    index.store(B, chain[:20], Tier.GPU)
    index.store(B, chain[19:20], kind=Kind.STATE)  # usable 20, fully credited
    settings = RoutingSettings(block_size=16, hybrid=True)
    engine = RoutingEngine(index, load, VllmKvAware(), settings)
    request = RouteRequest("x", "m", 40 * 16 + 8, chain, 16)
    candidates = engine.candidates(request, (A, B), 0.0)
    assert isinstance(candidates, list)
    a = next(c for c in candidates if c.replica == A)
    assert a.match.usable_blocks == 0  # hybrid: no checkpoint on A, nothing usable
    decision = engine.choose(request, candidates, 0.0, rng())
    assert decision.replica == A  # 10 + 30 x 0.8 blocks credited beat B's 20
    new = math.ceil(request.prompt_tokens - (10 + 30 * 0.8) * 16)
    assert decision.terms["new_prefill_tokens"] == new
    engine.dispatched(request, decision, 0.0)
    assert load.view(A, 0.0).queued_prefill_tokens == new
    load.first_token("x")
    assert load.view(A, 0.0).queued_prefill_tokens == 0
    # a retry on B (no predicted hit, the pick's terms cleared: router/service/state.py)
    # queues the whole prompt there, a decode leg (its prompt arrives computed) none
    retry = decision._replace(replica=B, usable_tokens=0, kv_tokens=0, terms={})
    engine.dispatched(request._replace(request_id="y"), retry, 0.0)
    assert load.view(B, 0.0).queued_prefill_tokens == request.prompt_tokens
    Disaggregator.dispatched_decode(engine, request._replace(request_id="z"), decision, 0.0)
    assert load.view(A, 0.0).queued_prefill_tokens == 1  # (the tracker's floor)


def test_vllm_kv_aware_routes_on_events_alone_without_speculating() -> None:
    """vllm-router never guesses what a replica will hold: the simulator's model of it must
    not get kvrouter's speculative entries, while ``ours`` does when they are on."""
    for policy, expected in ((VllmKvAware(), 0), (Ours(), 50)):
        index, load = PrefixIndex(), LoadTracker()
        for key in (A, B):
            index.add_replica(key)
            load.add_replica(key)
        settings = RoutingSettings(block_size=4, speculative_ttl_s=30.0)
        engine = RoutingEngine(index, load, policy, settings)  # type: ignore[arg-type]
        request = _turn("t1", list(range(1, 51)), session=None)
        engine.dispatched(request, engine.route(request, (A, B), 0.0, rng()), 0.0)
        assert index.stats().speculative_entries == expected


def test_a_sessions_requests_are_not_speculated_the_hint_carries_them() -> None:
    """By default a request of a session leaves no speculative entry when the policy reads
    session hints (the hint carries its next turn); one without a session does, and so does
    an approximate prompt (its index is speculation alone) or ``speculate_sessions``."""
    for settings, session, exact, expected in (
        (RoutingSettings(block_size=4), "s", True, 0),
        (RoutingSettings(block_size=4), None, True, 50),
        (RoutingSettings(block_size=4), "s", False, 50),
        (RoutingSettings(block_size=4, speculate_sessions=True), "s", True, 50),
        (RoutingSettings(block_size=4, speculative_ttl_s=0.0), None, True, 0),
    ):
        index, load = PrefixIndex(), LoadTracker()
        for key in (A, B):
            index.add_replica(key)
            load.add_replica(key)
        engine = RoutingEngine(index, load, Ours(), settings)
        request = _turn("t1", list(range(1, 51)), session=session)
        decision = engine.route(request, (A, B), 0.0, rng())
        engine.dispatched(request, decision, 0.0, exact=exact)
        assert index.stats().speculative_entries == expected, (settings, session, exact)
