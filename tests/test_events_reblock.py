"""Re-blocking engine events to canonical hashes, for engine block sizes smaller, equal,
larger than and not dividing the router's."""

from __future__ import annotations

import random

import msgspec
import pytest

from router.core.hashing import hash_prompt, root_hash
from router.core.index import PrefixIndex
from router.core.types import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    Kind,
    ReplicaKey,
    Tier,
)
from router.events.ingest import EngineIngest
from router.events.model import EngineAllCleared, EngineBlockRemoved, EngineBlockStored
from router.events.reblock import Reblocker
from tests.engines import load

B = 64
MODEL = "m"
ROOT = root_hash(MODEL)


def engine_events(tokens: list[int], be: int, parent: int | None, salt: int, per_event: int):
    """BlockStored events for ``tokens`` in engine blocks of ``be`` (engine hashes are
    arbitrary ints derived from the position, as an engine's would be)."""
    n = len(tokens) // be
    hashes = [hash((salt, i)) & (2**64 - 1) for i in range(n)]
    events = []
    for s in range(0, n, per_event):
        chunk = hashes[s : s + per_event]
        events.append(
            EngineBlockStored(
                block_hashes=tuple(chunk),
                parent_block_hash=parent if s == 0 else hashes[s - 1],
                token_ids=tuple(tokens[s * be : (s + len(chunk)) * be]),
                block_size=be,
            )
        )
    return hashes, events


