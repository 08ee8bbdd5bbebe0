"""The mock's engine events have vLLM's shape: one ``BlockStored`` per chain of new blocks
(a request's step), not one per block, and the router rebuilds the same index from them."""

from __future__ import annotations

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
from router.events.encode import encode_batch
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
