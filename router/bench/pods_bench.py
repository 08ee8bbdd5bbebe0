"""``kvrouter bench pods``: N router pods in front of one fleet, against one router.

One private ``redis-server``; for each row a fresh mock fleet (``kvrouter mock-replica``
processes with ``kvrouter publish`` sidecars feeding the Redis index: the shipped
deployment's shape), then the routers, each a separate ``kvrouter serve`` process, and the
same trace replayed through them over HTTP with the requests spread over the routers as a
load balancer does (router/demo/replay.py ``spread``). Rows:

* ``single``: one router;
* ``pods_shared``: ``--pods`` routers exchanging their in-flight load through the Redis
  (``server.pods_exchange``, ``--mode``);
* ``pods_unshared``: the same routers with the exchange off (each knows only its own
  requests and the engines' reports).

Each row: ``ok``, ``failed``, ``hit`` (engine-reported cached prompt tokens), ``goodput``,
``ttft_mean_ms``, ``ttft_p90_ms``, ``tpot_p90_ms`` (and more, router/demo/figures.py), and for
pod rows ``exchange``: per pod per second the snapshots it sent and received and their bytes
(its ``kvrouter_pod_exchange_*`` counters), plus the Redis server's commands and network
bytes per second over the row (publishers' traffic included: compare the rows).
``--kill-one-at S`` SIGKILLs the first pod S seconds into the pod rows and reports how long
the others took to stop counting it (``kill``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from router.bench.measure import median
from router.bench.redis_server import LocalRedis
from router.cliargs import at_least, non_negative_float, positive_float

ROWS = ("single", "pods_shared", "pods_unshared")
MODEL = "demo-model"


@dataclasses.dataclass(slots=True, frozen=True)
class PodsSpec:
    pods: int = 3
    replicas: int = 4
    requests: int = 300
    speedup: float = 2.0
    max_output: int = 64
    mode: str = "stream"
    interval_s: float = 0.005
    stale_s: float = 1.0
    time_scale: float = 1.0
    kill_one_at_s: float | None = None
    speculative_ttl_s: float = 0.0  # the model's; > 0: pods share speculative entries


def _router_toml(spec: PodsSpec, port: int, replicas: list[dict[str, str]], redis: str, prefix: str,
                 pod: str, exchange: str) -> str:  # fmt: skip
    lines = [
        "[server]",
        'host = "127.0.0.1"',
        f"port = {port}",
        "debug_header = true",
        'log_level = "warning"',
        f'redis_url = "{redis}"',
        f'redis_key_prefix = "{prefix}"',
        f'pod_name = "{pod}"',
        f'pods_exchange = "{exchange}"',
        f"pods_exchange_interval_s = {spec.interval_s}",
        f"pods_stale_s = {spec.stale_s}",
        "",
        f'[models."{MODEL}"]',
        'policy = "ours"',
        "block_size = 64",
        f"speculative_ttl_s = {spec.speculative_ttl_s}",
        # the bench's agentic requests all belong to sessions: speculate them too
        f"speculate_sessions = {'true' if spec.speculative_ttl_s > 0 else 'false'}",
    ]
    for rep in replicas:
        lines += ["", "[[replicas]]"]
        lines += [f'{k} = "{v}"' for k, v in rep.items() if k not in ("zmq", "zmq_replay")]
    return "\n".join(lines) + "\n"


async def _scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The router's ``kvrouter_pod_exchange_*`` and ``kvrouter_peer_views`` samples."""
    out: dict[str, float] = {}
    try:
        async with session.get(url + "/metrics") as resp:
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return out
    for line in text.splitlines():
        if line.startswith(("kvrouter_pod_exchange_", "kvrouter_peer_views ")):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def _redis_stats(url: str) -> dict[str, float]:
    from router.store.redis_store import connect

    client = connect(url)
    try:
        info = await client.info("stats")
    finally:
        await client.aclose()
    keys = ("total_commands_processed", "total_net_input_bytes", "total_net_output_bytes")
    return {k: float(info[k]) for k in keys}


