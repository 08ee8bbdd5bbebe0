"""``kvrouter sim ...``: replay traces through the policies, tune ``ours``, list profiles.

    kvrouter sim replay TRACE [--policy NAME|all|a,b] [--speedup S] [--json] [--report DIR]
    kvrouter sim tune TRACE --out tuned.toml
    kvrouter sim profiles

TRACE is a JSONL path (Mooncake, recorded or Bailian rows), ``mooncake`` (the bundled trace)
or ``agentic[:key=value,...]`` (the synthetic agentic-session generator).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from router.bench.measure import median_row
from router.core.errors import KVRouterError
from router.core.routing import DEFAULT_SPECULATIVE_TTL_S
from router.core.turnover import REUSE_WINDOW_S

MAX_RUNS = 100
# the figures whose [min, max] over --runs a summary gives (``spread``)
RUN_SPREAD = (
    "token_hit_rate", "goodput", "ttft_ms_p50", "ttft_ms_p90", "e2e_ms_p90", "tpot_ms_p90",
)  # fmt: skip


class ProgressBar:
    """A one-line progress bar on stderr, shown only on a terminal and only once the work
    has taken longer than ``delay_s`` (short runs stay quiet)."""

    def __init__(self, label: str, enabled: bool, delay_s: float = 1.0) -> None:
        self.label = label
        self.enabled = enabled and sys.stderr.isatty()
        self.delay_s = delay_s
        self.start = time.perf_counter()
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or time.perf_counter() - self.start < self.delay_s:
            return
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac:5.1%} ({done}/{total})")
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _add_fleet_args(p: argparse.ArgumentParser, traces: bool = False) -> None:
    if traces:
        p.add_argument(
            "trace",
            nargs="+",
            help="one or more traces: JSONL paths, bundled 'mooncake' or "
            "'mooncake-conversation', 'agentic[:k=v,...]'",
        )
    else:
        p.add_argument(
            "trace",
            help="JSONL path, bundled 'mooncake' or 'mooncake-conversation', or "
            "'agentic[:k=v,...]'",
        )
    p.add_argument("--format", default="auto", choices=("auto", "mooncake", "recorded", "bailian"))
    p.add_argument("--trace-block", type=int, help="tokens per trace hash id (512 / 16)")
    p.add_argument("--limit", type=int, help="use only the first N requests")
    p.add_argument("--model", default="sim-model", help="model name (hash namespace)")
    p.add_argument("--profile", default="dense-70b", help="replica profile name or TOML path")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--block-size", type=int, default=64, help="router/engine block size")
    p.add_argument("--kv-blocks", type=int, help="GPU KV blocks per replica (profile default)")
    p.add_argument("--cpu-blocks", type=int, help="host-tier blocks per replica")
    p.add_argument("--routers", type=int, default=1, help="router instances")
    p.add_argument("--regions", type=int, default=1)
    p.add_argument("--racks", type=int, default=1, help="racks per region")
    p.add_argument("--event-lag-ms", type=float, default=0.0, help="index event propagation lag")
    p.add_argument(
        "--transport-ms",
        type=float,
        default=0.0,
        help="what the HTTP path (client, router, engine and back) adds to each request's "
        "TTFT and E2E (kvrouter bench live measures it on its fleet)",
    )
    p.add_argument(
        "--arrival-jitter-ms",
        type=float,
        default=0.0,
        help="each arrival reaches the router up to this much later, uniformly, drawn from "
        "--seed: a live client's scheduling noise (a closed loop turns it into another run)",
    )
    p.add_argument(
        "--report-interval-ms",
        type=float,
        default=1000.0,
        help="engine load reports reach the routers this often (production: 1 s)",
    )
    p.add_argument(
        "--speculative-ttl-ms",
        type=float,
        default=DEFAULT_SPECULATIVE_TTL_S * 1000,
        help="a dispatched prompt counts as cached on its replica until the engine's events "
        "report it, at most this long (0: events only; requests of a session: never, with "
        "a policy that reads session hints)",
    )
    p.add_argument(
        "--reuse-window-s",
        type=float,
        default=REUSE_WINDOW_S,
        help="the time scale of a cached block's next use, by which ours prices eviction "
        "(the model setting reuse_window_s)",
    )
    p.add_argument(
        "--share-load-ms",
        type=float,
        help="routers exchange their in-flight load this often (default: they do not)",
    )
    p.add_argument(
        "--slo-tiers",
        help="TTFT targets by prompt length, e.g. '8192:2,32768:5,131072:15,*:60' "
        "(prompt tokens : seconds; the default)",
    )
    p.add_argument("--slo-ttft-ms", type=float, help="one TTFT target for every prompt")
    p.add_argument("--slo-tpot-ms", type=float, help="the TPOT target (default 100 ms)")
    p.add_argument(
        "--admission",
        choices=("off", "slo"),
        default="off",
        help="SLO-aware admission at the router (router/core/admission.py)",
    )
    p.add_argument(
        "--admission-params",
        help="JSON admission knobs, e.g. '{\"headroom\": [1, 0.5, 0.3]}' (implies slo)",
    )
    p.add_argument("--priority-share", type=float, default=0.0, help="share of priority traffic")
    p.add_argument("--flex-share", type=float, default=0.0, help="share of flex traffic")
    p.add_argument("--tenants", type=int, default=1, help="tenants (API keys) sessions spread over")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--pd",
        choices=("off", "always", "auto"),
        default="off",
        help="prefill/decode disaggregation (docs/pd.md)",
    )
    p.add_argument(
        "--prefill-share",
        type=float,
        default=0.25,
        help="share of each rack's replicas with the prefill role (--pd always|auto)",
    )
    p.add_argument("--pd-params", help="JSON PdKnobs overrides (router/core/disagg.py)")
    p.add_argument("--jobs", type=int, help="parallel worker processes (default: up to 4)")


def _config(args: argparse.Namespace, record_load: bool = False) -> Any:
    from sim.cluster_config import ClusterConfig
    from sim.profiles import load_profile

    if args.replicas <= 0 or args.block_size <= 0 or args.routers <= 0:
        raise KVRouterError("--replicas, --block-size and --routers must be positive")
    if args.kv_blocks is not None and args.kv_blocks <= 0:
        raise KVRouterError("--kv-blocks must be positive")
    for flag in ("regions", "racks"):
        if getattr(args, flag) < 1:
            raise KVRouterError(f"--{flag} must be at least 1")
    if args.cpu_blocks is not None and args.cpu_blocks < 0:
        raise KVRouterError("--cpu-blocks must not be negative")
    if args.jobs is not None and args.jobs < 1:
        raise KVRouterError(f"--jobs must be >= 1, got {args.jobs}")
    for flag in (
        "event_lag_ms", "transport_ms", "arrival_jitter_ms", "speculative_ttl_ms",
        "report_interval_ms", "share_load_ms",
    ):  # fmt: skip
        value = getattr(args, flag)
        if value is not None and not 0 <= value < math.inf:
            raise KVRouterError(f"--{flag.replace('_', '-')} must be >= 0 and finite, got {value}")
    if not 0 < args.reuse_window_s < math.inf:
        raise KVRouterError("--reuse-window-s must be positive and finite")
    if not 0.0 <= args.prefill_share < 1.0:
        raise KVRouterError("--prefill-share must be in [0, 1)")
    pd_params = None
    if args.pd_params:
        pd_params = _json_object(args.pd_params, "--pd-params")
        from router.core.disagg import PdKnobs

        # set by other flags (the service: by the model's SLO and its pd table's mode)
        for key, flag in (("mode", "--pd"), ("tpot_target_s", "--slo-tpot-ms")):
            if key in pd_params:
                raise KVRouterError(f"--pd-params: {key!r} is set by {flag}")
        try:
            PdKnobs(**pd_params)
        except TypeError as exc:
            raise KVRouterError(f"--pd-params: {exc}") from None
    return ClusterConfig(
        profile=load_profile(args.profile),
        slo=_slo(args),
        replicas=args.replicas,
        block_size=args.block_size,
        kv_blocks=args.kv_blocks,
        cpu_blocks=args.cpu_blocks,
        routers=args.routers,
        regions=args.regions,
        racks=args.racks,
        event_lag_s=args.event_lag_ms / 1000,
        transport_s=args.transport_ms / 1000,
        arrival_jitter_s=args.arrival_jitter_ms / 1000,
        report_interval_s=args.report_interval_ms / 1000,
        speculative_ttl_s=args.speculative_ttl_ms / 1000,
        reuse_window_s=args.reuse_window_s,
        share_load_s=args.share_load_ms / 1000 if args.share_load_ms is not None else None,
        seed=args.seed,
        record_load=record_load,
        pd=args.pd,
        prefill_share=args.prefill_share,
        pd_params=pd_params,
        admission=_admission(args),
        priority_share=args.priority_share,
        flex_share=args.flex_share,
        tenants=args.tenants,
    )


def _json_object(text: str, flag: str) -> dict[str, Any]:
    """A flag's JSON object, or a clear error naming the flag."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KVRouterError(f"{flag} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise KVRouterError(f"{flag} must be a JSON object")
    return value


