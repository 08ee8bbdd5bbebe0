"""Several state-like groups (mamba and sliding-window): a prefix is usable where all agree.

vLLM 0.34's ``HybridKVCacheCoordinator`` grants the longest prefix every group's manager
accepts: it asks each group in turn for its longest hit within the last one's and repeats
until none shortens it. The per-group rules come from an unmodified copy of the wheel's
``single_type_kv_cache_manager.py`` (tests/engines): ``SlidingWindowManager`` (the window
before the prefix end cached) and ``MambaManager`` (a state saved exactly at the prefix end).
The router sees only the engine's events (vLLM's event classes, msgpack, our decoder, the
re-blocker, the index) on random caches with holes, evictions, blocks stored again and a group
the router learns of only after others published checkpoints; the usable prefix it predicts
must be the coordinator's. A union of the groups' checkpoints (the router before it modelled
this) predicts more, and often.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import msgspec
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
from router.events.decode import decode_payload
from router.events.model import (
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineEvent,
)
from router.events.reblock import Reblocker
from router.events.state_groups import StateGroups
from tests.engines import load
from tests.test_events_window import _engine_hashes, _Pool, _vllm_window_manager

MODEL = "mixed-model"
BE = 16  # engine block
KEY = ReplicaKey("r0")


@dataclass(slots=True, frozen=True)
class Group:
    """One state-like group of the engine: ``mamba``, or ``sliding_window`` of ``window``."""

    idx: int
    kind: str
    window: int = 0


MAMBA = Group(1, "mamba")
SWA128 = Group(2, "sliding_window", 128)
SWA33 = Group(3, "sliding_window", 33)
SWA500 = Group(4, "sliding_window", 500)
MAMBA2 = Group(5, "mamba")


def _group_hit(group: Group, hashes: list[int], cached: set[int], limit: int, align: int) -> int:
    """Tokens of ``hashes`` vLLM 0.34's manager of ``group`` accepts within ``limit``."""
    mod = _vllm_window_manager()
    if group.kind == "mamba":
        manager, spec = mod.MambaManager, mod.MambaSpec()
    else:
        manager, spec = mod.SlidingWindowManager, mod.SlidingWindowSpec()
        spec.sliding_window = group.window
    spec.block_size = BE
    _, hit = manager.find_longest_cache_hit(
        hashes, limit, [group.idx], _Pool(cached), spec, False, align
    )
    return int(hit)


def vllm_hit(hashes: list[int], full: set[int], groups: dict[Group, set[int]], align: int) -> int:
    """The coordinator's hit: the full-attention prefix, then every group's hit within the
    last, until none shortens it."""
    hit = next((i for i, h in enumerate(hashes) if h not in full), len(hashes)) * BE
    while True:
        before = hit
        for group, cached in groups.items():
            hit = _group_hit(group, hashes, cached, hit, align)
        if hit == before:
            return hit


def union_hit(hashes: list[int], full: set[int], groups: dict[Group, set[int]], align: int) -> int:
    """What a prefix counted usable where any group's checkpoint exists would give."""
    return max(vllm_hit(hashes, full, {g: c}, align) for g, c in groups.items())


