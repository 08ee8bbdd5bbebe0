"""A router block is on a tier only while every engine block of it is there.

The router's block spans several engine blocks (16-token engine blocks under a 64-token
router block; a 48-token engine block straddles two): the engine can load it from a tier
only if it holds all of them there. vLLM 0.34's offloading connector publishes stores for
the CPU / STORAGE medium of any subset of a request's blocks, with their tokens
(self-describing) or by hash alone, and evicts them one by one; vLLM 0.33's own event
classes (0.34's kv_events module is byte-identical) encode the events here, through the
publisher's ingest into a real index.
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
B = 64  # router block
BE = 16  # engine block
MODEL = "m"
KEY = ReplicaKey("r0")


class Pipeline:
    """One engine's payloads -> ``EngineIngest`` -> a ``PrefixIndex``, as the service does."""

    def __init__(self, block_size: int = B) -> None:
        self.index = PrefixIndex()
        self.ingest = EngineIngest(KEY.replica, MODEL, block_size, self._sink)

    def _sink(self, key: ReplicaKey, events: list[IndexEvent]) -> None:
        self.index.apply(EventBatch(key, tuple(events)))

    def vllm(self, *events: Any) -> None:
        self.ingest.handle_payload(msgspec.msgpack.encode(VLLM.KVEventBatch(1.0, list(events))))
        assert self.ingest.stats.malformed_events == 0

    def match(self, canonical: list[int]) -> PrefixMatch:
        return self.index.match(canonical).get(KEY)


def _prompt(n: int, seed: int = 1) -> tuple[list[int], list[int], list[int]]:
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(n * BE)]
    hashes = [rng.getrandbits(63) for _ in range(n)]
    return tokens, hashes, hash_prompt(tokens, B, root_hash(MODEL)).hashes


def _store(
    tokens: list[int], hashes: list[int], first: int, stop: int, medium: str = "GPU", **kw: Any
) -> Any:
    """vLLM's store of engine blocks [first, stop) with their tokens (the GPU's, or the
    offloading connector's self-describing payload)."""
    parent = hashes[first - 1] if first else None
    span = tokens[first * BE : stop * BE]
    return VLLM.BlockStored(
        hashes[first:stop], parent, span, BE, None, medium, None, group_idx=0, **kw
    )


def _removed(hashes: list[int], medium: str = "GPU") -> Any:
    return VLLM.BlockRemoved(hashes, medium, group_idx=0)


def _on(medium: str, blocks: int) -> PrefixMatch:
    """What the index says of ``blocks`` router blocks held on ``medium`` alone."""
    return PrefixMatch(blocks, 0, blocks if medium == "CPU" else 0, blocks)


@pytest.mark.parametrize("medium", ["CPU", "STORAGE"])
def test_one_engine_block_offloaded_does_not_put_its_router_block_there(medium: str) -> None:
    """The connector offloads engine block 1 of 0-3: router block 0 is not loadable from that
    tier once the GPU evicts its copies (it was announced there with block 1)."""
    tokens, hashes, canonical = _prompt(4)
    p = Pipeline()
    p.vllm(_store(tokens, hashes, 0, 4))
    p.vllm(_store(tokens, hashes, 1, 2, medium))
    p.vllm(_removed(hashes))
    assert p.match(canonical) == PrefixMatch()
    # the other three offloaded too: now it is there
    p.vllm(_store(tokens, hashes, 0, 1, medium), _store(tokens, hashes, 2, 4, medium))
    assert p.match(canonical) == _on(medium, 1)
    # and gone again once the connector evicts one of them
    p.vllm(_removed([hashes[2]], medium))
    assert p.match(canonical) == PrefixMatch()


def test_new_engine_blocks_offloaded_after_a_gpu_parent_do_not_complete_it_there() -> None:
    """Engine blocks 2-3 stored on CPU (new to the router, their parent on GPU only) complete
    router block 0's tokens, not its CPU copy: blocks 0-1 are not on CPU."""
    tokens, hashes, canonical = _prompt(4)
    p = Pipeline()
    p.vllm(_store(tokens, hashes, 0, 2))
    p.vllm(_store(tokens, hashes, 2, 4, "CPU"))
    p.vllm(_store(tokens, hashes, 2, 4))  # the GPU's own store of them
    assert p.match(canonical) == PrefixMatch(1, 1, 1, 1)
    p.vllm(_removed(hashes))
    assert p.match(canonical) == PrefixMatch()


