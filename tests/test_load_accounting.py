"""Load accounting as the policies read it: the router's own counts, its peers', a failing
replica's phantom requests and the engines' own reports, combined without cancelling each
other out, the same on the per-candidate and the array path."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.core.index import PrefixIndex
from router.core.load import EngineReport, LoadTracker, PeerLoad
from router.core.policies import Candidate, CandidateColumns, Ours
from router.core.routing import RoutingEngine
from router.core.routing_settings import RoutingSettings
from router.core.types import NO_MATCH, ReplicaKey, RouteRequest

A, B = ReplicaKey("a"), ReplicaKey("b")
NOW = 100.0


def _engine(load: LoadTracker, keys: tuple[ReplicaKey, ...], columnar: bool) -> RoutingEngine:
    index = PrefixIndex()
    for key in keys:
        index.add_replica(key)
        load.add_replica(key)
    settings = RoutingSettings(block_size=16)
    return RoutingEngine(index, load, Ours(), settings, columnar_min=1 if columnar else 10**9)


@pytest.mark.parametrize("columnar", [False, True])
def test_a_fresh_engine_queue_does_not_cancel_a_failing_replicas_phantom_load(
    columnar: bool,
) -> None:
    """Phantom requests (LoadTracker.set_penalty) are no request the engine queues: its
    reported ``waiting`` beyond the router's requests counts other routers' traffic, which
    the phantoms must not explain away. Both replicas report the same queue; the failing one
    must cost more."""
    load = LoadTracker()
    keys = (A, B)
    engine = _engine(load, keys, columnar)
    for key in keys:
        load.engine_report(key, EngineReport(running=4, waiting=10, kv_usage=0.5, at=NOW))
    load.set_penalty(A, 6, 6 * 4096)  # three failures in a row, two phantoms each
    request = RouteRequest("q", "m", 2000, [], 16)
    queues = {}
    for key in keys:
        decision = engine.route(request, (key,), NOW, random.Random(0))
        queues[key] = decision.terms["queue"]
    assert queues[A] > queues[B]
    assert engine.route(request, keys, NOW, random.Random(0)).replica == B


def test_a_peer_report_of_no_request_carries_no_decode_weight() -> None:
    """A peer's report with decode weight but no request in flight (``own`` never sends
    one; a peer of another version might): the weight is not counted, and the peer's next
    report, of requests in flight, counts exactly its own weight (it used to be settled
    away, then taken off again: the replica looked lighter than its requests)."""
    load = LoadTracker()
    load.add_replica(A)
    load.dispatch("mine", A, 1000, 0, 100, 1.0, 1)
    mine = load.view(A, NOW).decode_weight
    load.set_peer_load(A, PeerLoad(decode_weight=1.0))
    assert load.view(A, NOW).decode_weight == pytest.approx(mine)
    load.complete("mine")
    load.set_peer_load(A, PeerLoad(0, 0, 2, 4000, 4000, 0.5))
    assert load.view(A, NOW).decode_weight == pytest.approx(0.5)


_KEYS = (A, B, ReplicaKey("c"))
_request_ids = st.sampled_from([f"q{i}" for i in range(6)])
_ops = st.one_of(
    st.tuples(
        st.just("dispatch"),
        _request_ids,
        st.sampled_from(_KEYS),
        st.integers(1, 20_000),
        st.integers(0, 20_000),
        st.sampled_from([None, 1, 2, 300]),
        st.sampled_from([1.0, 0.25, 4.0]),
        st.integers(1, 8),
    ),
    st.tuples(st.sampled_from(["first_token", "complete"]), _request_ids),
    st.tuples(
        st.just("peer"),
        st.sampled_from(_KEYS),
        st.tuples(*(st.integers(0, 5000) for _ in range(5)), st.floats(0, 3)),
    ),
    st.tuples(st.just("penalty"), st.sampled_from(_KEYS), st.integers(0, 6)),
    st.tuples(
        st.just("report"),
        st.sampled_from(_KEYS),
        st.integers(-2, 40),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([NOW, NOW - 1.5, NOW - 1.6]),
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_ops, max_size=40), st.booleans())
def test_counts_stay_whole_whatever_the_order_of_calls(ops: list[Any], mirrored: bool) -> None:
    """Any sequence of dispatches (retries: the same id again), first tokens and completions
    (twice, before the first token, of unknown ids), peer reports, penalties and engine
    reports: no count goes negative, the array mirror agrees with every view, own + peers'
    + phantom load is what the views count, and once every request completed only the
    peers' and the phantom load is left. Ours then scores each replica alike on both paths."""
    load = LoadTracker()
    for key in _KEYS:
        load.add_replica(key)
    if mirrored:
        load.columns(_KEYS)
    peers = dict.fromkeys(_KEYS, PeerLoad())
    phantoms = dict.fromkeys(_KEYS, 0)
    for op in ops:
        name = op[0]
        if name == "dispatch":
            _, rid, key, prompt, cached, out, weight, samples = op
            load.dispatch(rid, key, prompt, cached, out, weight, samples)
        elif name == "first_token":
            load.first_token(op[1])
        elif name == "complete":
            load.complete(op[1])
        elif name == "peer":
            load.set_peer_load(op[1], PeerLoad(*op[2]))
            held = op[2][0] + op[2][2]  # a report of no request in flight carries no weight
            peers[op[1]] = PeerLoad(*op[2][:5], op[2][5] if held else 0.0)
        elif name == "penalty":
            phantoms[op[1]] = op[2]
            load.set_penalty(op[1], op[2], op[2] * 4096)
        else:
            _, key, waiting, usage, at = op
            load.engine_report(key, EngineReport(1, waiting, usage, at))
        _check(load, peers, phantoms)
    for rid in [f"q{i}" for i in range(6)]:
        load.complete(rid)
    assert load.in_flight() == 0
    for key in _KEYS:
        view, peer, phantom = load.view(key, NOW), peers[key], phantoms[key]
        assert view.prefilling == peer.prefilling + phantom
        assert view.queued_prefill_tokens == peer.queued_prefill_tokens + phantom * 4096
        assert view.decoding == peer.decoding
        assert view.decode_context_tokens == peer.decode_context_tokens
        assert view.in_flight_prompt_tokens == peer.in_flight_prompt_tokens
        assert view.decode_weight == pytest.approx(peer.decode_weight, abs=1e-9)
    _check(load, peers, phantoms)