class Engine:
    """A full-attention group (0) and ``groups``, publishing as vLLM 0.34 does: each prefill
    step one store per group over the step's token range, a state-like group's naming its
    kept blocks only (mamba "align" mode and window tails keep few)."""

    def __init__(self, groups: tuple[Group, ...], router_block: int) -> None:
        self.mod = load("vllm-0.33.0")  # byte-identical to 0.34.0's kv_events.py
        self.groups = groups
        self.router_block = router_block
        self.rb = Reblocker(router_block, MODEL)
        self.index = PrefixIndex()
        self.index.add_replica(KEY)
        self.full: set[int] = set()
        self.cached: dict[Group, set[int]] = {g: set() for g in groups}

    def publish(self, events: list[Any], rng: random.Random) -> None:
        rng.shuffle(events)  # groups come in any order within a batch
        payload = msgspec.msgpack.encode(self.mod.KVEventBatch(ts=1.0, events=events))
        result = decode_payload(payload)
        assert result.batch is not None and not result.errors
        self.index.apply(EventBatch(KEY, tuple(self.rb.convert(result.batch.events))))

    def _store(self, group: Group | None, kept: list[int], parent: Any, tokens: list[int]) -> Any:
        return self.mod.BlockStored(
            block_hashes=kept, parent_block_hash=parent, token_ids=tokens, block_size=BE,
            lora_id=None, medium="GPU", lora_name=None, group_idx=group.idx if group else 0,
            kv_cache_spec_kind=group.kind if group else "full_attention",
            kv_cache_spec_sliding_window=group.window if group and group.window else None,
        )  # fmt: skip

    def _kept(
        self, group: Group, hashes: list[int], start: int, keep: float, rng: random.Random
    ) -> list[int]:
        kept = [h for h in hashes if rng.random() < keep]
        if group.kind == "mamba" and start == 0 and len(kept) == len(hashes) > 1:
            # every block from the first is vLLM's re-announced hit, not a prefill: keep fewer
            kept = kept[1:]
        return kept

    def prefill(self, tokens: list[int], keep: dict[Group, float], rng: random.Random) -> None:
        """The blocks of ``tokens`` past the full-attention prefix hit, in steps."""
        hashes = _engine_hashes(tokens)
        a = next((i for i, h in enumerate(hashes) if h not in self.full), len(hashes))
        while a < len(hashes):
            b = min(len(hashes), a + rng.randrange(1, 12))
            parent = hashes[a - 1] if a else None
            step = tokens[a * BE : b * BE]
            events = [self._store(None, hashes[a:b], parent, step)]
            for group in self.groups:
                kept = self._kept(group, hashes[a:b], a, keep[group], rng)
                if kept:  # a group that kept nothing publishes nothing
                    events.append(self._store(group, kept, parent, step))
                    self.cached[group].update(kept)
            self.publish(events, rng)
            self.full.update(hashes[a:b])
            a = b

    def restore(self, tokens: list[int], group: Group, rng: random.Random) -> None:
        """Some of ``group``'s missing blocks of ``tokens`` cached again (one store over the
        whole range, placed by their full-attention blocks)."""
        hashes = _engine_hashes(tokens)
        again = [h for h in hashes if h not in self.cached[group] and rng.random() < 0.5]
        if group.kind == "mamba" and len(again) == len(hashes):
            again = again[1:]  # not every block from the first: vLLM's re-announced hit
        if again:
            self.publish([self._store(group, again, None, tokens)], rng)
            self.cached[group].update(again)

    def evict(self, group: Group, hashes: list[int], rng: random.Random) -> None:
        gone = [h for h in hashes if h in self.cached[group]]
        if gone:
            removed = self.mod.BlockRemoved(block_hashes=gone, medium="GPU", group_idx=group.idx)
            self.publish([removed], rng)
            self.cached[group].difference_update(gone)

    def usable_tokens(self, tokens: list[int]) -> int:
        hashes = hash_prompt(tokens, self.router_block, root_hash(MODEL)).hashes
        found = self.index.match(hashes, hybrid=True).get(KEY)
        return 0 if found is None else found.usable_blocks * self.router_block


@dataclass(slots=True)
class Tally:
    checked: int = 0
    union_over: int = 0  # prefixes a union of checkpoints would over-predict


def _check(eng: Engine, probes: list[list[int]], tally: Tally) -> None:
    for seq in probes:
        hashes = _engine_hashes(seq)
        expected = vllm_hit(hashes, eng.full, eng.cached, eng.router_block)
        got = eng.usable_tokens(seq)
        assert got == expected, (len(seq), got, expected)
        tally.union_over += union_hit(hashes, eng.full, eng.cached, eng.router_block) > expected
        tally.checked += 1


CASES = [
    ((MAMBA, SWA128), 16),
    ((MAMBA, SWA128), 64),
    ((SWA128, SWA500), 64),
    ((MAMBA, MAMBA2), 16),
    ((MAMBA, SWA33, SWA500), 64),
]


@pytest.mark.parametrize(("groups", "router_block"), CASES)
def test_usable_prefix_is_vllms_coordinator_hit(
    groups: tuple[Group, ...], router_block: int
) -> None:
    """Every group known from the first batch: the index matches the coordinator after
    prefills with holes, evictions in each group and blocks stored again."""
    rng = random.Random(router_block * 100 + sum(g.idx for g in groups))
    base = [rng.randrange(1, 50_000) for _ in range(40 * BE)]
    tally = Tally()
    for _trial in range(25):
        eng = Engine(groups, router_block)
        seqs = _branches(base, rng, 3)
        keep = {g: rng.choice((0.5, 0.8, 1.0)) for g in groups}
        for seq in seqs:
            eng.prefill(seq, keep, rng)
        _check(eng, [*seqs, base], tally)
        for group in groups:  # each group evicts on its own
            for seq in seqs:
                eng.evict(group, [h for h in _engine_hashes(seq) if rng.random() < 0.15], rng)
        _check(eng, [*seqs, base], tally)
        for seq in seqs:
            eng.restore(seq, rng.choice(groups), rng)
        _check(eng, [*seqs, base], tally)
    # a union of the groups' checkpoints would have been wrong on many of these prefixes
    assert tally.union_over > tally.checked // 10, tally