async def _watch_kill(
    urls: list[str], victim: str, pods: int, at_s: float, in_flight: dict[str, int]
) -> dict[str, Any]:
    """Kill ``victim`` (a pid) at ``at_s``; wait until every other pod counts one pod fewer."""
    await asyncio.sleep(at_s)
    pid = int(victim)
    lost = in_flight.get(urls[0], 0)
    os.killpg(pid, signal.SIGKILL)
    killed = time.perf_counter()
    pending = set(urls[1:])
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while pending and time.perf_counter() - killed < 30:
            for url in list(pending):
                views = (await _scrape(session, url)).get("kvrouter_peer_views")
                if views is not None and views <= pods - 2:
                    pending.discard(url)
            await asyncio.sleep(0.02)
    return {
        "at_s": at_s,
        "in_flight_on_killed": lost,
        "dropped_after_s": round(time.perf_counter() - killed, 3) if not pending else None,
    }


async def run_row(
    row: str, spec: PodsSpec, requests: list[Any], redis: LocalRedis
) -> dict[str, Any]:
    from router.demo.figures import summarize
    from router.demo.fleet import Fleet, FleetSpec
    from router.demo.replay import replay

    prefix = f"kvr-pods-{row}-{int(time.time() * 1000)}"
    fleet_spec = FleetSpec(
        replicas=spec.replicas,
        policy=None,
        redis_url=redis.url,
        key_prefix=prefix,
        time_scale=spec.time_scale,
    )
    n = 1 if row == "single" else spec.pods
    exchange = "off" if row == "pods_unshared" else spec.mode
    started = time.perf_counter()
    async with Fleet(fleet_spec) as fleet:
        urls = []
        assert fleet._tmp is not None
        for k in range(n):
            port = fleet.port()
            config = Path(fleet._tmp.name) / f"pod-{k}.toml"
            config.write_text(
                _router_toml(spec, port, fleet.replicas, redis.url, prefix, f"pod-{k}", exchange)
            )
            cmd = [sys.executable, "-m", "router.cli", "serve", "--config", str(config)]
            url = f"http://127.0.0.1:{port}"
            await fleet.start_router(f"pod-{k}", cmd, url, ready="/ready")
            urls.append(url)
        before = await _redis_stats(redis.url)
        t0 = time.perf_counter()
        in_flight: dict[str, int] = {}
        kill_task = None
        if spec.kill_one_at_s is not None and n > 1:
            victim = str(fleet.procs[-n][1].pid)
            kill_task = asyncio.create_task(
                _watch_kill(urls, victim, n, spec.kill_one_at_s, in_flight)
            )
        outcomes = await replay(urls[0], requests, spec.speedup, spread=urls, in_flight=in_flight)
        wall = time.perf_counter() - t0
        after = await _redis_stats(redis.url)
        async with aiohttp.ClientSession() as session:
            scraped = [await _scrape(session, u) for u in urls]
        kill = await kill_task if kill_task is not None else None
        if kill is None:
            fleet.check_alive()
    figures = summarize(outcomes)  # ttft_mean_ms over the streamed answers, as the live bench
    figures["pods"] = n
    errors = sorted({o.error for o in outcomes if not o.ok})[:3]
    if errors:
        figures["errors"] = errors
    if exchange != "off" and n > 1:
        live = [s for s in scraped if s]
        per_pod: dict[str, float] = {}
        for name in (
            'kvrouter_pod_exchange_snapshots_total{direction="sent"}',
            'kvrouter_pod_exchange_snapshots_total{direction="received"}',
            'kvrouter_pod_exchange_bytes_total{direction="sent"}',
            'kvrouter_pod_exchange_bytes_total{direction="received"}',
            "kvrouter_pod_exchange_errors_total",
            "kvrouter_pod_exchange_rejected_total",
            'kvrouter_pod_exchange_shared_total{kind="speculative"}',
            'kvrouter_pod_exchange_shared_total{kind="session"}',
        ):
            total = sum(s.get(name, 0.0) for s in live)
            short = name.replace("kvrouter_pod_exchange_", "").replace("_total", "")
            short = short.replace('{direction="', "_").replace('{kind="', "_").rstrip('"}')
            per_pod[short + "_per_s"] = round(total / max(len(live), 1) / wall, 1)
        figures["exchange"] = per_pod
    figures["redis_per_s"] = {
        k.replace("total_", ""): round((after[k] - before[k]) / wall, 1) for k in before
    }
    if kill is not None:
        figures["kill"] = kill
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    return figures


