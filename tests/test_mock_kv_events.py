"""The mock's engine events have vLLM's shape: one ``BlockStored`` per chain of new blocks
(a request's step), not one per block, and the router rebuilds the same index from them."""

from __future__ import annotations

import pytest

from router.core.hashing import hash_prompt, root_hash
from router.core.index import PrefixIndex
from router.core.types import (
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    IndexEvent,
    Kind,
    ReplicaKey,
    Tier,
)
from router.events.encode import Encoding, encode_batch
from router.events.ingest import EngineIngest
from router.events.model import EngineBatch, EngineBlockRemoved, EngineBlockStored
from router.mock.kv_events import EngineEventEncoder

B = 64
MODEL = "m"
KEY = ReplicaKey("r0", 0)


def _prompt(n_blocks: int, seed: int) -> tuple[list[int], list[int]]:
    tokens = [(seed * 7919 + i) % 50_000 + 1 for i in range(n_blocks * B)]
    return tokens, list(hash_prompt(tokens, B, root_hash(MODEL)).hashes)


def _cached(index: PrefixIndex, hashes: list[int]) -> int:
    return index.match(hashes).get(KEY).kv_blocks


def test_a_stored_chain_is_one_event_with_every_engine_block() -> None:
    enc = EngineEventEncoder(B, 16)
    tokens, hashes = _prompt(3, 1)
    enc.learn(hashes, tokens)
    out = enc.convert([BlocksStored(tuple(hashes), Tier.GPU, Kind.KV)])
    assert len(out) == 1
    ev = out[0]
    assert isinstance(ev, EngineBlockStored)
    assert len(ev.block_hashes) == 12 and ev.parent_block_hash is None
    assert list(ev.token_ids) == tokens and ev.block_size == 16
    # the next step extends the chain: its event's parent is the last engine block above
    longer = tokens + _prompt(1, 2)[0]
    longer_hashes = list(hash_prompt(longer, B, root_hash(MODEL)).hashes)
    enc.learn(longer_hashes, longer)
    (nxt,) = enc.convert([BlocksStored((longer_hashes[3],), Tier.GPU, Kind.KV)])
    assert isinstance(nxt, EngineBlockStored)
    assert nxt.parent_block_hash == ev.block_hashes[-1] and len(nxt.block_hashes) == 4


def test_unrelated_blocks_in_one_canonical_event_become_separate_chains() -> None:
    enc = EngineEventEncoder(B, 16)
    a_tokens, a = _prompt(2, 3)
    b_tokens, b = _prompt(2, 4)
    enc.learn(a, a_tokens)
    enc.learn(b, b_tokens)
    out = enc.convert([BlocksStored((*a, *b), Tier.GPU, Kind.KV)])
    assert [len(e.block_hashes) for e in out if isinstance(e, EngineBlockStored)] == [8, 8]
    assert all(isinstance(e, EngineBlockStored) and e.parent_block_hash is None for e in out)


def test_the_router_index_from_batched_events_holds_every_block_and_drops_removed() -> None:
    index = PrefixIndex()
    index.add_replica(KEY)

    def sink(key: ReplicaKey, events: list[IndexEvent]) -> None:
        index.apply(EventBatch(key, tuple(events)))

    ingest = EngineIngest(KEY.replica, MODEL, B, sink)
    enc = EngineEventEncoder(B, 16)
    prompts = [_prompt(n, seed) for seed, n in enumerate((5, 3, 7))]
    for tokens, hashes in prompts:
        enc.learn(hashes, tokens)
    stored = [BlocksStored(tuple(h), Tier.GPU, Kind.KV) for _, h in prompts]
    ingest.handle_payload(encode_batch(EngineBatch(1.0, tuple(enc.convert(stored)), None)))
    for _, hashes in prompts:
        assert _cached(index, hashes) == len(hashes)
    _, victim = prompts[2]
    removed = enc.convert([BlocksRemoved(tuple(victim[4:]), Tier.GPU, Kind.KV)])
    assert all(isinstance(e, EngineBlockRemoved) for e in removed)
    ingest.handle_payload(encode_batch(EngineBatch(2.0, tuple(removed), None)))
    assert _cached(index, victim) == 4
    assert _cached(index, prompts[0][1]) == 5


