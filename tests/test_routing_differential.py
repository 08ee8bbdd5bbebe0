"""One routing engine, two evaluations: request after request on a changing fleet, the same
``RoutingEngine`` decides per candidate and as arrays (its ``columnar_min`` switched between
the two) and must give the same decision (replica, score, terms, tokens, ranking cut to
``MAX_RANKING``, the same random draws, the same refusal).

Unlike tests/test_routing_columns.py, the state both paths read is the one engine's own, built
by its own dispatches and withdrawals over simulated time: speculative entries (KV and
checkpoints) that expire, session hints (exact ones awaiting the engine's store, approximate
ones not), caches cleared under a hint (a new cache epoch), replicas the index forgot while
the fleet still routes to them, DP ranks of one replica, peer and phantom load, learned
alignment and lookahead, EAGLE, engine blocks finer and coarser than the router's."""

from __future__ import annotations

import math
import random

import pytest

from router.core.index import PrefixIndex
from router.core.load import EngineReport, LoadTracker, PeerLoad
from router.core.policies import Ours
from router.core.routing import RoutingEngine
from router.core.routing_settings import BusyThresholds, RoutingSettings
from router.core.state_layout import SOURCE_ENGINE
from router.core.types import (
    MAX_RANKING,
    AllCleared,
    Decision,
    EventBatch,
    Kind,
    ReplicaKey,
    RouteRequest,
    Tier,
)
from tests.test_routing_columns import _decide


