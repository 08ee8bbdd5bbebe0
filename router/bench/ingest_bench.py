"""``kvrouter bench ingest``: the router's CPU to take in engine KV events.

Builds the payloads an engine publishes for ``--requests`` prompts of ``--tokens`` random
token ids (engine blocks of ``--engine-block-size``, vLLM's msgpack layout), then feeds them
through the path ``kvrouter serve`` runs for each payload of its ZMQ subscribers:
``EngineIngest.handle_payload`` (decode, re-block to ``--block-size``) into a ``PrefixIndex``
(``DirectEvents``' sink). Two shapes of publication:

* ``per_block``: one ``BlockStored`` event per engine block, a batch per prompt (an engine
  that records each block on its own, as SGLang's radix cache does);
* ``step``: one ``BlockStored`` event with all the prompt's blocks, as vLLM publishes the
  blocks a prefill step completed and ``kvrouter mock-replica`` publishes them
  (router/mock/kv_events.py; what ``kvrouter bench live`` runs).

Then the same blocks are removed (one ``BlockRemoved`` batch per prompt, as evictions).
``--window W``: a full + sliding-window model's events, every block published in a window
group of W tokens too (router/events/window.py).
Figures are process CPU seconds (``time.process_time``), best of ``--reps`` rounds, each
round on a fresh ingest and index: per engine block and per prompt, stored and removed, and
the decode's share. ``events_digest`` hashes every canonical event the round produced: equal
digests mean the same index, whatever the code's speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from typing import Any

import xxhash

from router.bench.measure import emit
from router.cliargs import at_least
from router.core.hashing import hash_prompt, root_hash
from router.core.index import PrefixIndex
from router.core.types import BlocksRemoved, BlocksStored, EventBatch, IndexEvent, ReplicaKey
from router.events.decode import decode_payload
from router.events.encode import encode_batch
from router.events.ingest import EngineIngest
from router.events.model import EngineBatch, EngineBlockRemoved, EngineBlockStored
from router.mock.kv_events import EngineEventEncoder

MODEL = "bench-model"
SHAPES = ("per_block", "step")


def _prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(200_000) for _ in range(args.tokens)] for _ in range(args.requests)]


def _payloads(args: argparse.Namespace, shape: str) -> tuple[list[bytes], list[bytes], int]:
    """(stored payloads, removed payloads, engine blocks stored) of the prompts."""
    encoder = EngineEventEncoder(args.block_size, args.engine_block_size)
    stored: list[bytes] = []
    removed: list[bytes] = []
    blocks = 0
    for tokens in _prompts(args):
        hashes = hash_prompt(tokens, args.block_size, root_hash(MODEL)).hashes
        encoder.learn(hashes, tokens)
        events = encoder.convert([BlocksStored(tuple(hashes))])
        gone = encoder.convert([BlocksRemoved(tuple(reversed(hashes)))])
        if args.window:
            events, gone = _with_window(events, args.window), _with_window(gone, args.window)
        if shape == "per_block":
            events = [one for e in events for one in _per_block(e)]
        blocks += sum(len(e.block_hashes) for e in events if isinstance(e, EngineBlockStored))
        stored.append(encode_batch(EngineBatch(time.time(), tuple(events), None)))
        removed.append(encode_batch(EngineBatch(time.time(), tuple(gone), None)))
    assert all(isinstance(e, EngineBlockRemoved) for p in removed for e in decode_events(p))
    return stored, removed, blocks


def _with_window(events: list[Any], window: int) -> list[Any]:
    """``events`` and, after each, the same blocks in a sliding-window group (group 1), as a
    full + sliding-window model publishes them (every block kept: the dense case)."""
    out = []
    for ev in events:
        out.append(ev)
        if isinstance(ev, EngineBlockStored):
            out.append(dataclasses.replace(ev, group_idx=1, kv_cache_spec_kind="sliding_window",
                                           kv_cache_spec_sliding_window=window))  # fmt: skip
        elif isinstance(ev, EngineBlockRemoved):
            out.append(dataclasses.replace(ev, group_idx=1))
    return out


def _per_block(event: Any) -> list[Any]:
    """``event`` as one event per engine block (removals unchanged)."""
    if not isinstance(event, EngineBlockStored):
        return [event]
    out = []
    parent, size = event.parent_block_hash, event.block_size
    for i, h in enumerate(event.block_hashes):
        tokens = event.token_ids[i * size : (i + 1) * size]
        out.append(dataclasses.replace(event, block_hashes=(h,), parent_block_hash=parent,
                                       token_ids=tokens))  # fmt: skip
        parent = h
    return out


def decode_events(payload: bytes) -> tuple[Any, ...]:
    batch = decode_payload(payload).batch
    return () if batch is None else batch.events


class _Round:
    """One round: a fresh ingest and index; CPU seconds of each phase."""

    def __init__(self, block_size: int) -> None:
        self.index = PrefixIndex()
        self.seen: list[list[IndexEvent]] = []
        self.ingest = EngineIngest("r0", MODEL, block_size, self._sink)
        self.index.add_replica(ReplicaKey("r0"))

    def _sink(self, key: ReplicaKey, events: list[IndexEvent]) -> None:
        self.index.apply(EventBatch(key, tuple(events)))
        self.seen.append(events)

    def digest(self) -> str:
        return xxhash.xxh3_64_hexdigest(repr(self.seen).encode())

    def feed(self, payloads: list[bytes]) -> float:
        handle = self.ingest.handle_payload
        t0 = time.process_time()
        for payload in payloads:
            handle(payload)
        return time.process_time() - t0


def _shape(args: argparse.Namespace, shape: str) -> dict[str, Any]:
    stored, removed, blocks = _payloads(args, shape)
    best: dict[str, float] = {}
    digest = ""
    kv_blocks = 0
    for _ in range(args.reps):
        rnd = _Round(args.block_size)
        t0 = time.process_time()
        for payload in stored:
            decode_payload(payload)
        times = {"decode": time.process_time() - t0}
        times["stored"] = rnd.feed(stored)
        kv_blocks = rnd.index.stats().kv_entries
        times["removed"] = rnd.feed(removed)
        for name, seconds in times.items():
            best[name] = min(best.get(name, seconds), seconds)
        digest = rnd.digest()
        if rnd.ingest.stats.malformed_events or rnd.index.stats().kv_entries:
            raise RuntimeError("the bench's events did not round-trip")
    per_request = blocks / args.requests
    return {
        "engine_blocks": blocks,
        "events_per_request": round(sum(len(decode_events(p)) for p in stored) / args.requests),
        "canonical_blocks": kv_blocks,
        "stored_us_per_engine_block": round(best["stored"] / blocks * 1e6, 3),
        "stored_ms_per_request": round(best["stored"] / args.requests * 1e3, 3),
        "decode_share": round(best["decode"] / max(best["stored"], 1e-9), 3),
        "removed_us_per_engine_block": round(best["removed"] / blocks * 1e6, 3),
        "ms_per_request": round((best["stored"] + best["removed"]) / args.requests * 1e3, 3),
        "blocks_per_request": round(per_request),
        "events_digest": digest,
    }


def run(args: argparse.Namespace) -> int:
    shapes = SHAPES if args.shape == "both" else (args.shape,)
    result: dict[str, Any] = {
        "bench": "ingest",
        "requests": args.requests,
        "tokens": args.tokens,
        "engine_block_size": args.engine_block_size,
        "block_size": args.block_size,
        "window": args.window,
        "reps": args.reps,
    }
    for shape in shapes:
        result[shape] = _shape(args, shape)
    emit(result)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ingest", help="CPU to decode and re-block engine KV events")
    p.add_argument("--requests", type=at_least(1), default=40, help="prompts published")
    p.add_argument("--tokens", type=at_least(1), default=14_336, help="tokens a prompt")
    p.add_argument("--engine-block-size", type=at_least(1), default=16)
    p.add_argument("--block-size", type=at_least(1), default=64, help="the router's block size")
    p.add_argument("--shape", choices=(*SHAPES, "both"), default="both")
    p.add_argument("--reps", type=at_least(1), default=5, help="rounds; the best is kept")
    p.add_argument(
        "--window", type=at_least(0), default=0,
        help="also publish each block in a sliding-window group of this many tokens",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(handler=run)