def test_a_placeholder_for_one_engine_block_does_not_offload_its_router_block() -> None:
    """vLLM 0.25-0.34's default placeholder (one hash, ``block_size`` 0, blocks_per_chunk 1):
    engine block 3 alone is on CPU."""
    tokens, hashes, canonical = _prompt(8)
    p = Pipeline()
    p.vllm(_store(tokens, hashes, 0, 8))
    p.vllm(VLLM.BlockStored([hashes[3]], None, [], 0, None, "CPU", None, group_idx=0))
    p.vllm(_removed(hashes))
    assert p.match(canonical) == PrefixMatch()
    # the prompt computed on GPU again; the connector offloads blocks 0-2 and 4-7 too: both
    # router blocks are on CPU
    p.vllm(_store(tokens, hashes, 0, 8))
    others = [h for i, h in enumerate(hashes) if i != 3]
    p.vllm(*(VLLM.BlockStored([h], None, [], 0, None, "CPU", None, group_idx=0) for h in others))
    p.vllm(_removed(hashes))
    assert p.match(canonical) == _on("CPU", 2)


def test_a_gpu_reset_keeps_only_router_blocks_whole_on_the_offload_tier() -> None:
    """``AllBlocksCleared`` keeps the offloading connector's blocks: engine blocks 1-3 on CPU
    are not router block 0 (block 0 was on GPU only); blocks 4-7 are router block 1."""
    tokens, hashes, canonical = _prompt(8)
    p = Pipeline()
    p.vllm(_store(tokens, hashes, 0, 8))
    p.vllm(_store(tokens, hashes, 1, 8, "CPU"))
    p.vllm(VLLM.AllBlocksCleared())
    assert p.match(canonical) == PrefixMatch()
    assert p.match(canonical[1:]) == _on("CPU", 1)  # router block 1 alone, as the index sees it
    # a request computes the prompt on GPU again (no prefix hit without block 0); the
    # connector offloads block 0, the one the CPU lacks: the whole prefix is on CPU
    p.vllm(_store(tokens, hashes, 0, 8))
    p.vllm(_store(tokens, hashes, 0, 1, "CPU"))
    p.vllm(_removed(hashes))
    assert p.match(canonical) == _on("CPU", 2)


def test_lookahead_copies_count_as_one_position() -> None:
    """vLLM >= 0.33 with lookahead hashes caches the same tokens at one position under
    several hashes (one per next token seen). Two copies of engine block 3 on CPU are not
    the missing block 2 (on GPU alone); once block 2 is offloaded too, router block 0 stays
    on CPU until both copies of block 3 are evicted."""
    tokens, hashes, canonical = _prompt(5)
    rng = random.Random(9)
    copy = rng.getrandbits(63)  # block 3 hashed with another next token
    look = [[t] for t in tokens[BE::BE]]  # the token after each block
    p = Pipeline()
    p.vllm(_store(tokens, hashes, 0, 4, lookahead_token_ids=look[:4]))
    p.vllm(
        _store(tokens, hashes, 0, 2, "CPU", lookahead_token_ids=look[:2]),
        VLLM.BlockStored(
            [hashes[3]], hashes[2], tokens[3 * BE : 4 * BE], BE, None, "CPU", None,
            group_idx=0, lookahead_token_ids=[look[3]],
        ),
        VLLM.BlockStored(
            [copy], hashes[2], tokens[3 * BE : 4 * BE], BE, None, "CPU", None,
            group_idx=0, lookahead_token_ids=[[look[3][0] + 1]],
        ),
    )  # fmt: skip
    p.vllm(_removed([hashes[0], hashes[1], hashes[3]]))
    assert p.match(canonical) == PrefixMatch()
    p.vllm(_store(tokens, hashes, 2, 3, "CPU", lookahead_token_ids=look[2:3]))
    assert p.match(canonical) == _on("CPU", 1)
    p.vllm(_removed([hashes[3]], "CPU"))
    assert p.match(canonical) == _on("CPU", 1)
    p.vllm(_removed([copy], "CPU"))
    assert p.match(canonical) == PrefixMatch()


# ------------------------------------------------------------------------ fuzz vs an engine


class EngineCache:
    """The ground truth: which engine blocks (by hash) each tier holds. A router block is
    on a tier where every engine block overlapping it in some cached sequence is: several
    when the engine blocks do not divide the router's (two prompts diverging in the last
    engine block of a router block share it, not that engine block)."""

    def __init__(self, be: int, bs: int) -> None:
        self.held: dict[Tier, set[int]] = {t: set() for t in Tier}
        self.be, self.bs = be, bs
        # router block -> the engine blocks overlapping it, in each prompt that has it
        self.spans: dict[int, set[tuple[int, ...]]] = {}

    def add_prompt(self, hashes: list[int], canonical: list[int]) -> None:
        for k, c in enumerate(canonical):
            first, stop = k * self.bs // self.be, -(-(k + 1) * self.bs // self.be)
            self.spans.setdefault(c, set()).add(tuple(hashes[first:stop]))

    def expected(self, canonical: list[int]) -> PrefixMatch:
        def prefix(tiers: tuple[Tier, ...]) -> int:
            n = 0
            for c in canonical:
                if not any(
                    all(h in self.held[t] for h in span) for span in self.spans[c] for t in tiers
                ):
                    break
                n += 1
            return n

        kv = prefix(tuple(Tier))
        return PrefixMatch(kv, prefix((Tier.GPU,)), prefix((Tier.GPU, Tier.CPU)), kv)


