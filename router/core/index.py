"""The prefix index: which replica caches which prefix blocks, and how much of a request's
prefix each replica can actually reuse.

Layout (chosen for 10^3 replicas x 10^7 blocks, see docs/benchmarks.md):

* Every replica gets a *slot*, a bit position. For each block hash a dict maps to the set of
  slots holding it, as a Python int bitmask. A block held by a single replica (the common
  case: KV-aware routing pins sessions) stores ``~slot`` instead of ``1 << slot``, which is a
  small int (about 110 bytes a unique block all told, against 160+ bytes for a wide mask).
* One dict per tier (GPU, CPU, disk) and one for recurrent-state checkpoints; speculative
  entries live in two more dicts with expiry, so real events never have to undo a guess.
* Clearing a replica is O(1): it moves to a fresh slot and the old slot is marked dead.
  Queries mask dead bits out; ``compact()`` strips them later (amortised, when garbage
  exceeds the live entries, or dead slots the live keys) and frees the slots for reuse.

Lookup: with one dict probe we learn *all* replicas holding a depth, so the query bisects
over depth on bitmasks: replicas that drop out at different depths split a segment in two,
segments where nobody drops out are skipped. Cost is O(k log n) dict probes for k distinct
match lengths, independent of the number of replicas holding the blocks.

The bisection relies on the prefix property: if a replica holds block i it holds blocks
0..i-1 too. Engines evict leaves first (vLLM frees a request's blocks tail-first, SGLang's
radix tree evicts leaves) so caches are prefix-closed; where a hole exists anyway (e.g. a
lost removal) the reported match is an upper bound that a later event corrects.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import compress, filterfalse, repeat
from operator import eq, ne

import numpy as np

from router.core.engine_hits import peeked
from router.core.keycache import PerTuple
from router.core.prefix_match import (
    PrefixMatches,
    bisect_lengths,
    iter_slots,
    union_of,
    usable_lengths,
)
from router.core.types import (
    AllCleared,
    ApplyOutcome,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    Kind,
    ReplicaKey,
    Tier,
)

_TIERS = (Tier.GPU, Tier.CPU, Tier.DISK)
# blocks of each kind awaited from engines at once (PrefixIndex.await_store); beyond it the
# oldest are forgotten, i.e. no longer awaited
MAX_AWAITED = 400_000
_SINK: deque[object] = deque(maxlen=0)
_consume = _SINK.extend  # exhaust an iterator (C-level loops for bulk events)


COMPACT_CHUNK = 50_000
"""Entries a :meth:`PrefixIndex.compaction` step visits."""

_SLOT_SLACK = 64
"""Retired slots :meth:`PrefixIndex.garbage_ratio` weighs against at least this many keys
(a small fleet is not compacted for every replica that leaves)."""


def _bits(value: int) -> int:
    """Decode a stored holder set: negative values are single slots (``~slot``)."""
    return value if value >= 0 else 1 << ~value


def _pack(mask: int) -> int:
    """Encode a non-empty holder set, singletons as ``~slot``."""
    return ~(mask.bit_length() - 1) if mask & (mask - 1) == 0 else mask


def _discard(table: dict[int, int], block: int, bit: int) -> bool:
    value = table.get(block)
    if value is None:
        return False
    mask = _bits(value)
    if not mask & bit:
        return False
    mask ^= bit
    if mask:
        table[block] = _pack(mask)
    else:
        del table[block]
    return True


@dataclass(slots=True, frozen=True)
class IndexStats:
    replicas: int
    kv_entries: int
    state_entries: int
    speculative_entries: int
    garbage_entries: int
    unique_kv_blocks: int


class PrefixIndex:
    """Prefix-block index over many replicas. Not thread-safe; one owner mutates it."""

    def __init__(self, max_speculative_blocks: int = 1_000_000) -> None:
        """``max_speculative_blocks`` bounds the memory of speculative entries: beyond it the
        entries closest to expiry are dropped early (with one TTL, the oldest first; with
        mixed TTLs, such as approximate and exact prompts', the shortest-lived go first)."""
        self.max_speculative_blocks = max_speculative_blocks
        self._spec_queued = 0
        self._slot_of: dict[ReplicaKey, int] = {}
        self._key_of: list[ReplicaKey | None] = []
        self._free: list[int] = []
        self._live = 0
        self._dead = 0
        self._garbage = 0
        self._compacting: Iterator[int] | None = None  # (compaction)
        self._kv: tuple[dict[int, int], ...] = ({}, {}, {})
        self._state: dict[int, int] = {}
        self._spec: tuple[dict[int, int], dict[int, int]] = ({}, {})
        # (kind, slot) -> {block: id of the speculate() call that last named it}
        self._spec_owner: dict[tuple[int, int], dict[int, int]] = {}
        self._spec_heap: list[tuple[float, int, int, int, tuple[int, ...]]] = []
        self._spec_ids = itertools.count(1)
        # per kind: block -> mask of the slots whose engine has yet to report storing it,
        # oldest first (an OrderedDict: a plain dict's first key, deleted again and again,
        # costs a walk over every key deleted before it)
        self._awaited: tuple[OrderedDict[int, int], OrderedDict[int, int]] = (
            OrderedDict(),
            OrderedDict(),
        )
        self._kv_count: list[int] = []
        self._state_count: list[int] = []
        # GPU KV blocks each slot's engine reported removed since the slot was assigned
        self._kv_evicted: list[int] = []
        self._state_slots = 0
        # replica keys that ever published a recurrent-state checkpoint (the model is
        # hybrid), and a counter bumped when one is added (RoutingEngine's cache key)
        self._state_keys: set[ReplicaKey] = set()
        self.state_generation = 0
        self._last_seq: dict[ReplicaKey, int] = {}
        self._slot_generation = 0  # bumped whenever a key gets or loses a slot
        self._epochs = itertools.count(1)
        self._epoch: list[int] = []  # per slot: the cache_epoch of the key given it last
        self._slots_cache: PerTuple[np.ndarray] = PerTuple()

    # ------------------------------------------------------------------ replicas

    def _slot(self, key: ReplicaKey) -> int:
        slot = self._slot_of.get(key)
        if slot is None:
            if self._free:
                slot = self._free.pop()
                self._key_of[slot] = key
                self._kv_evicted[slot] = 0
                self._epoch[slot] = next(self._epochs)
            else:
                slot = len(self._key_of)
                self._key_of.append(key)
                self._kv_count.append(0)
                self._state_count.append(0)
                self._kv_evicted.append(0)
                self._epoch.append(next(self._epochs))
            self._slot_of[key] = slot
            self._live |= 1 << slot
            self._slot_generation += 1
        return slot

    def add_replica(self, key: ReplicaKey) -> None:
        """Register a replica with an empty cache (idempotent)."""
        self._slot(key)

    def _kill(self, key: ReplicaKey) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is None:
            return
        self._slot_generation += 1
        bit = 1 << slot
        self._live &= ~bit
        self._dead |= bit
        self._state_slots &= ~bit
        self._garbage += self._kv_count[slot] + self._state_count[slot]
        self._kv_count[slot] = 0
        self._state_count[slot] = 0
        self._key_of[slot] = None

    def clear_replica(self, key: ReplicaKey) -> None:
        """Forget everything ``key`` caches, in O(1); it stays registered."""
        if key in self._slot_of:
            self._kill(key)
            self._slot(key)

    def remove_replica(self, key: ReplicaKey) -> None:
        """Forget the replica and its cache (it left the fleet or its lease expired)."""
        self._kill(key)
        self._last_seq.pop(key, None)
        self._state_keys.discard(key)

    def cache_epoch(self, key: ReplicaKey) -> int:
        """Which cache of ``key`` the index describes: a number (> 0) that changes whenever
        the replica's cache is forgotten (``clear_replica``: an AllCleared event, a resync;
        ``remove_replica`` and back: a restart), never reused; 0 while the key is unknown.
        What was guessed of a replica under one epoch (a session hint) says nothing of the
        next."""
        slot = self._slot_of.get(key)
        return 0 if slot is None else self._epoch[slot]

    def publishes_state(self, key: ReplicaKey) -> bool:
        """Whether ``key`` ever stored a recurrent-state checkpoint (it serves a hybrid
        model); kept across ``clear_replica``, dropped by ``remove_replica``."""
        return key in self._state_keys

    def replicas(self) -> list[ReplicaKey]:
        return list(self._slot_of)

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def last_seq(self, key: ReplicaKey) -> int | None:
        return self._last_seq.get(key)

    def reset_sequence(self, key: ReplicaKey) -> None:
        """Accept any next ``seq`` from ``key`` (its event source restarted numbering)."""
        self._last_seq.pop(key, None)

    # ------------------------------------------------------------------ events

    def apply(self, batch: EventBatch) -> ApplyOutcome:
        """Apply one replica's batch of events.

        Idempotent: a batch whose ``seq`` was already applied is ignored, storing a stored
        block or removing an absent one changes nothing. A ``seq`` that skips ahead is still
        applied but reported as GAP so the caller resyncs that replica.
        """
        outcome = ApplyOutcome.APPLIED
        if batch.seq is not None:
            last = self._last_seq.get(batch.replica)
            if last is not None:
                if batch.seq <= last:
                    return ApplyOutcome.DUPLICATE
                if batch.seq > last + 1:
                    outcome = ApplyOutcome.GAP
            self._last_seq[batch.replica] = batch.seq
        slot = self._slot(batch.replica)
        for event in batch.events:
            if isinstance(event, BlocksStored):
                self._store(slot, event.hashes, event.tier, event.kind)
            elif isinstance(event, BlocksRemoved):
                self._remove(slot, event.hashes, event.tier, event.kind)
            elif isinstance(event, AllCleared):
                self.clear_replica(batch.replica)
                slot = self._slot_of[batch.replica]
        return outcome

    def store(
        self,
        key: ReplicaKey,
        hashes: Iterable[int],
        tier: Tier = Tier.GPU,
        kind: Kind = Kind.KV,
    ) -> None:
        self._store(self._slot(key), hashes, tier, kind)

    def remove(
        self,
        key: ReplicaKey,
        hashes: Iterable[int],
        tier: Tier = Tier.GPU,
        kind: Kind = Kind.KV,
    ) -> None:
        slot = self._slot_of.get(key)
        if slot is not None:
            self._remove(slot, hashes, tier, kind)

    def _store(self, slot: int, hashes: Iterable[int], tier: Tier, kind: Kind) -> None:
        table = self._state if kind is Kind.STATE else self._kv[tier]
        bit = 1 << slot
        blocks = hashes if isinstance(hashes, list | tuple) else list(hashes)
        size = len(table)
        added = 0
        # Bulk form of "add ``slot`` to each block's holders": blocks nobody holds are
        # inserted as ``~slot`` in one C-level update (in order, duplicates counted once).
        if table.keys().isdisjoint(blocks):
            table.update(zip(blocks, repeat(~slot)))
        else:
            held = table.keys() & blocks
            for block in held:  # _bits inlined: this loop is hot when replicas share blocks
                value = table[block]
                if value < 0:
                    if value != ~slot:
                        table[block] = (1 << ~value) | bit
                        added += 1
                elif not value & bit:
                    table[block] = value | bit
                    added += 1
            table.update(zip(filterfalse(held.__contains__, blocks), repeat(~slot)))
        added += len(table) - size
        if kind is Kind.STATE:
            self._state_count[slot] += added
            if self._state_count[slot]:
                self._state_slots |= bit
                key = self._key_of[slot]
                if key is not None and key not in self._state_keys:
                    self._state_keys.add(key)
                    self.state_generation += 1
        else:
            self._kv_count[slot] += added
        if self._spec_owner:
            self._settle(slot, blocks, kind)
        awaited = self._awaited[kind]
        if awaited:
            bit = 1 << slot
            for block in awaited.keys() & blocks:
                mask = awaited[block] & ~bit
                if mask:
                    awaited[block] = mask
                else:
                    del awaited[block]

    def _remove(self, slot: int, hashes: Iterable[int], tier: Tier, kind: Kind) -> None:
        table = self._state if kind is Kind.STATE else self._kv[tier]
        bit = 1 << slot
        blocks = hashes if isinstance(hashes, list | tuple) else list(hashes)
        size = len(table)
        # Bulk form of "drop ``slot`` from each block's holders": blocks held by ``slot``
        # alone (stored as ``~slot``) are popped in one C-level pass, the rest one by one.
        values = list(map(table.get, blocks))
        only = ~slot
        alone = values.count(only)
        removed = 0
        shared: Iterable[int] = blocks
        if alone:
            if alone == len(blocks):
                shared = ()
                _consume(map(table.pop, blocks, repeat(None)))
            else:
                shared = compress(blocks, map(ne, values, repeat(only)))
                _consume(
                    map(table.pop, compress(blocks, map(eq, values, repeat(only))), repeat(None))
                )
            removed = size - len(table)
        get = table.get
        for block in shared:  # _discard inlined; these blocks are not ours alone
            value = get(block)
            if value is not None and value >= 0 and value & bit:
                value ^= bit  # at least one other holder is left
                table[block] = ~(value.bit_length() - 1) if value & (value - 1) == 0 else value
                removed += 1
        if kind is Kind.STATE:
            self._state_count[slot] -= removed
            if not self._state_count[slot]:
                self._state_slots &= ~bit
        else:
            self._kv_count[slot] -= removed
            if tier is Tier.GPU:
                self._kv_evicted[slot] += removed
        if self._spec_owner:
            self._settle(slot, blocks, kind)

    # ------------------------------------------------------------------ speculation

    def _settle(self, slot: int, blocks: Sequence[int], kind: Kind) -> None:
        """The engine reported these blocks stored or removed: its word replaces what was
        speculated of them on ``slot`` (a stored block is now a real entry; a removed one
        must not live on as a guess until its TTL)."""
        owner = self._spec_owner.get((kind, slot))
        if not owner:
            return
        settled = owner.keys() & blocks
        if not settled:
            return
        table = self._spec[kind]
        bit = 1 << slot
        for block in settled:
            del owner[block]
            _discard(table, block, bit)
        if not owner:
            del self._spec_owner[(kind, slot)]

    def speculate(
        self,
        key: ReplicaKey,
        kv_hashes: Sequence[int],
        state_hashes: Sequence[int],
        now: float,
        ttl: float,
    ) -> int:
        """Assume ``key`` will cache these blocks (a request was just sent there) until
        ``now + ttl``. Covers event lag, and is the whole index in approximate mode.
        Returns the call's id, for :meth:`withdraw` (a tuple of hashes is kept as given,
        not copied)."""
        slot = self._slot(key)
        bit = 1 << slot
        spec_id = next(self._spec_ids)
        for kind, hashes in ((Kind.KV, kv_hashes), (Kind.STATE, state_hashes)):
            if not hashes:
                continue
            table = self._spec[kind]
            owner = self._spec_owner.setdefault((kind, slot), {})
            owner.update(dict.fromkeys(hashes, spec_id))
            single = ~slot
            get = table.get
            for block in hashes:
                value = get(block)
                if value is None:
                    table[block] = single
                elif value != single:
                    mask = _bits(value)
                    if not mask & bit:
                        table[block] = mask | bit
            # int(kind), not the enum member: a tuple of plain numbers leaves the garbage
            # collector's lists at its first collection (one entry a request, ~10^5 alive)
            entry = (now + ttl, spec_id, slot, int(kind), tuple(hashes))
            heapq.heappush(self._spec_heap, entry)
            self._spec_queued += len(hashes)
        while self._spec_queued > self.max_speculative_blocks and self._spec_heap:
            self._drop_spec(heapq.heappop(self._spec_heap))
        return spec_id

    def withdraw(
        self,
        key: ReplicaKey,
        spec_id: int,
        kv_hashes: Sequence[int],
        state_hashes: Sequence[int],
    ) -> int:
        """Take back what the :meth:`speculate` call ``spec_id`` of ``key`` (with these
        hashes) guessed, before its TTL: the request never reached the engine's cache (it
        refused the connection or answered an error). Only the blocks no later call named
        again go, and none the engine reported (they are real entries); a replica cleared
        or removed since has nothing of the call left. Returns how many entries went.
        Idempotent; the call's expiry later drops nothing more (its blocks count toward
        ``max_speculative_blocks`` until then, as its queued entry does)."""
        slot = self._slot_of.get(key)
        if slot is None:
            return 0
        dropped = 0
        for kind, hashes in ((Kind.KV, kv_hashes), (Kind.STATE, state_hashes)):
            if hashes:
                dropped += self._unspeculate(slot, int(kind), spec_id, hashes)
        return dropped

    def expire(self, now: float) -> int:
        """Drop speculative entries whose TTL ended at or before ``now``. Returns how many."""
        heap = self._spec_heap
        dropped = 0
        while heap and heap[0][0] <= now:
            dropped += self._drop_spec(heapq.heappop(heap))
        return dropped

    def _drop_spec(self, entry: tuple[float, int, int, int, tuple[int, ...]]) -> int:
        """Remove the blocks of one speculate() call that no later call has named again."""
        _, spec_id, slot, kind, hashes = entry
        self._spec_queued -= len(hashes)
        return self._unspeculate(slot, kind, spec_id, hashes)

    def _unspeculate(self, slot: int, kind: int, spec_id: int, hashes: Sequence[int]) -> int:
        """Drop the blocks of ``hashes`` that call ``spec_id`` was the last to name on
        ``slot``; returns how many."""
        owner = self._spec_owner.get((kind, slot))
        if owner is None:
            return 0
        table = self._spec[kind]
        bit = 1 << slot
        dropped = 0
        for block in hashes:
            if owner.get(block) == spec_id:
                del owner[block]
                _discard(table, block, bit)
                dropped += 1
        if not owner:
            del self._spec_owner[(kind, slot)]
        return dropped

    # ------------------------------------------------------------------ awaited stores

    def await_store(self, key: ReplicaKey, block: int, kind: Kind = Kind.KV) -> bool:
        """Expect ``key``'s engine to report storing ``block`` (a prompt ending there was just
        sent to it), unless its GPU cache is already indexed holding it (an engine reports a
        block once, when it first caches it). Returns whether it is now awaited.

        Why: what the router credits a replica ahead of its events (a session's hint) must
        lapse once they arrive; from then on the index alone says what is cached there, an
        eviction included. Bounded by ``MAX_AWAITED`` a kind, oldest forgotten first."""
        slot = self._slot(key)
        value = (self._state if kind is Kind.STATE else self._kv[Tier.GPU]).get(block)
        if value is not None and (value == ~slot or (value >= 0 and value >> slot & 1)):
            return False
        awaited = self._awaited[kind]
        awaited[block] = awaited.get(block, 0) | 1 << slot
        awaited.move_to_end(block)  # the newest
        while len(awaited) > MAX_AWAITED:
            awaited.popitem(last=False)
        return True

    def unawait(self, key: ReplicaKey, block: int, kind: Kind = Kind.KV) -> None:
        """Expect no report of ``block`` from ``key``'s engine after all: the prompt
        :meth:`await_store` named it for never reached the engine (``RoutingEngine.withdraw``)."""
        slot = self._slot_of.get(key)
        awaited = self._awaited[kind]
        mask = awaited.get(block)
        if slot is None or mask is None:
            return
        mask &= ~(1 << slot)
        if mask:
            awaited[block] = mask
        else:
            del awaited[block]

    def awaits(self, key: ReplicaKey, block: int, kind: Kind = Kind.KV) -> bool:
        """Whether ``key``'s engine has yet to report storing ``block`` since
        :meth:`await_store` named it (False when it was never awaited, or forgotten)."""
        slot = self._slot_of.get(key)
        return slot is not None and bool(self._awaited[kind].get(block, 0) >> slot & 1)

    # ------------------------------------------------------------------ maintenance

    def garbage_ratio(self) -> float:
        """What :meth:`compact` would reclaim, relative to what stays: the entries of
        retired slots per live entry, or the retired slots themselves per live key (at
        least ``_SLOT_SLACK``), whichever is more. A key that leaves (or is cleared) with
        next to nothing cached leaves few entries behind but retires its slot all the
        same, and new keys take ever higher slots until the dead ones are freed."""
        live = sum(self._kv_count) + sum(self._state_count)
        slots = self._dead.bit_count() / max(len(self._slot_of), _SLOT_SLACK)
        return max(self._garbage / max(live, 1), slots)

    def compact(self) -> int:
        """Strip bits of cleared/removed replicas from every entry (awaited blocks too) and
        free their slots, at once (a :meth:`compaction` in progress finished first).

        O(entries); callers run it when ``garbage_ratio()`` is high. Returns entries touched.
        """
        touched = sum(self.compaction())
        if self._dead:  # slots retired while that one ran
            touched += sum(self.compaction())
        return touched

    def compaction(self, chunk: int = COMPACT_CHUNK) -> Iterator[int]:
        """The compaction in progress, or a new one: each step strips the bits of the slots
        dead when it began from up to ``chunk`` entries and yields how many it touched, so
        an event loop can serve between steps (a whole index of 10^7 entries takes seconds).
        Between steps the index answers as before: those slots stay masked out of queries
        and are freed only by the last step, and no entry made meanwhile can name them (a
        dead slot is given to no key until freed). Slots that die meanwhile wait for the
        next compaction. One at a time: every caller gets the same iterator."""
        if self._compacting is None:
            self._compacting = self._compact_steps(chunk)
        return self._compacting

    def _compact_steps(self, chunk: int) -> Iterator[int]:
        try:
            dead = self._dead
            if not dead:
                return
            garbage = self._garbage
            keep = ~dead
            for table in (*self._kv, self._state, *self._spec):
                blocks = list(table)
                for at in range(0, len(blocks), chunk):
                    touched = 0
                    for block in blocks[at : at + chunk]:
                        value = table.get(block)
                        if value is None:
                            continue  # gone since the step began
                        mask = _bits(value)
                        if mask & dead:
                            touched += 1
                            mask &= keep
                            if mask:
                                table[block] = _pack(mask)
                            else:
                                del table[block]
                    yield touched
            for awaited in self._awaited:  # a freed slot's next replica awaits none of them
                blocks = list(awaited)
                for at in range(0, len(blocks), chunk):
                    touched = 0
                    for block in blocks[at : at + chunk]:
                        held = awaited.get(block)
                        if held is not None and held & dead:
                            touched += 1
                            if held & keep:
                                awaited[block] = held & keep  # (its place in the order kept)
                            else:
                                del awaited[block]
                    yield touched
            self._spec_owner = {k: v for k, v in self._spec_owner.items() if not (dead >> k[1]) & 1}
            self._spec_heap = [e for e in self._spec_heap if not (dead >> e[2]) & 1]
            heapq.heapify(self._spec_heap)
            self._spec_queued = sum(len(e[4]) for e in self._spec_heap)
            self._free.extend(iter_slots(dead))
            self._dead &= keep
            # what slots retired since the compaction began left behind stays counted
            self._garbage = max(0, self._garbage - garbage)
        finally:
            self._compacting = None

    def stats(self) -> IndexStats:
        return IndexStats(
            replicas=len(self._slot_of),
            kv_entries=sum(self._kv_count),
            state_entries=sum(self._state_count),
            speculative_entries=sum(len(o) for o in self._spec_owner.values()),
            garbage_entries=self._garbage,
            unique_kv_blocks=sum(len(t) for t in self._kv),
        )

    def replica_size(self, key: ReplicaKey) -> tuple[int, int]:
        """(KV entries, state checkpoints) cached on ``key``; (0, 0) if unknown."""
        slot = self._slot_of.get(key)
        if slot is None:
            return (0, 0)
        return (self._kv_count[slot], self._state_count[slot])

    def evicted_blocks(self, key: ReplicaKey) -> int:
        """GPU KV blocks ``key``'s engine reported removed since it got its slot (it was
        added, or cleared: the count restarts at 0); 0 if unknown. Engines remove a cached
        block to make room, so its growth over time is the cache's eviction rate
        (router/core/turnover.py)."""
        slot = self._slot_of.get(key)
        return 0 if slot is None else self._kv_evicted[slot]

    def slots(self, keys: Sequence[ReplicaKey]) -> np.ndarray:
        """The slot of each of ``keys`` (-1 for keys the index does not know), for
        :meth:`PrefixMatches.columns`. A tuple's answer is cached while no slot changes
        (routing passes each model's tuple request after request; other sequences, such as
        a gRPC Pick's candidate list, are looked up each time)."""
        slots = self._slots_cache.get(keys, self._slot_generation)
        if slots is None:
            get = self._slot_of.get
            slots = np.fromiter((get(k, -1) for k in keys), dtype=np.intp, count=len(keys))
            self._slots_cache.put(keys, self._slot_generation, slots)
        return slots

    # ------------------------------------------------------------------ queries

    def _holders(self, tables: list[dict[int, int]]) -> Callable[[int], int]:
        live = self._live
        if len(tables) == 1:
            get = tables[0].get

            def one(block: int) -> int:
                value = get(block)
                return 0 if value is None else _bits(value) & live

            return one

        def many(block: int) -> int:
            mask = 0
            for table in tables:
                value = table.get(block)
                if value is not None:
                    mask |= _bits(value)
            return mask & live

        return many

    def match(
        self,
        hashes: Sequence[int],
        *,
        hybrid: bool = False,
        now: float | None = None,
        prompt_tokens: int | None = None,
        block_size: int = 0,
        align_blocks: int = 1,
        peek_blocks: int = 0,
        fine_blocks: bool = False,
    ) -> PrefixMatches:
        """Cached prefix of ``hashes`` on every replica; ``now`` first expires speculative
        entries. The result is valid until the index next changes. ``prompt_tokens`` and
        ``block_size``: a state checkpoint is usable only before the prompt's last token
        (engines compute at least that one: vLLM caps a hit at ``prompt_tokens - 1``).
        ``align_blocks``: the engine block in router blocks (a usable prefix ends on one);
        ``peek_blocks`` (EAGLE / MTP engines): the usable prefix is what the engine grants once
        it gave back that many blocks of the hit (router/core/engine_hits.py).
        ``fine_blocks``: the engine block is finer than the router's, so a prompt cached whole
        is granted all but its last engine block, less than a router block short, which the
        block grid cannot show (a KV match is then usable whole; otherwise it ends a router
        block short of such a prompt's end, as the engine's hit does)."""
        if now is not None:
            self.expire(now)
        if not hashes or not self._live:
            return PrefixMatches.empty()
        spec_kv, spec_state = self._spec
        kv_tables = [t for t in (*self._kv, spec_kv) if t]
        if not kv_tables:
            return PrefixMatches.empty()
        kv = bisect_lengths(hashes, self._holders(kv_tables), self._live)
        if not kv:
            return PrefixMatches.empty()
        gpu: list[tuple[int, int]] | None = None
        host: list[tuple[int, int]] | None = None
        # Tier breakdown only when something lives off-GPU: GPU-only fleets skip it.
        if self._kv[Tier.CPU] or self._kv[Tier.DISK]:
            within = union_of(kv)
            gpu_tables = [t for t in (self._kv[Tier.GPU], spec_kv) if t]
            host_tables = [t for t in (self._kv[Tier.GPU], self._kv[Tier.CPU], spec_kv) if t]
            gpu = bisect_lengths(hashes, self._holders(gpu_tables), within) if gpu_tables else []
            host = bisect_lengths(hashes, self._holders(host_tables), within)
        usable: list[tuple[int, int]] | None = None
        limit = len(hashes)
        if prompt_tokens is not None and block_size > 0:
            limit = min(limit, (prompt_tokens - 1) // block_size)
        reach = kv
        if peek_blocks > 0 or align_blocks > 1:
            # an engine block spans several of ours: a match ending inside one is not a hit
            # there (its hash covers tokens the request does not share)
            reach = peeked(kv, limit, max(align_blocks, 1), peek_blocks)
            if not hybrid:
                usable = reach
        elif not hybrid and not fine_blocks and max(length for length, _ in kv) > limit:
            # the whole prompt cached (its last token recomputed): one block less is a hit
            usable = peeked(kv, limit, 1, 0)
        if hybrid:
            state_tables = [t for t in (self._state, spec_state) if t]
            candidates = self._state_slots | (self._live if spec_state else 0)
            usable = (
                usable_lengths(hashes, reach, self._holders(state_tables), candidates, limit)
                if state_tables and reach
                else []
            )
        return PrefixMatches(self._slot_of, self._key_of, kv, gpu, host, usable)
