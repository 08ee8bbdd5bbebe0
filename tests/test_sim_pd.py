"""Prefill/decode disaggregation in the simulator: the decode leg of the engine model, roles
by rack, and whole runs under --pd off / always / auto (sim/pd.py, sim/cluster.py)."""

from __future__ import annotations

import json
from pathlib import Path

from router.core.disagg import Role
from router.core.load import CostModel
from router.core.types import BlocksStored, Kind, ReplicaKey
from sim.agentic import AgenticSpec, generate
from sim.cluster import ClusterConfig, Simulation
from sim.engine import EngineModel, EngineRequest, Finished, FirstToken, TokensEmitted
from sim.pd import roles_of, sites_of
from sim.profiles import EngineProfile, load_profile
from sim.tuned import load_tuned
from tests.inprocess import kvrouter

B = 10


def test_a_remote_prefilled_request_publishes_its_blocks_and_decodes_without_prefill() -> None:
    cost = CostModel(0.01, 1e-3, 0.0, 0.001, 0.0, 100)
    profile = EngineProfile(
        "t", cost=cost, block_size=B, kv_blocks=100, hybrid=True, state_checkpoint_blocks=1.0
    )
    e = EngineModel(profile, ReplicaKey("d"), B)
    e.submit(EngineRequest("r", [1, 2, 3, 4], 45, 3, remote_prefilled=True), 0.0)
    outs = []
    while (t := e.next_time()) is not None:
        outs += e.advance(t)
    first = next(o for o in outs if isinstance(o, FirstToken))
    assert first.time < 0.02  # one step of overhead: none of the 45 prompt tokens computed
    assert any(isinstance(o, Finished) and o.output_tokens == 3 for o in outs)
    events = e.take_index_events()
    kv = [
        h for ev in events if isinstance(ev, BlocksStored) and ev.kind is Kind.KV for h in ev.hashes
    ]
    states = [
        h
        for ev in events
        if isinstance(ev, BlocksStored) and ev.kind is Kind.STATE
        for h in ev.hashes
    ]
    assert kv == [1, 2, 3, 4] and states == [4]  # the state at the prompt end came with it


def _pd_engine(**kw: object) -> EngineModel:
    cost = CostModel(0.01, 1e-4, 0.0, 0.001, 0.0, 100)
    profile = EngineProfile("t", cost=cost, block_size=B, **kw)  # type: ignore[arg-type]
    return EngineModel(profile, ReplicaKey("d"), B)


def _run(e: EngineModel) -> list[object]:
    outs: list[object] = []
    while (t := e.next_time()) is not None:
        outs += e.advance(t)
    return outs


def test_a_decode_legs_pull_holds_its_blocks_but_no_running_slot_or_budget() -> None:
    """vLLM 0.34 starts a decode leg's pull when it reaches the head of the queue
    (``load_kv_async``): its prompt's blocks allocated up front, then it waits in
    WAITING_FOR_REMOTE_KVS outside the batch; the request behind it is admitted in the
    same step. The engine model made the decode leg wait for the transfer before it queued,
    holding nothing, then scheduled it as any waiting request."""
    e = _pd_engine(kv_blocks=100, max_running=1)
    e.submit(EngineRequest("r", list(range(1, 9)), 85, 3, remote_prefilled=True, pull_s=1.0), 0.0)
    e.submit(EngineRequest("c", [50, 51], 20, 2), 0.0)
    e.advance(0.001)
    report = e.report(0.001)
    assert (report.running, report.waiting) == (1, 1)  # c runs; r waits for its KV
    assert report.kv_usage >= 9 / 100  # r's 9 blocks are allocated while its KV arrives
    outs = _run(e)
    first = {o.request_id: o.time for o in outs if isinstance(o, FirstToken)}
    assert first["c"] < 0.1
    # r: its pull (1 s from the step that started it), then one step scheduling the last
    # prompt token (vLLM recomputes it: _update_waiting_for_remote_kv)
    assert 1.0 < first["r"] <= 1.0 + 0.01 + 1e-4 + 1e-9
    assert any(isinstance(o, Finished) and o.request_id == "r" for o in outs)


