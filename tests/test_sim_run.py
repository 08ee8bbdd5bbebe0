"""Event ordering, determinism of whole runs, the ceilings on hand-made traces, and a
multi-router / lagged-index run through the real routing core."""

from __future__ import annotations

from typing import Any

import pytest

from router.core.admission import AdmissionSettings
from router.core.routing_settings import BusyThresholds
from sim.cluster import ClusterConfig, Simulation
from sim.events import ARRIVAL, DELIVER, ENGINE, EventQueue
from sim.metrics import ceilings
from sim.profiles import load_profile
from sim.workload import SimRequest, Workload, load_trace


def test_event_queue_orders_by_time_then_priority_then_insertion() -> None:
    q = EventQueue()
    q.push(2.0, ARRIVAL, "late")
    q.push(1.0, ARRIVAL, "a1")
    q.push(1.0, ENGINE, "e")
    q.push(1.0, ARRIVAL, "a2")
    q.push(1.0, DELIVER, "d")
    assert [q.pop()[2] for _ in range(len(q))] == ["e", "d", "a1", "a2", "late"]
    assert q.peek_time() is None and not q


def req(rid: str, hashes: list[int], arrival: float = 0.0, out: tuple[int, ...] = ()) -> SimRequest:
    return SimRequest(rid, arrival, len(hashes) * 10, 1, hashes, output_block_hashes=out)


def test_ceilings_on_hand_traces() -> None:
    trace = [req("a", [1, 2, 3]), req("b", [1, 2, 4]), req("c", [5]), req("d", [1, 2, 3])]
    c = ceilings(trace, capacity_blocks=100, block_size=10)
    assert c.infinite == pytest.approx((0 + 20 + 0 + 30) / 100)
    assert c.global_lru == c.infinite  # nothing evicted
    # capacity 4: after b the LRU holds 1,2,3,4; c evicts the oldest leaf (3, a's tail)...
    small = ceilings(trace, capacity_blocks=4, block_size=10)
    assert small.global_lru == pytest.approx((0 + 20 + 0 + 20) / 100)
    # ...and answers named by output blocks count as cached for the next request
    turns = [req("a", [1], out=(2,)), req("b", [1, 2, 3])]
    assert ceilings(turns, 100, 10).infinite == pytest.approx(20 / 40)


