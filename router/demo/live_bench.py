"""``kvrouter bench live``: kvrouter against vllm-router, end to end, on the same mock fleet.

For each router under test a fresh fleet of ``kvrouter mock-replica`` processes (the
simulator's engine model on the wall clock, real HTTP, vLLM-format KV events over ZMQ with a
replay socket) is started, the router is put in front of it, and the same trace is replayed
through it over HTTP (router/demo/replay.py: each row at its recorded endpoint, streamed or
not; streaming ``/v1/completions`` with token-id prompts for rows that name neither, as the
generated traces' rows; sessions in ``X-Session-Id``, closed-loop follow-ups). Rows:

* ``kvrouter_ours``: ``kvrouter serve``, policy ``ours``, following the mocks' events directly;
* ``vllm_router_kv_aware``: vllm-router (the binary given by ``--vllm-router``) with
  ``--policy kv_aware`` fed by the same events and replay sockets, in the mocks' engine
  block size (64 tokens: ``FleetSpec.engine_block_size``);
* ``vllm_router_kv_aware_affinity``: the same with ``--kv-aware-session-affinity-ttl-secs``;
* ``vllm_router_cache_aware``: vllm-router's approximate prefix tree.

Prefill/decode disaggregation rows (not run unless named in ``--rows``; docs/pd.md): the
mocks spread over 2 racks, half of each rack ``prefill``, the rest ``decode`` (``both`` for
``auto``), the KV and state pulls timed by link:

* ``kvrouter_pd_always`` / ``kvrouter_pd_auto``: ``kvrouter serve`` with ``[models.NAME.pd]``
  mode ``always`` / ``auto`` (rack-aware decode pick; ``auto`` prefills locally when that
  pays);
* ``vllm_router_pd``: vllm-router ``--vllm-pd-disaggregation`` with the prefill replicas as
  ``--prefill``, the decode ones as ``--decode``, ``kv_aware`` prefill fed by their events
  (``--pd-kv-events``) and ``power_of_two`` decode.

Each row: ``ok``, ``failed``, ``hit`` (engine-reported cached prompt tokens), ``goodput``
(router.core.slo, the default SLO unless flags say otherwise), ``goodput_by_slo_scale``
(goodput with every target scaled by 0.25, 0.5, 1, 2: where the fleet meets the SLO easily,
the stricter scales still tell routers apart), TTFT / E2E p50, p90, p99 and
TPOT p50, p90 in ms (router/demo/figures.py), ``router_cpu_s``, the CPU seconds the router
process used during the replay (/proc), ``transport_ms``, what the HTTP path adds to a
request's TTFT on that fleet (a few one-block probes on the idle fleet before the replay, less
the engine model's own time for them), and ``ttft_mean_ms`` (the client's) beside
``engine_ttft_mean_ms`` (the mocks' own, vLLM's ``vllm:time_to_first_token_seconds`` over
the replay) and ``engine_model_ttft_mean_ms`` (their engine model's for the same requests):
client less engine is the router's and HTTP's share under load, engine less model the
mocks' lag behind their model, and the model's against the simulator's ``ttft_mean_ms -
transport_ms`` what the live schedule did differently from the simulated one.
With ``--repeat N`` each row runs N times (the rows interleaved) and reports the runs'
medians, their totals and spread (``combine_runs``). A row without a vllm-router binary is
its ``error``; so is one whose processes die or never come up (the other rows are still run
and printed, and the bench exits 1); a ``--vllm-router`` that is no executable is a usage
error before anything runs.
``versus`` compares ``kvrouter_ours`` with each other row that ran: ours' goodput, TTFT p50
and p90, E2E p90 and TPOT p90 over the peer's, with a 95 % interval from a paired bootstrap
over the requests both replayed (router/demo/compare.py: an interval that holds 1 means the
runs cannot tell the two apart). ``sim`` is the simulator's prediction for ``ours`` on the
same trace and fleet (and for each policy ``--sim-policies`` adds, e.g. ``vllm_kv_aware``),
with the measured ``transport_ms`` of the matching row (``kvrouter_ours``'s for policies
without one) as its ``transport_s``, and every arrival up to that much later: the medians of
``--sim-runs`` runs, each drawing that jitter from its own seed (a closed loop turns a
millisecond into another schedule, so one run is one sample of the live run's spread;
without a live row there is no jitter and one run); ``sim_samples`` (``--sim-samples N``) the same
prediction over N samples of the workload's shape (router/demo/sim_samples.py), since one
trace of a few hundred requests ranks policies by luck. Workloads:

* ``agentic``: synthetic agent sessions (shared system prompts and tool schemas, contexts
  growing turn by turn, closed loop), 4 replicas;
* ``mooncake``: the bundled Mooncake trace's first requests, open loop, 8 replicas;
* ``agentic-heavy`` / ``mooncake-heavy``: the same past the fleet's decode capacity (twice
  the sessions at a higher rate; the trace at 8x), where the TPOT target is what most
  requests miss and the placement decides how many do;
* ``conversation``: open-loop conversations sharing 4 system prompts on 8 dense-70b mocks
  with small caches (1,536 blocks), which turn over while conversations come back: where
  placing new conversations decides whether the old ones find their context.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from router.bench.measure import json_text
from router.cliargs import at_least, non_negative_float, positive_float
from router.core.slo import SloTargets, SloTier

AGENTIC = (
    "agentic:sessions=60,session_rate=3,system_prompts=4,system_tokens=6000,tool_sets=2,"
    "tool_def_tokens=3000,mean_turns=6,max_turns=12,answer_tokens=100,tool_tokens=1500,"
    "think_s=0.5,tool_latency_s=0.5,max_context=65536,seed=7"
)


@dataclasses.dataclass(slots=True, frozen=True)
class Workload:
    trace: str  # a trace spec build_workload understands, or a JSONL path
    replicas: int
    speedup: float
    requests: int
    max_output: int
    kv_blocks: int = 16384
    profile: str | None = None  # the mocks' engine profile (None: router.demo.fleet.PROFILE)


AGENTIC_HEAVY = AGENTIC.replace("sessions=60,session_rate=3", "sessions=120,session_rate=4")
# open-loop conversations (turns arrive whatever the fleet does; no session ids) sharing 4
# system prompts, on small caches that turn over while conversations come back: the
# simulator's "second trace family" (docs/benchmarks.md) compressed in time 12x (turns 5 s
# apart, caches of 1,536 blocks), on dense-70b mocks
CONVERSATION = (
    "agentic:sessions=150,session_rate=1,system_prompts=4,system_tokens=2000,tool_sets=1,"
    "tool_def_tokens=64,user_tokens=4000,mean_turns=4,max_turns=12,answer_tokens=300,"
    "tool_tokens=1500,open_loop=1,turn_gap_s=5,session_ids=0,max_context=131072,seed=3"
)
WORKLOADS = {
    "agentic": Workload(AGENTIC, replicas=4, speedup=2.0, requests=600, max_output=64),
    "mooncake": Workload("mooncake", replicas=8, speedup=4.0, requests=500, max_output=64),
    # past the fleet's decode capacity: what routing does to goodput decides (docs/benchmarks.md)
    "agentic-heavy": Workload(AGENTIC_HEAVY, replicas=4, speedup=2.0, requests=900, max_output=64),
    "mooncake-heavy": Workload("mooncake", replicas=8, speedup=8.0, requests=1000, max_output=64),
    "conversation": Workload(
        CONVERSATION,
        replicas=8,
        speedup=1.0,
        requests=700,
        max_output=64,
        kv_blocks=1536,
        profile="dense-70b",
    ),
}
ROWS = (
    "kvrouter_ours",
    "vllm_router_kv_aware",
    "vllm_router_kv_aware_affinity",
    "vllm_router_cache_aware",
)
# the live row whose measured transport the simulator's run of a policy takes
SIM_ROW = {
    "ours": "kvrouter_ours",
    "vllm_kv_aware": "vllm_router_kv_aware",
    "vllm_cache_aware": "vllm_router_cache_aware",
}
PD_ROWS = ("kvrouter_pd_always", "kvrouter_pd_auto", "vllm_router_pd")
MODEL = "demo-model"


def _vllm_router_pd_cmd(
    binary: str, port: int, metrics_port: int, replicas: list[dict[str, str]], block_size: int
) -> list[str]:
    cmd = [
        binary, "--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-port", str(metrics_port), "--log-level", "warning",
        "--prefill-policy", "kv_aware", "--decode-policy", "power_of_two",
        "--kv-event-block-size", str(block_size), "--kv-event-model", MODEL,
    ]  # fmt: skip
    for r in replicas:
        if r.get("role") == "prefill":
            cmd += ["--prefill", r["url"], "--pd-kv-events", f"{r['url']}={r['zmq']}"]
        else:
            cmd += ["--decode", r["url"]]
    return cmd


def _vllm_router_cmd(
    binary: str,
    row: str,
    port: int,
    replicas: list[dict[str, str]],
    affinity_ttl_s: int,
    block_size: int,
) -> list[str]:
    policy = "cache_aware" if row == "vllm_router_cache_aware" else "kv_aware"
    cmd = [
        binary, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
        "--log-level", "warning", "--worker-urls", *[r["url"] for r in replicas],
    ]  # fmt: skip
    if policy == "kv_aware":
        for r in replicas:
            cmd += ["--kv-event-source", f"{r['url']}={r['zmq']}"]
            cmd += ["--kv-event-replay-source", f"{r['url']}={r['zmq_replay']}"]
        cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", MODEL]
    if row == "vllm_router_kv_aware_affinity":
        cmd += ["--kv-aware-session-affinity-ttl-secs", str(affinity_ttl_s)]
    return cmd


def _trace_file(workload: Workload, directory: Path) -> Path:
    """The workload as Mooncake rows (session / delay rows for agentic), for the replay."""
    if not workload.trace.startswith("agentic"):
        from sim.workload import BUNDLED

        return BUNDLED.get(workload.trace, Path(workload.trace))
    from sim.agentic import AgenticSpec, generate, to_trace_rows

    path = directory / "agentic.jsonl"
    generated = generate(AgenticSpec.parse(workload.trace), block_size=64)
    with path.open("w") as fh:
        for row in to_trace_rows(generated):
            fh.write(json.dumps(row) + "\n")
    return path


def _simulate(
    workload: Workload,
    trace: Path,
    slo: SloTargets,
    params: dict[str, Any] | None = None,
    policy: str = "ours",
    speculative_ttl_s: float | None = None,
    transport_s: float = 0.0,
    seed: int = 0,
) -> dict[str, Any]:
    """The simulator's figures for ``policy`` on ``trace``; arrivals jitter by up to
    ``transport_s`` (``ClusterConfig.arrival_jitter_s``), drawn from ``seed``."""
    from router.demo.fleet import PROFILE
    from sim.cluster_config import ClusterConfig
    from sim.profiles import load_profile
    from sim.runner import RunSpec, run_one
    from sim.workload import load_trace

    loaded = load_trace(str(trace), block_size=64, limit=workload.requests, model=MODEL)
    loaded.requests = [
        dataclasses.replace(r, output_tokens=max(1, min(r.output_tokens, workload.max_output)))
        for r in loaded.requests
    ]
    config = ClusterConfig(
        profile=load_profile(workload.profile or PROFILE),
        replicas=workload.replicas,
        block_size=64,
        kv_blocks=workload.kv_blocks,
        slo=slo,
        speculative_ttl_s=speculative_ttl_s,
        transport_s=transport_s,
        arrival_jitter_s=transport_s,
        seed=seed,
    )
    spec = RunSpec(policy, params=params or None, speedup=workload.speedup)
    s = run_one(loaded, config, spec).summary
    return {
        "hit": s["token_hit_rate"],
        "goodput": s["goodput"],
        "goodput_by_slo_scale": s["goodput_by_slo_scale"],
        "ttft_mean_ms": s["ttft_ms_mean"],
        "ttft_p50_ms": s["ttft_ms_p50"],
        "ttft_p90_ms": s["ttft_ms_p90"],
        "e2e_p50_ms": s["e2e_ms_p50"],
        "e2e_p90_ms": s["e2e_ms_p90"],
        "tpot_p50_ms": s["tpot_ms_p50"],
        "tpot_p90_ms": s["tpot_ms_p90"],
        "transport_ms": round(transport_s * 1000, 2),
    }


def _idle_ttft_s(profile: str, prompt_tokens: int) -> float:
    """The engine model's TTFT for one request of ``prompt_tokens`` on an idle replica: the
    mocks' own share of a probe's TTFT (``router.demo.replay.probe_ttft``)."""
    from router.core.types import ReplicaKey
    from sim.engine import EngineModel, EngineRequest, FirstToken
    from sim.profiles import load_profile

    model = EngineModel(load_profile(profile), ReplicaKey("probe"), 64, emit_tokens=False)
    model.submit(EngineRequest("probe", (1,) * (prompt_tokens // 64), prompt_tokens, 1), 0.0)
    while (at := model.next_time()) is not None:
        for out in model.advance(at):
            if isinstance(out, FirstToken):
                return out.time
    raise AssertionError("the engine model never produced the probe's first token")


async def _row(
    row: str,
    workload: Workload,
    requests: list[Any],
    binary: str | None,
    slo: SloTargets,
    speculative_ttl_s: float | None = None,
) -> tuple[dict[str, Any], list[Any]]:
    """The row's figures and its requests' outcomes (none when it could not run)."""
    from router.demo.figures import summarize
    from router.demo.fleet import PROFILE, Fleet, FleetSpec
    from router.demo.replay import PROBE_TOKENS, engine_ttft_totals, probe_ttft, replay

    ours = row.startswith("kvrouter_")
    if not ours and binary is None:
        return {
            "error": "no vllm-router binary: pass --vllm-router PATH (pip install vllm-router)"
        }, []
    pd = {"kvrouter_pd_always": "always", "kvrouter_pd_auto": "auto"}.get(row)
    spec = FleetSpec(
        replicas=workload.replicas,
        policy="ours" if ours else None,
        kv_blocks=workload.kv_blocks,
        profile=workload.profile or PROFILE,
        key_prefix=f"kvr-live-{int(time.time() * 1000)}",
        pd="always" if row == "vllm_router_pd" else pd,
        speculative_ttl_s=speculative_ttl_s if ours else None,
    )
    started = time.perf_counter()
    async with Fleet(spec) as fleet:
        if not ours:
            assert binary is not None
            port = fleet.port()
            if row == "vllm_router_pd":
                cmd = _vllm_router_pd_cmd(
                    binary, port, fleet.port(), fleet.replicas, spec.engine_block_size
                )
            else:
                cmd = _vllm_router_cmd(
                    binary, row, port, fleet.replicas, 600, spec.engine_block_size
                )
            await fleet.start_router("vllm-router", cmd, f"http://127.0.0.1:{port}")
        # the HTTP path's share of TTFT on this fleet, for the simulator's prediction
        probes = await probe_ttft(fleet.router_url, MODEL)
        idle = _idle_ttft_s(spec.profile, PROBE_TOKENS)
        name = "router" if ours else "vllm-router"
        urls = [r["url"] for r in fleet.replicas]
        engine0 = await engine_ttft_totals(urls)
        cpu0 = fleet.cpu_seconds(name)
        outcomes = await replay(fleet.router_url, requests, workload.speedup)
        fleet.check_alive()
        cpu1 = fleet.cpu_seconds(name)
        engine1 = await engine_ttft_totals(urls)
    figures = summarize(outcomes, slo)
    if engine0 is not None and engine1 is not None:
        engine = engine1.since(engine0)
        if engine.requests > 0:
            figures["engine_ttft_mean_ms"] = round(engine.seconds / engine.requests * 1e3, 1)
            if engine.model_seconds is not None:
                model_ms = engine.model_seconds / engine.requests * 1e3
                figures["engine_model_ttft_mean_ms"] = round(model_ms, 1)
    errors = sorted({o.error for o in outcomes if not o.ok})[:3]
    if errors:
        figures["errors"] = errors
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    if probes:
        transport = max(statistics.median(probes) - idle, 0.0)
        figures["transport_ms"] = round(transport * 1000, 2)
    if cpu0 is not None and cpu1 is not None:
        figures["router_cpu_s"] = round(cpu1 - cpu0, 2)  # over the replay, not the start
    return figures, outcomes


def _params(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _params_of(given: dict[str, Any] | None, policy: str) -> dict[str, Any] | None:
    """``--sim-params`` for ``policy``: an object keyed by policy names gives each its own
    (``{"vllm_kv_aware": {"session_ttl_s": 600}}``); a flat one is ``ours``'."""
    from router.core.policies import POLICY_NAMES

    if not given:
        return None
    if all(key in POLICY_NAMES for key in given):
        value = given.get(policy)
        return dict(value) if isinstance(value, dict) else None
    return given if policy == "ours" else None


