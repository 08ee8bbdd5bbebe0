"""``kvrouter bench instructions``: CPU instructions per proxied request, counted by valgrind.

Requests per second on a shared 2-core box move by 10-30 % between runs; instruction counts do
not. This runs each router under ``valgrind --tool=callgrind`` with instrumentation off,
warms it up, counts only while ``--requests`` requests go through it (a closed loop of
``--connections`` keep-alive clients, the proxy benchmark's body and backends), and prints
instructions per request (user space only: the kernel's share of the socket calls is not
counted, and is about the same for every router). Same run: kvrouter, and vllm-router when it
is installed (``--vllm-router PATH`` or on PATH; ``pip install vllm-router`` in a venv of its
own); with ``--limits`` kvrouter a second time with API keys and limits on
(``kvrouter_limits``).

Valgrind runs programs ~50x slower; the figures are counts, not times. Needs ``valgrind``
(Debian: ``apt-get install valgrind``).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from router.bench.measure import emit
from router.bench.ports import free_port as _free_port
from router.bench.proxy_bench import (
    API_KEY,
    VLLM_ROUTER_MISSING,
    _stop,
    _vllm_router_bin,
    _wait_http,
    chat_body,
    kvrouter_config,
    start_backend,
)
from router.cliargs import at_least
from router.sigterm import held


def _closed_loop(port: int, body: bytes, requests: int, connections: int) -> int:
    """Send ``requests`` POSTs over ``connections`` keep-alive connections, each waiting for
    its answer (Content-Length or chunked); returns how many were not 200."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n" % (API_KEY.encode(), len(body))
    )
    left = [requests]
    bad = [0]
    lock = threading.Lock()

    def client() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=600) as sock:
            f = sock.makefile("rb")
            while True:
                with lock:
                    if left[0] <= 0:
                        return
                    left[0] -= 1
                sock.sendall(head + body)
                status = f.readline()
                length, chunked = 0, False
                while (line := f.readline()) not in (b"\r\n", b""):
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                    elif name.lower() == b"transfer-encoding":
                        chunked = b"chunked" in value.lower()
                if chunked:
                    while (size := int(f.readline().strip(), 16)) > 0:
                        f.read(size + 2)
                    f.readline()
                else:
                    f.read(length)
                if b" 200 " not in status:
                    with lock:
                        bad[0] += 1

    threads = [threading.Thread(target=client) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return bad[0]


def _count(
    command: list[str], port: int, args: argparse.Namespace, out_dir: Path
) -> dict[str, Any]:
    """Instructions per request of the server ``command`` listening on ``port``."""
    prefix = out_dir / f"cg-{port}"
    proc: subprocess.Popen[bytes] | None = None
    try:
        with held():
            proc = subprocess.Popen(
                ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
                + [f"--callgrind-out-file={prefix}.%p", *command],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        _wait_http(f"http://127.0.0.1:{port}/health", timeout=600)
        body = chat_body(args.stream).encode()
        bad = _closed_loop(port, body, args.warmup, args.connections)
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], capture_output=True)
        bad += _closed_loop(port, body, args.requests, args.connections)
        subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], capture_output=True)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], capture_output=True)
        time.sleep(0.5)
    finally:
        _stop(proc)
    total = 0
    for path in out_dir.glob(f"{prefix.name}.*"):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith(("summary:", "totals:")):
                total = max(total, int(line.split()[1]))
    return {
        "instructions_per_request": round(total / args.requests),
        "failed_requests": bad,
    }


def run(args: argparse.Namespace) -> int:
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is needed: apt-get install valgrind")
    ports = [_free_port() for _ in range(args.backends)]
    backend: subprocess.Popen[bytes] | None = None
    result: dict[str, Any] = {
        "bench": "instructions",
        "stream": args.stream,
        "requests": args.requests,
        "connections": args.connections,
        "backends": args.backends,
    }
    try:
        with held():
            backend = start_backend(ports)
        _wait_http(f"http://127.0.0.1:{ports[0]}/health")
        with tempfile.TemporaryDirectory() as tmp:
            out_dir = Path(tmp)
            kv_port = _free_port()
            cfg = out_dir / "kvrouter.toml"
            kvrouter_config(cfg, ports, kv_port, 1)
            result["kvrouter"] = _count(
                [sys.executable, "-m", "router.cli", "serve", "--config", str(cfg)],
                kv_port,
                args,
                out_dir,
            )
            if args.limits:  # the same with API keys and limits on (proxy_bench --limits)
                kv_port = _free_port()
                kvrouter_config(cfg, ports, kv_port, 1, limits=True)
                result["kvrouter_limits"] = _count(
                    [sys.executable, "-m", "router.cli", "serve", "--config", str(cfg)],
                    kv_port,
                    args,
                    out_dir,
                )
            binary = _vllm_router_bin(args.vllm_router)
            if args.without_peer:
                result["vllm_router"] = {"skipped": "--without-peer"}
            elif binary is None:
                result["vllm_router"] = {"error": VLLM_ROUTER_MISSING}
            else:
                vr_port = _free_port()
                result["vllm_router"] = _count(
                    [binary, "--host", "127.0.0.1", "--port", str(vr_port)]
                    + ["--policy", "round_robin", "--log-level", "warning", "--worker-urls"]
                    + [f"http://127.0.0.1:{p}" for p in ports],
                    vr_port,
                    args,
                    out_dir,
                )
    finally:
        _stop(backend)
    kv = result["kvrouter"].get("instructions_per_request")
    vr = result.get("vllm_router", {}).get("instructions_per_request")
    if kv and vr:
        result["kvrouter_vs_vllm_router"] = round(kv / vr, 2)
    emit(result)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "instructions", help="CPU instructions per proxied request (valgrind callgrind)"
    )
    p.add_argument("--requests", type=at_least(1), default=2000)
    p.add_argument("--warmup", type=at_least(0), default=300)
    p.add_argument("--connections", type=at_least(1), default=8)
    p.add_argument("--backends", type=at_least(1), default=4)
    p.add_argument("--stream", action="store_true", help="streamed answers (SSE)")
    p.add_argument("--vllm-router", help="path of the vllm-router binary")
    p.add_argument("--without-peer", action="store_true", help="count kvrouter only")
    p.add_argument(
        "--limits",
        action="store_true",
        help="count kvrouter again with client API keys, a per-key limit and the header limit on",
    )
    p.set_defaults(handler=run)
