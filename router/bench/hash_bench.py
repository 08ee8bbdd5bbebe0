"""``kvrouter bench hash``: canonical block hashing speed."""

from __future__ import annotations

import argparse
import time

import numpy as np
import xxhash

from router.bench.measure import emit, percentile
from router.cliargs import at_least
from router.core.hashing import as_u32_array, hash_prompt, root_hash


def run(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(0, 200_000, args.tokens, dtype=np.uint32)
    as_list = tokens.tolist()
    root = root_hash("bench-model")
    hash_prompt(tokens, args.block_size, root)  # warm up
    hash_ms, list_ms, floor_ms = [], [], []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        hash_prompt(tokens, args.block_size, root)
        hash_ms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        hash_prompt(as_list, args.block_size, root)
        list_ms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        xxhash.xxh3_64_intdigest(as_u32_array(tokens).tobytes())
        floor_ms.append((time.perf_counter() - t0) * 1e3)
    emit(
        {
            "bench": "hash",
            "tokens": args.tokens,
            "block_size": args.block_size,
            "blocks": args.tokens // args.block_size,
            "hash_ms": round(percentile(hash_ms, 50), 3),
            "hash_ms_from_list": round(percentile(list_ms, 50), 3),
            "single_pass_floor_ms": round(percentile(floor_ms, 50), 3),
            "reps": args.reps,
        }
    )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("hash", help="time chained block hashing of one long prompt")
    p.add_argument("--tokens", type=at_least(1), default=1_000_000)
    p.add_argument("--block-size", type=at_least(1), default=64)
    p.add_argument("--reps", type=at_least(1), default=20)
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(handler=run)
