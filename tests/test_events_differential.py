"""Differential test: the router's ingest + index against a reference model of the engines.

A reference engine (per data-parallel rank) holds engine blocks by hash on each tier (GPU,
CPU, STORAGE) and recurrent-state checkpoints (a ``mamba`` group) on GPU. A seeded random
stream drives it and, encoded with vLLM 0.33's own event classes, the router's
``EngineIngest`` feeding a real ``PrefixIndex``: requests stored on GPU from their first
block not cached there (with and without a parent, evicted blocks stored again, held ones
re-announced), checkpoints on random blocks of what they stored (on the router grid or
not), offloads of GPU ranges to CPU / STORAGE (with tokens or by hash), evictions of several
blocks of a tier at once in any order (leaves of what that tier holds: the index relies on
caches being prefix-closed, router/core/index.py), checkpoint evictions, and
``AllBlocksCleared`` (vLLM's: the GPU cache only; a later one in the same batch, once
blocks were offloaded, the offload pool's: CPU and STORAGE only). Engine blocks divide the
router's, are multiples of it, or neither. After every batch, for random prompts (those
stored and others sharing their prefixes), the index's KV, GPU, host and hybrid-usable
prefix of every rank equal what the reference holds.

tests/test_events_tier_coverage.py fuzzes tiers without ranks, checkpoints, several blocks
evicted at once or engine blocks coarser than the router's; tests/test_hybrid_prediction.py
follows a simulated engine.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from router.core.hashing import hash_prompt, root_hash
from router.core.index import PrefixIndex
from router.core.types import EventBatch, IndexEvent, PrefixMatch, ReplicaKey, Tier
from router.events.ingest import EngineIngest
from tests.engines import load

VLLM = load("vllm-0.33.0")
MODEL = "m"
REPLICA = "r"
MEDIUM = {Tier.GPU: "GPU", Tier.CPU: "CPU", Tier.DISK: "STORAGE"}
KV_GROUP, STATE_GROUP = 0, 1


class Prompt:
    def __init__(self, tokens: list[int], be: int, bs: int) -> None:
        self.tokens = tokens
        self.hashes: list[int] = []
        parent = 0
        for j in range(len(tokens) // be):  # an engine's chained block hash
            parent = hash((parent, tuple(tokens[j * be : (j + 1) * be]))) & (2**63 - 1)
            self.hashes.append(parent)
        self.canonical = hash_prompt(tokens, bs, root_hash(MODEL)).hashes


class Rank:
    """The reference: one data-parallel rank's engine cache."""

    def __init__(self) -> None:
        self.held: dict[Tier, set[int]] = {t: set() for t in Tier}
        self.states: set[int] = set()  # engine block hashes with a checkpoint at their end
        self.offloaded = False  # it has stored blocks on CPU / STORAGE


