"""What changes the prefix index (:class:`IndexUpdates`, on the tables of
router/core/index_tables.py): engines' events, speculative entries and awaited stores.

Engines' events (canonical batches, router/core/types.py) are applied idempotently, in
bulk where the tables allow it. What the router guesses a replica will cache (speculative
entries) lasts until the engine's word on a block replaces it, its TTL ends or the guess is
withdrawn. Awaited stores record which blocks an engine has
yet to report, so that what the router credited ahead of its events lapses once they come.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import compress, filterfalse, repeat
from operator import eq, ne

from router.core.index_tables import IndexTables, bits, discard
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

# blocks of each kind awaited from engines at once (PrefixIndex.await_store); beyond it the
# oldest are forgotten, i.e. no longer awaited
MAX_AWAITED = 400_000
_SINK: deque[object] = deque(maxlen=0)
_consume = _SINK.extend  # exhaust an iterator (C-level loops for bulk events)


class IndexUpdates(IndexTables):
    """The writes of :class:`~router.core.index.PrefixIndex`: engine events, speculation and
    awaited stores."""

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
            for block in held:  # bits inlined: this loop is hot when replicas share blocks
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
        for block in shared:  # discard inlined; these blocks are not ours alone
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
        began = self._spec_began[(kind, slot)]
        bit = 1 << slot
        for block in settled:
            del owner[block]
            del began[block]
            discard(table, block, bit)

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
        not copied). A block stays guessed while any call naming it (since the engine last
        reported it) is alive: neither a later call's earlier end nor its withdrawal takes
        an earlier call's guess with it."""
        slot = self._slot(key)
        bit = 1 << slot
        spec_id = next(self._spec_ids)
        end = now + ttl
        for kind, hashes in ((Kind.KV, kv_hashes), (Kind.STATE, state_hashes)):
            if not hashes:
                continue
            table = self._spec[kind]
            at = (kind, slot)
            owner = self._spec_owner.setdefault(at, {})
            began = self._spec_began.setdefault(at, {})
            calls = self._spec_calls.setdefault(at, {})
            calls[spec_id] = (end, tuple(hashes))
            # no live call ends later: this one owns every block it names; else (a shorter
            # TTL, a peer's dispatch adopted late) only those whose owner ends sooner
            owns_all = end >= self._spec_max_end.get(at, -math.inf)
            if owns_all:
                self._spec_max_end[at] = end
            single = ~slot
            get = table.get
            # one loop for the three tables (a third of the time of bulk dict updates here)
            for block in hashes:
                if owns_all or (held := owner.get(block)) is None or calls[held][0] <= end:
                    owner[block] = spec_id
                if block not in began:  # an entry this call begins
                    began[block] = spec_id
                value = get(block)
                if value is None:
                    table[block] = single
                elif value != single:
                    mask = bits(value)
                    if not mask & bit:
                        table[block] = mask | bit
            # int(kind), not the enum member: a tuple of plain numbers leaves the garbage
            # collector's lists at its first collection (one entry a request, ~10^5 alive)
            entry = (end, spec_id, slot, int(kind), calls[spec_id][1])
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
        refused the connection or answered an error). Only the blocks no other live call
        (earlier or later) names go, and none the engine reported (they are real entries);
        a replica cleared or removed since has nothing of the call left. Returns how many
        entries went. Idempotent; the call's expiry later drops nothing more (its blocks
        count toward ``max_speculative_blocks`` until then, as its queued entry does)."""
        slot = self._slot_of.get(key)
        if slot is None:
            return 0
        dropped = 0
        for kind in (Kind.KV, Kind.STATE):
            dropped += self._unspeculate(slot, int(kind), spec_id, withdrawn=True)
        return dropped

    def expire(self, now: float) -> int:
        """Drop speculative entries whose TTL ended at or before ``now``. Returns how many."""
        heap = self._spec_heap
        dropped = 0
        while heap and heap[0][0] <= now:
            dropped += self._drop_spec(heapq.heappop(heap))
        return dropped

    def _drop_spec(self, entry: tuple[float, int, int, int, tuple[int, ...]]) -> int:
        """End one speculate() call's guess of one kind (unless withdrawn already)."""
        _, spec_id, slot, kind, hashes = entry
        self._spec_queued -= len(hashes)
        return self._unspeculate(slot, kind, spec_id)

    def _unspeculate(self, slot: int, kind: int, spec_id: int, withdrawn: bool = False) -> int:
        """Call ``spec_id`` (of ``slot``, ``kind``) ends: drop the blocks it owns (no live
        call naming them ends later); returns how many. ``withdrawn`` (before its end): a
        block it owns passes to the live call naming it since its entry began that ends
        last, if any (rare: a scan of the slot's live calls). A call ended already, or
        withdrawn, drops nothing more."""
        at = (kind, slot)
        calls = self._spec_calls.get(at)
        call = None if calls is None else calls.pop(spec_id, None)
        if call is None:
            return 0
        owner = self._spec_owner[at]
        began = self._spec_began[at]
        table = self._spec[kind]
        bit = 1 << slot
        get = owner.get
        heirs: dict[int, tuple[float, int]] = {}
        if withdrawn and calls:  # (rare) the live calls that name what it owns
            wanted = {block for block in call[1] if get(block) == spec_id}
            for other, (end, hashes) in calls.items():
                for block in wanted.intersection(hashes):
                    if other >= began[block] and heirs.get(block, (-math.inf, 0)) < (end, other):
                        heirs[block] = (end, other)
        dropped = 0
        for block in call[1]:
            if get(block) != spec_id:
                continue  # another call ends later, or the engine has had its word since
            heir = heirs.get(block) if heirs else None
            if heir is not None:
                owner[block] = heir[1]
                continue
            del owner[block]
            del began[block]
            discard(table, block, bit)
            dropped += 1
        if not calls:
            self._spec_forget(at)
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