def test_a_decode_leg_whose_kv_arrived_goes_before_the_waiting_requests() -> None:
    """A decode leg whose KV has arrived is scheduled ahead of the FCFS queue (vLLM 0.34
    drains ``kv_holding_waiting`` first), for one token of the step's budget, left once the
    running requests took theirs. Here r's pull ends during b's long prefill, which takes
    the budget; c waits behind b. When b's last chunk leaves budget r is scheduled, before c, which
    reached the engine after r."""
    e = _pd_engine(kv_blocks=400, max_running=4)
    e.submit(EngineRequest("a", [1], 10, 400), 0.0)  # decodes all along
    e.submit(
        EngineRequest("r", list(range(10, 18)), 80, 2, remote_prefilled=True, pull_s=0.05), 0.0
    )
    e.submit(EngineRequest("b", list(range(100, 200)), 1000, 1), 0.001)
    e.submit(EngineRequest("c", list(range(200, 300)), 1000, 1), 0.001)
    outs = _run(e)
    first = {o.request_id: o.time for o in outs if isinstance(o, FirstToken)}
    # the step of b's last chunk has budget left for it
    assert first["b"] <= first["r"] < first["c"]


def test_a_decode_legs_pull_starts_only_at_the_head_of_the_queue_with_a_slot_free() -> None:
    """vLLM 0.34 (no --max-num-inflight-kv-loads) starts a pull only from the waiting scan,
    which stops when no running slot is free: with a's decode in the one slot r's pull
    waits for it, then runs."""
    e = _pd_engine(kv_blocks=100, max_running=1)
    e.submit(EngineRequest("a", [1], 10, 50), 0.0)
    e.submit(EngineRequest("r", list(range(10, 18)), 80, 2, remote_prefilled=True, pull_s=0.2), 0.0)
    outs = _run(e)
    fin_a = next(o.time for o in outs if isinstance(o, Finished) and o.request_id == "a")
    first_r = next(o.time for o in outs if isinstance(o, FirstToken) and o.request_id == "r")
    assert first_r >= fin_a + 0.2


def test_a_decode_leg_cancelled_while_pulling_frees_its_blocks() -> None:
    e = _pd_engine(kv_blocks=100)
    e.submit(EngineRequest("r", list(range(1, 9)), 85, 3, remote_prefilled=True, pull_s=1.0), 0.0)
    e.advance(0.5)
    assert e.kv_usage() > 0 and e.report(0.5).waiting == 1
    e.cancel("r", 0.5)
    assert e.kv_usage() == 0 and e.report(0.5).waiting == 0 and e.next_time() is None
    assert e.advance(2.0) == [] and e.cached_blocks() == 0  # nothing arrived, nothing named


def test_roles_by_rack() -> None:
    keys = [ReplicaKey(f"reg0-rack{i // 4}-r{i}") for i in range(8)]
    sites = sites_of(keys)
    assert sites[keys[0]].rack == "reg0-rack0" and sites[keys[7]].rack == "reg0-rack1"
    roles = roles_of(keys, sites, "always", 0.25)
    assert [roles[k] for k in keys[:4]] == [Role.PREFILL] + [Role.DECODE] * 3
    assert roles_of(keys, sites, "auto", 0.5)[keys[5]] is Role.PREFILL
    assert roles_of(keys, sites, "auto", 0.5)[keys[6]] is Role.BOTH
    assert set(roles_of(keys, sites, "off", 0.5).values()) == {Role.BOTH}


def test_runs_by_mode() -> None:
    spec = AgenticSpec(sessions=12, session_rate=2.0, system_tokens=20000, tool_tokens=6000)
    workload = generate(spec, block_size=64)
    out = {}
    for mode in ("off", "always", "auto"):
        config = ClusterConfig(load_profile("kimi-k3"), replicas=8, racks=2, pd=mode)
        out[mode] = Simulation(workload, config, "ours", speedup=4).run().summary
    for s in out.values():
        assert s["completed"] == s["requests"] == len(workload)
    assert out["off"]["pd_share"] == 0 and out["off"]["transfer_gb"] == 0
    assert out["always"]["pd_share"] == 1.0 and out["always"]["transfer_gb"] > 0
    assert out["always"]["cross_rack_transfer_share"] <= 0.1  # pairs stay in their rack
    assert 0 <= out["auto"]["pd_share"] <= 1
    print(
        {m: (s["goodput"], s["pd_share"], s["cross_rack_transfer_share"]) for m, s in out.items()}
    )


