"""``kvrouter demo``: the main job on a fresh machine, nothing running beforehand.

For each chosen policy: start N mock replicas (real HTTP and ZMQ on loopback, the
simulator's engine model on the wall clock), the router with its embedded index fed by the
replicas' KV events (or Redis + one publisher per replica with ``--redis URL``), replay an
agentic trace (synthetic sessions sharing system prompts and tool schemas, contexts growing
turn by turn, closed loop; or ``--trace FILE`` in Mooncake/recorded format) through the
router over HTTP at a speed-up, then stop everything. Prints per policy the engines' usable
and KV-only hit, the router's predicted hit and its per-request error, goodput (the default
SLO, router.core.slo), TTFT and TPOT, next to what the simulator predicts for the same trace
and cluster, and exits non-zero if any request failed. The default profile is the hybrid
``kimi-k3`` (the mission's model).

``--pd off,auto,always`` runs each policy once per prefill/decode disaggregation mode (rows
``policy/pd=mode``): the replicas spread over ``--racks`` racks, ``--prefill-share`` of each
rack with the prefill role (the rest decode under ``always``, both under ``auto``), the
router speaking vLLM's ``kv_transfer_params`` protocol to the mocks (docs/pd.md).

``--sim-only`` skips the live part (no processes at all). ``--router-url URL`` replays the
workload through a router that is already running (any OpenAI-compatible one, in front of
its own replicas serving ``demo-model``) instead of starting a fleet: one row, ``external``.

This is a command-line entry point, so it may use ``sim/`` (for the prediction); the
serving code never does.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from router.cliargs import at_least, fraction, positive_float

# ~40 agent sessions over ~20 s: shared system prompts and tool schemas, 6 turns on average,
# contexts growing to ~20-60k tokens; sized so the default demo takes about a minute.
DEFAULT_AGENTIC = (
    "agentic:sessions=40,session_rate=2,system_prompts=4,system_tokens=6000,tool_sets=2,"
    "tool_def_tokens=3000,mean_turns=6,max_turns=12,answer_tokens=100,tool_tokens=1500,"
    "think_s=0.5,tool_latency_s=0.5,max_context=65536,seed=7"
)


def _summary(outcomes: list[Any]) -> dict[str, Any]:
    from router.demo.figures import summarize

    return summarize(outcomes)


def _simulate(
    args: argparse.Namespace, policy: str, trace: Path, pd: str | None = None
) -> dict[str, Any]:
    from router.demo.fleet import MODEL
    from sim.cluster_config import ClusterConfig
    from sim.profiles import load_profile
    from sim.runner import RunSpec, run_one
    from sim.workload import load_trace

    workload = load_trace(str(trace), block_size=args.block_size, limit=args.requests, model=MODEL)
    workload.requests = [
        dataclasses.replace(r, output_tokens=max(1, min(r.output_tokens, args.max_output)))
        for r in workload.requests
    ]
    config = ClusterConfig(
        profile=load_profile(args.profile),
        replicas=args.replicas,
        block_size=args.block_size,
        kv_blocks=args.kv_blocks,
        racks=args.racks if pd else 1,
        pd=pd or "off",
        prefill_share=args.prefill_share,
    )
    return run_one(workload, config, RunSpec(policy, speedup=args.speedup)).summary


async def _external(args: argparse.Namespace, requests: list[Any]) -> dict[str, Any]:
    from router.demo.replay import ProgressBar, replay

    outcomes = await replay(
        args.router_url.rstrip("/"), requests, args.speedup, ProgressBar(len(requests), "external")
    )
    for error in [o.error for o in outcomes if not o.ok][:3]:
        print(f"  external: request failed: {error}", file=sys.stderr)
    return _summary(outcomes)


async def _live(
    args: argparse.Namespace, policy: str, requests: list[Any], pd: str | None = None
) -> dict[str, Any]:
    from router.demo.fleet import Fleet, FleetSpec
    from router.demo.replay import ProgressBar, replay

    spec = FleetSpec(
        replicas=args.replicas,
        policy=policy,
        block_size=args.block_size,
        kv_blocks=args.kv_blocks,
        profile=args.profile,
        redis_url=args.redis,
        key_prefix=f"kvr-demo-{int(time.time() * 1000)}",
        record_path=str(Path(f"{args.record}.{policy}.jsonl").resolve()) if args.record else None,
        pd=pd,
        racks=args.racks,
        prefill_share=args.prefill_share,
    )
    try:
        async with Fleet(spec) as fleet:
            outcomes = await replay(
                fleet.router_url, requests, args.speedup, ProgressBar(len(requests), policy)
            )
            fleet.check_alive()
    finally:
        if args.redis:
            await _drop_keys(args.redis, spec.key_prefix)
    failed = [o.error for o in outcomes if not o.ok]
    for error in failed[:3]:
        print(f"  {policy}: request failed: {error}", file=sys.stderr)
    return _summary(outcomes)


async def _drop_keys(url: str, prefix: str) -> None:
    """Remove this run's keys from a Redis the demo was pointed at."""
    from router.store.redis_store import connect

    client = connect(url)  # redis://, rediss:// or a redis+cluster:// URL
    try:
        async for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            await client.delete(key)
    finally:
        await client.aclose()


