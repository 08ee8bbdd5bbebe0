"""``kvrouter bench reliability``: many concurrent streams through one router for a while.

Setup (this machine, loopback, real processes): ``--replicas`` ``kvrouter mock-replica``
processes (the simulator's engine model on the wall clock), one ``kvrouter serve`` in front
of them (``--policy``, round robin by default), and a closed-loop load generator in this
process (uvloop + aiohttp): ``--concurrency`` workers, each sending one streaming
``/v1/completions`` after the other (token-id prompts of ``--prompt-tokens`` tokens over a
pool of shared prefixes, ``--max-tokens`` output tokens) for ``--duration`` seconds.

Two phases: ``direct`` (workers spread round-robin over the replicas, no router) for
``--direct-duration`` seconds, then ``router``. Each answer is read as every live bench reads
it (router/demo/replay.py ``read_answer``; the requests ask for ``stream_options:
{include_usage: true}``): TTFT at the first event that carries a token, TPOT from it to the
last token (per output token after the first, from the usage's count), the end at
``[DONE]``. The router's added latency is the difference of the two phases' percentiles
(same load, same replicas, same round-robin spread; with ``--policy ours`` the difference
also contains the cache hits the router wins). Memory: the router's RSS sampled every
second; ``rss_first_mb`` / ``rss_last_mb`` are the means of the
first and last 10 % of the router phase. Errors: any non-200, a transport error, or a
stream ``read_answer`` does not take for an answer (keyed by its reason: without a token,
without its usage chunk, cut short before ``[DONE]``, an error event).

Prints one JSON object. On a 2-core machine the load generator, the router and 16 mock
engines share the CPUs; the figures are therefore an upper bound of the router's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from router.bench.measure import emit, percentile, use_uvloop
from router.bench.ports import free_port as _free_port
from router.cliargs import at_least, non_negative_float, positive_float

if TYPE_CHECKING:  # imported where used: ``kvrouter bench`` imports every bench to list it
    import aiohttp

    from router.demo.replay import Outcome
from router.sigterm import held

KVROUTER = str(Path(sys.executable).parent / "kvrouter")


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def _wait_health(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not healthy after {timeout}s")


class Procs:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - owned by the child
        with held():
            proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            self.procs.append(proc)
        log.close()
        return proc

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _prompt(i: int, tokens: int) -> list[int]:
    prefix = [(i % 64) * 7919 % 50000 + j for j in range(tokens // 2)]
    return prefix + [(i * 31 + j) % 50000 for j in range(tokens - len(prefix))]


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Outcome:
    """One request, its answer read by ``read_answer``; a failed Outcome's ``error`` names
    the status, the transport error or why the stream was not an answer."""
    import aiohttp

    from router.demo.replay import Outcome, read_answer

    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                await resp.read()
                return Outcome(False, error=str(resp.status))
            return await read_answer(resp, Outcome(True), t0)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Outcome(False, error=type(exc).__name__)


async def _load(
    urls: list[str], concurrency: int, duration: float, prompt_tokens: int, max_tokens: int
) -> dict[str, Any]:
    ttft: list[float] = []
    total: list[float] = []
    import aiohttp

    tpot: list[float] = []
    errors: dict[str, int] = {}
    error_at: list[float] = []
    started = time.monotonic()
    stop_at = started + duration
    counter = 0

    async def worker(w: int, session: aiohttp.ClientSession) -> None:
        nonlocal counter
        url = urls[w % len(urls)] + "/v1/completions"
        while time.monotonic() < stop_at:
            counter += 1
            body = {
                "model": "m",
                "prompt": _prompt(counter, prompt_tokens),
                "max_tokens": max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},  # read_answer's output length
            }
            out = await _one(session, url, body)
            if not out.ok:
                errors[out.error] = errors.get(out.error, 0) + 1
                error_at.append(time.monotonic() - started)
                continue
            ttft.append(out.ttft_s)
            total.append(out.e2e_s)
            per_token = out.tpot_s()
            if per_token is not None:
                tpot.append(per_token)

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(worker(w, session) for w in range(concurrency)))
    return {"ttft": ttft, "total": total, "tpot": tpot, "errors": errors, "error_at": error_at}


def _summary(res: dict[str, Any], seconds: float) -> dict[str, Any]:
    ttft, total, tpot = res["ttft"], res["total"], res["tpot"]
    out: dict[str, Any] = {"requests": len(total), "rps": round(len(total) / seconds, 1)}
    out["errors"] = res["errors"]
    if res["error_at"]:  # when errors happened, seconds into the phase
        out["errors_first_s"] = round(min(res["error_at"]), 2)
        out["errors_last_s"] = round(max(res["error_at"]), 2)
    if ttft:
        out["ttft_p50_ms"] = round(percentile(ttft, 50) * 1000, 1)
        out["ttft_p99_ms"] = round(percentile(ttft, 99) * 1000, 1)
        out["total_p50_ms"] = round(percentile(total, 50) * 1000, 1)
        out["total_p99_ms"] = round(percentile(total, 99) * 1000, 1)
    if tpot:  # answers of more than one token
        out["tpot_p50_ms"] = round(percentile(tpot, 50) * 1000, 2)
        out["tpot_p99_ms"] = round(percentile(tpot, 99) * 1000, 2)
    return out


async def _sample_rss(pid: int, every: float, out: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        out.append(_rss_mb(pid))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


def run(args: argparse.Namespace) -> int:
    use_uvloop()
    workdir = Path(tempfile.mkdtemp(prefix="kvr-reliability-"))
    procs = Procs(workdir)
    try:
        mocks = []
        for i in range(args.replicas):
            port = _free_port()
            p = procs.spawn(
                f"mock{i}",
                [KVROUTER, "mock-replica", "--port", str(port), "--replica", f"r{i}"]
                + ["--model", "m", "--block-size", "16", "--log-level", "WARNING"],
            )
            mocks.append((f"r{i}", f"http://127.0.0.1:{port}", p))
        for _, url, p in mocks:
            _wait_health(url, p)
        rport = _free_port()
        cfg = workdir / "router.toml"
        lines = ["[server]", f"port = {rport}", 'log_level = "warning"', "pool_per_replica = 1024"]
        cap = getattr(args, "max_speculative_blocks", None)
        if cap is not None:
            lines.append(f"max_speculative_blocks = {cap}")
        for name, url, _ in mocks:
            lines += ["[[replicas]]", f'name = "{name}"', f'url = "{url}"', 'model = "m"']
        lines += ["[models.m]", "block_size = 16", f'policy = "{args.policy}"']
        cfg.write_text("\n".join(lines) + "\n")
        router = procs.spawn("router", [KVROUTER, "serve", "--config", str(cfg)])
        rurl = f"http://127.0.0.1:{rport}"
        _wait_health(rurl, router)

        result: dict[str, Any] = {
            "bench": "reliability",
            "replicas": args.replicas,
            "concurrency": args.concurrency,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "policy": args.policy,
            "cpus": os.cpu_count(),
        }
        if args.direct_duration > 0:
            direct = asyncio.run(
                _load(
                    [u for _, u, _ in mocks],
                    args.concurrency,
                    args.direct_duration,
                    args.prompt_tokens,
                    args.max_tokens,
                )
            )
            result["direct"] = _summary(direct, args.direct_duration)

        samples: list[float] = []

        async def routed() -> dict[str, Any]:
            stop = asyncio.Event()
            sampler = asyncio.create_task(_sample_rss(router.pid, 1.0, samples, stop))
            res = await _load(
                [rurl], args.concurrency, args.duration, args.prompt_tokens, args.max_tokens
            )
            stop.set()
            await sampler
            return res

        res = asyncio.run(routed())
        result["router"] = _summary(res, args.duration)
        k = max(1, len(samples) // 10)
        result["rss_first_mb"] = round(sum(samples[:k]) / k, 1)
        result["rss_last_mb"] = round(sum(samples[-k:]) / k, 1)
        result["rss_max_mb"] = round(max(samples), 1)
        result["rss_every_10s_mb"] = [round(x, 1) for x in samples[::10]]
        if "direct" in result and "ttft_p50_ms" in result["direct"]:
            d, r = result["direct"], result["router"]
            result["added_ttft_p50_ms"] = round(r["ttft_p50_ms"] - d["ttft_p50_ms"], 1)
            result["added_ttft_p99_ms"] = round(r["ttft_p99_ms"] - d["ttft_p99_ms"], 1)
            result["added_total_p50_ms"] = round(r["total_p50_ms"] - d["total_p50_ms"], 1)
            result["added_total_p99_ms"] = round(r["total_p99_ms"] - d["total_p99_ms"], 1)
        result["router_alive"] = router.poll() is None
        emit(result)
        errors = sum(result["router"]["errors"].values())
        return 0 if errors == 0 and result["router_alive"] else 1
    finally:
        procs.stop()


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("reliability", help="many concurrent streams through one router")
    p.add_argument("--replicas", type=at_least(1), default=16)
    p.add_argument("--concurrency", type=at_least(1), default=1000)
    p.add_argument("--duration", type=positive_float, default=60.0)
    p.add_argument("--direct-duration", type=non_negative_float, default=20.0)
    p.add_argument("--prompt-tokens", type=at_least(1), default=256)
    p.add_argument("--max-tokens", type=at_least(1), default=16)
    p.add_argument(
        "--max-speculative-blocks",
        type=at_least(0),
        help="router's cap on speculative index entries (default: the router's own)",
    )
    p.add_argument(
        "--policy",
        default="round_robin",
        help="router policy; round_robin (default) makes the router phase comparable with the "
        "round-robin direct phase, so the difference is the proxy's cost, not routing quality",
    )
    p.set_defaults(handler=run)