class Reference:
    def __init__(self, be: int, bs: int, ranks: int) -> None:
        self.be, self.bs = be, bs
        self.ranks = [Rank() for _ in range(ranks)]
        # router block -> the engine blocks overlapping it, in each prompt that has it
        self.spans: dict[int, set[tuple[int, ...]]] = {}
        # engine block hash -> the canonical block ending where it ends (on the router grid)
        self.checkpoint_of: dict[int, int] = {}
        self.parent: dict[int, int] = {}  # engine block -> its parent engine block

    def add_prompt(self, p: Prompt) -> None:
        be, bs = self.be, self.bs
        for k, c in enumerate(p.canonical):
            first, stop = k * bs // be, -(-(k + 1) * bs // be)
            self.spans.setdefault(c, set()).add(tuple(p.hashes[first:stop]))
        for j, h in enumerate(p.hashes):
            end = (j + 1) * be
            if end % bs == 0 and end // bs <= len(p.canonical):
                self.checkpoint_of[h] = p.canonical[end // bs - 1]
            if j:
                self.parent[h] = p.hashes[j - 1]

    def leaves(self, r: Rank, t: Tier) -> list[int]:
        """Blocks of ``t`` no block held there has as its parent (what an LRU that frees a
        request's blocks tail first evicts: the index relies on it, router/core/index.py)."""
        held = r.held[t]
        return sorted(held - {self.parent.get(h) for h in held})

    def expected(self, r: Rank, canonical: list[int]) -> PrefixMatch:
        def on(t: Tier, span: tuple[int, ...]) -> bool:
            return all(h in r.held[t] for h in span)

        def prefix(tiers: tuple[Tier, ...]) -> int:
            n = 0
            for c in canonical:
                if not any(on(t, span) for span in self.spans.get(c, ()) for t in tiers):
                    break
                n += 1
            return n

        kv = prefix(tuple(Tier))
        ckpts = {self.checkpoint_of[h] for h in r.states if h in self.checkpoint_of}
        usable = next((n for n in range(kv, 0, -1) if canonical[n - 1] in ckpts), 0)
        return PrefixMatch(kv, prefix((Tier.GPU,)), prefix((Tier.GPU, Tier.CPU)), usable)


def _prompts(rng: random.Random, be: int, bs: int, n: int) -> list[Prompt]:
    unit = max(be, bs)
    trunks = [[rng.randrange(50_000) for _ in range(unit * 8)] for _ in range(3)]
    out = []
    for i in range(n):
        trunk = trunks[i % 3]
        cut = rng.randrange(0, len(trunk))
        tokens = trunk[:cut] + [rng.randrange(50_000) for _ in range(rng.randrange(1, 4) * unit)]
        out.append(Prompt(tokens[: len(tokens) // be * be], be, bs))
    return out


@pytest.mark.parametrize(
    ("be", "bs", "seed"),
    [(16, 64, 1), (64, 16, 2), (32, 32, 3), (48, 64, 4), (16, 32, 5), (128, 32, 6)],
)
def test_index_agrees_with_a_reference_engine_cache(be: int, bs: int, seed: int) -> None:
    """Two data-parallel ranks of one engine, 250 random batches; every answer compared."""
    rng = random.Random(seed)
    ref = Reference(be, bs, ranks=2)
    index = PrefixIndex()

    def sink(key: ReplicaKey, events: list[IndexEvent]) -> None:
        index.apply(EventBatch(key, tuple(events)))

    ingest = EngineIngest(REPLICA, MODEL, bs, sink)
    prompts = _prompts(rng, be, bs, 12)
    for p in prompts:
        ref.add_prompt(p)
    queries = [p.canonical for p in prompts]
    queries += [p.canonical for p in _prompts(rng, be, bs, 6)]  # never stored: prefixes only

    def store(r: Rank, t: Tier, p: Prompt, first: int, stop: int, group: int = KV_GROUP) -> Any:
        parent = p.hashes[first - 1] if first else None
        kind = "mamba" if group == STATE_GROUP else "full_attention"
        if group == KV_GROUP:
            r.held[t].update(p.hashes[first:stop])
        return VLLM.BlockStored(
            p.hashes[first:stop], parent, p.tokens[first * be : stop * be], be, None,
            MEDIUM[t], None, group_idx=group, kv_cache_spec_kind=kind,
        )  # fmt: skip

    def cached(held: set[int], p: Prompt) -> int:
        n = 0
        while n < len(p.hashes) and p.hashes[n] in held:
            n += 1
        return n

    seen: set[tuple[str, object]] = set()
    steps = 250
    for step in range(steps):
        rank = rng.randrange(len(ref.ranks))
        r = ref.ranks[rank]
        events: list[Any] = []
        reset_in_batch = pool_reset = False
        for _ in range(rng.randrange(1, 4)):
            p = prompts[rng.randrange(len(prompts))]
            op = rng.random()
            if op < 0.35:  # a request: stored on GPU from its first block not cached there
                first = cached(r.held[Tier.GPU], p)
                stop = rng.randrange(first, len(p.hashes) + 1)
                if first < stop:
                    events.append(store(r, Tier.GPU, p, first, stop))
                    for j in sorted(rng.sample(range(first, stop), min(2, stop - first))):
                        r.states.add(p.hashes[j])  # a checkpoint kept on block j
                        events.append(store(r, Tier.GPU, p, j, j + 1, STATE_GROUP))
            elif op < 0.5:  # the connector offloads a range of GPU blocks, its prefix there
                t = rng.choice((Tier.CPU, Tier.DISK))
                first, on_gpu = cached(r.held[t], p), cached(r.held[Tier.GPU], p)
                if first < on_gpu:
                    r.offloaded = True
                    stop = rng.randrange(first + 1, on_gpu + 1)
                    ev = store(r, t, p, first, stop)
                    if rng.random() < 0.5:
                        events.append(ev)
                    else:  # placeholders: one token-less store per engine block
                        events.extend(
                            VLLM.BlockStored([h], None, [], 0, None, MEDIUM[t], None)
                            for h in p.hashes[first:stop]
                        )
            elif op < 0.85:  # evictions of one tier: leaves, a few levels deep, in any order
                t = rng.choice(tuple(Tier))
                gone = []
                for _ in range(rng.randrange(1, 6)):
                    leaves = ref.leaves(r, t)
                    if not leaves:
                        break
                    h = rng.choice(leaves)
                    r.held[t].discard(h)
                    gone.append(h)
                if gone:
                    rng.shuffle(gone)
                    events.append(VLLM.BlockRemoved(gone, MEDIUM[t], group_idx=KV_GROUP))
            elif op < 0.95:  # a checkpoint evicted
                states = sorted(r.states)
                gone = rng.sample(states, min(len(states), rng.randrange(1, 3)))
                if gone:
                    r.states.difference_update(gone)
                    events.append(VLLM.BlockRemoved(gone, "GPU", group_idx=STATE_GROUP))
            elif reset_in_batch and r.offloaded:  # a later reset: the offload pool's
                r.held[Tier.CPU].clear()
                r.held[Tier.DISK].clear()
                events.append(VLLM.AllBlocksCleared())
                seen.add(("offload reset", True))
            else:  # vLLM's reset: the GPU prefix cache only
                r.held[Tier.GPU].clear()
                r.states.clear()
                events.append(VLLM.AllBlocksCleared())
                reset_in_batch = True
                # with the connector's cache too: its reset comes after the GPU's events
                pool_reset = pool_reset or rng.random() < 0.5
        if pool_reset and r.offloaded:
            r.held[Tier.CPU].clear()
            r.held[Tier.DISK].clear()
            events.append(VLLM.AllBlocksCleared())
            seen.add(("offload reset", True))
        if not events:
            continue
        payload = msgspec.msgpack.encode(VLLM.KVEventBatch(float(step), events, rank))
        ingest.handle_payload(payload)
        assert ingest.stats.malformed_events == 0, ingest.stats.last_errors
        for q in queries:
            got = index.match(q, hybrid=True)
            for i, rr in enumerate(ref.ranks):
                m = got.get(ReplicaKey(REPLICA, i))
                assert m == ref.expected(rr, q), f"step {step} rank {i} query {queries.index(q)}"
                seen |= {("usable", m.usable_blocks > 0), ("host", m.host_blocks > m.gpu_blocks)}
                seen |= {("disk", m.kv_blocks > m.host_blocks), ("rank", i if m.kv_blocks else 0)}
    # the stream reached every case it is meant to compare
    assert {("usable", True), ("host", True), ("disk", True), ("rank", 1)} <= seen
    assert ("offload reset", True) in seen