def _fmt(value: float, pct: bool = False, digits: int = 0) -> str:
    if value != value:
        return "-"
    return f"{value * 100:.1f}%" if pct else f"{value:.{digits}f}"


def _agentic_trace(spec_text: str, path: Path) -> None:
    from sim.agentic import AgenticSpec, generate, to_trace_rows

    workload = generate(AgenticSpec.parse(spec_text), block_size=64)
    with path.open("w") as fh:
        for row in to_trace_rows(workload):
            fh.write(json.dumps(row) + "\n")


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvrouter-demo-trace-") as tmp:
        trace = Path(args.trace) if args.trace else Path(tmp) / "agentic.jsonl"
        if not args.trace:
            _agentic_trace(args.agentic, trace)
        return _run(args, trace)


def _run(args: argparse.Namespace, trace: Path) -> int:
    from router.demo.fleet import MODEL
    from router.demo.replay import load_requests
    from sim.runner import parse_policies

    policies = parse_policies(args.policies)
    modes: list[str | None] = [m.strip() for m in args.pd.split(",")] if args.pd else [None]
    if any(m not in ("off", "always", "auto") for m in modes if m is not None):
        print("kvrouter demo: --pd takes off, always and auto", file=sys.stderr)
        return 2
    requests = load_requests(trace, args.requests, MODEL, args.max_output)
    sessions = len({r.session_id for r in requests})
    print(
        f"kvrouter demo: {len(requests)} requests in {sessions} sessions "
        f"({'trace ' + str(trace) if args.trace else 'synthetic agentic trace'}, "
        f"{args.speedup:g}x), {args.replicas} mock replicas "
        f"({args.profile}, {args.kv_blocks} KV blocks of {args.block_size} tokens), "
        f"index: {'redis ' + args.redis if args.redis else 'embedded (ZMQ events)'}"
    )
    rows: list[tuple[str, dict[str, Any] | None, dict[str, Any]]] = []
    failed = 0
    if args.router_url:
        external = asyncio.run(_external(args, requests))
        failed += int(external["failed"])
        rows.append(("external", external, _simulate(args, "ours", trace)))
    for policy in [] if args.router_url else policies:
        for mode in modes:
            sim = _simulate(args, policy, trace, mode)
            live = None if args.sim_only else asyncio.run(_live(args, policy, requests, mode))
            if live:
                failed += int(live["failed"])
            rows.append((policy if mode is None else f"{policy}/pd={mode}", live, sim))
    width = max(14, *(len(r[0]) for r in rows)) if rows else 14
    header = (
        f"{'policy':<{width}} {'ok':>5} {'hit%':>6} {'kv%':>6} {'pred%':>6} {'err p99':>7}"
        f" {'good%':>6} {'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p90':>9} | {'sim hit%':>8}"
        f" {'sim kv%':>7} {'sim good%':>9} {'sim p50':>8}"
        f" {'sim p90':>8}"
    )
    print(header)
    print("-" * len(header))
    for policy, live, sim in rows:
        lv = live or {}
        ok = f"{lv['ok']:.0f}" if live else "-"

        def cell(key: str, pct: bool = False, digits: int = 0, lv: dict[str, Any] = lv) -> str:
            return _fmt(lv.get(key, math.nan), pct, digits)

        print(
            f"{policy:<{width}} {ok:>5} {cell('hit', True):>6} {cell('kv_hit', True):>6} "
            f"{cell('predicted_hit', True):>6} {cell('error_p99', True):>7} "
            f"{cell('goodput', True):>6} {cell('ttft_p50_ms'):>9} {cell('ttft_p90_ms'):>9} "
            f"{cell('tpot_p90_ms', digits=1):>9}"
            f" | {_fmt(sim['token_hit_rate'], True):>8} {_fmt(sim['kv_token_hit_rate'], True):>7}"
            f" {_fmt(sim['goodput'], True):>9} {_fmt(sim['ttft_ms_p50']):>8}"
            f" {_fmt(sim['ttft_ms_p90']):>8}"
        )
    print(
        "hit% = prompt tokens the engines reused (usable hit: cached KV up to a recurrent-state"
        " checkpoint or a cached window);\nkv% = their KV-only hit; pred% = the router's"
        " predicted usable hit; "
        "err p99 = 99th percentile over requests of |predicted - reused| / prompt;\n"
        "good% = requests meeting their TTFT and TPOT targets; TTFT / TPOT in ms at the client;"
        "\nsim = the simulator on the same trace and cluster (ours, for an external router)."
    )
    if failed:
        print(f"FAILED: {failed} request(s) did not complete", file=sys.stderr)
        return 1
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="live demo: mock replicas + router + trace replay")
    p.add_argument("--replicas", type=at_least(1), default=4)
    p.add_argument(
        "--requests", type=at_least(1), default=400, help="at most N requests of the trace"
    )
    p.add_argument(
        "--speedup", type=positive_float, default=2.0, help="arrival speed-up of the trace"
    )
    p.add_argument(
        "--agentic",
        default=DEFAULT_AGENTIC,
        help="synthetic agentic trace spec (sim.agentic.AgenticSpec fields)",
    )
    p.add_argument("--trace", help="replay this Mooncake/recorded JSONL instead")
    p.add_argument("--policies", default="round_robin,ours", help="comma-separated policies")
    p.add_argument(
        "--profile",
        default="kimi-k3",
        help="mock replica / simulator profile (kimi-k3: the hybrid KDA model; dense-70b; "
        "gpt-oss-120b: full + sliding-window attention; or a .toml path)",
    )
    p.add_argument("--block-size", type=at_least(1), default=64)
    p.add_argument("--kv-blocks", type=at_least(1), default=16384, help="GPU KV blocks per replica")
    p.add_argument(
        "--max-output", type=at_least(1), default=64, help="cap on output tokens per request"
    )
    p.add_argument("--redis", help="use this Redis (publishers + shared index) instead of ZMQ")
    p.add_argument(
        "--record",
        metavar="PREFIX",
        help="record the router's live traffic to PREFIX.<policy>.jsonl (replay with sim)",
    )
    p.add_argument("--sim-only", action="store_true", help="only the simulator's prediction")
    p.add_argument(
        "--pd",
        help="prefill/decode disaggregation modes to run, e.g. off,auto,always (docs/pd.md)",
    )
    p.add_argument(
        "--racks", type=at_least(1), default=2, help="racks the replicas spread over (--pd)"
    )
    p.add_argument(
        "--prefill-share", type=fraction, default=0.5, help="share of a rack with the prefill role"
    )
    p.add_argument(
        "--router-url",
        help="replay through this running router (e.g. http://host:8000) instead of a fleet;"
        " the requests name the model 'demo-model', which it must serve",
    )
    p.set_defaults(handler=run)