def _check(
    load: LoadTracker, peers: dict[ReplicaKey, PeerLoad], phantoms: dict[ReplicaKey, int]
) -> None:
    columns = load.columns(_KEYS)
    policy = Ours()
    request = RouteRequest("x", "m", 3000, [], 16, max_output_tokens=100)
    for i, key in enumerate(_KEYS):
        view = load.view(key, NOW)
        own = load.own(key)
        assert min(own) >= 0 and min(view[:6]) >= 0 and view.decode_weight >= 0
        assert view.prefilling == own.prefilling + peers[key].prefilling + phantoms[key]
        assert view.decoding == own.decoding + peers[key].decoding
        row = tuple(float(getattr(columns, f)[i]) for f in ("prefilling", "decoding"))
        assert row == (view.prefilling, view.decoding)
        assert float(columns.queued_prefill_tokens[i]) == view.queued_prefill_tokens
        assert float(columns.decode_weight[i]) == view.decode_weight
        assert int(columns.phantom[i]) == view.phantom == phantoms[key]
    candidates = [Candidate(key, NO_MATCH, load.view(key, NOW)) for key in _KEYS]
    none = np.zeros(len(_KEYS), dtype=np.int64)  # no prefix cached anywhere
    eligible = np.ones(len(_KEYS), dtype=bool)
    arrays = CandidateColumns(_KEYS, eligible, none, none, none, none, columns, lambda key: 0)
    per_candidate = [policy.term_values(request, c) for c in candidates]
    as_arrays = policy.term_columns(request, arrays, NOW)
    for i in range(len(_KEYS)):
        assert per_candidate[i] == tuple(float(term[i]) for term in as_arrays)