@pytest.mark.parametrize(("groups", "router_block"), CASES)
def test_a_group_first_seen_late_cuts_what_was_published(
    groups: tuple[Group, ...], router_block: int
) -> None:
    """The router learns an engine's groups from its events: while the last group keeps
    nothing it publishes nothing, and the others' checkpoints are indexed; its first store
    withdraws every published checkpoint it lacks, in the same batch."""
    rng = random.Random(router_block * 7 + len(groups))
    base = [rng.randrange(1, 50_000) for _ in range(40 * BE)]
    late = groups[-1]
    tally = Tally()
    over = 0  # prefixes predicted usable before the late group was seen (cut when it is)
    for _trial in range(25):
        eng = Engine(groups, router_block)
        seqs = _branches(base, rng, 3)
        keep = {g: rng.choice((0.6, 1.0)) for g in groups}
        for seq in seqs:
            eng.prefill(seq, {**keep, late: 0.0}, rng)
        assert not eng.cached[late]  # it published nothing
        # not known yet: the others' checkpoints are indexed (the engine grants none)
        for seq in [*seqs, base]:
            assert vllm_hit(_engine_hashes(seq), eng.full, eng.cached, router_block) == 0
            over += eng.usable_tokens(seq) > 0
        more = _branches(base, rng, 2)
        for seq in more:
            eng.prefill(seq, keep, rng)
        while not eng.cached[late]:  # its first store, if the prefills kept nothing
            eng.restore(rng.choice(seqs), late, rng)
        _check(eng, [*seqs, *more, base], tally)
        for seq in [*seqs, *more]:
            gone = [h for h in _engine_hashes(seq) if rng.random() < 0.2]
            eng.evict(rng.choice(groups), gone, rng)
            eng.restore(seq, late, rng)
        _check(eng, [*seqs, *more, base], tally)
    assert over > 25 and tally.union_over > tally.checked // 10, (over, tally)


def _branches(base: list[int], rng: random.Random, n: int) -> list[list[int]]:
    """``n`` sequences sharing prefixes of ``base`` (branching at random blocks)."""
    out = []
    for _ in range(n):
        cut = rng.randrange(1, 40) * BE
        tail = [rng.randrange(1, 50_000) for _ in range(rng.randrange(0, 12) * BE)]
        out.append(base[:cut] + tail)
    return out


def _state(events: list[IndexEvent], kind: type[BlocksStored | BlocksRemoved]) -> set[int]:
    """The checkpoints ``events`` of type ``kind`` name."""
    return {
        h for e in events if isinstance(e, kind) and e.kind is Kind.STATE for h in e.hashes
    }  # fmt: skip


def test_a_checkpoint_in_one_group_only_is_not_usable() -> None:
    """mamba + sliding window + full attention (SambaY / Phi-4-mini-flash): a state saved at
    4 blocks while the window there is not cached is no hit at 4 blocks; the window complete at
    3 blocks with no state there is none either. Both at 2 blocks: the hit is 2 blocks."""
    tokens = list(range(1, 6 * BE + 1))
    hashes = _engine_hashes(tokens)
    rb = Reblocker(BE, MODEL)
    canonical = hash_prompt(tokens, BE, root_hash(MODEL)).hashes
    full = EngineBlockStored(tuple(hashes), None, tuple(tokens), BE, group_idx=0)
    mamba = EngineBlockStored(
        (hashes[1], hashes[3]), None, tuple(tokens), BE, group_idx=1, kv_cache_spec_kind="mamba"
    )
    window = EngineBlockStored(
        tuple(hashes[:3]), None, tuple(tokens), BE, group_idx=2,
        kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=2 * BE,
    )  # fmt: skip
    out = rb.convert([full, mamba, window])
    index = PrefixIndex()
    index.apply(EventBatch(KEY, tuple(out)))
    found = index.match(canonical, hybrid=True).get(KEY)
    assert found is not None and found.kv_blocks == 6 and found.usable_blocks == 2
    # the window group, seen after the mamba group published, withdrew its checkpoints and
    # published those both hold
    assert _state(out, BlocksRemoved) == {canonical[1], canonical[3]}
    assert out[-1] == BlocksStored((canonical[1],), Tier.GPU, Kind.STATE)
    # the window slides past block 1: the checkpoint at 2 blocks goes
    out = rb.convert([EngineBlockRemoved((hashes[0],), group_idx=2)])
    assert _state(out, BlocksRemoved) == {canonical[1]}
    index.apply(EventBatch(KEY, tuple(out)))
    assert index.match(canonical, hybrid=True).get(KEY).usable_blocks == 0
    # the window group's blocks 2-4 cached again: the state at 4 blocks is usable now
    again = EngineBlockStored(
        (hashes[3],), None, tuple(tokens), BE, group_idx=2,
        kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=2 * BE,
    )  # fmt: skip
    out = rb.convert([again])
    assert _state(out, BlocksStored) == {canonical[3]}
    index.apply(EventBatch(KEY, tuple(out)))
    assert index.match(canonical, hybrid=True).get(KEY).usable_blocks == 4


