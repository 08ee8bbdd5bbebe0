"""``kvrouter sim ...``: replay traces through the policies, tune ``ours``, list profiles.

    kvrouter sim replay TRACE [--policy NAME|all|a,b] [--speedup S] [--json] [--report DIR]
    kvrouter sim tune TRACE --out tuned.toml
    kvrouter sim profiles

TRACE is a JSONL path (Mooncake, recorded or Bailian rows), ``mooncake`` (the bundled trace)
or ``agentic[:key=value,...]`` (the synthetic agentic-session generator).

This module registers the commands (``register(subparsers)``, which ``router/cli.py`` calls)
and runs them; the fleet flags they share and their checks live in ``sim/cli_args.py``.
Each handler returns the exit status: 0, or 2 with a one-line ``kvrouter sim: error: ...``
on stderr for bad input (``KVRouterError`` or ``ValueError``, no traceback). Results go to
stdout (a table, or one JSON object per line), progress and logs to stderr.
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

from router.bench.measure import json_text, median_row
from router.core.errors import KVRouterError
from sim.cli_args import add_fleet_args, config_of, json_object, settings_of, workload_of

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
        params[names[0]] = json_object(args.params, "--params")
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
        args.sweep = speed_ups(args.sweep, "--sweep")
    config = config_of(args, record_load=bool(args.report))
    workload = workload_of(args)
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
    settings = {**settings_of(args, config), "runs": args.runs, "seeds": seeds}
    common = {
        "trace": args.trace,
        "requests": workload.client_requests(),
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
        sys.stdout.write(json_text(document) + "\n")
    else:
        sys.stdout.write(text + "\n")
        sys.stdout.write(
            f"{common['requests']} requests, speed-up {args.speedup}x, "
            f"wall {sim_wall:.2f} s "
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
    for spec in specs:
        for s in args.sweep:  # (checked before the runs: :func:`speed_ups`)
            sweep_specs.append(RunSpec(spec.policy, spec.params, s))
    bar = ProgressBar("sweep", enabled=not args.no_progress)
    sweep = run_many(workload, config, sweep_specs, jobs=jobs, on_done=bar) if sweep_specs else []
    bar.close()
    document = {**document, "sweep": [r.summary for r in sweep]}
    paths = write_report(Path(args.report), runs, sweep, document, text)
    sys.stderr.write(f"report: {', '.join(str(p) for p in paths)}\n")


def speed_ups(text: str, flag: str) -> list[float]:
    """A comma-separated list of speed-ups, each positive and finite (``inf`` would put
    every arrival at 0, NaN every arrival nowhere)."""
    try:
        out = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        out = []
    if not out or not all(0 < s < math.inf for s in out):
        raise KVRouterError(f"{flag} must list positive finite numbers, got {text!r}")
    return out


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
    if args.seeds < 1:
        raise KVRouterError(f"--seeds must be >= 1, got {args.seeds}")
    config = config_of(args)
    workloads = [(t, workload_of(args, t)) for t in args.trace]
    speedups = speed_ups(args.speedups, "--speedups")
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
        seeds=args.seeds,
    )
    top = trials[0]
    seeds = sorted(top.by_seed)
    low, high = top.spread
    over = f"seeds {seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else f"seed {seeds[0]}"
    if args.objective == "goodput":
        goal = (
            f"mean goodput over traces x speed-ups {speedups} x {over}: {top.goodput:.4f} "
            f"(per seed {-high:.4f} .. {-low:.4f})"
        )
    else:
        goal = (
            f"geometric mean of p90 TTFT over traces x speed-ups {speedups}, mean over "
            f"{over}: {top.objective:.1f} ms (per seed {low:.1f} .. {high:.1f}; p90 per "
            f"speed-up {top.p90_ms})"
        )
    requests = sum(w.client_requests() for _, w in workloads)
    header = (
        f"written by kvrouter sim tune on {', '.join(args.trace)} ({requests} requests), "
        f"profile {config.profile.name}, {config.replicas} replicas x "
        f"{config.replica_blocks()[0]} blocks of "
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
        "seeds": seeds,
        # the objective at each seed (goodput, or the TTFT p90 geometric mean in ms)
        "by_seed": {
            str(k): round(-v if args.objective == "goodput" else v, 5)
            for k, v in top.by_seed.items()
        },
        "cases": [
            {
                "trace": c.trace,
                "speedup": c.speedup,
                "seed": c.seed,
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
    sys.stdout.write(json_text(result) + "\n")
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
    sys.stdout.write(json_text(result, default=str) + "\n")
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
    add_fleet_args(replay)
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
    add_fleet_args(tune_p, traces=True)
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
    tune_p.add_argument(
        "--seeds",
        type=int,
        default=3,
        help="score each setting past the first rung by its mean over this many simulation "
        "seeds (--seed onwards: arrival jitter, tie-breaks); default 3",
    )
    tune_p.set_defaults(handler=_guard(_tune))

    prof = cmds.add_parser("profiles", help="list the bundled replica profiles")
    prof.add_argument("--json", action="store_true")
    prof.set_defaults(handler=_guard(_profiles))
