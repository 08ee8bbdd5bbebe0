"""``kvrouter bench store``: the shared index in Redis.

* ``--what publish``: a publisher's write path, canonical block events -> Redis, batched
  (``StoreWriter`` + ``RedisStore``): block events per second, one process, one replica.
* ``--what pipeline``: the whole sidecar path from engine payloads (vLLM msgpack, engine
  blocks of ``--engine-block-size`` tokens) through decode + re-block + write.
* ``--what bootstrap``: ``--replicas`` x ``--entries`` (block, replica) entries are loaded
  into Redis, Redis memory per entry is measured (INFO used_memory delta), then a router
  (``IndexSync``) bootstraps a fresh ``PrefixIndex`` from it and is timed.

Uses ``--redis URL`` or, by default, a private redis-server on a free port.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from router.bench.measure import emit, rss_mb
from router.bench.redis_server import LocalRedis, LocalRedisCluster
from router.cliargs import at_least, fraction
from router.core.index import PrefixIndex
from router.core.types import BlocksRemoved, BlocksStored, IndexEvent, ReplicaKey
from router.events.encode import encode_batch
from router.events.ingest import EngineIngest
from router.events.model import EngineBatch, EngineBlockRemoved, EngineBlockStored
from router.store.base import ReplicaInfo, ReplicaState
from router.store.packed import PackedTable
from router.store.redis_store import RedisStore
from router.store.schema import KeySchema
from router.store.sync import IndexSync
from router.store.writer import StoreWriter


def _rand64(seed: int, n: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    return np.random.Generator(np.random.PCG64(seed)).integers(
        0, 2**64, size=n, dtype=np.uint64, endpoint=False
    )


async def _used_memory(store: RedisStore) -> int:
    """``used_memory`` of the server, summed over the primaries of a cluster."""
    if store.cluster:
        from redis.asyncio.cluster import RedisCluster

        per_node: Any = await store.redis.info("memory", target_nodes=RedisCluster.PRIMARIES)
        return sum(int(info["used_memory"]) for info in per_node.values())
    info = await store.redis.info("memory")
    return int(info["used_memory"])


async def bench_publish(store: RedisStore, args: argparse.Namespace) -> dict[str, Any]:
    """Events shaped like an engine's: chains stored in runs of ``--event-blocks``, a quarter
    of them later removed (eviction), flushed every ``--batch`` block events."""
    key = ReplicaKey("bench-pub")
    await store.register(ReplicaInfo(key.replica), "bench", 60)
    writer = StoreWriter(store, [key], "bench")  # fenced by its lease, as a publisher
    await writer.flush()
    hashes = _rand64(args.seed, args.events).tolist()
    evs: list[IndexEvent] = []
    step = args.event_blocks
    for i in range(0, len(hashes), step):
        evs.append(BlocksStored(tuple(hashes[i : i + step])))
        if i % (4 * step) == 0 and i:
            evs.append(BlocksRemoved(tuple(hashes[i - step : i])))
    total = sum(len(e.hashes) for e in evs if isinstance(e, (BlocksStored, BlocksRemoved)))
    gc.collect()
    t_apply = t_write = 0.0
    t0 = time.perf_counter()
    for ev in evs:
        a = time.perf_counter()
        writer.add(key, (ev,))
        t_apply += time.perf_counter() - a
        if writer.pending_events >= args.batch:
            a = time.perf_counter()
            await writer.flush()
            t_write += time.perf_counter() - a
    a = time.perf_counter()
    await writer.flush()
    t_write += time.perf_counter() - a
    elapsed = time.perf_counter() - t0
    stored = writer.states[key].kv.count
    return {
        "what": "publish",
        "block_events": total,
        "batch": args.batch,
        "seconds": round(elapsed, 3),
        "block_events_per_s": round(total / elapsed),
        "apply_s": round(t_apply, 3),
        "redis_write_s": round(t_write, 3),
        "flushes": writer.flushes,
        "entries_in_redis": stored,
    }


async def bench_pipeline(store: RedisStore, args: argparse.Namespace) -> dict[str, Any]:
    """Engine payloads -> decode -> re-block -> Redis."""
    key = ReplicaKey("bench-pipe")
    await store.register(ReplicaInfo(key.replica), "bench", 60)
    writer = StoreWriter(store, [key], "bench")  # fenced by its lease, as a publisher
    await writer.flush()
    ingest = EngineIngest(key.replica, "bench-model", args.block_size, writer.add)
    rng = random.Random(args.seed)
    be = args.engine_block_size
    payloads: list[bytes] = []
    engine_blocks = 0
    parent = None
    next_hash = 1
    prev_blocks: list[int] = []
    while engine_blocks < args.events:
        tokens = tuple(rng.randrange(100_000) for _ in range(be * args.event_blocks))
        hs = tuple(range(next_hash, next_hash + args.event_blocks))
        next_hash += args.event_blocks
        events: list[Any] = [EngineBlockStored(hs, parent, tokens, be)]
        if prev_blocks and rng.random() < 0.25:
            events.append(EngineBlockRemoved(tuple(prev_blocks[::-1])))
            parent = None
        else:
            parent = hs[-1] if rng.random() < 0.8 else None
        prev_blocks = list(hs)
        payloads.append(encode_batch(EngineBatch(0.0, tuple(events), 0)))
        engine_blocks += len(hs)
    gc.collect()
    t0 = time.perf_counter()
    for payload in payloads:
        ingest.handle_payload(payload)
        if writer.pending_events >= args.batch:
            await writer.flush()
    await writer.flush()
    elapsed = time.perf_counter() - t0
    return {
        "what": "pipeline",
        "engine_block_events": engine_blocks,
        "engine_block_size": be,
        "router_block_size": args.block_size,
        "canonical_block_events": writer.block_events,
        "seconds": round(elapsed, 3),
        "engine_block_events_per_s": round(engine_blocks / elapsed),
        "canonical_block_events_per_s": round(writer.block_events / elapsed),
        "malformed": ingest.stats.malformed_events + ingest.stats.malformed_payloads,
    }


async def bench_bootstrap(store: RedisStore, args: argparse.Namespace) -> dict[str, Any]:
    """Fill Redis with replicas x entries, measure its memory, time a router's bootstrap."""
    per = args.entries // args.replicas
    shared = _rand64(args.seed + 999, max(1, int(per * args.shared_fraction)))
    await store.redis.flushdb()
    base_mem = await _used_memory(store)
    t0 = time.perf_counter()
    for r in range(args.replicas):
        name = f"rack{r // 9}-r{r % 9}"
        info = ReplicaInfo(name, model="bench", block_size=args.block_size)
        await store.register(info, "bench", 600)
        own = _rand64(args.seed + r + 1, per - len(shared))
        hashes = np.concatenate([shared, own])
        masks = np.where(np.arange(len(hashes)) % 5 == 0, 3, 1).astype(np.uint8)  # 20% GPU+CPU
        state = ReplicaState(ReplicaKey(name), seq=1)
        state.kv = PackedTable.from_arrays(hashes, masks)
        await store.reset([state])
    load_s = time.perf_counter() - t0
    # Stream entries (registration/reset) are tiny; trim them to measure the state keys.
    for stream in store.schema.streams():
        await store.redis.xtrim(stream, maxlen=0)
    mem = await _used_memory(store) - base_mem
    entries = per * args.replicas
    gc.collect()
    rss0 = rss_mb()
    index = PrefixIndex()
    reader = RedisStore.from_url(args.redis_url, store.schema)
    sync = IndexSync(reader, index, bootstrap_chunk=args.chunk)
    t0 = time.perf_counter()
    await sync.start()
    boot_s = time.perf_counter() - t0
    await sync.stop()
    await reader.close()
    stats = index.stats()
    return {
        "what": "bootstrap",
        "replicas": args.replicas,
        "entries": entries,
        "kv_entries_in_index": stats.kv_entries,
        "redis_load_s": round(load_s, 2),
        "redis_bytes": mem,
        "redis_bytes_per_entry": round(mem / entries, 2),
        "bootstrap_s": round(boot_s, 2),
        "bootstrap_entries_per_s": round(entries / boot_s),
        "router_index_mb": round(rss_mb() - rss0, 1),
    }