@pytest.mark.parametrize(
    ("encoding", "engine_block"), [("vllm", 16), ("vllm", 128), ("array", 16), ("map", 16)]
)
def test_a_salted_chain_is_indexed_under_its_salt(encoding: Encoding, engine_block: int) -> None:
    """The salt reaches the router in the event, as each engine sends it (vLLM: the first
    block's ``extra_keys``; SGLang: ``cache_salt``), so the index holds the salted blocks:
    the same prompt unsalted, or under another salt, matches nothing there."""
    index = PrefixIndex()
    index.add_replica(KEY)

    def sink(key: ReplicaKey, events: list[IndexEvent]) -> None:
        index.apply(EventBatch(key, tuple(events)))

    ingest = EngineIngest(KEY.replica, MODEL, B, sink)
    enc = EngineEventEncoder(
        B, engine_block, salt_field="cache_salt" if encoding == "map" else "extra_keys"
    )
    tokens, plain = _prompt(4, 9)
    salted = list(hash_prompt(tokens, B, root_hash(MODEL, "tenant-1")).hashes)
    other = list(hash_prompt(tokens, B, root_hash(MODEL, "tenant-2")).hashes)
    enc.learn(salted, tokens, "tenant-1")
    events = enc.convert([BlocksStored(tuple(salted), Tier.GPU, Kind.KV)])
    ingest.handle_payload(encode_batch(EngineBatch(1.0, tuple(events), None), encoding))
    assert _cached(index, salted) == 4
    assert _cached(index, plain) == 0 and _cached(index, other) == 0
    # the chain's next step has a parent: no salt in it, and it extends the salted chain
    longer = tokens + _prompt(2, 10)[0]
    longer_salted = list(hash_prompt(longer, B, root_hash(MODEL, "tenant-1")).hashes)
    enc.learn(longer_salted, longer, "tenant-1")
    (step,) = enc.convert([BlocksStored(tuple(longer_salted[4:]), Tier.GPU, Kind.KV)])
    assert isinstance(step, EngineBlockStored) and step.parent_block_hash is not None
    assert step.extra_keys is None and step.cache_salt is None
    ingest.handle_payload(encode_batch(EngineBatch(2.0, (step,), None), encoding))
    assert _cached(index, longer_salted) == 6


def test_a_checkpoint_is_published_as_vllm_034_publishes_it_and_indexed_there() -> None:
    """vLLM's mamba "align" mode lists the kept checkpoint's hash with the tokens of the whole
    range the step cached; the router indexes the checkpoint at its own position."""
    index = PrefixIndex()
    index.add_replica(KEY)

    def sink(key: ReplicaKey, events: list[IndexEvent]) -> None:
        index.apply(EventBatch(key, tuple(events)))

    ingest = EngineIngest(KEY.replica, MODEL, B, sink)
    enc = EngineEventEncoder(B, 16)
    tokens, hashes = _prompt(6, 5)
    enc.learn(hashes, tokens)
    events = enc.convert(
        [
            BlocksStored((hashes[5],), Tier.GPU, Kind.STATE),  # the state group first
            BlocksStored(tuple(hashes), Tier.GPU, Kind.KV),
        ]
    )
    state = next(e for e in events if isinstance(e, EngineBlockStored) and e.group_idx == 1)
    assert len(state.block_hashes) == 1 and len(state.token_ids) == 4 * B  # a sparse range
    ingest.handle_payload(encode_batch(EngineBatch(1.0, tuple(events), None)))
    hit = index.match(hashes + [1], hybrid=True).get(KEY)
    assert hit.kv_blocks == 6 and hit.usable_blocks == 6