def test_transfer_ms_mean_is_over_the_transfers_a_fallback_moved_nothing() -> None:
    """A prefill leg the engine rejects falls back to a local prefill and moves no bytes:
    ``transfer_ms_mean`` is the mean over the transfers made, which the fallback halved
    (it divided by every disaggregated request)."""
    from sim.workload import SimRequest, Workload

    small = SimRequest("a", 0.0, 640, 4, tuple(range(1, 11)))
    huge = SimRequest("b", 1.0, 64 * 200, 4, tuple(range(100, 300)))  # > the 100-block cache
    config = ClusterConfig(
        load_profile("dense-70b"), replicas=4, kv_blocks=100, pd="always", prefill_share=0.5
    )
    alone = Simulation(Workload("t", [small], 64, "sim-model"), config, "ours").run().summary
    both = Simulation(Workload("t", [small, huge], 64, "sim-model"), config, "ours").run()
    s = both.summary
    assert s["pd_fallbacks"] == 1 and s["rejected"] == 1 and s["transfer_gb"] > 0
    assert alone["transfer_ms_mean"] > 0
    assert s["transfer_ms_mean"] == alone["transfer_ms_mean"]


TRACE = "agentic:sessions=6,system_tokens=20000,tool_tokens=6000,max_turns=4"
FLEET = ["--profile", "kimi-k3", "--replicas", "4", "--racks", "2"]


def test_cli_pd_flags_json_and_tune(tmp_path: Path) -> None:
    p = kvrouter("sim", "replay", TRACE, *FLEET, "--pd", "always", "--json", "--no-progress")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["pd_share"] == 1.0 and doc["settings"]["pd"] == "always"
    assert {"goodput", "token_hit_rate", "ttft_ms_p90", "cross_rack_transfer_share"} <= set(doc)
    bad = kvrouter("sim", "replay", TRACE, *FLEET, "--pd", "auto", "--pd-params", '{"x": 1}')
    assert bad.returncode == 2 and "x" in bad.stderr
    out = tmp_path / "tuned.toml"
    p = kvrouter(
        "sim", "tune", TRACE, *FLEET, "--pd", "auto", "--budget", "2", "--speedups", "4",
        "--jobs", "1", "--out", str(out),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout)
    assert set(result["pd"]) == {"prefill_share", "pd_params"}
    assert "prefill/decode (auto)" in out.read_text()
    assert load_tuned(out).policy == "ours"


def test_a_disaggregated_model_ignores_admission_as_the_service_does() -> None:
    """A model with P/D on routes without admission in the service (docs/admission.md): its
    requests carry no class decode weight and no engine priority (handling.py routes them
    through RouterState.route, weight 1, no priority patch); the simulator did both for the
    locally prefilled ones under ``--admission slo``."""
    from router.core.admission import AdmissionSettings

    spec = AgenticSpec(sessions=6, session_rate=2.0, system_tokens=20000, tool_tokens=6000)
    workload = generate(spec, block_size=64)
    config = ClusterConfig(
        load_profile("kimi-k3"),
        replicas=8,
        racks=2,
        pd="auto",
        admission=AdmissionSettings(engine_priority=True),
        priority_share=1.0,
    )
    sim = Simulation(workload, config, "ours", speedup=4)
    weights: list[float] = []
    priorities: list[int] = []
    for router in sim.routers:
        engine = router.engine
        original = engine.dispatched

        def spy(*args: object, _original: object = original, **kw: object) -> object:
            weights.append(float(kw.get("class_weight", 1.0)))  # type: ignore[arg-type]
            return _original(*args, **kw)  # type: ignore[operator]

        engine.dispatched = spy  # type: ignore[method-assign]
    for e in sim.engines:
        submit = e.submit

        def spy_submit(req: EngineRequest, now: float, _submit: object = submit) -> None:
            priorities.append(req.priority)
            _submit(req, now)  # type: ignore[operator]

        e.submit = spy_submit  # type: ignore[method-assign]
    summary = sim.run().summary
    assert summary["completed"] == len(workload)
    assert weights and set(weights) == {1.0}
    assert priorities and set(priorities) == {0}


