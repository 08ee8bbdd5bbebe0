"""Peer load: several routers (the service's worker processes) in front of one fleet add
what the others have in flight (LoadTracker.set_peer_load / own), in views, in the array
mirror, and in the simulator, where it undoes the pile-up of routers that know only their own
requests."""

from __future__ import annotations

import pytest

from router.core.load import NO_PEER_LOAD, LoadTracker, PeerLoad, decode_weight
from router.core.types import ReplicaKey
from sim.cluster import ClusterConfig, Simulation
from sim.profiles import load_profile
from sim.workload import Workload, load_trace

A = ReplicaKey("a")
B = ReplicaKey("b")


def test_peer_load_is_added_to_views_and_own_leaves_it_out() -> None:
    t = LoadTracker()
    t.dispatch("r1", A, prompt_tokens=1000, cached_tokens=200)
    others = PeerLoad(
        prefilling=2,
        queued_prefill_tokens=5000,
        decoding=3,
        decode_context_tokens=9000,
        in_flight_prompt_tokens=14000,
    )
    t.set_peer_load(A, others)
    v = t.view(A, 0.0)
    assert (v.prefilling, v.queued_prefill_tokens, v.decoding, v.in_flight) == (3, 5800, 3, 6)
    assert v.decode_context_tokens == 9000 and v.in_flight_prompt_tokens == 15000
    weight = decode_weight(None)
    assert t.own(A) == PeerLoad(1, 800, 0, 0, 1000, weight)
    # the own requests move on; the peers' part stays as reported
    t.first_token("r1")
    assert t.own(A) == PeerLoad(0, 0, 1, 1000, 1000, weight)
    assert t.view(A, 0.0).decoding == 4
    t.complete("r1")
    assert t.own(A) == NO_PEER_LOAD
    assert t.view(A, 0.0).prefilling == 2


def test_a_new_report_replaces_the_last_and_bad_figures_are_clamped() -> None:
    t = LoadTracker()
    t.add_replica(A)
    t.set_peer_load(A, PeerLoad(prefilling=5, queued_prefill_tokens=500))
    t.set_peer_load(A, PeerLoad(prefilling=1, queued_prefill_tokens=100))
    assert t.view(A, 0.0).prefilling == 1  # replaced, not accumulated
    t.set_peer_load(A, PeerLoad(prefilling=-7, queued_prefill_tokens=-1))
    v = t.view(A, 0.0)
    assert (v.prefilling, v.queued_prefill_tokens) == (0, 0)
    assert t.own(B) == NO_PEER_LOAD  # unknown replica
    t.set_peer_load(B, PeerLoad(prefilling=3))  # a replica this tracker does not know...
    assert B not in t.replicas()  # ...is not brought (back) into it
    t.remove_replica(A)
    t.set_peer_load(A, PeerLoad(prefilling=3))  # a peer lagging behind a removal
    assert A not in t.replicas()


def test_the_array_mirror_carries_peer_load_too() -> None:
    t = LoadTracker()
    keys = (A, B)
    t.columns(keys)  # mirrored (and known) from now on
    t.dispatch("r1", B, prompt_tokens=64, cached_tokens=0)
    t.set_peer_load(A, PeerLoad(prefilling=4, queued_prefill_tokens=4000))
    cols = t.columns(keys)
    assert cols.prefilling.tolist() == [4, 1]
    assert cols.queued_prefill_tokens.tolist() == [4000, 64]
    for key, i in ((A, 0), (B, 1)):  # the same numbers as the views
        assert t.view(key, 0.0).prefilling == cols.prefilling[i]


@pytest.fixture(scope="module")
def trace() -> Workload:
    return load_trace("mooncake", block_size=64, limit=800)


def _run(trace: Workload, **kw: object) -> dict[str, float]:
    cfg = ClusterConfig(
        profile=load_profile("dense-70b"),
        replicas=8,
        block_size=64,
        event_lag_s=0.05,
        speculative_ttl_s=2.0,
        **kw,  # type: ignore[arg-type]
    )
    return Simulation(trace, cfg, "ours").run().summary  # type: ignore[return-value]


def test_routers_that_share_their_load_stop_piling_onto_one_replica(trace: Workload) -> None:
    alone = _run(trace)
    split = _run(trace, routers=4)
    shared = _run(trace, routers=4, share_load_s=0.01)
    # four routers that only know their own requests queue far more than one router...
    assert split["ttft_ms_mean"] > 1.2 * alone["ttft_ms_mean"]
    assert split["itl_ms_p99"] > 3 * alone["itl_ms_p99"]
    # ...and sharing their load every 10 ms takes most of that back
    assert shared["ttft_ms_mean"] < split["ttft_ms_mean"] - 0.5 * (
        split["ttft_ms_mean"] - alone["ttft_ms_mean"]
    )
    assert shared["itl_ms_p99"] < 2 * alone["itl_ms_p99"]
    # one router has nobody to share with: the same run
    assert _run(trace, share_load_s=0.01) == alone


def test_an_idle_replica_keeps_no_decode_weight_residue() -> None:
    """Decode weights are float sums: adding a peer's weight and removing requests left
    5e-15 on a replica with nothing in flight, which put an interference term on it, so it
    lost every exact tie with idle replicas (the cache-size tie-break and the rng's)."""
    import random

    from router.core.index import PrefixIndex
    from router.core.policies import Ours
    from router.core.routing import RoutingEngine
    from router.core.routing_settings import RoutingSettings
    from router.core.types import RouteRequest

    t = LoadTracker()
    for key in (A, B):
        t.add_replica(key)
    t.columns((A, B))  # mirrored too
    for i, (out, klass) in enumerate(((16, 1.0), (2, 10.0), (300, 10.0), (2, 10.0))):
        t.dispatch(f"q{i}", A, 100, 0, out, klass)
    t.set_peer_load(A, PeerLoad(1, 10, 0, 0, 10, 10.176676676676676))
    for i in range(4):
        t.complete(f"q{i}")
    t.set_peer_load(A, NO_PEER_LOAD)
    assert t.view(A, 0.0).decode_weight == 0.0
    assert t.columns((A, B)).decode_weight[0] == 0.0
    assert t.own(A) == NO_PEER_LOAD
    # the tie between two idle replicas goes to the smaller cache, A's
    index = PrefixIndex()
    index.store(B, [11, 12, 13])
    request = RouteRequest("q", "m", 20000, [1, 2, 3], 16)
    for columnar_min in (1, 10**9):
        engine = RoutingEngine(
            index, t, Ours(), RoutingSettings(block_size=16), columnar_min=columnar_min
        )
        assert engine.route(request, (A, B), 0.0, random.Random(0)).replica == A