async def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    store = RedisStore.from_url(args.redis_url, KeySchema(args.key_prefix, args.stream_shards))
    out = []
    try:
        whats = ["publish", "pipeline", "bootstrap"] if args.what == "all" else [args.what]
        for what in whats:
            fn = {
                "publish": bench_publish,
                "pipeline": bench_pipeline,
                "bootstrap": bench_bootstrap,
            }
            out.append(await fn[what](store, args))
    finally:
        await store.close()
    return out


def run(args: argparse.Namespace) -> int:
    server: LocalRedis | LocalRedisCluster | None = None
    if not args.redis:
        work = Path(tempfile.mkdtemp(prefix="kvr-bench-redis-"))
        if args.cluster:
            server = LocalRedisCluster(work, nodes=args.cluster).start()
        else:
            server = LocalRedis(work).start()
        args.redis_url = server.url
    else:
        args.redis_url = args.redis
    try:
        for result in asyncio.run(_run(args)):
            where = "given" if server is None else "private"
            if args.cluster and server is not None:
                where = f"private cluster of {args.cluster}"
            emit({"bench": "store", "redis": where, **result})
    finally:
        if server is not None:
            server.stop()
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("store", help="Redis index: publisher throughput, bootstrap, memory")
    p.add_argument("--what", choices=["publish", "pipeline", "bootstrap", "all"], default="all")
    p.add_argument("--redis", default="", help="Redis URL (default: a private redis-server)")
    p.add_argument(
        "--cluster",
        type=at_least(0),
        default=0,
        metavar="N",
        help="without --redis: a private Redis Cluster of N primaries instead",
    )
    p.add_argument("--key-prefix", default="kvrbench")
    p.add_argument("--stream-shards", type=at_least(1), default=8)
    p.add_argument("--events", type=at_least(1), default=2_000_000, help="publish/pipeline: blocks")
    p.add_argument("--event-blocks", type=at_least(1), default=32, help="blocks per engine event")
    p.add_argument("--batch", type=at_least(1), default=8192, help="block events per flush")
    p.add_argument("--block-size", type=at_least(1), default=64, help="router block size")
    p.add_argument("--engine-block-size", type=at_least(1), default=16)
    p.add_argument("--replicas", type=at_least(1), default=100, help="bootstrap: replicas")
    p.add_argument(
        "--entries", type=at_least(1), default=10_000_000, help="bootstrap: total entries"
    )
    p.add_argument("--shared-fraction", type=fraction, default=0.2)
    p.add_argument("--chunk", type=at_least(1), default=8, help="bootstrap: replica keys per read")
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(handler=run)