MEDIUM = {Tier.GPU: "GPU", Tier.CPU: "CPU", Tier.DISK: "STORAGE"}


@pytest.mark.parametrize(("be", "bs"), [(16, 64), (16, 32), (48, 64)])
def test_fuzz_index_matches_an_engine_cache_model(be: int, bs: int) -> None:
    """Random prompts sharing prefixes; the engine stores them on GPU from its first missing
    block (vLLM's prefix hit), offloads ranges of them to CPU / STORAGE (with their tokens,
    or by hash), evicts leaves of each tier's cache, and resets its GPU cache; after every
    step the index says of each prompt exactly what the engine holds."""
    rng = random.Random(be * 1000 + bs)
    engine = EngineCache(be, bs)
    p = Pipeline(bs)
    trunks = [[rng.randrange(50_000) for _ in range(be * 12)] for _ in range(3)]
    prompts: list[tuple[list[int], list[int], list[int]]] = []
    for i in range(10):
        trunk = trunks[i % 3]
        cut = rng.randrange(1, 12) * be + rng.randrange(be)
        tokens = trunk[:cut] + [rng.randrange(50_000) for _ in range(rng.randrange(1, 8) * be)]
        tokens = tokens[: len(tokens) // be * be]
        hashes, parent = [], 0
        for j in range(len(tokens) // be):  # an engine's chained block hash
            parent = hash((parent, tuple(tokens[j * be : (j + 1) * be]))) & (2**63 - 1)
            hashes.append(parent)
        prompts.append((tokens, hashes, hash_prompt(tokens, bs, root_hash(MODEL)).hashes))
        engine.add_prompt(*prompts[-1][1:])

    def cached(t: Tier, hashes: list[int]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in engine.held[t]:
            n += 1
        return n

    def store(t: Tier, tokens: list[int], hashes: list[int], first: int, stop: int) -> Any:
        parent = hashes[first - 1] if first else None
        span = tokens[first * be : stop * be]
        engine.held[t].update(hashes[first:stop])
        return VLLM.BlockStored(hashes[first:stop], parent, span, be, None, MEDIUM[t], None)

    def leaves(t: Tier) -> list[int]:
        """Blocks of ``t`` no other block on ``t`` has as its parent (an LRU evicts those)."""
        held = engine.held[t]
        parents = {h[i - 1] for _, h, _ in prompts for i in range(1, len(h)) if h[i] in held}
        return sorted(held - parents)

    for _ in range(300):
        tokens, hashes, canonical = prompts[rng.randrange(len(prompts))]
        op = rng.random()
        if op < 0.3:  # a request: stored on GPU from its first block not cached there
            first = cached(Tier.GPU, hashes)
            if first < len(hashes):
                p.vllm(store(Tier.GPU, tokens, hashes, first, len(hashes)))
        elif op < 0.55:  # the connector offloads a range of GPU blocks, its prefix there
            t = rng.choice((Tier.CPU, Tier.DISK))
            first, on_gpu = cached(t, hashes), cached(Tier.GPU, hashes)
            if first < on_gpu:
                stop = rng.randrange(first + 1, on_gpu + 1)
                if rng.random() < 0.5:
                    p.vllm(store(t, tokens, hashes, first, stop))
                else:  # placeholders: one token-less store per engine block
                    store(t, tokens, hashes, first, stop)
                    p.vllm(*(
                        VLLM.BlockStored([h], None, [], 0, None, MEDIUM[t], None)
                        for h in hashes[first:stop]
                    ))  # fmt: skip
        elif op < 0.95:  # an eviction of a few leaves of one tier
            t = rng.choice(tuple(Tier))
            candidates = leaves(t)
            gone = rng.sample(candidates, min(len(candidates), rng.randrange(1, 4)))
            if gone:
                engine.held[t].difference_update(gone)
                p.vllm(VLLM.BlockRemoved(gone, MEDIUM[t]))
        else:
            engine.held[Tier.GPU].clear()
            p.vllm(VLLM.AllBlocksCleared())
        for _, _, canonical in prompts:
            assert p.index.match(canonical).get(KEY) == engine.expected(canonical)