def small_config(**kw: object) -> ClusterConfig:
    return ClusterConfig(
        profile=load_profile("dense-70b"),
        replicas=4,
        block_size=64,
        kv_blocks=4096,
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def slice_() -> Workload:
    return load_trace("mooncake", block_size=64, limit=300)


def test_runs_are_deterministic_and_seed_matters_for_random(slice_: Workload) -> None:
    cfg = small_config()
    one = Simulation(slice_, cfg, "ours").run().summary
    two = Simulation(slice_, cfg, "ours").run().summary
    assert one == two and one["completed"] == 300
    r1 = Simulation(slice_, cfg, "random").run().summary
    r2 = Simulation(slice_, small_config(seed=9), "random").run().summary
    assert r1["requests_per_replica"] != r2["requests_per_replica"]


def test_cache_aware_beats_round_robin_and_stays_under_ceiling(slice_: Workload) -> None:
    cfg = small_config()
    rr = Simulation(slice_, cfg, "round_robin").run()
    ours = Simulation(slice_, cfg, "ours").run()
    ceil = ceilings(slice_.requests, cfg.capacity_blocks(), 64)
    assert rr.summary["token_hit_rate"] < ours.summary["token_hit_rate"] <= ceil.infinite
    assert ours.summary["ttft_ms_p50"] < rr.summary["ttft_ms_p50"]
    assert rr.summary["requests_per_replica"] == [75, 75, 75, 75]


def test_several_routers_with_event_lag_pile_on(slice_: Workload) -> None:
    events_only = small_config(speculative_ttl_s=0.0)
    base = Simulation(slice_, events_only, "longest_prefix").run().summary
    lagged_config = small_config(routers=4, event_lag_s=5.0, speculative_ttl_s=0.0)
    lagged = Simulation(slice_, lagged_config, "longest_prefix").run().summary
    assert lagged["completed"] == 300
    # with stale indexes the routers miss prefixes they would otherwise have seen
    assert lagged["token_hit_rate"] < base["token_hit_rate"]
    spec = (
        Simulation(
            slice_,
            small_config(routers=4, event_lag_s=5.0, speculative_ttl_s=30.0),
            "longest_prefix",
        )
        .run()
        .summary
    )
    assert spec["token_hit_rate"] > lagged["token_hit_rate"]


def test_hybrid_profile_usable_hits_below_kv_hits(slice_: Workload) -> None:
    kimi = load_profile("kimi-k3").with_overrides(checkpoint_interval_tokens=4096)
    cfg = ClusterConfig(profile=kimi, replicas=4, block_size=64, kv_blocks=20000, cpu_blocks=0)
    s = Simulation(slice_, cfg, "ours").run().summary
    assert 0 < s["token_hit_rate"] < s["kv_token_hit_rate"]


@pytest.mark.parametrize("policy", ["round_robin", "random", "least_loaded"])
def test_index_free_policies_skip_the_index_with_identical_results(
    slice_: Workload, policy: str
) -> None:
    """Policies that ignore the prefix index do not pay for maintaining it, and nothing the
    simulation reports changes (the index is forced back on for the comparison)."""
    cfg = small_config(event_lag_s=0.01)
    lean = Simulation(slice_, cfg, policy)
    assert not lean._feed_index
    fed = Simulation(slice_, cfg, policy)
    fed._feed_index = True
    a, b = lean.run(), fed.run()
    assert a.summary == b.summary
    assert lean.routers[0].engine.index.stats().kv_entries == 0
    assert fed.routers[0].engine.index.stats().kv_entries > 0
    assert Simulation(slice_, cfg, "ours")._feed_index


@pytest.mark.parametrize(
    ("extra", "speedup"),
    [
        # admission predicts each candidate's TTFT from its prefix match
        ({"admission": AdmissionSettings(), "priority_share": 0.2, "speculative_ttl_s": 0.0}, 2),
        ({"pd": "auto"}, 8),  # the plan and the decode pick read the matches too
    ],
)
def test_index_is_fed_where_more_than_the_policy_reads_it(
    slice_: Workload, extra: dict[str, Any], speedup: float
) -> None:
    """The service feeds every model's index the engines' events, whatever its policy:
    admission (router/core/admission.py ``assess``), P/D (``Disaggregator.plan`` /
    ``pick_decode``) and a queued-prefill busy threshold read the prefix matches, so with
    any of them a policy that ignores the index still gets it fed: the figures are those
    of a run with the index fed."""
    cfg = small_config(**extra)
    lean = Simulation(slice_, cfg, "round_robin", speedup=speedup)
    fed = Simulation(slice_, cfg, "round_robin", speedup=speedup)
    fed._feed_index = True
    assert lean.run().summary == fed.run().summary
    busy = small_config(busy=BusyThresholds(max_queued_prefill_tokens=1 << 16))
    assert Simulation(slice_, busy, "least_loaded")._feed_index
    assert not Simulation(slice_, small_config(), "least_loaded")._feed_index


def test_transport_delays_what_the_client_sees_not_the_engine(slice_: Workload) -> None:
    """``transport_s`` is the HTTP path: every TTFT and E2E grows by it, decode speed does
    not change, and a session's next turn leaves that much later."""
    base = Simulation(slice_, small_config(), "ours").run()
    moved = Simulation(slice_, small_config(transport_s=0.25), "ours").run()
    assert sorted(moved.ttft_s) == pytest.approx([t + 0.25 for t in sorted(base.ttft_s)])
    b, m = base.summary, moved.summary
    assert m["ttft_ms_p50"] == pytest.approx(b["ttft_ms_p50"] + 250, abs=0.01)
    assert m["e2e_ms_p50"] == pytest.approx(b["e2e_ms_p50"] + 250, abs=0.01)
    assert m["tpot_ms_p90"] == pytest.approx(b["tpot_ms_p90"])
    first = SimRequest("a", 0.0, 128, 4, [1, 2], session_id="s")
    follow = SimRequest("b", 0.0, 192, 4, [1, 2, 3], session_id="s", after="a", delay_s=1.0)
    gaps = {}
    for transport in (0.0, 0.25):
        chain = Workload("chain", [first, follow], 64, "m")
        sim = Simulation(chain, small_config(transport_s=transport), "ours")
        sim.run()
        a, b = sim._records["a"], sim._records["b"]
        gaps[transport] = (b.arrival - a.finish, a.finish - a.arrival)
    # the think time runs from when the client saw the answer, 0.25 s after the engine
    assert gaps[0.0][0] == pytest.approx(1.0) and gaps[0.25][0] == pytest.approx(1.0)
    assert gaps[0.25][1] == pytest.approx(gaps[0.0][1] + 0.25)


def test_arrival_jitter_delays_each_arrival_by_at_most_its_bound(slice_: Workload) -> None:
    """``arrival_jitter_s``: every request reaches the router no earlier than its trace time
    and at most the bound later, the draw follows the seed, and 0 leaves the run as it was."""
    due = {r.request_id: r.arrival_s for r in slice_.requests}
    runs = {}
    for seed in (0, 1):
        sim = Simulation(slice_, small_config(arrival_jitter_s=0.005, seed=seed), "ours")
        sim.run()
        late = [rec.arrival - due[rid] for rid, rec in sim._records.items()]
        assert len(late) == len(due) and all(0 <= d <= 0.005 for d in late)
        assert max(late) > 0.004 and min(late) < 0.001  # drawn over the whole bound
        runs[seed] = late
    assert runs[0] != runs[1]
    plain = Simulation(slice_, small_config(), "ours").run().summary
    assert Simulation(slice_, small_config(arrival_jitter_s=0.0), "ours").run().summary == plain


def test_a_request_the_engine_rejects_leaves_no_guess_in_the_index() -> None:
    """An engine that rejects a request (larger than its whole cache) holds none of its
    prompt: the router withdraws what it speculated there, as the service does for a
    replica that refused a request, instead of keeping it until the TTL."""
    big = SimRequest("big", 0.0, 100 * 64, 1, list(range(1, 101)))
    small = SimRequest("small", 1.0, 4 * 64, 1, [1, 2, 3, 4])
    work = Workload("rejects", [big, small], 64, "m")
    cfg = ClusterConfig(
        profile=load_profile("dense-70b"),
        replicas=4,
        block_size=64,
        kv_blocks=64,
        speculative_ttl_s=600.0,
        event_lag_s=0.5,
    )
    sim = Simulation(work, cfg, "longest_prefix")
    summary = sim.run().summary
    assert summary["rejected"] == 1 and summary["completed"] == 1
    index = sim.routers[0].engine.index
    found = index.match(list(range(1, 101)))
    held = {str(k): found.get(k).kv_blocks for k in sim.keys}
    # the small request's 4 blocks are there (speculated, then stored); none of big's rest
    assert max(held.values()) == 4, held


@pytest.mark.parametrize("admission", [False, True])
def test_a_request_every_busy_replica_refuses_is_a_miss_not_a_crash(admission: bool) -> None:
    """With ``reject_when_all_busy`` the service answers 429 when every replica is over its
    busy threshold (router.core.eligibility ``filter_candidates``); the simulator let the
    NoReplicaAvailable escape and the run died. The refused request counts as rejected (a
    goodput miss) and its session goes on, as after an admission shed."""
    from router.core.admission import AdmissionSettings
    from router.core.routing_settings import BusyThresholds
    from sim.agentic import AgenticSpec, generate

    workload = generate(AgenticSpec(sessions=20, session_rate=20.0), block_size=64)
    config = ClusterConfig(
        load_profile("dense-70b"),
        replicas=2,
        busy=BusyThresholds(max_in_flight=1, reject_when_all_busy=True),
        admission=AdmissionSettings() if admission else None,
    )
    s = Simulation(workload, config, "ours", speedup=8).run().summary
    assert s["requests"] == len(workload)
    assert s["rejected"] > 0 and s["completed"] + s["rejected"] == s["requests"]
    assert s["goodput"] <= s["completed"] / s["requests"]


def test_an_eagle_profiles_routers_predict_the_block_its_engines_give_back() -> None:
    """A profile with ``eagle = true`` models engines that give back the last block of every
    hit; the service routing such engines is configured ``[models.NAME] eagle = true``
    (docs/configuration.md) and predicts that. The simulator's routers were not told, so
    they predicted one block more than the engines granted on every hit."""
    import dataclasses

    from sim.workload import SimRequest, Workload

    b = 64
    profile = dataclasses.replace(load_profile("dense-70b"), eagle=True)
    first = SimRequest("a", 0.0, 20 * b, 4, list(range(1, 21)))
    second = SimRequest("b", 100.0, 30 * b + 10, 4, list(range(1, 31)))
    workload = Workload("t", [first, second], b, "m")
    sim = Simulation(workload, ClusterConfig(profile, replicas=1, block_size=b), "ours")
    predicted: list[int] = []
    dispatch = sim._dispatch  # (the simulator's own method: RoutingEngine may be compiled)

    def spy(router: Any, req: Any, rr: Any, decision: Any, *args: Any) -> Any:
        predicted.append(decision.usable_tokens)
        return dispatch(router, req, rr, decision, *args)

    sim._dispatch = spy  # type: ignore[method-assign]
    sim.run()
    granted = [sim._records[r.request_id].cached for r in (first, second)]
    assert granted == [0, 19 * b]  # 20 blocks cached, the last given back
    assert predicted == granted


@pytest.mark.parametrize("stream", [True, False])
def test_the_router_learns_of_a_first_token_as_the_service_does(stream: bool) -> None:
    """The service's router books a request's first token when its first byte comes
    (router/service/proxy.py ``LoadTracker.first_token``): a stream's first event, but an
    answer not streamed only whole, at its end; until then the request loads its replica
    as one still prefilling. The simulated router must see the same load while the engine
    decodes such an answer, or it routes on a load no live router has."""
    hashes = list(range(1, 11))
    r = SimRequest("a", 0.0, 640, 200, hashes, stream=stream)
    wl = Workload("one", [r], 64, "sim-model")
    s = Simulation(wl, small_config(), "ours")
    s._arrive(r, 0.0)
    record = s._records["a"]
    while record.first != record.first:  # step the engines until its first token
        t, prio, payload = s._queue.pop()
        assert prio == ENGINE
        i, g = payload
        if g == s._gen[i]:
            s._wake_at[i] = None
            s._after_engine(i, t, s.engines[i].advance(t))
    assert record.finish != record.finish  # decoding: the answer is not over
    view = s.routers[0].engine.load.view(s.keys[record.replica], record.first)
    assert (view.prefilling, view.decoding) == ((0, 1) if stream else (1, 0))


def test_the_global_lru_ceiling_holds_the_host_tier_the_engines_hit() -> None:
    """``ceiling_global_lru`` is one LRU of the cluster's KV capacity; with ``cpu_blocks``
    the engines keep what their GPU blocks evict in a host tier and reuse it, so an LRU of
    the GPU blocks alone fell below the hit the engines reached (mooncake, 4 replicas x
    1,024 GPU + 16,384 host blocks: 0.8 % against 9.2 %, "of LRU" 1087 %). Here one replica
    of 5 GPU blocks: b evicts all of a's blocks to the host tier, and c (a again) reloads
    them; the GPU-only LRU kept a's first block alone."""
    from sim.runner import workload_ceilings

    a = SimRequest("a", 0.0, 4 * 64 + 1, 1, [1, 2, 3, 4])
    b = SimRequest("b", 1.0, 4 * 64 + 1, 1, [5, 6, 7, 8])
    c = SimRequest("c", 2.0, 4 * 64 + 1, 1, [1, 2, 3, 4])
    work = Workload("host", [a, b, c], 64, "m")
    cfg = ClusterConfig(
        profile=load_profile("dense-70b"), replicas=1, block_size=64, kv_blocks=5, cpu_blocks=100
    )
    s = Simulation(work, cfg, "round_robin").run().summary
    assert s["token_hit_rate"] == pytest.approx(256 / (3 * 257), abs=1e-5)
    ceil = workload_ceilings(work, cfg)
    assert ceil.global_lru == ceil.infinite == pytest.approx(256 / (3 * 257), abs=1e-5)
    assert cfg.capacity_blocks() == 105
    # without a host tier, the GPU's blocks alone
    gpu = ClusterConfig(profile=load_profile("dense-70b"), replicas=2, block_size=64, kv_blocks=5)
    assert gpu.capacity_blocks() == 10