def _combined(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from its repeats, as ``kvrouter bench live --repeat`` combines its runs
    (router/demo/figures.py ``combine_runs``: ``requests`` / ``ok`` / ``failed`` summed,
    every other figure the median of the repeats that have it, ``runs`` their number and
    ``spread`` the headline figures' ``[min, max]``)."""
    from router.demo.figures import combine_runs

    return combine_runs(runs)


def _ratios(rows: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key figure, the median over repeats of row / base measured in the same repeat
    (``median``: a repeat without the figure, NaN, is left out, whatever the order)."""
    out: dict[str, Any] = {}
    for k in ("ttft_mean_ms", "ttft_p90_ms", "tpot_p90_ms", "hit"):
        each = [r[k] / b[k] if b[k] else math.nan for r, b in zip(rows, base, strict=True)]
        out[k] = round(median(each), 3)
        if len(each) > 1:
            out[k + "_each"] = [round(x, 3) for x in each]
    return out


def run(args: argparse.Namespace) -> int:
    from router.demo.live_bench import WORKLOADS, _trace_file
    from router.demo.replay import load_requests

    spec = PodsSpec(
        pods=args.pods,
        replicas=args.replicas,
        requests=args.requests,
        speedup=args.speedup,
        mode=args.mode,
        interval_s=args.interval_ms / 1e3,
        stale_s=args.stale_s,
        time_scale=args.time_scale,
        kill_one_at_s=args.kill_one_at,
        speculative_ttl_s=args.speculative_ttl_s,
    )
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown row(s) {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    workload = WORKLOADS["agentic"]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvrouter-pods-") as tmp:
        trace = _trace_file(workload, Path(tmp))
        requests = load_requests(trace, spec.requests, MODEL, spec.max_output)
        result: dict[str, Any] = {
            "bench": "pods",
            "spec": dataclasses.asdict(spec),
            "requests": len(requests),
        }
        runs: dict[str, list[dict[str, Any]]] = {row: [] for row in rows}
        with LocalRedis(Path(tmp) / "redis") as redis:
            for k in range(args.repeat):  # interleaved: the machine's drift hits every row
                for row in rows:
                    print(f"bench pods: {row} ({k + 1}/{args.repeat}) ...", file=sys.stderr)
                    runs[row].append(asyncio.run(run_row(row, spec, requests, redis)))
        for row in rows:
            result[row] = _combined(runs[row])
    if "single" in runs and "pods_shared" in runs:
        result["shared_vs_single"] = _ratios(runs["pods_shared"], runs["single"])
    if "single" in runs and "pods_unshared" in runs:
        result["unshared_vs_single"] = _ratios(runs["pods_unshared"], runs["single"])
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    sys.stdout.write(json.dumps(result, indent=None if args.json else 2) + "\n")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("pods", help="N router pods (shared / unshared load) vs one router")
    p.add_argument("--pods", type=at_least(1), default=3)
    p.add_argument("--replicas", type=at_least(1), default=4, help="mock replicas")
    p.add_argument("--requests", type=at_least(1), default=300, help="agentic requests replayed")
    p.add_argument("--speedup", type=positive_float, default=2.0, help="arrival speed-up")
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--mode", choices=("stream", "hash"), default="stream")
    p.add_argument(
        "--interval-ms", type=positive_float, default=5.0, help="pods_exchange_interval_s"
    )
    p.add_argument("--stale-s", type=positive_float, default=1.0, help="pods_stale_s")
    p.add_argument("--time-scale", type=positive_float, default=1.0, help="the mocks' time scale")
    p.add_argument("--repeat", type=at_least(1), default=1, help="run the rows this many times")
    p.add_argument(
        "--kill-one-at", type=non_negative_float, help="SIGKILL one pod this many seconds in"
    )
    p.add_argument(
        "--speculative-ttl-s",
        type=non_negative_float,
        default=0.0,
        help="the model's speculative_ttl_s (> 0: the pods also share speculative entries)",
    )
    p.add_argument("--json", action="store_true", help="one line of JSON (default: indented)")
    p.set_defaults(handler=run)