@pytest.mark.parametrize("be", [16, 64, 256, 48, 100])
@pytest.mark.parametrize("per_event", [1, 3])
def test_canonical_hashes_match_router_hashing(be: int, per_event: int) -> None:
    rng = random.Random(be * 10 + per_event)
    tokens = [rng.randrange(50_000) for _ in range(be * 40)]
    rb = Reblocker(B, MODEL)
    _, events = engine_events(tokens, be, None, 1, per_event)
    out = rb.convert(events)
    stored = [h for e in out if isinstance(e, BlocksStored) for h in e.hashes]
    expected = hash_prompt(tokens[: (len(tokens) // be) * be], B, ROOT).hashes
    assert stored == expected
    assert rb.stats.bad_event == 0 and rb.stats.unknown_parent == 0


@pytest.mark.parametrize("be", [16, 64, 256, 48])
def test_removal_drops_exactly_the_overlapped_canonical_blocks(be: int) -> None:
    rng = random.Random(be)
    tokens = [rng.randrange(50_000) for _ in range(be * 24)]
    rb = Reblocker(B, MODEL)
    hashes, events = engine_events(tokens, be, None, 2, 4)
    index = PrefixIndex()
    key = ReplicaKey("r")
    index.apply(EventBatch(key, tuple(rb.convert(events))))
    canonical = hash_prompt(tokens, B, ROOT).hashes
    assert index.match(canonical).get(key).kv_blocks == len(canonical)
    # Evict the tail engine blocks (vLLM evicts leaves first): keep the first k engine blocks.
    keep = len(hashes) // 2
    index.apply(
        EventBatch(key, tuple(rb.convert([EngineBlockRemoved(tuple(hashes[keep:][::-1]))])))
    )
    assert index.match(canonical).get(key).kv_blocks == (keep * be) // B
    # A diverging continuation from the kept prefix re-blocks from the stored tail.
    more = [rng.randrange(50_000) for _ in range(be * 8)]
    _, events2 = engine_events(more, be, hashes[keep - 1], 3, 2)
    index.apply(EventBatch(key, tuple(rb.convert(events2))))
    full = tokens[: keep * be] + more
    expect = hash_prompt(full, B, ROOT).hashes
    assert index.match(expect).get(key).kv_blocks == len(expect)


@pytest.mark.parametrize("be", [16, 48, 64, 100])
@pytest.mark.parametrize("per_event", [1, 4])
def test_removing_any_engine_block_removes_every_canonical_block_it_overlaps(
    be: int, per_event: int
) -> None:
    """Not only the engine block that completes a canonical one: an engine that evicts the
    first of the four 16-token blocks under a 64-token canonical block no longer has it,
    whether the four came in one event or in four."""
    rng = random.Random(be + per_event)
    tokens = [rng.randrange(50_000) for _ in range(be * 12)]
    canonical = hash_prompt(tokens, B, ROOT).hashes
    for j in range(len(tokens) // be):
        rb = Reblocker(B, MODEL)
        hashes, events = engine_events(tokens, be, None, 4, per_event)
        rb.convert(events)
        out = rb.convert([EngineBlockRemoved((hashes[j],))])
        removed = {h for e in out if isinstance(e, BlocksRemoved) for h in e.hashes}
        first, stop = j * be // B, min(-(-(j + 1) * be // B), len(canonical))
        assert removed == set(canonical[first:stop]), (j, first, stop)


def test_tiers_state_groups_and_clear() -> None:
    rng = random.Random(5)
    tokens = [rng.randrange(1000) for _ in range(B * 4)]
    rb = Reblocker(B, MODEL)
    canonical = hash_prompt(tokens, B, ROOT).hashes
    hashes = [11, 12, 13, 14]
    ev = EngineBlockStored(tuple(hashes), None, tuple(tokens), B, group_idx=0)
    assert rb.convert([ev]) == [BlocksStored(tuple(canonical))]
    # Same blocks offloaded to CPU: same canonical hashes, CPU tier, without token work.
    cpu = EngineBlockStored(tuple(hashes), None, tuple(tokens), B, medium="CPU")
    assert rb.convert([cpu]) == [BlocksStored(tuple(canonical), Tier.CPU)]
    # A mamba group storing states at the end of blocks 1 and 2, one step each (separate
    # map per group).
    st = EngineBlockStored(
        (21,), None, tuple(tokens[:B]), B, group_idx=1, kv_cache_spec_kind="mamba"
    )
    st2 = EngineBlockStored(
        (22,), 21, tuple(tokens[B : 2 * B]), B, group_idx=1, kv_cache_spec_kind="mamba"
    )
    assert rb.convert([st, st2]) == [
        BlocksStored((canonical[0], canonical[1]), Tier.GPU, Kind.STATE)
    ]
    assert rb.convert([EngineBlockRemoved((22,), group_idx=1)]) == [
        BlocksRemoved((canonical[1],), Tier.GPU, Kind.STATE)
    ]
    local = EngineBlockStored(
        (31,), None, tuple(tokens[:B]), B, group_idx=2, kv_cache_spec_kind="chunked_local_attention"
    )
    assert rb.convert([local]) == [] and rb.stats.ignored_group == 1
    # vLLM's reset clears the GPU prefix cache; the offloading connector's CPU copies stay
    kept = BlocksStored(tuple(canonical), Tier.CPU)
    assert rb.convert([EngineAllCleared()]) == [AllCleared(), kept]
    assert len(rb) == 4 and rb.stats.kept_on_clear == 4
    rb.clear()  # a restart or lost events: nothing is known any more
    assert len(rb) == 0


def test_state_checkpoint_off_the_router_grid_is_skipped() -> None:
    tokens = list(range(96))
    rb = Reblocker(B, MODEL)
    ev = [
        EngineBlockStored((i + 1,), i or None, tuple(tokens[32 * i : 32 * i + 32]), 32,
                          kv_cache_spec_kind="mamba")
        for i in range(3)
    ]  # fmt: skip
    out = rb.convert(ev)
    assert out == [BlocksStored((hash_prompt(tokens, B, ROOT).hashes[0],), Tier.GPU, Kind.STATE)]
    assert rb.stats.unaligned_state == 2


def test_a_hit_reannounced_in_full_report_mode_keeps_only_its_last_checkpoint() -> None:
    """vLLM's kv_cache_report_mode "full" re-announces a request's prefix hit: every group
    stores every block from the first (block_pool.emit_cached_block_events), the state group
    included, though the engine kept the state at the hit's end only (its prefills publish
    the checkpoints they keep and skip the rest). Engine hashes are shared across groups."""
    rng = random.Random(8)
    tokens = [rng.randrange(1000) for _ in range(B * 3)]
    canonical = hash_prompt(tokens, B, ROOT).hashes
    rb = Reblocker(B, MODEL)
    hashes = (41, 42, 43)
    kv = EngineBlockStored(hashes, None, tuple(tokens), B, kv_cache_spec_kind="full_attention")
    state = EngineBlockStored(
        (43,), None, tuple(tokens), B, group_idx=1, kv_cache_spec_kind="mamba"
    )  # the prefill: one kept checkpoint over the range
    assert rb.convert([kv, state])[-1] == BlocksStored((canonical[2],), Tier.GPU, Kind.STATE)
    again_kv = EngineBlockStored(
        hashes, None, tuple(tokens), B, kv_cache_spec_kind="full_attention"
    )
    again = EngineBlockStored(
        hashes, None, tuple(tokens), B, group_idx=1, kv_cache_spec_kind="mamba"
    )
    out = rb.convert([again_kv, again])
    states = {
        h for e in out if isinstance(e, BlocksStored) and e.kind is Kind.STATE for h in e.hashes
    }
    assert not states & {canonical[0], canonical[1]}
    assert rb.stats.reannounced_state == 1
    # on a router that has not seen the prefill (started since), the last one is taken
    fresh = Reblocker(B, MODEL)
    out = fresh.convert([again_kv, again])
    assert [e for e in out if e.kind is Kind.STATE] == [  # type: ignore[union-attr]
        BlocksStored((canonical[2],), Tier.GPU, Kind.STATE)
    ]


def test_bad_events_are_counted_and_skipped() -> None:
    rb = Reblocker(B, MODEL)
    assert rb.convert([EngineBlockStored((1,), None, (1, 2, 3), B)]) == []
    assert rb.convert([EngineBlockStored((1,), None, tuple(range(B)), B, medium="TAPE")]) == []
    assert rb.convert([EngineBlockStored((2,), 999, tuple(range(B)), B)]) == []
    assert rb.convert([EngineBlockRemoved((12345,))]) == []
    assert rb.stats.bad_event == 2
    assert rb.stats.unknown_parent == 1 and rb.stats.unknown_removed == 1


def test_blocks_stored_again_mid_event_take_the_canonical_block_it_completes() -> None:
    """vLLM evicted an ancestor (block 2) while its descendants stayed cached; a request
    recomputing from there stores blocks 2-7 again, new copies of 4 and 5 among them, and
    completes the router block of blocks 4-7. Once the engine has evicted both copies of
    block 4, that router block is gone; it stayed indexed (an over-prediction) because the
    blocks already known kept the covers of their first store, which did not complete it."""
    vllm = load("vllm-0.33.0")
    be = 16
    rng = random.Random(7)
    tokens = [rng.randrange(50_000) for _ in range(8 * be)]
    hashes = [rng.getrandbits(63) for _ in range(8)]
    canonical = hash_prompt(tokens, B, ROOT).hashes
    index, key = PrefixIndex(), ReplicaKey("r")
    ingest = EngineIngest(
        key.replica, MODEL, B, lambda k, evs: index.apply(EventBatch(k, tuple(evs)))
    )

    def publish(*events: object) -> None:
        ingest.handle_payload(msgspec.msgpack.encode(vllm.KVEventBatch(1.0, list(events))))

    def stored(first: int, stop: int) -> object:
        parent = hashes[first - 1] if first else None
        span = tokens[first * be : stop * be]
        return vllm.BlockStored(
            hashes[first:stop], parent, span, be, None, "GPU", None, group_idx=0
        )

    publish(stored(0, 6))  # a 96-token prompt: router block 0 complete
    publish(vllm.BlockRemoved([hashes[2]], "GPU", group_idx=0))
    publish(stored(2, 8))  # the longer prompt, from the evicted block on
    assert index.match(canonical).get(key).kv_blocks == 2
    publish(vllm.BlockRemoved([hashes[4]], "GPU", group_idx=0))  # the old copy
    publish(vllm.BlockRemoved([hashes[4]], "GPU", group_idx=0))  # the new one
    assert index.match(canonical).get(key).kv_blocks == 1
    assert ingest.stats.malformed_events == 0


@pytest.mark.parametrize("be", [128, 256])
def test_evicting_a_branch_keeps_router_blocks_another_engine_block_still_holds(be: int) -> None:
    """Engine blocks a multiple of the router's: two prompts diverging inside their second
    engine block hold different engine blocks there, both holding the router blocks before
    the divergence. Evicting one branch's block must not remove those router blocks while
    the other branch's block still holds them (before: removed, a hole in the other
    branch's cached prefix: it matched one engine block, or, by the index's bisection, its
    whole length, whatever was evicted after)."""
    rng = random.Random(be)
    a = [rng.randrange(50_000) for _ in range(2 * be)]
    b = a[: be + B] + [rng.randrange(50_000) for _ in range(be - B)]  # one router block on
    rb = Reblocker(B, MODEL)
    a_hashes, a_events = engine_events(a, be, None, 1, 2)
    rb.convert(a_events)
    b_second = hash((2, 1)) & (2**64 - 1)
    rb.convert([EngineBlockStored((b_second,), a_hashes[0], tuple(b[be:]), be)])
    a_canonical = hash_prompt(a, B, ROOT).hashes
    b_canonical = hash_prompt(b, B, ROOT).hashes
    assert a_canonical[be // B] == b_canonical[be // B]  # shared by both second blocks
    assert rb.convert([EngineBlockRemoved((b_second,))]) == [
        BlocksRemoved(tuple(b_canonical[be // B + 1 :]), Tier.GPU, Kind.KV)
    ]
    assert rb.convert([EngineBlockRemoved((a_hashes[1],))]) == [
        BlocksRemoved(tuple(a_canonical[be // B :]), Tier.GPU, Kind.KV)
    ]
