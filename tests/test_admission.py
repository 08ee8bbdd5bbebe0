"""router/core/admission.py: judging, ordering by slack, classes, tenant fairness, shedding,
cancellation; and its predictions on real candidates (the ``ours`` cost model)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from router.core.admission import (
    ADMIT,
    DEADLINE,
    DEFAULT,
    FLEX,
    HOLD,
    PRIORITY,
    QUEUE_FULL,
    SHED,
    AdmissionQueue,
    AdmissionSettings,
    Assessment,
    Ticket,
    assess,
    parse_service_tier,
    predictor_for,
    restrict,
)
from router.core.errors import BadRequest
from router.core.index import PrefixIndex
from router.core.load import LoadTracker
from router.core.policies import make_policy
from router.core.routing import RoutingEngine
from router.core.routing_settings import RoutingSettings
from router.core.slo import SloTargets
from router.core.stall import StallLedger
from router.core.types import BlocksStored, EventBatch, ReplicaKey, RouteRequest

SLO = SloTargets.flat(ttft_s=2.0)


def one(ttft: float, prefill: float = 0.1, replica: str = "r0") -> Assessment:
    """One replica predicted to answer in ``ttft`` seconds."""
    return Assessment(
        np.array([ttft]),
        np.array([prefill]),
        np.array([max(ttft - prefill, 0.0)]),
        np.array([0.01]),
        np.array([True]),
        (ReplicaKey(replica),),
    )


def queue(**kw: object) -> AdmissionQueue:
    """A queue that may hold requests up to their deadlines (unless ``max_hold_s`` given)."""
    kw.setdefault("max_hold_s", 60.0)
    return AdmissionQueue(AdmissionSettings(**kw), SLO)  # type: ignore[arg-type]


def test_service_tier_parsing() -> None:
    assert parse_service_tier(None) == DEFAULT
    assert parse_service_tier("auto", FLEX) == FLEX  # auto: the key's own class
    assert parse_service_tier("priority") == PRIORITY
    assert parse_service_tier("flex") == FLEX
    for bad in ("gold", 3, ["priority"]):
        with pytest.raises(BadRequest):
            parse_service_tier(bad)


def test_settings_are_checked() -> None:
    with pytest.raises((ValueError, TypeError)):  # compiled (mypyc): TypeError
        AdmissionSettings(headroom=(1.0, 0.5))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AdmissionSettings(headroom=(1.5, 0.5, 0.3))
    # NaN passed ``< 0``: a NaN hold limit would never expire a held request
    for name in ("max_hold_s", "stall_backlog_s", "urgency_power"):
        for bad in (math.nan, math.inf, -1.0):
            with pytest.raises(ValueError, match=name):
                AdmissionSettings(**{name: bad})  # type: ignore[arg-type]


def test_per_class_factors_must_be_finite_but_max_stall() -> None:
    """``inf`` passed ``> 0``: a class ``decode_weight`` of inf made a replica's summed
    decode weight inf, so ``ours``'s interference term NaN for a fully cached prompt (0 x
    inf) and for good once such a request completed (inf - inf); a ``ttft_factor`` of inf
    made every held request's urgency NaN (inf / inf), ordering the queue arbitrarily.
    Only ``max_stall`` means something at inf (no limit, priority's default)."""
    for name in ("decode_weight", "ttft_factor"):
        with pytest.raises(ValueError, match=name):
            AdmissionSettings(**{name: (math.inf, 1.0, 1.0)})  # type: ignore[arg-type]
    assert AdmissionSettings(max_stall=(math.inf, math.inf, 3.0)).max_stall[1] == math.inf


def test_admit_hold_shed_by_class_headroom() -> None:
    q = queue()
    now = 100.0
    # 1.5 s predicted on a 2 s target: priority (whole budget) goes, default (half) waits
    p = q.ticket("p", PRIORITY, "a", 100, now)
    assert q.judge(p, one(1.5), now).action == ADMIT
    d = q.ticket("d", DEFAULT, "a", 100, now)
    assert q.judge(d, one(1.5), now).action == HOLD
    assert len(q) == 1 and q.depth(DEFAULT) == 1
    # flex waits behind held default work; on its own, with 4x the target (8 s), it is
    # admitted below 0.3 * 8 = 2.4 s
    f = q.ticket("f", FLEX, "a", 100, now)
    assert f.budget_s == 8.0
    assert q.judge(f, one(2.3), now).action == HOLD
    q2 = queue()
    assert q2.judge(q2.ticket("f", FLEX, "a", 100, now), one(2.3), now).action == ADMIT


def test_shed_at_once_with_retry_after_when_the_slo_cannot_be_met() -> None:
    q = queue()
    now = 0.0
    v = q.judge(q.ticket("x", DEFAULT, "a", 100, now), one(5.0), now)
    assert v.action == SHED and v.reason == DEADLINE
    assert v.retry_after_s >= 1
    assert len(q) == 0  # never held to miss anyway
    # work held ahead counts: 1.8 s predicted plus held prefill ahead > 2 s
    q.judge(q.ticket("h1", DEFAULT, "a", 100, now), one(1.5, prefill=0.5), now)
    assert len(q) == 1
    v = q.judge(q.ticket("h2", DEFAULT, "a", 100, now), one(1.8, prefill=0.5), now)
    assert v.action == SHED and v.reason == DEADLINE


def test_nothing_is_held_long() -> None:
    q = queue(max_hold_s=0.5)
    # a replica fits a default request at 1 s predicted; 1.7 s: 0.7 s to wait, over 0.5 s
    v = q.judge(q.ticket("x", DEFAULT, "a", 10, 0.0), one(1.7), 0.0)
    assert v.action == SHED and v.reason == DEADLINE
    assert q.judge(q.ticket("y", DEFAULT, "a", 10, 0.0), one(1.3), 0.0).action == HOLD
    assert q.expire(0.4) == [] and [t.key for t in q.expire(0.6)] == ["y"]


def test_expire_finds_every_late_request_whatever_left_the_queue_before() -> None:
    """``expire`` skips its scan until the earliest a held request can be late: that bound
    follows requests joining and leaving the queue (cancelled, handed out, expired)."""
    q = queue(max_hold_s=0.5)
    for key, at in (("a", 0.0), ("b", 0.3), ("c", 0.35)):
        assert q.judge(q.ticket(key, DEFAULT, "t", 10, at), one(1.3), at).action == HOLD
    assert q.cancel("a") is not None
    assert q.expire(0.6) == [] and len(q) == 2
    assert [t.key for t in q.expire(0.81)] == ["b"]
    assert q.judge(q.ticket("d", DEFAULT, "t", 10, 0.82), one(1.3), 0.82).action == HOLD
    assert [t.key for t in q.expire(0.86)] == ["c"]
    assert q.expire(1.3) == [] and [t.key for t in q.expire(1.33)] == ["d"]
    assert len(q) == 0 and q.expire(9.0) == []


def test_queue_bound() -> None:
    q = queue(max_queue=1)
    assert q.judge(q.ticket(1, DEFAULT, "a", 10, 0.0), one(1.5), 0.0).action == HOLD
    v = q.judge(q.ticket(2, DEFAULT, "a", 10, 0.0), one(1.0), 0.0)
    assert v.action == SHED and v.reason == QUEUE_FULL


def test_a_full_queue_makes_room_for_a_better_class() -> None:
    """Held requests are served best class first, so a full queue keeps its places for the
    best: a request of a better class than the worst held one takes the place of the one of
    that class that would be served last (handed back as ``displaced`` to refuse, reason
    ``queue_full``); a request of the worst held class is refused itself."""
    q = queue(max_queue=2, headroom=(0.9, 0.5, 0.3))
    for key in ("f0", "f1"):  # flex: 8 s budget, fits at 2.4 s predicted; 3 s: held
        assert q.judge(q.ticket(key, FLEX, "t", 10, 0.0), one(3.0), 0.0).action == HOLD
    v = q.judge(q.ticket("d", DEFAULT, "t", 10, 0.1), one(1.5), 0.1)
    assert v.action == HOLD and v.displaced is not None and v.displaced.key == "f1"
    assert v.reason == QUEUE_FULL and v.retry_after_s >= 1
    assert len(q) == 2 and q.depth(FLEX) == 1 and q.depth(DEFAULT) == 1
    v = q.judge(q.ticket("f2", FLEX, "t", 10, 0.2), one(3.0), 0.2)
    assert v.action == SHED and v.reason == QUEUE_FULL and v.displaced is None
    v = q.judge(q.ticket("p", PRIORITY, "t", 10, 0.3), one(1.85), 0.3)
    assert v.action == HOLD and v.displaced is not None and v.displaced.key == "f0"
    v = q.judge(q.ticket("p2", PRIORITY, "t", 10, 0.3), one(1.85), 0.3)
    assert v.action == HOLD and v.displaced is not None and v.displaced.key == "d"
    v = q.judge(q.ticket("d2", DEFAULT, "t", 10, 0.4), one(1.5), 0.4)
    assert v.action == SHED and v.reason == QUEUE_FULL
    assert sorted(str(t.key) for t in q.order(0.4)) == ["p", "p2"]
    assert q.depth(DEFAULT) == 0 and q.depth(FLEX) == 0


def test_held_bodies_are_bounded_in_bytes() -> None:
    """Held requests keep their bodies: ``max_queue_mb`` bounds those bytes as ``max_queue``
    bounds their number. A request whose body would pass it is refused ``queue_full``,
    unless its class is better than the worst held and the held request it then displaces
    (the one of that class that would go last) frees room enough; a body larger than the
    bound is never held. Bytes leave the count with their request."""
    mb = 2**20
    q = queue(max_queue_mb=3.0, headroom=(0.9, 0.5, 0.3))
    assert AdmissionSettings().max_queue_mb == 256.0
    assert q.judge(q.ticket("f0", FLEX, "t", 10, 0.0, size=mb), one(3.0), 0.0).action == HOLD
    assert q.judge(q.ticket("f1", FLEX, "t", 10, 0.0, size=mb), one(3.0), 0.0).action == HOLD
    v = q.judge(q.ticket("f2", FLEX, "t", 10, 0.1, size=2 * mb), one(3.0), 0.1)
    assert v.action == SHED and v.reason == QUEUE_FULL and v.retry_after_s >= 1
    v = q.judge(q.ticket("d", DEFAULT, "t", 10, 0.1, size=2 * mb), one(1.5), 0.1)
    assert v.action == HOLD and v.displaced is not None and v.displaced.key == "f1"
    assert len(q) == 2 and q.held_bytes == 3 * mb
    v = q.judge(q.ticket("p", PRIORITY, "t", 10, 0.2, size=2 * mb), one(1.85), 0.2)
    assert v.action == SHED and v.reason == QUEUE_FULL  # f0's 1 MB: not room enough
    v = q.judge(q.ticket("p", PRIORITY, "t", 10, 0.2, size=mb), one(1.85), 0.2)
    assert v.action == HOLD and v.displaced is not None and v.displaced.key == "f0"
    v = q.judge(q.ticket("p2", PRIORITY, "t", 10, 0.2, size=3 * mb), one(1.85), 0.2)
    assert v.action == SHED and v.reason == QUEUE_FULL  # d's 2 MB leave 2 MB: not enough
    v = q.judge(q.ticket("big", PRIORITY, "t", 10, 0.2, size=4 * mb), one(1.85), 0.2)
    assert v.action == SHED and v.reason == QUEUE_FULL
    assert q.cancel("d") is not None and q.cancel("p") is not None
    assert len(q) == 0 and q.held_bytes == 0
    v = q.judge(q.ticket("big", PRIORITY, "t", 10, 0.3, size=4 * mb), one(1.85), 0.3)
    assert v.action == SHED and v.reason == QUEUE_FULL and len(q) == 0
    with pytest.raises(ValueError, match="max_queue_mb"):
        AdmissionSettings(max_queue_mb=float("nan"))


def test_ready_orders_by_slack_then_expires_the_late() -> None:
    q = queue()
    slo = SloTargets.flat(ttft_s=2.0)
    q = AdmissionQueue(AdmissionSettings(), slo)
    # b arrived earlier: less slack left, so it goes first although it was held later
    a = q.ticket("a", DEFAULT, "t", 10, 1.0)
    b = q.ticket("b", DEFAULT, "t", 10, 0.5)
    q.judge(a, one(1.2, prefill=0.05), 1.0)
    q.judge(b, one(1.2, prefill=0.05), 1.0)
    assert [t.key for t in q.order(1.0)] == ["b", "a"]
    got = q.ready(1.1, lambda t: one(0.5))
    assert got is not None and got[0].key == "b" and bool(got[1][0])
    # nothing fits: nothing handed out, nothing lost
    assert q.ready(1.1, lambda t: one(1.5)) is None
    assert len(q) == 1
    # past its deadline minus its own prefill: shed, never dispatched late
    assert [t.key for t in q.expire(2.96)] == ["a"]
    assert len(q) == 0


def test_priority_is_served_before_default() -> None:
    q = queue()
    for i in range(3):
        q.judge(q.ticket(f"d{i}", DEFAULT, "t", 10, 0.0), one(1.5), 0.0)
    # a priority request while defaults wait: no default is ahead of it
    v = q.judge(q.ticket("p0", PRIORITY, "t", 10, 0.1), one(2.5), 0.1)
    assert v.action == SHED  # over its whole budget: shed, priority or not
    q.judge(q.ticket("p1", PRIORITY, "t", 10, 0.1), one(1.9), 0.1)
    assert q.depth(PRIORITY) == 0  # it fit: admitted at once
    # held priority work comes out first
    q2 = queue()
    q2.judge(q2.ticket("d", DEFAULT, "t", 10, 0.0), one(1.5), 0.0)
    q2.judge(q2.ticket("p", PRIORITY, "t", 10, 0.1), one(2.1, prefill=0.1), 0.1)
    assert q2.depth(PRIORITY) == 0  # 2.1 s > 2 s: shed at once
    held = q2.ticket("p2", PRIORITY, "t", 10, 0.1)
    # a priority request behind another held priority one is held, then comes first
    q2._hold(held, 0.1)
    got = q2.ready(0.2, lambda t: one(0.9))
    assert got is not None and got[0].key == "p2"


def test_a_heavy_tenant_cannot_starve_a_light_one() -> None:
    q = queue()
    now = 0.0
    # the heavy tenant was served 1M uncached tokens; both have requests waiting
    q.served("heavy", 1_000_000)
    for i in range(20):
        q.judge(q.ticket(f"h{i}", DEFAULT, "heavy", 200_000, now), one(1.5), now)
    for i in range(3):
        q.judge(q.ticket(f"l{i}", DEFAULT, "light", 1000, now + 0.01), one(1.5), now)
    # the light tenant was lifted to the lowest waiting counter, not left at 0 (no banked
    # credit), but it is at most the heavy one's
    assert q.counter("light") <= q.counter("heavy")
    served = []
    for _ in range(6):
        got = q.ready(now, lambda t: one(0.5))
        assert got is not None
        t = got[0]
        served.append(t.tenant)
        q.served(t.tenant, t.prompt_tokens)
    # heavy prefills do not lock the light tenant out: all its requests are among the first
    assert served.count("light") == 3
    assert served.index("light") <= 1


def test_cancel_leaves_the_queue() -> None:
    q = queue()
    q.judge(q.ticket("gone", DEFAULT, "t", 10, 0.0), one(1.5), 0.0)
    assert isinstance(q.cancel("gone"), Ticket)
    assert q.cancel("gone") is None
    assert len(q) == 0 and q.ready(0.1, lambda t: one(0.1)) is None
    # the work it held is no longer counted ahead of others
    assert q.judge(q.ticket("next", DEFAULT, "t", 10, 0.0), one(0.9), 0.0).action == ADMIT


def test_stall_headroom_protects_decoding_requests() -> None:
    q = queue()
    busy, free = ReplicaKey("busy"), ReplicaKey("free")
    two = Assessment(
        np.array([0.5, 0.5]),
        np.array([0.4, 0.4]),
        np.array([0.1, 0.1]),
        np.array([0.02, 0.02]),
        np.array([True, True]),
        (busy, free),
    )
    # a default request decoding 11 tokens on "busy": it may stand 0.5 x (0.1 - 0.02) x 10
    # = 0.4 s of prefill while it decodes
    short = q.ticket("short", DEFAULT, "t", 10, 0.0)
    q.dispatched(short, two, busy, 10, output_tokens=11)
    assert q.stall_headroom(two).tolist() == pytest.approx([0.4, float("inf")])
    q.dispatched(q.ticket("x", DEFAULT, "t", 10, 0.0), two, busy, 10, output_tokens=1)
    # that used it up: a default prefill of 0.4 s more would overdraw it by 4 TPOT targets
    # (more than max_stall, 3), priority goes anywhere
    d = q.ticket("d", DEFAULT, "t", 10, 0.0)
    assert q.fits(d, two, 0.0).tolist() == [False, True]
    p = q.ticket("p", PRIORITY, "t", 10, 0.0)
    assert q.fits(p, two, 0.0).tolist() == [True, True]
    q.finished("short")  # done decoding: nothing left to protect
    assert q.fits(d, two, 0.0).tolist() == [True, True]


def test_stall_ledger() -> None:
    ledger = StallLedger()
    r = ReplicaKey("r")
    assert ledger.headroom(r) == float("inf")
    ledger.add("a", r, 1.0, 5.0)  # limit at clock 6
    ledger.add("b", r, 2.0, 10.0)  # clock 3, limit 13
    assert ledger.headroom(r) == pytest.approx(3.0)
    ledger.add("c", r, 4.0, float("inf"))  # clock 7: a is 1 s over, c is not tracked
    assert ledger.headroom(r) == pytest.approx(-1.0) and len(ledger) == 2
    ledger.remove("a")
    assert ledger.headroom(r) == pytest.approx(6.0)
    ledger.forget(r)
    assert ledger.headroom(r) == float("inf") and len(ledger) == 0
    # a retry moves a request's allowance to its new replica, with its prefill there
    other = ReplicaKey("o")
    ledger.add("d", r, 1.0, 5.0)
    ledger.move("d", other, 2.0)
    assert ledger.headroom(r) == float("inf")
    assert ledger.headroom(other) == pytest.approx(5.0) and len(ledger) == 1
    ledger.move("c", r, 1.0)  # untracked: nothing to move
    assert ledger.headroom(r) == float("inf")


def test_assess_uses_the_policy_prediction_with_the_usable_hit() -> None:
    keys = (ReplicaKey("a"), ReplicaKey("b"))
    index, load = PrefixIndex(), LoadTracker()
    for k in keys:
        index.add_replica(k)
        load.add_replica(k)
    policy = make_policy("ours")
    engine = RoutingEngine(index, load, policy, RoutingSettings(block_size=16))
    hashes = list(range(1, 65))
    index.apply(EventBatch(keys[0], (BlocksStored(tuple(hashes[:60])),)))
    req = RouteRequest("r", "m", 64 * 16, hashes, 16)
    cands = engine.candidates(req, keys, 0.0)
    assert isinstance(cands, list)
    a = assess(predictor_for(policy), req, cands, 0.0)
    by = {c.replica: i for i, c in enumerate(cands)}
    assert a.prefill_s[by[keys[0]]] < a.prefill_s[by[keys[1]]]  # the cached one is cheaper
    only_a = restrict(cands, np.array([c.replica == keys[0] for c in cands]))
    d = engine.choose(req, only_a, 0.0, random.Random(0))
    assert d.replica == keys[0]
    # the columnar path predicts the same
    cols = RoutingEngine(index, load, policy, RoutingSettings(block_size=16), columnar_min=1)
    ca = assess(predictor_for(policy), req, cols.candidates(req, keys, 0.0), 0.0)
    assert sorted(ca.ttft_s.tolist()) == pytest.approx(sorted(a.ttft_s.tolist()))


def test_a_held_request_never_overtakes_a_better_class() -> None:
    """A flex request held behind a default one (``judge``: no overtaking) does not go first
    from the queue either just because its budget (4x) fits a replica the default one does
    not fit yet: that would fill the replica the default request waits for."""
    q = queue()
    # 1.5 s on a 2 s target: over the default class's headroom (1 s), held
    assert q.judge(q.ticket("d", DEFAULT, "t", 10, 0.0), one(1.5), 0.0).action == HOLD
    assert q.judge(q.ticket("f", FLEX, "t", 10, 0.0), one(1.5), 0.0).action == HOLD
    assert q.ready(0.1, lambda t: one(1.5)) is None  # the flex one (2.4 s) would fit
    assert len(q) == 2
    got = q.ready(0.2, lambda t: one(0.5))  # room for both: best class first
    assert got is not None and got[0].key == "d"
    got = q.ready(0.2, lambda t: one(0.5))
    assert got is not None and got[0].key == "f"


def test_a_retried_one_token_request_puts_its_prefill_on_its_new_replica() -> None:
    """A request answering one token has no allowance of its own, but its prefill still
    stalls the requests decoding where it runs: retried there, it is on that replica's
    clock as its first dispatch was on the first one's."""
    q = queue()
    first, second = ReplicaKey("first"), ReplicaKey("second")
    two = Assessment(
        np.array([0.5, 0.5]),
        np.array([0.3, 0.3]),
        np.array([0.1, 0.1]),
        np.array([0.02, 0.02]),
        np.array([True, True]),
        (first, second),
    )
    # a default request decoding 11 tokens on "second": 0.4 s of headroom there
    q.dispatched(q.ticket("long", DEFAULT, "t", 10, 0.0), two, second, 10, output_tokens=11)
    assert q.stall_headroom(two).tolist() == pytest.approx([float("inf"), 0.4])
    one_token = q.ticket("one", DEFAULT, "t", 10, 0.0)
    q.dispatched(one_token, two, first, 10, output_tokens=1)
    q.retried("one", second, 0.3)  # its first replica failed it: 0.3 s of prefill on "second"
    assert q.stall_headroom(two).tolist() == pytest.approx([float("inf"), 0.1])
