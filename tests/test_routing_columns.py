"""The array path of the routing step (CandidateColumns, for large fleets) decides exactly
as the per-candidate path: same replica, score, terms, tokens and ranking, same
NoReplicaAvailable, same random draws, on random fleets (tiers, hybrid state checkpoints,
speculative entries, stale and fresh engine reports, unhealthy / draining / busy replicas)."""

from __future__ import annotations

import math
import random

import pytest

from router.core.errors import NoReplicaAvailable
from router.core.index import PrefixIndex
from router.core.load import EngineReport, LoadTracker
from router.core.policies import Candidate, CandidateColumns, Ours
from router.core.routing import RoutingEngine
from router.core.routing_settings import BusyThresholds, RoutingSettings
from router.core.slo import DEFAULT_TIERS, SloTier
from router.core.types import MAX_RANKING, Decision, Kind, ReplicaKey, RouteRequest, Tier


def _fleet(rng: random.Random, n: int) -> tuple[PrefixIndex, LoadTracker, tuple[ReplicaKey, ...]]:
    index = PrefixIndex()
    load = LoadTracker()
    keys = tuple(ReplicaKey(f"r{i}", rng.choice([0, 0, 1])) for i in range(n))
    keys = tuple(dict.fromkeys(keys))  # no duplicate keys
    for key in keys:
        index.add_replica(key)
        load.add_replica(key)
    return index, load, keys


def _populate(
    rng: random.Random,
    index: PrefixIndex,
    load: LoadTracker,
    keys: tuple[ReplicaKey, ...],
    chain: list[int],
    now: float,
) -> None:
    for key in keys:
        r = rng.random()
        if r < 0.3:
            continue  # nothing cached
        depth = rng.randrange(0, len(chain) + 1)
        if r < 0.6:
            depth = min(depth, 3)  # a shared system prompt
        gpu = rng.randrange(0, depth + 1)
        index.store(key, chain[:gpu], Tier.GPU)
        if depth > gpu:
            index.store(key, chain[gpu:depth], rng.choice([Tier.CPU, Tier.DISK]))
        states = [h for i, h in enumerate(chain[:depth]) if rng.random() < 0.3 or i == depth - 1]
        if states and rng.random() < 0.7:
            index.store(key, states, kind=Kind.STATE)
        if rng.random() < 0.2:
            index.speculate(key, chain[: rng.randrange(1, len(chain) + 1)], [], now, 5.0)
    for i in range(rng.randrange(0, 4 * len(keys) + 1)):
        key = rng.choice(keys)
        prompt = rng.randrange(1, 9000)
        out = rng.choice([None, 1, 2, 5, 64, 600])
        load.dispatch(f"f{i}", key, prompt, rng.randrange(0, prompt), out)
        if rng.random() < 0.5:
            load.first_token(f"f{i}")
        if rng.random() < 0.1:
            load.complete(f"f{i}")
    for key in keys:
        if rng.random() < 0.4:
            age = rng.choice([0.0, 0.5, 1.0, 3.0])
            # kv usage from another process's gauge: now and then NaN, infinite or out of range
            usage = rng.choice([rng.random(), rng.random(), float("nan"), float("inf"), -1.0, 1.5])
            report = EngineReport(rng.randrange(0, 8), rng.randrange(0, 20), usage, now - age)
            load.engine_report(key, report)
        if rng.random() < 0.1:
            load.set_health(key, False)
        if rng.random() < 0.1:
            load.set_draining(key, True)
        if rng.random() < 0.1:  # failing: phantom requests (router/core/outliers.py)
            n = rng.randrange(1, 7)
            load.set_penalty(key, n, n * 4096)


def _busy(rng: random.Random) -> BusyThresholds:
    if rng.random() < 0.5:
        return BusyThresholds()
    return BusyThresholds(
        max_in_flight=rng.choice([None, 2, 4]),
        max_queued_prefill_tokens=rng.choice([None, 5000, 20000]),
        max_kv_usage=rng.choice([None, 0.5, 0.9]),
        reject_when_all_busy=rng.random() < 0.5,
    )


def _decide(
    engine: RoutingEngine,
    request: RouteRequest,
    keys: tuple[ReplicaKey, ...],
    now: float,
    seed: int,
) -> object:
    rng = random.Random(seed)
    try:
        decision = engine.route(request, keys, now, rng)
    except NoReplicaAvailable as exc:
        return ("refused", str(exc), exc.busy)
    return decision, rng.random()  # the same draws were made


