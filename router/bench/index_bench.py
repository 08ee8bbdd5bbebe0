"""``kvrouter bench index``: prefix-index ingest speed, lookup latency and memory.

Two workloads:

* Anchor (``--blocks``): the same shape as ``dynamo_index_bench.py`` so the figures compare
  with Dynamo's RadixTree: every replica caches a ``--shared``-block prefix plus unique
  blocks up to ``--blocks``, all stored in events of 500 blocks; the query is ``--query``
  blocks, the shared prefix first.
* Fleet scale (``--unique-blocks``): a sharing pattern shaped like agentic traffic on a
  KV-aware fleet (documented in docs/benchmarks.md):
  - 16 system prompts / tool schemas of 64 blocks held by every replica;
  - 10% of unique blocks are shared documents (chains of 500 blocks), each held by
    ``--doc-replicas`` replicas;
  - the rest are session chains (200-2000 blocks) held by one replica, 30% of them also by a
    second one (the session moved).
  Queries are session continuations (system prompt + document + session + 50 new blocks),
  new sessions over a document, and cold prompts, in equal parts.

Hashes are random 64-bit ints (the index treats them as opaque). Events are generated batch
by batch and only ``apply`` is timed; memory is the RSS growth over the ingest divided by
the (block, replica) pairs stored.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections.abc import Iterator

import numpy as np

from router.bench.measure import emit, percentile, rss_mb
from router.cliargs import at_least
from router.core.index import PrefixIndex
from router.core.types import BlocksStored, EventBatch, ReplicaKey

EVENT_BLOCKS = 500


def _hashes(seed: int, count: int) -> list[int]:
    raw = np.random.Generator(np.random.PCG64(seed)).bit_generator.random_raw(count)
    return [int(x) for x in raw.tolist()]


def _chunks(hashes: list[int]) -> Iterator[tuple[int, ...]]:
    for i in range(0, len(hashes), EVENT_BLOCKS):
        yield tuple(hashes[i : i + EVENT_BLOCKS])


class _Ingest:
    def __init__(self) -> None:
        self.index = PrefixIndex()
        self.seconds = 0.0
        self.pairs = 0

    def put(self, replica: ReplicaKey, hashes: list[int]) -> None:
        for chunk in _chunks(hashes):
            batch = EventBatch(replica, (BlocksStored(chunk),))
            t0 = time.perf_counter()
            self.index.apply(batch)
            self.seconds += time.perf_counter() - t0
            self.pairs += len(chunk)


def _time_queries(
    index: PrefixIndex, queries: list[list[int]], reps: int, materialize: bool = False
) -> list[float]:
    """Per-query milliseconds of ``match``; with ``materialize`` also building the
    per-replica PrefixMatch of every matched replica (what a policy reading all does)."""
    for q in queries[:5]:
        index.match(q)
    samples = []
    for _ in range(reps):
        for q in queries:
            t0 = time.perf_counter()
            result = index.match(q)
            if materialize:
                result.as_dict()
            samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def anchor(args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)
    gc.collect()
    base = rss_mb()
    ing = _Ingest()
    shared = _hashes(args.seed, args.shared)
    for w in range(args.replicas):
        key = ReplicaKey(f"r{w}")
        ing.put(key, shared)
        ing.put(key, _hashes(args.seed * 1_000_003 + w + 1, max(0, args.blocks - args.shared)))
    grown = rss_mb() - base
    query = shared[: min(args.query, args.shared)]
    query += [rng.getrandbits(64) for _ in range(args.query - len(query))]
    samples = _time_queries(ing.index, [query], args.reps)
    full = _time_queries(ing.index, [query], args.reps, materialize=True)
    matched = ing.index.match(query)
    return {
        "workload": "anchor",
        "replicas": args.replicas,
        "blocks_per_replica": args.blocks,
        "shared_blocks": args.shared,
        "query_blocks": args.query,
        "replicas_matched": len(matched),
        "pairs": ing.pairs,
        **_figures(ing, samples, grown),
        "lookup_materialized_ms_p50": round(percentile(full, 50), 4),
        **compaction(ing.index, [ReplicaKey(f"r{w}") for w in range(args.replicas)]),
    }


def fleet(args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)
    replicas = [ReplicaKey(f"rack{i // 9}-r{i % 9}") for i in range(args.replicas)]
    gc.collect()
    base = rss_mb()
    ing = _Ingest()
    systems = [_hashes(args.seed + 10 + s, 64) for s in range(16)]
    for key in replicas:
        for prompt in systems:
            ing.put(key, prompt)
    budget = args.unique_blocks - 16 * 64
    doc_blocks = budget // 10
    docs: list[list[int]] = []
    for d in range(max(1, doc_blocks // EVENT_BLOCKS)):
        chain = _hashes(args.seed * 7919 + d, EVENT_BLOCKS)
        docs.append(chain)
        for key in rng.sample(replicas, min(args.doc_replicas, len(replicas))):
            ing.put(key, chain)
    sessions: list[tuple[list[int], list[int], list[int]]] = []
    left = budget - len(docs) * EVENT_BLOCKS
    s = 0
    while left > 0:
        length = min(left, rng.randint(200, 2000))
        chain = _hashes(args.seed * 104729 + s, length)
        s += 1
        left -= length
        holders = rng.sample(replicas, 2 if rng.random() < 0.3 else 1)
        for key in holders:
            ing.put(key, chain)
        if len(sessions) < 2000:
            sessions.append((rng.choice(systems), rng.choice(docs), chain))
    gc.collect()
    grown = rss_mb() - base
    queries: list[list[int]] = []
    for i in range(args.queries):
        system, doc, chain = sessions[i % len(sessions)]
        kind = i % 3
        fresh = [rng.getrandbits(64) for _ in range(50)]
        if kind == 0:
            queries.append(system + doc + chain + fresh)
        elif kind == 1:
            queries.append(system + doc + fresh)
        else:
            queries.append([rng.getrandbits(64) for _ in range(args.query)])
    samples = _time_queries(ing.index, queries, 1)
    full = _time_queries(ing.index, queries, 1, materialize=True)
    stats = ing.index.stats()
    return {
        "workload": "fleet",
        "replicas": args.replicas,
        "unique_blocks": stats.unique_kv_blocks,
        "pairs": stats.kv_entries,
        "queries": len(samples),
        **_figures(ing, samples, grown),
        "lookup_materialized_ms_p50": round(percentile(full, 50), 4),
        "lookup_materialized_ms_p99": round(percentile(full, 99), 4),
        **compaction(ing.index, replicas),
    }


def _figures(ing: _Ingest, samples: list[float], grown_mb: float) -> dict[str, object]:
    pairs = ing.index.stats().kv_entries
    return {
        "lookup_ms_p50": round(percentile(samples, 50), 4),
        "lookup_ms_p99": round(percentile(samples, 99), 4),
        "lookup_ms_max": round(max(samples), 4),
        "ingest_blocks_per_s": round(ing.pairs / max(ing.seconds, 1e-9)),
        "rss_mb": round(rss_mb(), 1),
        "index_mb": round(grown_mb, 1),
        "bytes_per_entry": round(grown_mb * 2**20 / max(pairs, 1), 1),
    }


def compaction(index: PrefixIndex, keys: list[ReplicaKey]) -> dict[str, object]:
    """Clear every eighth replica (their entries become garbage, as an engine restart leaves
    them), then compact as the service does, a step at a time: the whole compaction's time
    and the longest step (how long it holds the event loop at once)."""
    for key in keys[::8]:
        index.clear_replica(key)
    steps: list[float] = []
    touched = 0
    last = time.perf_counter()
    for n in index.compaction():
        now = time.perf_counter()
        steps.append(now - last)
        last = now
        touched += n
    return {
        "compact_entries": touched,
        "compact_ms": round(sum(steps) * 1000, 1),
        "compact_step_ms_max": round(max(steps, default=0.0) * 1000, 2),
    }


def run(args: argparse.Namespace) -> int:
    result = fleet(args) if args.unique_blocks else anchor(args)
    emit({"bench": "index", **result})
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("index", help="prefix index ingest, lookup latency and memory")
    p.add_argument("--replicas", type=at_least(1), default=64)
    p.add_argument("--blocks", type=at_least(1), default=10_000, help="anchor: blocks per replica")
    p.add_argument("--shared", type=at_least(0), default=2_000, help="anchor: shared prefix blocks")
    p.add_argument("--query", type=at_least(1), default=2_000, help="query length in blocks")
    p.add_argument("--reps", type=at_least(1), default=200, help="anchor: query repetitions")
    p.add_argument(
        "--unique-blocks",
        type=at_least(0),
        default=0,
        help="fleet workload with this many unique blocks",
    )
    p.add_argument(
        "--doc-replicas", type=at_least(1), default=16, help="fleet: holders per document"
    )
    p.add_argument(
        "--queries", type=at_least(1), default=3000, help="fleet: number of lookups timed"
    )
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(handler=run)
