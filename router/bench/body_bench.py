"""``kvrouter bench body``: the router's work on a token-id completion body before routing.

A body of ``N`` random token ids (the shape agentic clients and vllm-router's own clients send)
goes through what the service does with it: ``parse_body`` then
``PromptProcessor.completion`` (type check, uint32 array, block hashes). The ``stdlib`` row
does the same with the standard library's parser and a per-element ``isinstance`` check, the
way the service did before; ``speedup`` is stdlib over service, measured in the same run.
Figures: median milliseconds per body over ``--reps``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from typing import Any

from router.bench.measure import emit, percentile
from router.cliargs import at_least, sizes


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return round(percentile(samples, 50), 3)


def run(args: argparse.Namespace) -> int:
    from router.core.hashing import hash_prompt, root_hash
    from router.service.intake import parse_body
    from router.tokenize.pipeline import PromptProcessor

    processor = PromptProcessor("bench", args.block_size)
    root = root_hash("bench")
    rng = random.Random(0)
    rows: dict[str, dict[str, float]] = {}
    for n in args.tokens:
        tokens = [rng.randrange(1, 200_000) for _ in range(n)]
        raw = json.dumps({"model": "bench", "prompt": tokens, "max_tokens": 64}).encode()

        def service(raw: bytes = raw) -> Any:
            return processor.completion(parse_body(raw))

        def stdlib(raw: bytes = raw) -> Any:
            prompt = json.loads(raw)["prompt"]
            assert all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)
            return hash_prompt(prompt, args.block_size, root)

        ours, base = _median_ms(service, args.reps), _median_ms(stdlib, args.reps)
        rows[str(n)] = {
            "body_kb": round(len(raw) / 1024, 1),
            "service_ms": ours,
            "stdlib_ms": base,
            "speedup": round(base / ours, 2) if ours else 0.0,
        }
    emit({"bench": "body", "block_size": args.block_size, "rows": rows})
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("body", help="request-body parsing of token-id prompts")
    p.add_argument(
        "--tokens", type=sizes, default="1000,20000,60000,1000000", help="comma-separated sizes"
    )
    p.add_argument("--block-size", type=at_least(1), default=64)
    p.add_argument("--reps", type=at_least(1), default=9)
    p.set_defaults(handler=run)