@pytest.mark.parametrize("seed", range(300))
def test_the_array_path_decides_as_the_per_candidate_path(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randrange(1, MAX_RANKING + 2)
    index, load, keys = _fleet(rng, n)
    chain = [rng.getrandbits(63) for _ in range(rng.randrange(1, 12))]
    now = 100.0
    _populate(rng, index, load, keys, chain, now)
    if rng.random() < 0.3:  # another model's replicas share the index (higher slots)
        for i in range(rng.randrange(1, 70)):
            index.store(ReplicaKey(f"other{i}"), chain[: rng.randrange(1, len(chain) + 1)])
    if rng.random() < 0.3:  # a caller's list may name a replica twice: decided alike
        keys = keys + keys[: rng.randrange(1, 4)]
    hybrid = rng.random() < 0.5
    settings = RoutingSettings(block_size=rng.choice([16, 64]), hybrid=hybrid, busy=_busy(rng))
    policy = Ours(
        host_hit_value=rng.choice([0.75, 0.5]),
        kv_pressure_threshold=rng.choice([0.9, 0.5]),
        w_interference=rng.choice([0.0, 4.0]),
        w_batch=rng.choice([0.0, 1.0, 3.0]),
        w_miss=rng.choice([0.0, 4.0, 40.0]),
        ttft_tiers=rng.choice([DEFAULT_TIERS, (SloTier(None, 0.05),), (SloTier(None, 1e-4),)]),
    )
    per_candidate = RoutingEngine(index, load, policy, settings, columnar_min=10**9)
    arrays = RoutingEngine(index, load, policy, settings, columnar_min=1)
    # one meter, as one load tracker: only per_candidate's dispatches are recorded below
    arrays.turnover = per_candidate.turnover
    if rng.random() < 0.5:  # some caches turning over (eviction risks: the eviction term)
        per_candidate.turnover.sample(
            now - 30.0, keys, index.evicted_blocks, lambda k: index.replica_size(k)[0]
        )
        for key in keys:
            if rng.random() < 0.5:
                index.remove(key, chain[rng.randrange(0, len(chain)) :])
    tokens = len(chain) * settings.block_size + rng.randrange(0, settings.block_size)
    if rng.random() < 0.5:  # a session seen before, on some replica, with some prefix
        hinted = chain[: rng.randrange(0, len(chain) + 1)]
        bound, at = rng.choice(keys), now - rng.choice([1, 900])
        for engine in (per_candidate, arrays):
            assert engine.sessions is not None
            engine.sessions.record("s", bound, hinted, at, index.cache_epoch(bound))
    for step, prompt_tokens in enumerate((tokens, 1, rng.randrange(1, tokens + 1), tokens)):
        blocks = min(len(chain), prompt_tokens // settings.block_size)
        request = RouteRequest(
            f"q{step}",
            "m",
            prompt_tokens,
            chain[:blocks],
            settings.block_size,
            rng.choice([None, "s"]),
            rng.choice([None, 3, 300]),
            samples=rng.choice([1, 1, 8]),
            prompts=rng.choice([1, 1, 3]),
        )
        decided = _decide(arrays, request, keys, now, seed)
        assert decided == _decide(per_candidate, request, keys, now, seed)
        # the shared load moves between requests (what the array path mirrors and caches)
        if isinstance(decided, tuple) and not isinstance(decided[0], str):
            per_candidate.dispatched(request, decided[0], now)
            assert arrays.sessions is not None and per_candidate.sessions is not None
            if request.session_id:  # what dispatched() records for the session, in both
                got = decided[0].replica
                hashes = request.block_hashes
                arrays.sessions.record("s", got, hashes, now, index.cache_epoch(got))
        key = rng.choice(keys)
        load.dispatch(f"m{step}", key, rng.randrange(1, 5000), 0, samples=rng.choice([1, 4]))
        if rng.random() < 0.5:
            load.first_token(f"m{step}")
        if rng.random() < 0.3:
            load.set_draining(rng.choice(keys), rng.random() < 0.5)


def test_ties_among_idle_replicas_follow_cache_size_then_the_rng() -> None:
    """900 idle replicas without a match all tie: the smallest cache wins, then the rng."""
    rng = random.Random(7)
    index, load, keys = _fleet(rng, 900)
    for key in keys[:-3]:
        index.store(key, [rng.getrandbits(63) for _ in range(5)])
    settings = RoutingSettings(block_size=16)
    request = RouteRequest("q", "m", 100, [1, 2, 3, 4, 5, 6], 16)
    per_candidate = RoutingEngine(index, load, Ours(), settings, columnar_min=10**9)
    arrays = RoutingEngine(index, load, Ours(), settings)  # 900 >= COLUMNAR_MIN
    assert isinstance(arrays.candidates(request, keys, 0.0), CandidateColumns)
    assert isinstance(per_candidate.candidates(request, keys, 0.0), list)
    picks = set()
    for seed in range(20):
        a = arrays.route(request, keys, 0.0, random.Random(seed))
        b = per_candidate.route(request, keys, 0.0, random.Random(seed))
        assert a.replica == b.replica
        assert a.ranking == b.ranking[:MAX_RANKING]
        assert a.replica in keys[-3:]  # the empty caches
        picks.add(a.replica)
    assert len(picks) > 1  # the rng spreads the ties


def test_columns_follow_replicas_that_leave_and_come_back() -> None:
    """The cached positions in the index and the load table are dropped when the fleet
    changes (a cleared replica moves to another index slot; a removed one frees its row)."""
    rng = random.Random(3)
    index, load, keys = _fleet(rng, 40)
    chain = [rng.getrandbits(63) for _ in range(8)]
    settings = RoutingSettings(block_size=16)
    engine = RoutingEngine(index, load, Ours(), settings, columnar_min=1)
    request = RouteRequest("q", "m", 200, chain, 16)
    index.store(keys[5], chain)
    assert engine.route(request, keys, 0.0, random.Random(0)).replica == keys[5]
    index.clear_replica(keys[5])  # new slot
    index.store(keys[9], chain)
    assert engine.route(request, keys, 0.0, random.Random(0)).replica == keys[9]
    load.remove_replica(keys[9])  # its row is freed; the same tuple asks again
    load.add_replica(keys[9])
    for i in range(30):
        load.dispatch(f"x{i}", keys[9], 8000, 0)
    load.set_draining(keys[9], True)
    decision = engine.route(request, keys, 0.0, random.Random(0))
    assert decision.replica != keys[9]
    assert isinstance(
        RoutingEngine(index, load, Ours(), settings, columnar_min=10**9).candidates(
            request, keys, 0.0
        )[0],
        Candidate,
    )


def test_engine_reports_outside_the_unit_range_are_clamped_for_both_paths() -> None:
    """A NaN KV usage compares false with everything (no score would ever win: the array
    path had nothing to pick) and an infinite one tied with the ineligible replicas' +inf."""
    load = LoadTracker()
    key = ReplicaKey("r")
    for usage, taken in ((float("nan"), 0.0), (float("inf"), 1.0), (-0.5, 0.0), (0.4, 0.4)):
        load.engine_report(key, EngineReport(1, 2, usage, 5.0))
        assert load.view(key, 5.0).kv_usage == taken
        assert load.columns((key,)).kv_usage[0] == taken
    rng = random.Random(1)
    index, load, keys = _fleet(rng, 20)
    for k in keys[1:]:
        load.set_health(k, False)
    load.engine_report(keys[0], EngineReport(0, 0, float("inf"), 0.0))
    request = RouteRequest("q", "m", 100, [1, 2], 16)
    settings = RoutingSettings(block_size=16)
    for columnar_min in (1, 10**9):
        engine = RoutingEngine(index, load, Ours(), settings, columnar_min=columnar_min)
        decision = engine.route(request, keys, 0.0, random.Random(0))
        assert decision.replica == keys[0] and decision.ranking == ()


@pytest.mark.parametrize("count", [10**306, 2**70, -3])
def test_engine_counts_past_float_range_or_negative_are_clamped(count: int) -> None:
    """A running / waiting count from another process (a Redis load sample's JSON integer)
    past float range made ``ours``'s per-candidate path raise OverflowError on every request
    while the report was fresh (and its array path score NaN); every policy now routes on
    both paths alike, with a finite score."""
    from router.core.load import MAX_COUNT
    from router.core.policies import POLICY_NAMES, make_policy

    rng = random.Random(2)
    index, load, keys = _fleet(rng, 3)
    load.engine_report(keys[0], EngineReport(count, count, 0.5, 0.0))
    request = RouteRequest("q", "m", 100, [1, 2], 16)
    settings = RoutingSettings(block_size=16)
    for name in POLICY_NAMES:
        decided = []
        for columnar_min in (1, 10**9):
            engine = RoutingEngine(
                index, load, make_policy(name), settings, columnar_min=columnar_min
            )
            decision = engine.route(request, keys, 0.0, random.Random(0))
            assert math.isfinite(decision.score), name
            decided.append(decision)
        assert decided[0] == decided[1], name
    load = LoadTracker()
    key = ReplicaKey("r")
    load.engine_report(key, EngineReport(count, count, 0.5, 5.0))
    taken = min(max(count, 0), MAX_COUNT)
    engine_report = load.view(key, 5.0).engine
    assert engine_report is not None
    assert (engine_report.running, engine_report.waiting) == (taken, taken)
    assert load.columns((key,)).waiting[0] == taken


def _misbehave(
    rng: random.Random, load: LoadTracker, keys: tuple[ReplicaKey, ...], now: float
) -> None:
    """Engine reports as a broken or hostile engine's metrics give them: counts negative or
    at the clamp, usage NaN / infinite, stamps from the future, exactly at the freshness
    bound or not numbers at all; zero-token prompts and requests that ask for no output. Now
    and then every engine reports a queue at the clamp (the winner's figures are then the
    huge ones)."""
    every = rng.random() < 0.2
    for i, key in enumerate(keys):
        if every:
            load.engine_report(key, EngineReport(2**60, 2**60 - i, 0.5, now))
        elif rng.random() < 0.5:
            age = rng.choice([0.0, 1.5, 3.0, -2.0, float("nan"), float("inf")])
            usage = rng.choice([rng.random(), float("nan"), float("inf"), -1.0, 0.95])

            def count() -> int:
                return rng.choice([0, rng.randrange(0, 20), 10**6, 2**60, -5])

            load.engine_report(key, EngineReport(count(), count(), usage, now - age))
        if rng.random() < 0.2:
            prompt = rng.choice([0, 1, 10**7])
            load.dispatch(f"x{i}", key, prompt, rng.randrange(0, prompt + 1), rng.choice([0, 1]))


@pytest.mark.parametrize("seed", range(200))
def test_fleets_of_up_to_60_replicas_with_misbehaving_engines_decide_alike(seed: int) -> None:
    """Fleets on both sides of ``COLUMNAR_MIN`` (1..60 replicas), engine figures at and past
    every clamp: both paths pick the same replica with the same score, terms and ranking (cut
    to ``MAX_RANKING``) and make the same random draws; every score is finite."""
    rng = random.Random(seed)
    index, load, keys = _fleet(rng, rng.randrange(1, 61))
    chain = [rng.getrandbits(63) for _ in range(rng.randrange(1, 12))]
    now = 100.0
    _populate(rng, index, load, keys, chain, now)
    _misbehave(rng, load, keys, now)
    settings = RoutingSettings(block_size=rng.choice([16, 64]), hybrid=rng.random() < 0.5)
    policy = Ours(report_max_age_s=rng.choice([1.5, 0.0, float("inf")]))
    per_candidate = RoutingEngine(index, load, policy, settings, columnar_min=10**9)
    arrays = RoutingEngine(index, load, policy, settings, columnar_min=1)
    arrays.turnover = per_candidate.turnover
    tokens = len(chain) * settings.block_size
    # a prompt of 1 token with a whole block's hash (a match longer than the prompt), and
    # one 3 times its chain (a match far shorter)
    for step, prompt_tokens in enumerate((tokens, 0, 1, 3 * tokens)):
        blocks = (len(chain), 0, 1, len(chain))[step]
        request = RouteRequest(
            f"q{step}", "m", prompt_tokens, chain[:blocks], settings.block_size,
            max_output_tokens=rng.choice([None, 0, 1, 300]),
        )  # fmt: skip
        decided: list[tuple[object, ...]] = []
        for engine in (per_candidate, arrays):
            draws = random.Random(seed)
            try:
                d = engine.route(request, keys, now, draws)
            except NoReplicaAvailable as exc:
                decided.append(("refused", str(exc), exc.busy))
                continue
            assert math.isfinite(d.score)
            decided.append((d._replace(ranking=d.ranking[:MAX_RANKING]), draws.random()))
        assert decided[0] == decided[1]
        if isinstance(decided[0][0], Decision):
            per_candidate.dispatched(request, decided[0][0], now)