def _slo(args: argparse.Namespace) -> SloTargets:
    base = SloTargets()
    tiers = base.tiers if args.slo_ttft_ms is None else (SloTier(None, args.slo_ttft_ms / 1e3),)
    tpot = base.tpot_s if args.slo_tpot_ms is None else args.slo_tpot_ms / 1e3
    return SloTargets(tiers, tpot)


def run(args: argparse.Namespace) -> int:
    from router.core.policies import POLICY_NAMES
    from router.demo.compare import paired
    from router.demo.figures import combine_runs
    from router.demo.replay import count_requests, load_requests

    workload = WORKLOADS[args.workload]
    if args.requests:
        workload = dataclasses.replace(workload, requests=args.requests)
    if args.speedup:
        workload = dataclasses.replace(workload, speedup=args.speedup)
    if args.replicas:
        workload = dataclasses.replace(workload, replicas=args.replicas)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in (*ROWS, *PD_ROWS)]
    if unknown:
        known = ", ".join((*ROWS, *PD_ROWS))
        raise SystemExit(f"unknown row(s) {', '.join(unknown)}; choose from {known}")
    # checked before any row: found at its own row, it would cost the rows run before it
    peers = any(not r.startswith("kvrouter_") for r in rows)
    if peers and args.vllm_router is not None and shutil.which(args.vllm_router) is None:
        raise SystemExit(f"--vllm-router {args.vllm_router}: not an executable")
    slo = _slo(args)
    sim_policies = [p.strip() for p in args.sim_policies.split(",") if p.strip()]
    if unknown := [p for p in sim_policies if p not in POLICY_NAMES]:
        known = ", ".join(POLICY_NAMES)
        raise SystemExit(f"unknown --sim-policies {', '.join(unknown)}; choose from {known}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvrouter-live-") as tmp:
        trace = _trace_file(workload, Path(tmp))
        # bodies only for live rows: a simulator-only run (``--rows ""``) sends nothing
        requests = (
            load_requests(trace, workload.requests, MODEL, workload.max_output) if rows else []
        )
        result: dict[str, Any] = {
            "bench": "live",
            "workload": args.workload,
            "trace": workload.trace,
            "requests": len(requests) if rows else count_requests(trace, workload.requests),
            "replicas": workload.replicas,
            "speedup": workload.speedup,
            "max_output": workload.max_output,
            "slo": {"ttft_s": {t.label: t.ttft_s for t in slo.tiers}, "tpot_s": slo.tpot_s},
            "rows": {},
        }
        broken = False
        runs: dict[str, list[dict[str, Any]]] = {row: [] for row in rows}
        outcomes: dict[str, list[list[Any]]] = {row: [] for row in rows}
        for k in range(args.repeat):  # rows interleaved: a drifting machine hits them all
            for row in rows:
                if runs[row] and "error" in runs[row][0]:
                    continue
                print(f"bench live: {row} (run {k + 1} of {args.repeat}) ...", file=sys.stderr)
                ttl = args.speculative_ttl_s
                try:
                    figures, answered = asyncio.run(
                        _row(row, workload, requests, args.vllm_router, slo, ttl)
                    )
                except (RuntimeError, OSError, TimeoutError) as exc:
                    # a process died or never came up: this run is the row's error, the
                    # rows measured before and after it are kept
                    print(f"bench live: {row}: {exc}", file=sys.stderr)
                    figures, answered = {"error": f"{type(exc).__name__}: {exc}"[:500]}, []
                    broken = True
                runs[row].append(figures)
                outcomes[row].append(answered)
        rows_out = {row: combine_runs(r) for row, r in runs.items()}
        result["rows"] = rows_out
        if outcomes.get("kvrouter_ours"):
            result["versus"] = {
                row: versus
                for row, theirs in outcomes.items()
                if row != "kvrouter_ours"
                and (versus := paired(outcomes["kvrouter_ours"], theirs, slo))
            }

        def transport_s(policy: str) -> float:
            row = rows_out.get(SIM_ROW.get(policy, ""), {})
            ms = row.get("transport_ms", rows_out.get("kvrouter_ours", {}).get("transport_ms"))
            return (ms or 0.0) / 1000

        def predict(policy: str, sample: Workload, path: Path, runs: int = 1) -> dict[str, Any]:
            params = _params_of(args.sim_params, policy)
            ttl = args.speculative_ttl_s
            transport = transport_s(policy)
            if transport <= 0:  # no jitter: every seed gives the same run
                runs = 1
            return combine_runs(
                [
                    _simulate(sample, path, slo, params, policy, ttl, transport, seed)
                    for seed in range(runs)
                ]
            )

        def key(policy: str) -> str:
            return "kvrouter_ours" if policy == "ours" else policy

        result["sim"] = {key(p): predict(p, workload, trace, args.sim_runs) for p in sim_policies}
        if args.sim_samples:
            from router.demo import sim_samples

            drawn = sim_samples.samples(workload, trace, args.sim_samples, Path(tmp), _trace_file)
            # one run a sample, the first (the workload's own trace) included: ``sim`` above
            # is the median of ``--sim-runs``, which would weigh that sample differently
            per_policy = {key(p): [predict(p, w, at) for _, w, at in drawn] for p in sim_policies}
            result["sim_samples"] = sim_samples.summarize(per_policy, [n for n, _, _ in drawn])
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json_text(result, indent=None if args.json else 2)
    sys.stdout.write(text + "\n")
    return 1 if broken else 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "live", help="kvrouter vs vllm-router end to end on mock fleets (goodput, TTFT, TPOT)"
    )
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="agentic")
    p.add_argument("--vllm-router", help="the vllm-router binary (pip install vllm-router)")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run")
    p.add_argument("--requests", type=at_least(1), help="replay at most N requests of the workload")
    p.add_argument("--speedup", type=positive_float, help="arrival speed-up (workload default)")
    p.add_argument("--replicas", type=at_least(1), help="mock replicas (workload default)")
    p.add_argument(
        "--slo-ttft-ms", type=positive_float, help="one TTFT target (default: the tiers)"
    )
    p.add_argument("--slo-tpot-ms", type=positive_float, help="the TPOT target (default 100 ms)")
    p.add_argument(
        "--sim-policies",
        default="ours",
        help="policies the simulator predicts on the same fleet (`sim` in the JSON: "
        "kvrouter_ours, then each other policy by name), e.g. ours,vllm_kv_aware",
    )
    p.add_argument(
        "--sim-params",
        type=_params,
        help="JSON object of `ours` parameters for the simulator's prediction only, or of "
        "objects keyed by policy name (with --rows '' nothing runs live: a quick what-if "
        "on the bench's fleet)",
    )
    p.add_argument(
        "--sim-runs",
        type=at_least(1),
        default=5,
        help="simulator runs behind `sim`, arrivals jittered by the measured transport, each "
        "from its own seed; `sim` gives their medians (default 5)",
    )
    p.add_argument(
        "--sim-samples",
        type=at_least(0),
        default=0,
        help="also predict each --sim-policies policy on N samples of the workload (its next "
        "seeds or trace windows; `sim_samples` in the JSON: means, ours over each per sample)",
    )
    p.add_argument(
        "--repeat", type=at_least(1), default=1, help="runs of each row; figures are their medians"
    )
    p.add_argument(
        "--speculative-ttl-s",
        type=non_negative_float,
        help="kvrouter's speculative_ttl_s for the model, live and in the simulator "
        "(default: the router's, 30 s; 0: events only)",
    )
    p.add_argument("--json", action="store_true", help="one line of JSON (default: indented)")
    p.set_defaults(handler=run)
