"""``kvrouter bench grpc``: Router.Pick throughput and latency for gateways.

A router process (RouterState + the gRPC server, 8 replicas of one model, index populated
with the prompts' prefixes on different replicas) serves Pick; this process runs
``--concurrency`` callers on one channel, each sending 8k-token prompts as token ids, for
``--seconds``. Prints requests/s and latency percentiles. Server and clients share the
machine's cores (2 here), so the figure is a floor for a dedicated router.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import random
import time
from multiprocessing.connection import Connection
from typing import Any

from router.bench.measure import emit, percentile
from router.cliargs import at_least, positive_float

MODEL = "bench-model"


def _prompts(count: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(100_000) for _ in range(tokens // 4)]
    out = []
    for _ in range(count):
        out.append(system + [rng.randrange(100_000) for _ in range(tokens - len(system))])
    return out


def _server_main(conn: Connection, args: dict[str, Any]) -> None:
    import uvloop

    from router.core.hashing import hash_prompt, root_hash
    from router.rpc.server import loop_clock, serve_grpc
    from router.rpc.settings import GrpcSettings
    from router.service.config import build_settings
    from router.service.state import RouterState

    async def main() -> None:
        settings = build_settings(
            {
                "replicas": [
                    {"url": f"http://127.0.0.1:{20000 + i}", "model": MODEL, "name": f"r{i}"}
                    for i in range(args["replicas"])
                ],
                "models": {MODEL: {"block_size": args["block_size"], "policy": args["policy"]}},
            }
        )
        state = RouterState(settings)
        root = root_hash(MODEL)
        keys = state.registry.keys_for(MODEL)
        for i, prompt in enumerate(_prompts(args["sessions"], args["tokens"], args["seed"])):
            hashes = hash_prompt(prompt, args["block_size"], root).hashes
            state.index.store(keys[i % len(keys)], hashes[: len(hashes) * 3 // 4])
        gen = serve_grpc(state, GrpcSettings(port=0), loop_clock)
        _, port = await gen.__anext__()
        conn.send(port)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, conn.recv)  # until the parent says stop
        await gen.aclose()

    uvloop.run(main())


async def _clients(port: int, args: argparse.Namespace) -> tuple[list[float], int]:
    import grpc

    from router.rpc.gen import router_pb2, router_pb2_grpc

    prompts = _prompts(args.sessions, args.tokens, args.seed)
    requests = [
        router_pb2.PickRequest(model=MODEL, token_ids=router_pb2.TokenIds(ids=p)) for p in prompts
    ]
    report = router_pb2.ReportRequest
    latencies: list[float] = []
    errors = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        await stub.Pick(requests[0])
        deadline = time.perf_counter() + args.seconds

        async def caller(i: int) -> None:
            nonlocal errors
            n = i
            while time.perf_counter() < deadline:
                req = requests[n % len(requests)]
                n += args.concurrency
                t0 = time.perf_counter()
                try:
                    resp = await stub.Pick(req, timeout=10)
                except grpc.aio.AioRpcError:
                    errors += 1
                    continue
                latencies.append((time.perf_counter() - t0) * 1e3)
                if args.report:
                    # Completing keeps the router's load model flat over the run.
                    await stub.Report(report(decision_id=resp.decision_id, phase=report.COMPLETED))

        await asyncio.gather(*(caller(i) for i in range(args.concurrency)))
    return latencies, errors


def run(args: argparse.Namespace) -> int:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    server_args = {
        k: getattr(args, k)
        for k in ("replicas", "tokens", "sessions", "seed", "block_size", "policy")
    }
    proc = ctx.Process(target=_server_main, args=(child, server_args), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("gRPC bench server did not start")
        port = parent.recv()
        t0 = time.perf_counter()
        latencies, errors = asyncio.run(_clients(port, args))
        elapsed = time.perf_counter() - t0
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    emit(
        {
            "bench": "grpc",
            "concurrency": args.concurrency,
            "prompt_tokens": args.tokens,
            "replicas": args.replicas,
            "policy": args.policy,
            "seconds": round(elapsed, 2),
            "picks": len(latencies),
            "errors": errors,
            "picks_per_s": round(len(latencies) / elapsed, 1),
            "p50_ms": round(percentile(latencies, 50), 3) if latencies else None,
            "p99_ms": round(percentile(latencies, 99), 3) if latencies else None,
            "reports": bool(args.report),
        }
    )
    return 0 if latencies and not errors else 1


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("grpc", help="Router.Pick requests/s and latency over gRPC")
    p.add_argument("--concurrency", type=at_least(1), default=64)
    p.add_argument("--tokens", type=at_least(1), default=8192, help="prompt tokens (as token ids)")
    p.add_argument("--seconds", type=positive_float, default=10.0)
    p.add_argument("--replicas", type=at_least(1), default=8)
    p.add_argument("--sessions", type=at_least(1), default=64, help="distinct prompts")
    p.add_argument("--block-size", type=at_least(1), default=64)
    p.add_argument("--policy", default="ours")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--no-report",
        dest="report",
        action="store_false",
        help="skip the Report(COMPLETED) that normally follows each Pick",
    )
    p.set_defaults(handler=run)