def _admission(args: argparse.Namespace) -> Any:
    """The run's admission settings (None: off); checks the class shares and tenants."""
    from router.core.admission import AdmissionSettings

    p, f = args.priority_share, args.flex_share
    if not (0 <= p <= 1 and 0 <= f <= 1 and p + f <= 1):
        raise KVRouterError("--priority-share and --flex-share must be in [0, 1], sum <= 1")
    if args.tenants < 1:
        raise KVRouterError("--tenants must be at least 1")
    if args.admission_params:
        knobs = _json_object(args.admission_params, "--admission-params")
        try:
            return AdmissionSettings(**{k: _tuple(v) for k, v in knobs.items()})
        except TypeError as exc:
            raise KVRouterError(f"--admission-params: {exc}") from None
    return AdmissionSettings() if args.admission == "slo" else None


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _slo(args: argparse.Namespace) -> Any:
    """The run's SLO: the default tiers, or ``--slo-tiers``, a flat ``--slo-ttft-ms`` over
    either, and ``--slo-tpot-ms``."""
    from router.core.slo import DEFAULT_TPOT_S, SloTargets, SloTier, parse_tiers

    for flag in ("slo_ttft_ms", "slo_tpot_ms"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise KVRouterError(f"--{flag.replace('_', '-')} must be positive")
    tiers = parse_tiers(args.slo_tiers) if args.slo_tiers else SloTargets().tiers
    if args.slo_ttft_ms is not None:
        tiers = (SloTier(None, args.slo_ttft_ms / 1000),)
    tpot = args.slo_tpot_ms / 1000 if args.slo_tpot_ms is not None else DEFAULT_TPOT_S
    return SloTargets(tiers, tpot)


def _workload(args: argparse.Namespace, trace: str | None = None) -> Any:
    from sim.runner import build_workload

    if args.trace_block is not None and args.trace_block < 1:
        raise KVRouterError("--trace-block must be at least 1")

    return build_workload(
        trace or args.trace,
        block_size=args.block_size,
        fmt=args.format,
        trace_block=args.trace_block,
        limit=args.limit,
        model=args.model,
    )


def _settings(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    return {
        "profile": config.profile.name,
        "replicas": config.replicas,
        "block_size": config.block_size,
        "kv_blocks": config.kv_blocks or config.profile.scaled(config.block_size).kv_blocks,
        "cpu_blocks": config.cpu_blocks,
        "routers": config.routers,
        "regions": config.regions,
        "event_lag_ms": args.event_lag_ms,
        "transport_ms": args.transport_ms,
        "arrival_jitter_ms": args.arrival_jitter_ms,
        "report_interval_ms": args.report_interval_ms,
        "speculative_ttl_ms": args.speculative_ttl_ms,
        "share_load_ms": args.share_load_ms,
        "reuse_window_s": config.reuse_window_s,
        "hybrid": config.profile.hybrid,
        "slo": {
            "ttft_s": {t.label: t.ttft_s for t in config.slo.tiers},
            "tpot_s": config.slo.tpot_s,
        },
        "seed": config.seed,
        "racks": config.racks,
        "pd": config.pd,
        "prefill_share": config.prefill_share,
        "pd_params": dict(config.pd_params) if config.pd_params else None,
        "admission": asdict(config.admission) if config.admission is not None else None,
        "priority_share": config.priority_share,
        "flex_share": config.flex_share,
        "tenants": config.tenants,
    }


def _replay(args: argparse.Namespace) -> int:
    from sim.runner import RunSpec, default_jobs, parse_policies, run_many, run_one
    from sim.tuned import load_tuned

    t0 = time.perf_counter()
    try:
        names = parse_policies(args.policy)
    except ValueError as exc:
        raise KVRouterError(str(exc)) from None
    params: dict[str, dict[str, Any]] = {}
    if args.params:
        if len(names) != 1:
            raise KVRouterError("--params needs exactly one --policy")
        params[names[0]] = _json_object(args.params, "--params")
    if args.config:
        tuned = load_tuned(args.config, args.tuned_model)
        params[tuned.policy] = tuned.params
        if tuned.policy not in names:
            names.append(tuned.policy)
    if not 0 < args.speedup < math.inf:
        raise KVRouterError("--speedup must be positive and finite")
    if not 1 <= args.runs <= MAX_RUNS:
        raise KVRouterError(f"--runs must be in [1, {MAX_RUNS}], got {args.runs}")
    if args.runs > 1 and args.report:
        raise KVRouterError("--report plots one run per policy: drop --runs or --report")
    if args.report:  # before the runs, not after them
        from sim.report import require_plotting

        require_plotting()
    config = _config(args, record_load=bool(args.report))
    workload = _workload(args)
    if not len(workload):
        raise KVRouterError("the trace has no requests")
    load_s = time.perf_counter() - t0
    seeds = [config.seed + i for i in range(args.runs)]
    specs = [
        RunSpec(n, params.get(n), args.speedup, cluster={"seed": seed} if args.runs > 1 else None)
        for n in names
        for seed in seeds
    ]
    jobs = args.jobs or default_jobs()
    bar = ProgressBar("sim", enabled=not args.no_progress)
    if len(specs) == 1:
        runs = [run_one(workload, config, specs[0], progress=bar)]
    else:
        runs = run_many(workload, config, specs, jobs=jobs, on_done=bar)
    bar.close()
    sim_wall = time.perf_counter() - t0
    from sim.runner import workload_ceilings

    t2 = time.perf_counter()
    ceil = workload_ceilings(workload, config, runs[0].arrival_ids)
    ceiling_s = time.perf_counter() - t2
    ceilings = {"ceiling_infinite": ceil.infinite, "ceiling_global_lru": ceil.global_lru}
    summaries = [  # one run: its own summary, which --report's plots read too
        median_row([r.summary for r in runs[i : i + args.runs]], spread=RUN_SPREAD)
        if args.runs > 1
        else runs[i].summary
        for i in range(0, len(runs), args.runs)
    ]
    for s in summaries:
        s.update(ceilings)
        s["of_lru_ceiling"] = (
            round(s["token_hit_rate"] / ceil.global_lru, 4) if ceil.global_lru else None
        )
    settings = {**_settings(args, config), "runs": args.runs, "seeds": seeds}
    common = {
        "trace": args.trace,
        "requests": len(workload),
        "speedup": args.speedup,
        **ceilings,
        "load_s": round(load_s, 3),
        "ceiling_s": round(ceiling_s, 3),
        "settings": settings,
    }
    if len(summaries) == 1:
        document: dict[str, Any] = {**summaries[0], **common, "wall_s": round(sim_wall, 3)}
    else:
        document = {"runs": summaries, **common, "wall_s": round(sim_wall, 3)}
    text = _table_for(summaries, ceilings)
    if args.runs > 1:
        ranges = ", ".join(
            f"{s['policy']} {s['spread']['goodput'][0]:.1%}-{s['spread']['goodput'][1]:.1%}"
            for s in summaries
        )
        text += (
            f"\nmedians of {args.runs} runs per policy (seeds {seeds[0]}-{seeds[-1]}); "
            f"goodput range: {ranges}"
        )
    if args.report:
        _write_report(args, workload, config, runs, specs, document, text, jobs)
    if args.json:
        sys.stdout.write(json.dumps(document) + "\n")
    else:
        sys.stdout.write(text + "\n")
        sys.stdout.write(
            f"{len(workload)} requests, speed-up {args.speedup}x, wall {sim_wall:.2f} s "
            f"(trace load + hashing {load_s:.2f} s; ceilings {ceiling_s:.2f} s more)\n"
        )
    return 0


def _table_for(summaries: list[dict[str, Any]], ceilings: dict[str, float]) -> str:
    from sim.report import table

    return table(summaries, ceilings)


def _write_report(
    args: argparse.Namespace,
    workload: Any,
    config: Any,
    runs: list[Any],
    specs: list[Any],
    document: dict[str, Any],
    text: str,
    jobs: int,
) -> None:
    from sim.report import write_report
    from sim.runner import RunSpec, run_many

    sweep_specs = []
    speedups = [float(s) for s in args.sweep.split(",") if s]
    for spec in specs:
        for s in speedups:
            sweep_specs.append(RunSpec(spec.policy, spec.params, s))
    bar = ProgressBar("sweep", enabled=not args.no_progress)
    sweep = run_many(workload, config, sweep_specs, jobs=jobs, on_done=bar) if sweep_specs else []
    bar.close()
    document = {**document, "sweep": [r.summary for r in sweep]}
    paths = write_report(Path(args.report), runs, sweep, document, text)
    sys.stderr.write(f"report: {', '.join(str(p) for p in paths)}\n")


def _log(line: str) -> None:
    sys.stderr.write(line + "\n")


def _tune(args: argparse.Namespace) -> int:
    from sim.runner import default_jobs
    from sim.tune import tune
    from sim.tuned import TunedPolicy, dump_tuned

    out_dir = Path(args.out).parent
    if not out_dir.is_dir():  # found before the search, not after it
        raise KVRouterError(f"--out {args.out}: directory {out_dir} does not exist")
    if args.budget is not None and args.budget < 1:
        raise KVRouterError(f"--budget must be >= 1, got {args.budget}")
    if not 0 <= args.min_priority <= 1:
        raise KVRouterError(f"--min-priority must be in [0, 1], got {args.min_priority}")
    config = _config(args)
    workloads = [(t, _workload(args, t)) for t in args.trace]
    speedups = [float(s) for s in args.speedups.split(",") if s]
    if not speedups or not all(0 < s < math.inf for s in speedups):
        raise KVRouterError("--speedups must list positive finite numbers")
    if args.tune == "admission":
        return _tune_admission(args, config, workloads, speedups)
    t0 = time.perf_counter()
    best, trials = tune(
        workloads,
        config,
        speedups=speedups,
        budget=args.budget,
        jobs=args.jobs or default_jobs(),
        seed=args.seed,
        objective=args.objective,
        log=_log,
    )
    top = trials[0]
    if args.objective == "goodput":
        goal = f"mean goodput over traces x speed-ups {speedups}: {top.goodput:.4f}"
    else:
        goal = (
            f"geometric mean of p90 TTFT over traces x speed-ups {speedups}: "
            f"{top.objective:.1f} ms (p90 per speed-up {top.p90_ms})"
        )
    requests = sum(len(w) for _, w in workloads)
    header = (
        f"written by kvrouter sim tune on {', '.join(args.trace)} ({requests} requests), "
        f"profile {config.profile.name}, {config.replicas} replicas x "
        f"{config.kv_blocks or config.profile.scaled(config.block_size).kv_blocks} blocks of "
        f"{config.block_size}\nobjective: {goal}"
    )
    from sim.tune import split_point

    _, pd_best = split_point({k: v for k, v in best.items() if k.startswith("pd.")})
    best = {k: v for k, v in best.items() if not k.startswith("pd.")}
    if pd_best:
        header += f"\nprefill/decode ({config.pd}): {json.dumps(pd_best)}"
    text = dump_tuned(
        {args.model: TunedPolicy.for_cluster(args.model, "ours", best, config)}, header
    )
    Path(args.out).write_text(text)
    result = {
        "out": args.out,
        "objective": args.objective,
        "best": {k: v for k, v in best.items() if k != "cost"},
        "pd": pd_best,
        "goodput": round(top.goodput, 5),
        "p90_ms": top.p90_ms,
        "hit_rate": top.hit_rate,
        "cases": [
            {
                "trace": c.trace,
                "speedup": c.speedup,
                "goodput": c.goodput,
                "ttft_ms_p90": c.ttft_p90_ms,
                "tpot_ms_p90": c.tpot_p90_ms,
                "e2e_ms_p90": c.e2e_p90_ms,
            }
            for c in top.cases
        ],
        "wall_s": round(time.perf_counter() - t0, 3),
    }
    if args.objective == "ttft":
        result["objective_ms"] = round(top.objective, 3)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


def _tune_admission(
    args: argparse.Namespace, config: Any, workloads: list[Any], speedups: list[float]
) -> int:
    from sim.runner import default_jobs
    from sim.tune_admission import admission_toml, tune_admission

    t0 = time.perf_counter()
    trials = tune_admission(
        workloads,
        config,
        speedups=speedups,
        min_priority=args.min_priority,
        jobs=args.jobs or default_jobs(),
        budget=args.budget,
        log=_log,
    )
    best = trials[0]
    header = (
        f"written by kvrouter sim tune --tune admission on {', '.join(args.trace)}, "
        f"profile {config.profile.name}, {config.replicas} replicas, speed-ups {speedups}, "
        f"priority share {config.priority_share}\nobjective: mean goodput {best.goodput} "
        f"with priority attainment >= {args.min_priority} (worst case {best.priority})"
    )
    Path(args.out).write_text(admission_toml(args.model, best.settings, header))
    result = {
        "out": args.out,
        "tune": "admission",
        "best": asdict(best.settings),
        "goodput": best.goodput,
        "priority_attainment_min": best.priority,
        "meets_min_priority": best.priority >= args.min_priority,
        "cases": list(best.cases),
        "settings_tried": len(trials),
        "wall_s": round(time.perf_counter() - t0, 3),
    }
    sys.stdout.write(json.dumps(result, default=str) + "\n")
    return 0


def _profiles(args: argparse.Namespace) -> int:
    from sim.profiles import load_profile, profile_names

    for name in profile_names():
        p = load_profile(name)
        if args.json:
            sys.stdout.write(json.dumps({**asdict(p)}) + "\n")
        else:
            sys.stdout.write(f"{name:12s} {p.description}\n")
    return 0


def _guard(handler: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            return int(handler(args))
        except (KVRouterError, ValueError) as exc:  # bad input: a clear message, no traceback
            sys.stderr.write(f"kvrouter sim: error: {exc}\n")
            return 2

    return run


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sim = sub.add_parser("sim", help="discrete-event simulator: replay traces, tune policies")
    cmds = sim.add_subparsers(dest="sim_command", metavar="SIMCOMMAND", required=True)

    replay = cmds.add_parser("replay", help="replay a trace through one or more policies")
    _add_fleet_args(replay)
    replay.add_argument("--policy", default="ours", help="policy name, 'all', or a,b,c")
    replay.add_argument("--params", help="JSON parameters for the (single) policy")
    replay.add_argument("--config", help="tuned-settings TOML (from 'sim tune')")
    replay.add_argument("--tuned-model", help="model to take from --config")
    replay.add_argument("--speedup", type=float, default=1.0, help="arrival speed-up")
    replay.add_argument(
        "--runs",
        type=int,
        default=1,
        help="runs of each policy, seeds --seed, --seed+1, ...; figures are their medians, "
        "with 'runs' and 'spread' (give --arrival-jitter-ms so the schedules differ)",
    )
    replay.add_argument("--json", action="store_true", help="print one JSON object")
    replay.add_argument("--report", metavar="DIR", help="write PNG plots + index.html here")
    replay.add_argument("--sweep", default="0.5,1,2,4", help="speed-ups plotted by --report")
    replay.add_argument("--no-progress", action="store_true")
    replay.set_defaults(handler=_guard(_replay))

    tune_p = cmds.add_parser("tune", help="search ours' coefficients; write a tuned TOML")
    _add_fleet_args(tune_p, traces=True)
    tune_p.add_argument(
        "--objective",
        choices=("goodput", "ttft"),
        default="goodput",
        help="maximise goodput under the SLO (default) or minimise p90 TTFT",
    )
    tune_p.add_argument(
        "--tune",
        choices=("policy", "admission"),
        default="policy",
        help="what to search: ours' coefficients (default) or the admission knobs",
    )
    tune_p.add_argument(
        "--min-priority",
        type=float,
        default=0.99,
        help="--tune admission: the priority class's SLO attainment to keep in every case",
    )
    tune_p.add_argument("--out", required=True, help="where to write the tuned settings")
    tune_p.add_argument("--speedups", default="1,4", help="arrival speed-ups to optimise over")
    tune_p.add_argument("--budget", type=int, help="at most this many grid points")
    tune_p.set_defaults(handler=_guard(_tune))

    prof = cmds.add_parser("profiles", help="list the bundled replica profiles")
    prof.add_argument("--json", action="store_true")
    prof.set_defaults(handler=_guard(_profiles))
