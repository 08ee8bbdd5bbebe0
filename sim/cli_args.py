"""The fleet flags ``kvrouter sim replay`` and ``kvrouter sim tune`` share, and what a
parsed command line of them means: a checked ``ClusterConfig``, the workload, the settings
record a replay's JSON carries.

Contracts: ``add_fleet_args`` adds the flags (``trace`` one positional, or with
``traces=True`` one or more); ``config_of`` and ``workload_of`` check every flag they
read and raise ``KVRouterError`` naming the flag on a bad value (the command's guard turns
it into exit status 2), before any simulation runs; ``settings_of`` is a plain,
JSON-serialisable dict. Heavy imports (profiles, the runner) happen inside the functions,
so registering the command stays cheap.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from typing import Any

from router.core.errors import KVRouterError
from router.core.routing_settings import DEFAULT_SPECULATIVE_TTL_S
from router.core.turnover import REUSE_WINDOW_S


def add_fleet_args(p: argparse.ArgumentParser, traces: bool = False) -> None:
    """Add the trace positional (one, or with ``traces`` one or more) and the fleet, SLO,
    admission, P/D and ``--jobs`` flags to ``p``."""
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
    p.add_argument(
        "--model",
        default="sim-model",
        help="model name (hash namespace; a recording's rows of it alone)",
    )
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


def config_of(args: argparse.Namespace, record_load: bool = False) -> Any:
    """The run's ``ClusterConfig`` from the fleet flags (``record_load``: keep each replica's
    pending-request series for the report's load plot); a bad flag raises ``KVRouterError``
    naming it."""
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
        pd_params = json_object(args.pd_params, "--pd-params")
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


def json_object(text: str, flag: str) -> dict[str, Any]:
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
        knobs = json_object(args.admission_params, "--admission-params")
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


def workload_of(args: argparse.Namespace, trace: str | None = None) -> Any:
    """The workload of ``trace`` (default ``args.trace``), hashed at ``--block-size``."""
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


def settings_of(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    """The run's settings as a replay's JSON reports them (``settings``): the config's
    resolved values, and the flags in their own units (milliseconds)."""
    return {
        "profile": config.profile.name,
        "replicas": config.replicas,
        "block_size": config.block_size,
        # per replica, as the engines ran (the profile's where no flag named them)
        "kv_blocks": config.replica_blocks()[0],
        "cpu_blocks": config.replica_blocks()[1],
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