def test_the_service_s_keep_local_rule_is_the_one_the_simulator_applies() -> None:
    """One rule (router.core.disagg.keep_local_reason) names why a request stays local, from
    what a recorded row carries: its endpoint, ``n``, its prompts; the service reads those
    from the body and applies the same rule."""
    from router.core.disagg import keep_local_reason
    from router.service.disagg import keep_local

    assert keep_local_reason("messages") == "messages_api"
    assert keep_local_reason("responses", samples=2) == "responses_api"
    assert keep_local_reason("chat", samples=2) == "parallel_sampling"
    assert keep_local_reason("completions", prompts=3) == "batch_prompts"
    assert keep_local_reason("completions", prompt_logprobs=True) == "prompt_logprobs"
    assert keep_local_reason("chat") == keep_local_reason("completions") == ""
    assert keep_local({"prompt": ["a", "b"]}, "completion") == "batch_prompts"
    assert keep_local({"prompt": [1, 2]}, "completion") == ""
    assert keep_local({"messages": [], "n": 2}, "chat") == "parallel_sampling"


def test_a_lone_decoder_outgrowing_a_pulling_legs_memory_is_preempted() -> None:
    """A decode leg's pull holds its blocks outside the batch, beside one decoder. The
    decoder grows until its next block does not fit: vLLM 0.34's ``allocate_slots`` fails
    and ``schedule`` preempts ``running[-1]``, the decoder itself (the leg, not running, is
    not a candidate); it resumes once the leg is done. The engine model never preempted
    the last running sequence and let it write into memory the engine did not have (11
    blocks in use on 10)."""
    e = _pd_engine(kv_blocks=10)
    e.submit(EngineRequest("d", [1, 2], 20, 60), 0.0)  # 8 blocks by its last token
    e.advance(0.05)
    leg = EngineRequest("leg", list(range(100, 104)), 40, 5, remote_prefilled=True, pull_s=5.0)
    e.submit(leg, 0.06)  # 4 blocks, held for 5 s
    outs: list[object] = []
    while (t := e.next_time()) is not None:
        outs += e.advance(t)
        assert _used(e) <= e.capacity
    assert e.preemptions == 1
    fins = {o.request_id: o for o in outs if isinstance(o, Finished)}
    assert fins["d"].output_tokens == 60 and fins["leg"].output_tokens == 5
    assert fins["leg"].time < fins["d"].time  # d waited for the leg's blocks


def test_a_decode_leg_joins_the_running_order_when_its_kv_arrives() -> None:
    """vLLM 0.34 appends a decode leg to ``running`` when its KV has arrived and it is
    scheduled, not when its pull starts; FCFS preemption takes ``running[-1]``. Here the
    leg r's pull starts first, then b is admitted; r joins the batch after b, so when the
    decoders outgrow the cache r, the last to join, is preempted. The engine model ranked r
    by the start of its pull and preempted b."""
    e = _pd_engine(kv_blocks=11, max_running=4)  # 6 blocks each by the end
    r = EngineRequest("r", [10, 11], 20, 40, remote_prefilled=True, pull_s=0.05)
    e.submit(r, 0.0)
    e.submit(EngineRequest("b", [20, 21], 20, 40), 0.0)
    outs = _run(e)
    assert e.preemptions == 1
    first = {o.request_id: o.time for o in outs if isinstance(o, FirstToken)}
    assert first["b"] < first["r"]  # b ran before r's KV arrived
    resumed = [o.request_id for o in outs if isinstance(o, TokensEmitted) and o.count == 1]
    fins = [o.request_id for o in outs if isinstance(o, Finished)]
    assert "r" in resumed and fins == ["b", "r"]


def _used(e: EngineModel) -> float:
    return e._used()


def test_the_decode_pick_reads_the_load_the_other_routers_shared_by_then() -> None:
    """``--share-load-ms``: the decode replica is picked when the prefill leg ends, with the
    other routers' load as of then (the service's exchange runs on its own clock, not only
    when requests arrive): two routers sharing at every look never send two decode legs
    that end together to one idle decoder while another is free."""
    from sim.workload import SimRequest, Workload

    profile = load_profile("dense-70b")
    reqs = [
        SimRequest(f"r{i}", 0.0, 2048, 64, [1000 * (i + 1) + j for j in range(32)])
        for i in range(2)
    ]
    for seed in range(12):
        cfg = ClusterConfig(
            profile=profile, replicas=4, block_size=64, kv_blocks=4096, routers=2,
            share_load_s=0.0, pd="always", prefill_share=0.25, seed=seed,
        )  # fmt: skip
        sim = Simulation(Workload("two", reqs, 64, "m"), cfg, "ours")
        sim.run()
        a, b = sim._records["r0"], sim._records["r1"]
        assert a.finish == a.finish and b.finish == b.finish
        assert a.replica != b.replica, seed
