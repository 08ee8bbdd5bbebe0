"""``kvrouter bench scrape``: the router's ``/metrics`` page at fleet scale.

Setup (loopback, real processes): ``--models`` ``kvrouter mock-replica`` processes (one per
model) and ``kvrouter serve`` (``--workers``) configured with ``--entries`` replicas spread
over them (a production router follows ~1,000: several models, DP ranks; the page's size
depends on the entries, not on how many engines answer them), round robin. Each worker is
sent two requests per entry, half of them streamed, so every entry has its per-replica
series; then ``--scrapes`` scrapes, 0.3 s apart, each over a fresh connection as Prometheus
makes them.

Prints one JSON object: the page's bytes, series (sample lines) and bytes per entry, the
scrape's time (p50, max), and ``kvrouter_event_loop_lag_seconds`` read from each page
(the largest lateness of a 50 ms timer in the second before it: with scrapes 0.3 s apart,
it holds the previous scrape's stall of the loop; p50, max; with several workers, the
largest of them), against the same gauge after 1.5 s without scrapes (``idle_lag_ms``).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from router.bench.measure import emit, percentile, use_uvloop
from router.bench.ports import free_port as _free_port
from router.bench.reliability_bench import KVROUTER, Procs, _wait_health
from router.cliargs import at_least


def _lag_ms(page: str) -> float:
    lags = [
        float(line.rsplit(" ", 1)[1]) * 1e3
        for line in page.split("\n")
        if line.startswith("kvrouter_event_loop_lag_seconds")
    ]
    return max(lags, default=0.0)


async def _measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    sem = asyncio.Semaphore(32)
    async with aiohttp.ClientSession() as http:

        async def one(i: int) -> None:
            body = {
                "model": f"m{i % args.models}",
                "prompt": [(i * 31 + j) % 50000 for j in range(64)],
                "max_tokens": 2,
                "stream": i % 2 == 0,
            }
            async with sem, http.post(url + "/v1/completions", json=body) as r:
                await r.read()

        await asyncio.gather(*(one(i) for i in range(2 * args.entries * args.workers)))

    async def scrape() -> tuple[float, str]:
        began = time.perf_counter()
        connector = aiohttp.TCPConnector(force_close=True)
        async with (
            aiohttp.ClientSession(connector=connector) as fresh,
            fresh.get(url + "/metrics") as r,
        ):
            page = await r.text()
        return (time.perf_counter() - began) * 1e3, page

    await asyncio.sleep(1.5)
    _, page = await scrape()
    idle = _lag_ms(page)
    times, lags = [], []
    for _ in range(args.scrapes):
        took, page = await scrape()
        times.append(took)
        lags.append(_lag_ms(page))
        await asyncio.sleep(0.3)
    series = [ln for ln in page.split("\n") if ln and not ln.startswith("#")]
    size = len(page.encode())
    return {
        "bytes": size,
        "series": len(series),
        "bytes_per_entry": round(size / args.entries),
        "scrape_ms_p50": round(percentile(times, 50), 1),
        "scrape_ms_max": round(max(times), 1),
        "lag_ms_p50": round(percentile(lags[1:], 50), 1),
        "lag_ms_max": round(max(lags[1:]), 1),
        "idle_lag_ms": round(idle, 1),
    }


def run(args: argparse.Namespace) -> int:
    use_uvloop()
    workdir = Path(tempfile.mkdtemp(prefix="kvr-scrape-"))
    procs = Procs(workdir)
    try:
        mocks = []
        for j in range(args.models):
            port = _free_port()
            p = procs.spawn(
                f"mock{j}",
                [KVROUTER, "mock-replica", "--port", str(port), "--replica", f"mock{j}"]
                + ["--model", f"m{j}", "--block-size", "16", "--log-level", "WARNING"],
            )
            mocks.append((f"http://127.0.0.1:{port}", p))
        for url, p in mocks:
            _wait_health(url, p)
        rport = _free_port()
        lines = ["[server]", f"port = {rport}", 'log_level = "warning"']
        lines += [f"workers = {args.workers}", "health_interval_s = 0"]
        for i in range(args.entries):
            j = i % args.models
            lines += ["[[replicas]]", f'name = "replica-{i:04d}"', f'url = "{mocks[j][0]}"']
            lines += [f'model = "m{j}"', f'rack = "rack{i % 20}"']
        for j in range(args.models):
            lines += [f"[models.m{j}]", "block_size = 16", 'policy = "round_robin"']
        cfg = workdir / "router.toml"
        cfg.write_text("\n".join(lines) + "\n")
        router = procs.spawn("router", [KVROUTER, "serve", "--config", str(cfg)])
        rurl = f"http://127.0.0.1:{rport}"
        _wait_health(rurl, router, timeout=120)
        result: dict[str, Any] = {
            "bench": "scrape",
            "entries": args.entries,
            "models": args.models,
            "workers": args.workers,
            "scrapes": args.scrapes,
        }
        result.update(asyncio.run(_measure(rurl, args)))
        emit(result)
        return 0
    finally:
        procs.stop()


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("scrape", help="the /metrics page at fleet scale: size, time, loop lag")
    p.add_argument("--entries", type=at_least(1), default=1000, help="[[replicas]] entries")
    p.add_argument("--models", type=at_least(1), default=4, help="models (a mock replica each)")
    p.add_argument("--workers", type=at_least(1), default=1, help="router worker processes")
    p.add_argument("--scrapes", type=at_least(1), default=20)
    p.set_defaults(handler=run)