def test_reset_keeps_offloaded_checkpoints_only_where_every_group_holds_them() -> None:
    """``AllBlocksCleared`` keeps what vLLM's offloading connector holds: with two mamba
    groups, a checkpoint both offloaded is stored again, one offloaded by one group only is
    not; a sliding-window group (GPU only) keeps none."""
    tokens = list(range(1, 4 * BE + 1))
    hashes = _engine_hashes(tokens)
    canonical = hash_prompt(tokens, BE, root_hash(MODEL)).hashes

    def mamba(group: int, kept: tuple[int, ...], medium: str = "GPU") -> EngineBlockStored:
        return EngineBlockStored(
            kept, None, tuple(tokens), BE, medium=medium, group_idx=group,
            kv_cache_spec_kind="mamba",
        )  # fmt: skip

    full = EngineBlockStored(tuple(hashes), None, tuple(tokens), BE, group_idx=0)
    rb = Reblocker(BE, MODEL)
    rb.convert([full, mamba(1, (hashes[1], hashes[3])), mamba(2, (hashes[1], hashes[2]))])
    cpu: list[EngineEvent] = [
        mamba(1, (hashes[1], hashes[3]), "CPU"),
        mamba(2, (hashes[1],), "CPU"),
    ]
    assert _state(rb.convert(cpu), BlocksStored) == {canonical[1]}
    out = rb.convert([EngineAllCleared()])
    assert _state(out, BlocksStored) == {canonical[1]}
    assert all(e.tier is Tier.CPU for e in out if isinstance(e, BlocksStored))
    # with a window group as well, nothing is kept: its window was on the GPU
    window = EngineBlockStored(
        tuple(hashes), None, tuple(tokens), BE, group_idx=3,
        kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=BE,
    )  # fmt: skip
    rb.convert([full, window])
    assert rb.stats.unmapped_offload == 0
    assert _state(rb.convert([EngineAllCleared()]), BlocksStored) == set()


def test_one_state_group_publishes_as_before() -> None:
    """KV + one mamba group, or KV + one window group: no intersection is kept (the common
    case costs what it did), and two window stores of one group stay one group."""
    tokens = list(range(1, 4 * BE + 1))
    hashes = _engine_hashes(tokens)
    for kind, window in (("mamba", None), ("sliding_window", 40)):
        rb = Reblocker(BE, MODEL)
        full = EngineBlockStored(tuple(hashes), None, tuple(tokens), BE, group_idx=0)
        state = EngineBlockStored(
            tuple(hashes[1:]), None, tuple(tokens), BE, group_idx=1, kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
        )  # fmt: skip
        rb.convert([full, state])
        rb.convert([state, EngineBlockRemoved((hashes[2],), group_idx=1)])
        assert rb._mixed is None, kind


def test_state_groups_intersection() -> None:
    groups = StateGroups({1: {10, 11, 12}})
    assert groups.published() == {10, 11, 12}
    # a group first seen holding 11 only: 10 and 12 are withdrawn
    assert sorted(groups.join(2, {11})) == [10, 12]
    assert groups.join(2, {10}) == []  # known: nothing changes
    assert groups.stored(2, [12, 13]) == [12]  # 13: group 1 lacks it
    assert groups.stored(1, [13, 11]) == [13, 11]  # announced again, as one group would
    assert groups.removed(1, [11, 99]) == [11]  # 99 was never held
    assert groups.removed(2, [11]) == []  # no longer published
    assert groups.published() == {12, 13}
    assert groups.reset({1: {12}, 2: {12, 13}}) == {12}
    assert groups.reset({}) == set() and groups.groups() == (1, 2)
