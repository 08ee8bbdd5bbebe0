"""``kvrouter bench stalls``: how long the router's event loop stalls under KV events and requests.

Every request's first byte and every streamed token the router relays waits while its event
loop is held, by a long callback or by a garbage collection (a full, generation-2 collection
scans every GC-tracked object of the process, so its pause grows with what the process keeps).

Setup (loopback, real processes): ``--replicas`` ``kvrouter mock-replica`` processes (fast
modelled time, publishing their KV events over ZMQ), ``--feeds`` event feeds (a process each:
``KVEventPublisher``, vLLM's wire format) that publish ``--batches`` batches of ``--blocks``
engine blocks (16 tokens; one prompt a batch, as an engine's prefill step) at ``--rate``
batches a second, each registered as one more replica of the router (served by the mock
replicas' URLs), and a closed-loop load generator process (``--concurrency`` streaming
``/v1/completions`` over shared prefixes). The router runs in this process, its
collector set up as ``kvrouter serve`` sets it up (``gc.freeze()`` at start-up) or, with
``--gc off``, turned off (the floor).

While the feeds publish: a 1 ms ticker records how late it runs (``lag_*_ms``: p50, p99,
max), ``gc.callbacks`` the generation and duration of every collection (``gc``: count, total
and largest pause by generation). Also: the GC-tracked objects the process holds at the end
(``tracked_objects``, frozen ones excluded), the index's entries and the load generator's
requests and TTFT percentiles. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from router.bench.measure import emit, percentile, use_uvloop
from router.bench.ports import free_port as _free_port
from router.bench.reliability_bench import KVROUTER, Procs, _wait_health
from router.cliargs import at_least, positive_float
from router.sigterm import held

ENGINE_BLOCK = 16
MODEL = "m"


# ---------------------------------------------------------------------------- child roles


async def _feed(
    endpoint: str, replay: str, batches: int, blocks: int, rate: float, seed: int
) -> None:
    """Publish ``batches`` stores of fresh prompts at ``rate`` a second, then linger until
    killed (the router may still ask the replay socket)."""
    from router.core.hashing import hash_prompt, root_hash
    from router.core.types import BlocksStored
    from router.events.encode import encode_batch
    from router.events.model import EngineBatch
    from router.events.zmq_pub import KVEventPublisher
    from router.mock.kv_events import EngineEventEncoder

    rng = random.Random(seed)
    encoder = EngineEventEncoder(64, ENGINE_BLOCK)
    payloads = []
    for _ in range(batches):
        tokens = [rng.randrange(50_000) for _ in range(blocks * ENGINE_BLOCK)]
        hashes = hash_prompt(tokens, 64, root_hash(MODEL)).hashes
        encoder.learn(hashes, tokens)
        events = encoder.convert([BlocksStored(tuple(hashes))])
        payloads.append(encode_batch(EngineBatch(time.time(), tuple(events), None)))
    pub = KVEventPublisher(endpoint, replay, buffer_steps=batches)
    pub.start()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # go
    start = time.monotonic()
    for i, payload in enumerate(payloads):
        due = start + i / rate
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        await pub.publish_raw(payload)
    print("done", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # stop
    await pub.close()


def _load(url: str, concurrency: int, seconds: float, prompt_tokens: int, max_tokens: int) -> None:
    from router.bench.reliability_bench import _load as load
    from router.bench.reliability_bench import _summary

    print("ready", flush=True)
    sys.stdin.readline()  # go
    res = asyncio.run(load([url], concurrency, seconds, prompt_tokens, max_tokens))
    print(json.dumps(_summary(res, seconds)), flush=True)


def child(argv: list[str]) -> None:
    role, *rest = argv
    if role == "feed":
        endpoint, replay, batches, blocks, rate, seed = rest
        asyncio.run(_feed(endpoint, replay, int(batches), int(blocks), float(rate), int(seed)))
    elif role == "load":
        url, concurrency, seconds, prompt_tokens, max_tokens = rest
        _load(url, int(concurrency), float(seconds), int(prompt_tokens), int(max_tokens))


# ---------------------------------------------------------------------------- measuring


class Stalls:
    """A 1 ms ticker's lateness and every collection's generation and duration."""

    def __init__(self) -> None:
        self.late: list[float] = []
        self.collections: list[tuple[int, float]] = []
        self._started = 0.0

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.collections.append((info["generation"], time.perf_counter() - self._started))

    async def tick(self) -> None:
        loop = asyncio.get_running_loop()
        gc.callbacks.append(self._gc)
        try:
            while True:
                asked = loop.time() + 0.001
                await asyncio.sleep(0.001)
                self.late.append(max(loop.time() - asked, 0.0))
        finally:
            gc.callbacks.remove(self._gc)

    def figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ticks": len(self.late)}
        if self.late:
            out["lag_p50_ms"] = round(percentile(self.late, 50) * 1e3, 2)
            out["lag_p99_ms"] = round(percentile(self.late, 99) * 1e3, 2)
            out["lag_max_ms"] = round(max(self.late) * 1e3, 1)
            out["lags_over_50ms"] = sum(x > 0.05 for x in self.late)
        for gen in range(3):
            pauses = [d for g, d in self.collections if g == gen]
            out[f"gc{gen}"] = {
                "count": len(pauses),
                "total_ms": round(sum(pauses) * 1e3, 1),
                "max_ms": round(max(pauses, default=0.0) * 1e3, 2),
            }
        return out


# ---------------------------------------------------------------------------- the run


def _config(
    workdir: Path,
    port: int,
    mocks: list[tuple[str, str, str, str]],
    feeds: list[tuple[str, str, str]],
) -> Path:
    lines = ["[server]", f"port = {port}", 'log_level = "warning"', "pool_per_replica = 256"]
    for name, url, pub, replay in mocks:
        lines += ["[[replicas]]", f'name = "{name}"', f'url = "{url}"', f'model = "{MODEL}"']
        lines += [f'zmq = "{pub}"', f'zmq_replay = "{replay}"']
    for i, (name, pub, replay) in enumerate(feeds):
        url = mocks[i % len(mocks)][1]
        lines += ["[[replicas]]", f'name = "{name}"', f'url = "{url}"', f'model = "{MODEL}"']
        lines += [f'zmq = "{pub}"', f'zmq_replay = "{replay}"']
    lines += [f"[models.{MODEL}]", "block_size = 64", 'policy = "ours"']
    path = workdir / "router.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _child(procs: Procs, name: str, argv: list[str]) -> Any:
    import subprocess

    with held():
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.bench.stall_bench", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(procs.workdir / f"{name}.log", "wb"),  # noqa: SIM115 - the child's
            text=True,
        )
        procs.procs.append(proc)  # type: ignore[arg-type]
    if proc.stdout is None or proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"{name} did not start: {procs.workdir / (name + '.log')}")
    return proc


def _setup_gc(mode: str) -> None:
    gc.freeze()  # as kvrouter serve does at start-up (router/service/cli.py)
    if mode == "off":
        gc.disable()


async def _measure(
    args: argparse.Namespace, cfg: Path, port: int, feeds: list[Any], load: Any
) -> dict[str, Any]:
    from router.service.app import create_app, start
    from router.service.config import load_settings

    app = create_app(load_settings(str(cfg)))
    _setup_gc(args.gc)
    running = await start(app, "127.0.0.1", port)
    loop = asyncio.get_running_loop()
    stalls = Stalls()
    try:
        await asyncio.sleep(1.0)  # the subscribers connect (a late one replays what it missed)
        ticker = asyncio.create_task(stalls.tick())
        for proc in [*feeds, load]:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        t0 = time.monotonic()
        for proc in feeds:
            line = await loop.run_in_executor(None, proc.stdout.readline)
            if line.strip() != "done":
                raise RuntimeError("an event feed failed")
        feeding = time.monotonic() - t0
        load_line = await loop.run_in_executor(None, load.stdout.readline)
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
        from router.service.keys import INDEX

        stats = app[INDEX].stats()
        t0 = time.perf_counter()
        gc.collect()
        collect_ms = (time.perf_counter() - t0) * 1e3
        tracked = gc.get_objects()
        result = {
            "feeding_s": round(feeding, 1),
            **stalls.figures(),
            "full_collection_ms": round(collect_ms, 1),  # one more, after the run
            "tracked_objects": len(tracked),
            "tracked_top": dict(Counter(type(o).__name__ for o in tracked).most_common(6)),
            "kv_entries": stats.kv_entries,
            "requests": json.loads(load_line),
        }
    finally:
        await running.cleanup()
        gc.enable()
    return result


def run(args: argparse.Namespace) -> int:
    use_uvloop()
    workdir = Path(tempfile.mkdtemp(prefix="kvr-stalls-"))
    procs = Procs(workdir)
    try:
        mocks = []
        for i in range(args.replicas):
            port, pub, replay = _free_port(), _free_port(), _free_port()
            p = procs.spawn(
                f"mock{i}",
                [KVROUTER, "mock-replica", "--port", str(port), "--replica", f"r{i}"]
                + ["--model", MODEL, "--block-size", "64", "--time-scale", "0.05"]
                + ["--zmq", f"tcp://127.0.0.1:{pub}", "--replay", f"tcp://127.0.0.1:{replay}"]
                + ["--log-level", "WARNING"],
            )
            url = f"http://127.0.0.1:{port}"
            mocks.append((f"r{i}", url, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", p))
        for _, url, _, _, p in mocks:
            _wait_health(url, p)
        feed_eps = [
            (f"feed{i}", f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}")
            for i in range(args.feeds)
        ]
        feeds = [
            _child(
                procs,
                name,
                ["feed", pub, replay, str(args.batches), str(args.blocks), str(args.rate), str(i)],
            )
            for i, (name, pub, replay) in enumerate(feed_eps)
        ]
        rport = _free_port()
        seconds = args.batches / args.rate
        load = _child(procs, "load", ["load", f"http://127.0.0.1:{rport}", str(args.concurrency),
                                      str(seconds), str(args.prompt_tokens), "16"])  # fmt: skip
        cfg = _config(workdir, rport, [m[:4] for m in mocks], feed_eps)
        result: dict[str, Any] = {
            "bench": "stalls",
            "gc_setup": args.gc,
            "replicas": args.replicas,
            "feeds": args.feeds,
            "batches": args.batches,
            "blocks": args.blocks,
            "rate": args.rate,
            "concurrency": args.concurrency,
            "cpus": os.cpu_count(),
        }
        result.update(asyncio.run(_measure(args, cfg, rport, feeds, load)))
        for proc in feeds:
            proc.stdin.write("stop\n")
            proc.stdin.flush()
        emit(result)
        return 0
    finally:
        procs.stop()


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("stalls", help="event-loop stalls and GC pauses under events and requests")
    p.add_argument("--replicas", type=at_least(1), default=2, help="mock replicas serving requests")
    p.add_argument("--feeds", type=at_least(1), default=2, help="event feeds (one engine each)")
    p.add_argument("--batches", type=at_least(1), default=5000, help="batches each feed publishes")
    p.add_argument("--blocks", type=at_least(1), default=32, help="engine blocks a batch")
    p.add_argument("--rate", type=positive_float, default=500.0, help="batches a second, each feed")
    p.add_argument(
        "--concurrency", type=at_least(1), default=8, help="streaming requests in flight"
    )
    p.add_argument("--prompt-tokens", type=at_least(1), default=1024)
    p.add_argument(
        "--gc", choices=("serve", "off"), default="serve",
        help="the collector as kvrouter serve sets it up (gc.freeze() at start-up), or off",
    )  # fmt: skip
    p.set_defaults(handler=run)


if __name__ == "__main__":
    child(sys.argv[1:])
