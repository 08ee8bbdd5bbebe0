"""``kvrouter bench listener``: how ``server.listener`` spreads connections over the workers.

Setup (loopback): the canned backend of router/bench/proxy_bench.py (its own process, 4
ports), ``kvrouter serve --workers W`` in front of it (proxy_bench's configuration plus
``listener``), and an aiohttp client in this process: ``--concurrency`` tasks, each sending
the ~2 KB non-streaming chat body over a new connection per request (no keep-alive, so
every request is a new accept), ``--requests`` in all per run, after ``--warmup`` requests.
The listener modes run in turn, ``--runs`` times each (alternating, so a busy machine
weighs on both alike).

Prints one JSON object: per mode, the runs (``per_worker``: requests each worker routed in
the run, from the ``worker`` label of ``kvrouter_requests_total`` on ``/metrics``;
``max_share``: the busiest worker's share, 1/W is even; ``rps``: requests a second of the
whole run, the client in this process sharing the machine's cores; ``failed``: requests
not answered 200) and the medians. A measurement, never a test.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from router.bench.measure import emit, use_uvloop
from router.bench.ports import free_port as _free_port
from router.bench.proxy_bench import (
    _stop,
    _wait_http,
    chat_body,
    kvrouter_config,
    start_backend,
)
from router.cliargs import at_least
from router.sigterm import held

MODES = ("reuseport", "shared")
_SAMPLE = re.compile(r'^kvrouter_requests_total\{worker="(\d+)",[^}]*outcome="ok"[^}]*\} (\S+)$')


def per_worker(page: str) -> dict[str, float]:
    """Requests each worker routed (``ok`` outcomes), by worker index, from a ``/metrics``
    page of a router with several workers."""
    out: dict[str, float] = {}
    for line in page.splitlines():
        found = _SAMPLE.match(line)
        if found:
            out[found.group(1)] = out.get(found.group(1), 0.0) + float(found.group(2))
    return out


async def _load(url: str, body: bytes, requests: int, concurrency: int) -> tuple[float, int]:
    """(seconds, failures) of ``requests`` POSTs from ``concurrency`` tasks, one new
    connection each."""
    import aiohttp

    left = requests
    failed = 0
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def client() -> None:
            nonlocal left, failed
            while left > 0:
                left -= 1
                try:
                    async with http.post(url, data=body, headers=headers) as r:
                        await r.read()
                        failed += r.status != 200
                except aiohttp.ClientError:
                    failed += 1

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return time.perf_counter() - start, failed


async def _scrape(port: int) -> dict[str, float]:
    import aiohttp

    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/metrics") as r,
    ):
        return per_worker(await r.text())


def _run_one(mode: str, ports: list[int], args: argparse.Namespace) -> dict[str, Any]:
    kv_port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "kvrouter.toml"
        kvrouter_config(cfg, ports, kv_port, args.workers)
        text = cfg.read_text().replace("[server]\n", f'[server]\nlistener = "{mode}"\n', 1)
        cfg.write_text(text)
        kv: subprocess.Popen[bytes] | None = None
        try:
            with held():
                kv = subprocess.Popen(
                    [sys.executable, "-m", "router.cli", "serve", "--config", str(cfg)]
                )
            _wait_http(f"http://127.0.0.1:{kv_port}/health")
            url = f"http://127.0.0.1:{kv_port}/v1/chat/completions"
            body = chat_body(False).encode()

            async def measure() -> dict[str, Any]:
                await _load(url, body, args.warmup, args.concurrency)
                before = await _scrape(kv_port)
                seconds, failed = await _load(url, body, args.requests, args.concurrency)
                after = await _scrape(kv_port)
                counts = [
                    int(after.get(str(i), 0) - before.get(str(i), 0)) for i in range(args.workers)
                ]
                return {
                    "per_worker": counts,
                    "max_share": round(max(counts) / max(sum(counts), 1), 3),
                    "rps": round(args.requests / seconds),
                    "failed": failed,
                }

            return asyncio.run(measure())
        finally:
            _stop(kv)


def run(args: argparse.Namespace) -> int:
    use_uvloop()
    ports = [_free_port() for _ in range(4)]
    backend: subprocess.Popen[bytes] | None = None
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    try:
        with held():
            backend = start_backend(ports)
        _wait_http(f"http://127.0.0.1:{ports[0]}/health")
        for _ in range(args.runs):
            for mode in MODES:
                runs[mode].append(_run_one(mode, ports, args))
    finally:
        _stop(backend)
    result: dict[str, Any] = {
        "bench": "listener",
        "workers": args.workers,
        "requests": args.requests,
        "concurrency": args.concurrency,
    }
    for mode, rows in runs.items():
        shares = sorted(r["max_share"] for r in rows)
        rps = sorted(r["rps"] for r in rows)
        result[mode] = {
            "runs": rows,
            "max_share_median": shares[len(shares) // 2],
            "rps_median": rps[len(rps) // 2],
        }
    emit(result)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("listener", help="connection spread over workers per server.listener")
    p.add_argument("--workers", type=at_least(2), default=2)
    p.add_argument("--requests", type=at_least(1), default=2000, help="per run")
    p.add_argument("--warmup", type=at_least(0), default=200)
    p.add_argument("--concurrency", type=at_least(1), default=32)
    p.add_argument("--runs", type=at_least(1), default=3, help="per mode")
    p.set_defaults(handler=run)
