"""``StoreWriter``: the write side a publisher runs for its replica.

Events are folded into the authoritative ``ReplicaState`` per ``ReplicaKey`` as they come
(``add``) and committed in batches (``flush``): one ``seq`` per key per flush, changed
buckets only. ``reset`` rewrites every key's full state (start-up, lost lease, Redis data
loss, failed write). A failed flush leaves the writer needing a reset, so nothing is lost:
the states already hold every event; so does a flush that found the stored seq it replaced
not its own last (``SeqMismatch``: the store went back, or another writer wrote). With an
``owner``, every write is fenced by that owner's lease (``LeaseTaken`` / ``LeaseLost``: the
write was refused, the writer needs a reset).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from router.core.types import AllCleared, IndexEvent, ReplicaKey
from router.store.base import IndexStore, ReplicaState


class StoreWriter:
    def __init__(
        self,
        store: IndexStore,
        keys: Iterable[ReplicaKey],
        owner: str | None = None,
        seq_floor: Callable[[], int] | None = None,
    ) -> None:
        """``seq_floor``: where a key this writer starts writing later numbers from (a
        publisher passes its wall clock in microseconds): a rank dropped and added again
        numbers above what it wrote before, so a router that lagged past both sees a gap, not
        batches it takes for ones it applied."""
        self.store = store
        self.owner = owner
        self.seq_floor = seq_floor
        self.states: dict[ReplicaKey, ReplicaState] = {k: ReplicaState(k) for k in keys}
        self._pending: dict[ReplicaKey, list[IndexEvent]] = {}
        self.pending_events = 0
        self.needs_reset = True
        self.flushes = 0
        self.block_events = 0

    def state(self, key: ReplicaKey) -> ReplicaState:
        st = self.states.get(key)
        if st is None:
            st = self.states[key] = self._new(key)
            self.needs_reset = True
        return st

    def _new(self, key: ReplicaKey) -> ReplicaState:
        return ReplicaState(key, self.seq_floor() if self.seq_floor is not None else 0)

    def set_keys(self, keys: Iterable[ReplicaKey]) -> None:
        """Write ``keys`` from now on (the replica's ranks changed): the states of other
        keys are dropped with their pending events, new ones start empty, and a full reset
        is due."""
        self.states = {k: self.states.get(k) or self._new(k) for k in keys}
        self._pending = {k: evs for k, evs in self._pending.items() if k in self.states}
        self.needs_reset = True

    def add(self, key: ReplicaKey, events: Iterable[IndexEvent]) -> None:
        """Fold canonical events of ``key`` in; they are written at the next flush."""
        evs = list(events)
        if not evs:
            return
        self.state(key).apply(evs)
        self._pending.setdefault(key, []).extend(evs)
        n = sum(1 if isinstance(e, AllCleared) else len(e.hashes) for e in evs)
        self.pending_events += n
        self.block_events += n

    async def flush(self) -> int:
        """Commit pending events (or a full reset if one is due); returns keys written.

        On an exception the writer stays consistent and marks itself for reset."""
        if self.needs_reset:
            await self.reset()
            return len(self.states)
        if not self._pending:
            return 0
        writes = []
        for key, evs in self._pending.items():
            st = self.states[key]
            st.seq += 1
            writes.append((st, tuple(evs)))
        self._pending = {}
        self.pending_events = 0
        try:
            await self.store.write(writes, self.owner)
        except BaseException:
            self.needs_reset = True
            raise
        self.flushes += 1
        return len(writes)

    async def reset(self) -> None:
        """Write every key's full state; pending events are included in it. A reset asked
        for while this one is in flight (``needs_reset`` set: the lease found gone, the keys
        changed) is another one, still due when this one returns."""
        self._pending = {}
        self.pending_events = 0
        states = list(self.states.values())
        for st in states:
            st.seq += 1
        self.needs_reset = False
        try:
            await self.store.reset(states, self.owner)
        except BaseException:
            self.needs_reset = True
            raise
        self.flushes += 1

    async def resume_seq(self, floor: int = 0) -> None:
        """Continue numbering after what the store holds (a restarted publisher), and at
        least from ``floor``: a publisher passes its wall clock in microseconds, so a new one
        numbers above any earlier one for the replica even when the store kept no seq (it
        deregistered): a router that missed the entries between them sees a gap, never
        batches it takes for ones it has applied."""
        for key, st in self.states.items():
            stored = await self.store.stored_seq(key)
            st.seq = max(st.seq, stored or 0, floor)
