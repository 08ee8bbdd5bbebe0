"""Prefix index semantics: exact cases, the hybrid rule, sequencing, speculation, and a
property test against a naive reference model."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.index import PrefixIndex
from router.core.types import (
    NO_MATCH,
    AllCleared,
    ApplyOutcome,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    Kind,
    PrefixMatch,
    ReplicaKey,
    Tier,
)

A, B, C = ReplicaKey("a"), ReplicaKey("b"), ReplicaKey("c", 1)
H = [1000 + i for i in range(20)]


def kv(index: PrefixIndex, hashes: list[int], key: ReplicaKey, **kw: object) -> int:
    return index.match(hashes, **kw).get(key).kv_blocks  # type: ignore[arg-type]


def test_match_lengths_per_replica() -> None:
    idx = PrefixIndex()
    idx.store(A, H[:10])
    idx.store(B, H[:3])
    idx.store(C, H[:20])
    res = idx.match(H[:15])
    assert res.get(A) == PrefixMatch(10, 10, 10, 10)
    assert res.get(B).kv_blocks == 3
    assert res.get(C).kv_blocks == 15
    assert res.get(ReplicaKey("zzz")) is NO_MATCH
    assert len(res) == 3 and res.longest() == 15
    assert dict(res.items()) == res.as_dict() and set(res.as_dict()) == {A, B, C}
    # Diverging query: only the shared part counts.
    assert idx.match(H[:2] + [1, 2, 3]).get(A).kv_blocks == 2
    assert not idx.match([5, 6, 7])


def test_hybrid_usable_needs_state_checkpoint_at_the_boundary() -> None:
    idx = PrefixIndex()
    idx.store(A, H[:10])
    idx.store(A, [H[3], H[7]], kind=Kind.STATE)  # checkpoints after 4 and 8 blocks
    idx.store(B, H[:10])  # KV only, no state: nothing usable on a hybrid model
    idx.store(C, H[:5])
    idx.store(C, [H[9]], kind=Kind.STATE)  # checkpoint beyond its KV: not usable
    res = idx.match(H[:10], hybrid=True)
    assert res.get(A) == PrefixMatch(10, 10, 10, 8)
    assert res.get(B).usable_blocks == 0 and res.get(B).kv_blocks == 10
    assert res.get(C).usable_blocks == 0
    # Query shorter than the KV match: the checkpoint must be inside the query.
    assert idx.match(H[:6], hybrid=True).get(A).usable_blocks == 4
    # Non-hybrid models ignore state.
    assert idx.match(H[:10]).get(B).usable_blocks == 10


def test_a_checkpoint_at_the_prompts_last_token_is_not_usable() -> None:
    """Engines compute at least a prompt's last token (vLLM caps a hit at N - 1): a state
    checkpoint exactly at the end of an N-token prompt (N a multiple of the block size) is
    not usable for that prompt; the one before it is."""
    idx = PrefixIndex()
    idx.store(A, H[:10])
    idx.store(A, [H[3], H[9]], kind=Kind.STATE)
    bs = 16
    aligned = idx.match(H[:10], hybrid=True, prompt_tokens=10 * bs, block_size=bs).get(A)
    assert aligned.usable_blocks == 4 and aligned.kv_blocks == 10
    longer = idx.match(H[:10], hybrid=True, prompt_tokens=10 * bs + 1, block_size=bs).get(A)
    assert longer.usable_blocks == 10


def test_tiers_are_tracked_separately() -> None:
    idx = PrefixIndex()
    idx.store(A, H[:4], Tier.GPU)
    idx.store(A, H[4:8], Tier.CPU)
    idx.store(A, H[8:10], Tier.DISK)
    m = idx.match(H[:10]).get(A)
    assert (m.kv_blocks, m.gpu_blocks, m.host_blocks, m.usable_blocks) == (10, 4, 8, 10)
    idx.remove(A, H[8:10], Tier.DISK)
    assert idx.match(H[:10]).get(A).kv_blocks == 8
    idx.remove(A, H[4:8], Tier.GPU)  # wrong tier: nothing changes
    assert idx.match(H[:10]).get(A).host_blocks == 8


def test_remove_clear_and_replica_removal() -> None:
    idx = PrefixIndex()
    idx.store(A, H[:10])
    idx.store(B, H[:10])
    idx.remove(A, H[6:10])
    assert kv(idx, H, A) == 6
    idx.remove(A, H[6:10])  # idempotent
    assert idx.replica_size(A) == (6, 0)
    idx.clear_replica(A)
    assert idx.match(H).get(A) is NO_MATCH and A in idx
    assert idx.replica_size(A) == (0, 0)
    assert kv(idx, H, B) == 20 - 10
    idx.store(A, H[:2])
    assert kv(idx, H, A) == 2
    idx.remove_replica(B)
    assert B not in idx and idx.match(H).get(B) is NO_MATCH
    assert idx.stats().garbage_entries == 16


def test_replicas_that_leave_little_behind_still_get_their_slots_freed() -> None:
    """Every removal or clear retires a slot (a bit position); ``compact`` frees them, and
    callers compact when ``garbage_ratio`` is high. Replicas that come and go with (almost)
    nothing cached (a crash-looping pod; each registration's resync clears the new key)
    leave no garbage entries behind, yet each takes a new, higher slot: without counting
    the dead slots the slot numbers (per-slot lists, the width of every shared block's
    bitmask) grow for ever next to a large live index."""
    idx = PrefixIndex()
    for i in range(4):
        idx.store(ReplicaKey(f"r{i}"), H[:10])
    idx.store(ReplicaKey("big"), range(10_000, 20_000))
    for i in range(1000):
        key = ReplicaKey(f"pod-{i}")
        idx.add_replica(key)  # registered ...
        idx.clear_replica(key)  # ... its resync ...
        idx.store(key, H[:1])
        idx.remove_replica(key)  # ... and gone
        if idx.garbage_ratio() > 0.5:  # the housekeeping's rule (router/service/background.py)
            idx.compact()
    assert len(idx._key_of) <= 2 * 64
    assert idx.match(H).get(ReplicaKey("r0")).kv_blocks == 10


def test_compaction_frees_slots_and_keeps_answers() -> None:
    idx = PrefixIndex()
    for i in range(5):
        idx.store(ReplicaKey(f"r{i}"), H[: 4 + i])
    for i in range(3):
        idx.clear_replica(ReplicaKey(f"r{i}"))
    before = idx.match(H).as_dict()
    assert idx.garbage_ratio() > 0
    touched = idx.compact()
    assert touched > 0 and idx.stats().garbage_entries == 0
    assert idx.match(H).as_dict() == before
    idx.store(ReplicaKey("new"), H[:3])  # reuses a freed slot without inheriting stale bits
    assert idx.match(H).get(ReplicaKey("new")).kv_blocks == 3
    assert idx.stats().unique_kv_blocks == 8


def test_a_compaction_in_steps_changes_no_answer_while_the_index_changes() -> None:
    """``compaction`` strips dead slots' bits a chunk at a time so the event loop serves
    between steps. Stores, removals, clears, replicas leaving and coming, speculation and
    awaited blocks go on meanwhile: every answer equals that of an index that never
    compacts, no slot is reused before its bits are gone, and ``compact`` finishes the
    compaction in progress rather than start a second one over it."""
    rng = random.Random(7)
    keys = [ReplicaKey(f"r{i}", i % 2) for i in range(12)]
    steady, stepping = PrefixIndex(), PrefixIndex()
    steps = None
    finished = 0
    for op in range(2000):
        key = rng.choice(keys)
        n = rng.randint(1, 20)
        tier = rng.choice(list(Tier))
        kind = rng.choice([Kind.KV, Kind.KV, Kind.STATE])
        roll = rng.random()
        for idx in (steady, stepping):
            if roll < 0.45:
                idx.store(key, H[:n], tier, kind)
            elif roll < 0.6:
                idx.remove(key, H[n - 1 : n + 2], tier, kind)
            elif roll < 0.7:
                idx.clear_replica(key)
            elif roll < 0.77:
                idx.remove_replica(key)
            elif roll < 0.85:
                idx.speculate(key, H[:n], H[n - 1 : n], float(op), 50.0)
                idx.expire(float(op))
            else:
                idx.await_store(key, H[n - 1], kind)
        if steps is None and stepping.garbage_ratio() > 0.2:
            steps = stepping.compaction(chunk=3)
        if steps is not None:
            if rng.random() < 0.02:
                stepping.compact()  # finishes the one in progress
            if next(steps, None) is None:
                steps, finished = None, finished + 1
        for prompt in (H[:5], H[:20], H[3:9]):
            for hybrid in (False, True):
                want = steady.match(prompt, hybrid=hybrid).as_dict()
                assert stepping.match(prompt, hybrid=hybrid).as_dict() == want, op
        for k in keys:
            assert stepping.awaits(k, H[0]) == steady.awaits(k, H[0])
    assert finished > 10
    stepping.compact()
    assert stepping.stats().garbage_entries == 0


def test_event_batches_sequencing() -> None:
    idx = PrefixIndex()
    stored = EventBatch(A, (BlocksStored(tuple(H[:5])),), seq=1)
    assert idx.apply(stored) is ApplyOutcome.APPLIED
    assert idx.apply(stored) is ApplyOutcome.DUPLICATE
    removed = EventBatch(A, (BlocksRemoved(tuple(H[3:5])),), seq=2)
    assert idx.apply(removed) is ApplyOutcome.APPLIED
    assert kv(idx, H, A) == 3
    # A redelivered old batch must not resurrect removed blocks.
    assert idx.apply(stored) is ApplyOutcome.DUPLICATE
    assert kv(idx, H, A) == 3
    gap = EventBatch(A, (BlocksStored(tuple(H[3:6])),), seq=5)
    assert idx.apply(gap) is ApplyOutcome.GAP and idx.last_seq(A) == 5
    assert kv(idx, H, A) == 6
    cleared = EventBatch(A, (AllCleared(), BlocksStored((H[0],))), seq=6)
    idx.apply(cleared)
    assert kv(idx, H, A) == 1
    idx.reset_sequence(A)
    assert idx.apply(EventBatch(A, (BlocksStored(tuple(H[:2])),), seq=0)) is ApplyOutcome.APPLIED
    # Batches without seq are always applied.
    assert idx.apply(EventBatch(B, (BlocksStored((H[0],)),))) is ApplyOutcome.APPLIED


def test_speculative_entries_expire() -> None:
    idx = PrefixIndex()
    idx.speculate(A, H[:6], [H[5]], now=10.0, ttl=2.0)
    m = idx.match(H, hybrid=True, now=11.0).get(A)
    assert (m.kv_blocks, m.usable_blocks) == (6, 6)
    # Refreshing extends the lifetime of the blocks named again.
    idx.speculate(A, H[:3], [H[2]], now=11.5, ttl=2.0)
    m = idx.match(H, hybrid=True, now=12.5).get(A)
    assert (m.kv_blocks, m.usable_blocks) == (3, 3)
    assert idx.match(H, now=13.6).get(A) is NO_MATCH
    assert idx.stats().speculative_entries == 0
    # Real entries are unaffected by speculation expiring.
    idx.store(A, H[:4])
    idx.speculate(A, H[:8], [], now=20.0, ttl=1.0)
    assert idx.match(H, now=20.5).get(A).kv_blocks == 8
    assert idx.match(H, now=21.0).get(A).kv_blocks == 4


def test_the_engines_events_replace_what_was_speculated() -> None:
    """A guess lasts until the engine reports the blocks: stored, they are real entries and
    the guess is gone; removed, they are gone, guess and all. Other replicas' guesses and
    the guesses of blocks not reported stay until their TTL."""
    idx = PrefixIndex()
    idx.speculate(A, H[:6], [H[5]], now=0.0, ttl=30.0)
    idx.speculate(B, H[:6], [], now=0.0, ttl=30.0)
    assert idx.stats().speculative_entries == 6 + 1 + 6
    idx.apply(EventBatch(A, (BlocksStored(tuple(H[:4])),), seq=1))
    assert idx.stats().speculative_entries == 2 + 1 + 6  # A's first 4 are real now
    assert idx.match(H, now=1.0).get(A).kv_blocks == 6  # 4 stored + 2 still guessed
    # the engine evicts a block it never reported storing: the guess must not outlive it
    idx.apply(EventBatch(A, (BlocksRemoved((H[5],)),), seq=2))
    assert idx.match(H, now=1.0).get(A).kv_blocks == 5
    # a recurrent-state checkpoint is settled by state events, not by KV ones
    m = idx.match(H, hybrid=True, now=1.0).get(A)
    assert m.usable_blocks == 0  # the guessed checkpoint at H[5] is past the 5 KV blocks
    idx.apply(EventBatch(A, (BlocksStored((H[5],), kind=Kind.STATE),), seq=3))
    assert idx.stats().speculative_entries == 1 + 6  # H[4] on A, and B's six
    assert idx.match(H, now=1.0).get(B).kv_blocks == 6
    # at the TTL the remaining guesses go; what the engine reported stays
    assert idx.match(H, now=31.0).get(A).kv_blocks == 4
    assert idx.match(H, now=31.0).get(B) is NO_MATCH
    assert idx.stats().speculative_entries == 0


def test_hole_in_a_chain_gives_an_upper_bound() -> None:
    """Documented limit: the bisection assumes prefix-closed caches (engines evict leaves
    first). A hole in the middle is not detected; the match is an upper bound."""
    idx = PrefixIndex()
    idx.store(A, H[:8])
    idx.remove(A, [H[7]])
    assert kv(idx, H, A) == 7  # removing the leaf: exact
    idx.remove(A, [H[2]])
    assert kv(idx, H[:8], A) >= 2


# ---------------------------------------------------------------- reference model


@dataclass
class RefReplica:
    tiers: dict[Tier, set[int]] = field(default_factory=lambda: {t: set() for t in Tier})
    state: set[int] = field(default_factory=set)


def ref_len(hashes: list[int], present: set[int]) -> int:
    n = 0
    for h in hashes:
        if h not in present:
            break
        n += 1
    return n


def ref_match(ref: dict[ReplicaKey, RefReplica], hashes: list[int], hybrid: bool) -> dict:
    out = {}
    for key, rep in ref.items():
        allkv = rep.tiers[Tier.GPU] | rep.tiers[Tier.CPU] | rep.tiers[Tier.DISK]
        k = ref_len(hashes, allkv)
        if not k:
            continue
        g = ref_len(hashes, rep.tiers[Tier.GPU])
        h = ref_len(hashes, rep.tiers[Tier.GPU] | rep.tiers[Tier.CPU])
        u = k
        if hybrid:
            u = next((d for d in range(k, 0, -1) if hashes[d - 1] in rep.state), 0)
        out[key] = PrefixMatch(k, min(g, k), max(min(g, k), min(h, k)), u)
    return out


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_index_agrees_with_reference_on_prefix_closed_caches(data: st.DataObject) -> None:
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    # A random tree of blocks: node i has a parent < i (or is a root).
    n_nodes = data.draw(st.integers(5, 60))
    parent = [-1] + [
        rng.choice([-1, *range(i)]) if rng.random() < 0.9 else -1 for i in range(1, n_nodes)
    ]
    path: list[list[int]] = []
    for i in range(n_nodes):
        path.append((path[parent[i]] if parent[i] >= 0 else []) + [i])
    hashes = [rng.getrandbits(64) for _ in range(n_nodes)]
    keys = [ReplicaKey(f"r{i}", i % 2) for i in range(data.draw(st.integers(1, 6)))]
    idx, ref = PrefixIndex(), {}
    for _ in range(data.draw(st.integers(1, 40))):
        key = rng.choice(keys)
        rep = ref.setdefault(key, RefReplica())
        idx.add_replica(key)
        op = rng.random()
        if op < 0.45:  # store a path on one tier (deeper tiers only below a GPU prefix)
            node = rng.randrange(n_nodes)
            tier = rng.choice([Tier.GPU, Tier.GPU, Tier.CPU, Tier.DISK])
            blocks = [hashes[i] for i in path[node]]
            idx.store(key, blocks, tier)
            rep.tiers[tier].update(blocks)
        elif op < 0.75:  # evict leaves (blocks no held child depends on), any tier
            for _ in range(rng.randint(1, 4)):
                held = set().union(*rep.tiers.values())
                leaves = [
                    i
                    for i in range(n_nodes)
                    if hashes[i] in held
                    and not any(parent[j] == i and hashes[j] in held for j in range(n_nodes))
                ]
                if not leaves:
                    break
                leaf = hashes[rng.choice(leaves)]
                for tier in Tier:
                    if leaf in rep.tiers[tier]:
                        idx.remove(key, [leaf], tier)
                        rep.tiers[tier].discard(leaf)
        elif op < 0.9:  # state checkpoints anywhere, and some removed
            node = hashes[rng.randrange(n_nodes)]
            if rng.random() < 0.7:
                idx.store(key, [node], kind=Kind.STATE)
                rep.state.add(node)
            else:
                idx.remove(key, [node], kind=Kind.STATE)
                rep.state.discard(node)
        elif op < 0.95:
            idx.clear_replica(key)
            ref[key] = RefReplica()
        else:
            idx.remove_replica(key)
            ref.pop(key)
        if rng.random() < 0.1:
            idx.compact()
    for _ in range(10):
        node = rng.randrange(n_nodes)
        query = [hashes[i] for i in path[node]] + [rng.getrandbits(64)] * rng.randint(0, 2)
        for hybrid in (False, True):
            got = idx.match(query, hybrid=hybrid).as_dict()
            assert got == ref_match(ref, query, hybrid)


def test_speculative_entries_are_bounded_oldest_dropped_first() -> None:
    idx = PrefixIndex(max_speculative_blocks=10)
    idx.speculate(A, H[:6], [], now=0.0, ttl=100.0)
    idx.speculate(B, H[:6], [], now=1.0, ttl=100.0)  # 12 > 10: A's entries go early
    assert idx.match(H, now=2.0).get(A) is NO_MATCH
    assert idx.match(H, now=2.0).get(B).kv_blocks == 6
    assert idx.stats().speculative_entries == 6
    # A block named again by a later call survives the drop of the earlier call.
    idx.speculate(C, H[:4], [], now=3.0, ttl=100.0)
    idx.speculate(C, H[:2], [], now=4.0, ttl=100.0)  # drops B's call (12 queued)
    assert idx.match(H, now=5.0).get(B) is NO_MATCH
    assert idx.match(H, now=5.0).get(C).kv_blocks == 4


def test_an_awaited_block_settles_on_its_replicas_store_only(monkeypatch: Any) -> None:
    """``await_store`` / ``awaits``: per replica and kind, settled by that replica's store
    of that kind (any tier) and by nothing else; bounded, the oldest forgotten first."""
    idx = PrefixIndex()
    assert idx.await_store(A, 7) and idx.await_store(B, 7)
    assert idx.await_store(A, 8, Kind.STATE)
    idx.store(C, [7])  # another replica
    idx.store(A, [8])  # KV, not the awaited checkpoint
    assert idx.awaits(A, 7) and idx.awaits(B, 7) and idx.awaits(A, 8, Kind.STATE)
    idx.store(A, [5, 7], tier=Tier.CPU)
    assert not idx.awaits(A, 7) and idx.awaits(B, 7)
    idx.store(A, [8], kind=Kind.STATE)
    assert not idx.awaits(A, 8, Kind.STATE)
    assert not idx.await_store(A, 8)  # held on the GPU already: nothing to wait for
    assert not idx.awaits(ReplicaKey("nobody"), 7)
    monkeypatch.setattr("router.core.index_updates.MAX_AWAITED", 2)
    for block in (20, 21, 22):
        idx.await_store(A, block)
    assert [idx.awaits(A, b) for b in (7, 20, 21, 22)] == [False, False, True, True]


def test_withdrawing_a_dispatch_drops_only_what_no_later_dispatch_named() -> None:
    """A dispatch the engine never took (refused, an error answer) withdraws its guesses at
    once: the blocks no later dispatch to that replica named again, KV and checkpoints, and
    nothing of another replica's or of what the engine reported."""
    idx = PrefixIndex()
    first = idx.speculate(A, H[:8], [H[7]], now=0.0, ttl=30.0)
    second = idx.speculate(A, H[:4], [H[3]], now=1.0, ttl=30.0)  # shares H[:4] with first
    idx.speculate(B, H[:8], [H[7]], now=1.0, ttl=30.0)
    idx.store(A, H[:2])
    assert idx.stats().speculative_entries == 8 + 2 + 8 + 1 - 2  # H[:2] on A settled
    assert idx.withdraw(A, first, H[:8], [H[7]]) == 4 + 1  # H[4:8] and the checkpoint
    m = idx.match(H, hybrid=True, now=2.0)
    assert (m.get(A).kv_blocks, m.get(A).usable_blocks) == (4, 4)  # the second's guess
    assert (m.get(B).kv_blocks, m.get(B).usable_blocks) == (8, 8)
    assert idx.withdraw(A, first, H[:8], [H[7]]) == 0  # idempotent
    assert idx.withdraw(A, second, H[:4], [H[3]]) == 2 + 1
    assert idx.match(H, now=2.0).get(A).kv_blocks == 2  # what the engine reported
    assert idx.stats().speculative_entries == 8 + 1
    # the withdrawn calls' expiry later changes nothing, and the cap's count stays right
    assert idx.expire(31.0) == 8 + 1
    assert idx._spec_queued == 0 and not idx._spec_heap
    assert idx.stats().speculative_entries == 0


def test_withdrawing_a_dispatch_keeps_what_an_earlier_one_still_guesses() -> None:
    """A block named by several dispatches to a replica stays guessed while any of them is
    alive: withdrawing the later one (refused) takes back only what it alone named, and
    the earlier one's guess stays whole until its own TTL (it reached the engine). Before,
    the index kept only the last call per block, so the withdrawal dropped the shared
    prefix and left the earlier guess with a hole at its start: no match at all."""
    idx = PrefixIndex()
    idx.speculate(A, H[:6], [H[5]], now=0.0, ttl=30.0)  # reached the engine
    later = idx.speculate(A, H[:8], [H[7]], now=1.0, ttl=30.0)  # refused
    assert idx.withdraw(A, later, H[:8], [H[7]]) == 2 + 1  # H[6:8] and its checkpoint
    m = idx.match(H, hybrid=True, now=2.0).get(A)
    assert (m.kv_blocks, m.usable_blocks) == (6, 6)
    assert idx.stats().speculative_entries == 6 + 1
    assert idx.expire(30.5) == 6 + 1
    assert idx.match(H, now=30.5).get(A) is NO_MATCH


def test_a_later_guess_that_ends_sooner_does_not_cut_an_earlier_one_short() -> None:
    """A block is guessed until the last of the calls naming it ends, whichever was made
    last: a later dispatch may carry a shorter TTL (a peer pod's, adopted late; another
    model's setting), and its end must not take the earlier dispatch's blocks with it."""
    idx = PrefixIndex()
    idx.speculate(A, H[:6], [], now=0.0, ttl=30.0)
    idx.speculate(A, H[:4], [], now=1.0, ttl=2.0)  # ends at 3.0
    assert idx.match(H, now=5.0).get(A).kv_blocks == 6
    assert idx.match(H, now=30.0).get(A) is NO_MATCH


def test_withdrawing_after_the_replica_was_cleared_or_removed_is_harmless() -> None:
    idx = PrefixIndex()
    spec = idx.speculate(A, H[:6], [], now=0.0, ttl=30.0)
    idx.clear_replica(A)  # A moves to a fresh slot
    later = idx.speculate(A, H[:6], [], now=1.0, ttl=30.0)
    assert idx.withdraw(A, spec, H[:6], []) == 0
    assert idx.match(H, now=2.0).get(A).kv_blocks == 6  # the later guess, on the new cache
    idx.compact()  # the old slot is free for another replica
    idx.speculate(B, H[:3], [], now=2.0, ttl=30.0)
    assert idx.withdraw(B, spec, H[:6], []) == 0
    assert idx.match(H, now=2.0).get(B).kv_blocks == 3
    idx.remove_replica(A)
    assert idx.withdraw(A, later, H[:6], []) == 0


def test_awaiting_at_the_bound_forgets_the_oldest_and_renews_a_block_named_again(
    monkeypatch: Any,
) -> None:
    """At ``MAX_AWAITED`` every ``await_store`` forgets the oldest awaited block (an
    ``OrderedDict``: a plain dict's first key deleted again and again leaves deleted slots
    at its front that each next lookup walks over, a cost growing with every eviction); a
    block awaited again becomes the newest."""
    bound = 1_000
    monkeypatch.setattr("router.core.index_updates.MAX_AWAITED", bound)
    idx = PrefixIndex()
    for block in range(5 * bound):
        idx.await_store(A, block)
        if block == 4 * bound:
            idx.await_store(B, 4 * bound - 1)  # named again: the newest, not forgotten
    awaited = [b for b in range(5 * bound) if idx.awaits(A, b) or idx.awaits(B, b)]
    assert awaited == [4 * bound - 1, *range(4 * bound + 1, 5 * bound)]
    assert idx.awaits(A, 4 * bound - 1) and idx.awaits(B, 4 * bound - 1)


def test_a_slot_freed_by_compaction_awaits_nothing_for_its_next_replica() -> None:
    """A replica that leaves with blocks still awaited (its engine never reported them)
    leaves nothing awaited for the replica that later gets its slot: that one never
    awaited those blocks, and a session hint of it would otherwise credit such a block
    (``RoutingEngine._hint``) after its engine reported it stored and evicted."""
    idx = PrefixIndex()
    assert idx.await_store(A, 7) and idx.await_store(A, 8, Kind.STATE)
    idx.remove_replica(A)
    idx.compact()
    idx.add_replica(B)  # A's old slot
    assert not idx.awaits(B, 7) and not idx.awaits(B, 8, Kind.STATE)
    idx.store(C, [9])
    assert idx.await_store(C, 7)  # still awaited for a replica that asked
    idx.remove_replica(C)
    idx.compact()
    assert not idx._awaited[Kind.KV]  # nothing left of the replicas gone