def _world(rng: random.Random) -> tuple[RoutingEngine, tuple[ReplicaKey, ...], int]:
    n = rng.randrange(1, 45)
    names = [f"r{i}" for i in range(rng.randrange(1, n + 1))]
    # DP ranks of one replica side by side (distinct keys of one name)
    keys = tuple(dict.fromkeys(ReplicaKey(rng.choice(names), rng.randrange(3)) for _ in range(n)))
    index, load = PrefixIndex(), LoadTracker()
    for key in keys:
        if rng.random() < 0.9:  # else unknown to the index (a publisher's lease lapsed)
            index.add_replica(key)
        load.add_replica(key)
    bs = rng.choice([16, 64])
    busy = rng.choice(
        [
            BusyThresholds(),
            BusyThresholds(max_in_flight=3),
            BusyThresholds(max_queued_prefill_tokens=3000, reject_when_all_busy=True),
        ]
    )
    settings = RoutingSettings(
        block_size=bs,
        hybrid=rng.choice([None, True, False]),
        state_interval_blocks=rng.choice([0, 2, 4]),
        engine_block_size=rng.choice([0, bs // 2, bs, 2 * bs, 4 * bs]),
        eagle=rng.random() < 0.3,
        speculate_sessions=rng.random() < 0.5,
        speculative_ttl_s=rng.choice([None, 0.0, 3.0]),
        busy=busy,
    )
    engine = RoutingEngine(index, load, Ours(w_interference=rng.choice([0.0, 7.0])), settings)
    if rng.random() < 0.2:
        engine.learn(lookahead=(rng.choice([2, 5]), SOURCE_ENGINE))
    if rng.random() < 0.2:
        engine.learn(alignment=(rng.choice([1, 2, 4]), SOURCE_ENGINE))
    return engine, keys, bs


def _change(
    rng: random.Random,
    engine: RoutingEngine,
    keys: tuple[ReplicaKey, ...],
    chains: list[list[int]],
    now: float,
    sent: int,
) -> None:
    """One change of the world: an engine event, a guess, a report, a health or drain
    change, a peer's or a failing replica's load, a replica the index forgets, a request's
    progress."""
    index, load = engine.index, engine.load
    key, chain = rng.choice(keys), rng.choice(chains)
    depth = rng.randrange(len(chain) + 1)
    r = rng.random()
    if r < 0.4:
        gpu = rng.randrange(depth + 1)
        index.store(key, chain[:gpu], Tier.GPU)
        if depth > gpu:
            index.store(key, chain[gpu:depth], rng.choice([Tier.CPU, Tier.DISK]))
        states = [h for i, h in enumerate(chain[:depth]) if rng.random() < 0.3 or i == depth - 1]
        if states and rng.random() < 0.6:
            index.store(key, states, kind=Kind.STATE)
    elif r < 0.5:
        index.remove(key, chain[depth:])  # leaves first: the cache stays prefix-closed
    elif r < 0.55:
        index.apply(EventBatch(key, (AllCleared(),)))  # a new cache epoch
    elif r < 0.6:
        states = [h for h in chain[:depth] if rng.random() < 0.3]
        index.speculate(key, chain[:depth], states, now, rng.choice([0.5, 5.0]))
    elif r < 0.7:
        age = rng.choice([0.0, 1.0, 3.0])
        report = EngineReport(rng.randrange(5), rng.randrange(9), rng.random(), now - age)
        load.engine_report(key, report)
    elif r < 0.75:
        load.set_health(key, rng.random() < 0.7)
    elif r < 0.8:
        load.set_draining(key, rng.random() < 0.3)
    elif r < 0.85:
        load.set_penalty(key, rng.randrange(3), rng.randrange(9000))
    elif r < 0.9:
        peer = PeerLoad(
            rng.randrange(3),
            rng.randrange(5000),
            rng.randrange(3),
            rng.randrange(9000),
            rng.randrange(9000),
            rng.random(),
        )
        load.set_peer_load(key, peer)
    elif r < 0.93:
        index.remove_replica(key)  # the fleet still routes to it
    else:
        load.first_token(f"q{rng.randrange(sent + 1)}")
        if rng.random() < 0.5:
            load.complete(f"q{rng.randrange(sent + 1)}")


def _route(
    engine: RoutingEngine,
    request: RouteRequest,
    keys: tuple[ReplicaKey, ...],
    now: float,
    seed: int,
) -> object:
    got = _decide(engine, request, keys, now, seed)  # a refusal, or the decision and a draw
    assert isinstance(got, tuple)
    d, draw = got[0], got[-1]
    if not isinstance(d, Decision):
        return got
    assert math.isfinite(d.score)
    return d._replace(ranking=d.ranking[:MAX_RANKING]), draw


@pytest.mark.parametrize("seed", range(100))
def test_one_engine_decides_alike_per_candidate_and_as_arrays(seed: int) -> None:
    rng = random.Random(seed)
    engine, keys, bs = _world(rng)
    chains = [[rng.getrandbits(63) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
    chains.append(chains[0][:3] + [rng.getrandbits(63) for _ in range(8)])  # a shared prefix
    now = 100.0
    for step in range(25):
        now += rng.choice([0.0, 0.5, 2.0, 10.0])  # speculative entries expire
        for _ in range(rng.randrange(4)):
            _change(rng, engine, keys, chains, now, step)
        chain = rng.choice(chains)
        blocks = rng.randrange(len(chain) + 1)
        request = RouteRequest(
            f"q{step + 1}",
            "m",
            max(blocks * bs + rng.choice([0, 0, 1, bs - 1]), 1),
            chain[:blocks],
            bs,
            rng.choice([None, "s1", "s2"]),
            rng.choice([None, 5, 300]),
            reads_cache=rng.random() < 0.95,
        )
        decided = []
        for columnar_min in (10**9, 1):
            engine.columnar_min = columnar_min
            decided.append(_route(engine, request, keys, now, seed * 1000 + step))
        assert decided[0] == decided[1], (seed, step)
        first = decided[0]
        if isinstance(first, tuple) and not isinstance(first[0], str):
            dispatch = engine.dispatched(request, first[0], now, exact=rng.random() < 0.85)
            if rng.random() < 0.15:
                engine.withdraw(dispatch)


def test_a_session_hint_on_a_replica_the_index_does_not_know_counts_alike() -> None:
    """An approximate prompt of a session, not speculated, sent to a replica the index does
    not know (its publisher's lease lapsed; the fleet still routes to it): the hint was
    recorded with cache epoch 0, which an unknown key also has, so the per-candidate path
    credited the session's next turn there and the array path, which finds the replica by
    its index slot (none), did not: two decisions for one request."""
    keys = tuple(ReplicaKey(f"r{i}") for i in range(3))
    index, load = PrefixIndex(), LoadTracker()
    for key in keys:
        load.add_replica(key)
    index.add_replica(keys[0])
    index.add_replica(keys[1])
    settings = RoutingSettings(block_size=16, speculative_ttl_s=0.0)
    engine = RoutingEngine(index, load, Ours(), settings)
    chain = list(range(1, 40))
    first = RouteRequest("a", "m", 16 * 20, chain[:20], 16, "s")
    decision = engine.route(first, keys, 0.0, random.Random(0))
    decision = decision._replace(replica=keys[2])  # (any replica: the one unknown)
    engine.dispatched(first, decision, 0.0, exact=False)
    load.complete("a")
    nxt = RouteRequest("b", "m", 16 * 39, chain, 16, "s")
    decided = []
    for columnar_min in (10**9, 1):
        engine.columnar_min = columnar_min
        decided.append(engine.route(nxt, keys, 1.0, random.Random(0)))
    assert decided[0] == decided[1]
    # the hint holds: the replica was sent the session's prompt
    assert decided[0].replica == keys[2] and decided[0].usable_tokens == 16 * 20
