"""The prefix index's storage: replica slots, the tables of holder sets, their upkeep.

:class:`IndexTables` owns every table of the index: it creates them, gives replicas slots
and retires them, strips retired slots from the tables (compaction) and reports their sizes.
:class:`~router.core.index.PrefixIndex` builds on it (its updates: router/core/index_updates.py;
its lookup: router/core/index.py); all three read holder sets with :func:`bits`.

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
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from router.core.keycache import PerTuple
from router.core.prefix_match import iter_slots
from router.core.types import ReplicaKey

COMPACT_CHUNK = 50_000
"""Entries a :meth:`PrefixIndex.compaction` step visits."""

_SLOT_SLACK = 64
"""Retired slots :meth:`PrefixIndex.garbage_ratio` weighs against at least this many keys
(a small fleet is not compacted for every replica that leaves)."""


def bits(value: int) -> int:
    """Decode a stored holder set: negative values are single slots (``~slot``)."""
    return value if value >= 0 else 1 << ~value


def _pack(mask: int) -> int:
    """Encode a non-empty holder set, singletons as ``~slot``."""
    return ~(mask.bit_length() - 1) if mask & (mask - 1) == 0 else mask


def discard(table: dict[int, int], block: int, bit: int) -> bool:
    value = table.get(block)
    if value is None:
        return False
    mask = bits(value)
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


class IndexTables:
    """The storage of :class:`~router.core.index.PrefixIndex`: its tables, replica slots and
    compaction."""

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
        # per (kind, slot), of the speculated blocks (router/core/index_updates.py): the live
        # speculate() call naming each that ends last; the call that began each one's entry
        # (since the engine's last word on it); the live calls, id -> (end, hashes); the
        # latest end of any call made
        self._spec_owner: dict[tuple[int, int], dict[int, int]] = {}
        self._spec_began: dict[tuple[int, int], dict[int, int]] = {}
        self._spec_calls: dict[tuple[int, int], dict[int, tuple[float, tuple[int, ...]]]] = {}
        self._spec_max_end: dict[tuple[int, int], float] = {}
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
                        mask = bits(value)
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
            for k in [k for k in self._spec_calls if (dead >> k[1]) & 1]:
                self._spec_forget(k)
            self._spec_heap = [e for e in self._spec_heap if not (dead >> e[2]) & 1]
            heapq.heapify(self._spec_heap)
            self._spec_queued = sum(len(e[4]) for e in self._spec_heap)
            self._free.extend(iter_slots(dead))
            self._dead &= keep
            # what slots retired since the compaction began left behind stays counted
            self._garbage = max(0, self._garbage - garbage)
        finally:
            self._compacting = None

    def _spec_forget(self, at: tuple[int, int]) -> None:
        """Nothing of (kind, slot) ``at`` is speculated any more."""
        self._spec_owner.pop(at, None)
        self._spec_began.pop(at, None)
        self._spec_calls.pop(at, None)
        self._spec_max_end.pop(at, None)

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
