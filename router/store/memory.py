"""``MemoryStore``: the in-process store (single router, simulator, tests).

Same contract as the Redis store, with plain dicts and an in-memory change log. Leases use
the injected ``clock`` (seconds, monotonic). ``max_log`` bounds the change log the way
``MAXLEN`` bounds a Redis stream: a follower that falls further behind sees sequence gaps
and resyncs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence

from router.core.types import IndexEvent, ReplicaKey
from router.store.base import (
    BatchChange,
    Change,
    ChangeRead,
    LeaseLost,
    LeaseTaken,
    LoadChange,
    LoadSample,
    ReplicaDown,
    ReplicaInfo,
    ReplicaSnapshot,
    ReplicaState,
    ReplicaUp,
    ResetChange,
    SeqMismatch,
    UnreadableSnapshot,
)


class MemoryStore:
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_log: int = 100_000) -> None:
        self._clock = clock
        self._token = uuid.uuid4().hex
        self._infos: dict[str, ReplicaInfo] = {}
        self._leases: dict[str, tuple[str, float]] = {}
        self._snapshots: dict[ReplicaKey, ReplicaSnapshot] = {}
        self._loads: dict[ReplicaKey, LoadSample] = {}
        self._log: deque[Change] = deque(maxlen=max_log)
        self._appended = 0  # total changes ever appended; log holds the last len(_log)
        self._wakeup = asyncio.Event()

    def _append(self, change: Change) -> None:
        self._log.append(change)
        self._appended += 1
        self._wakeup.set()

    def flush_all(self) -> None:
        """Forget everything, as a Redis FLUSHALL would (tests of data loss)."""
        self._token = uuid.uuid4().hex
        self._infos.clear()
        self._leases.clear()
        self._snapshots.clear()
        self._loads.clear()

    # ------------------------------------------------------------------ write side

    async def register(
        self, info: ReplicaInfo, owner: str, lease_ttl_s: float, *, take_over: bool = True
    ) -> None:
        lease = self._leases.get(info.replica)
        if not take_over and lease is not None and lease[1] > self._clock() and lease[0] != owner:
            raise LeaseTaken(info.replica, lease[0])
        self._drop(info.replica, keep=info.dp_ranks)  # DP ranks it no longer has
        self._infos[info.replica] = info
        self._leases[info.replica] = (owner, self._clock() + lease_ttl_s)
        self._append(ReplicaUp(info))

    async def heartbeat(self, replica: str, owner: str, lease_ttl_s: float) -> bool:
        lease = self._leases.get(replica)
        if lease is None or lease[1] <= self._clock():
            return False
        if lease[0] != owner:
            raise LeaseTaken(replica, lease[0])
        self._leases[replica] = (owner, self._clock() + lease_ttl_s)
        return True

    async def deregister(self, replica: str, owner: str | None = None) -> bool:
        lease = self._leases.get(replica)
        held = lease is not None and lease[1] > self._clock()
        if owner is not None and held and lease is not None and lease[0] != owner:
            return False
        self._infos.pop(replica, None)
        self._leases.pop(replica, None)
        self._drop(replica)
        self._append(ReplicaDown(replica))
        return True

    def _drop(self, replica: str, keep: Sequence[int] = ()) -> None:
        """Forget the state and load of every DP rank of ``replica`` not in ``keep``, not
        just the registered ones (a superseded writer may have written others)."""
        for table in (self._snapshots, self._loads):
            for key in [k for k in table if k.replica == replica and k.dp_rank not in keep]:
                del table[key]

    def _fence(self, replicas: set[str], owner: str | None) -> None:
        """As RedisStore's lease-fenced writes: ``owner`` must hold each replica's lease."""
        if owner is None:
            return
        for replica in sorted(replicas):
            lease = self._leases.get(replica)
            if lease is None or lease[1] <= self._clock():
                raise LeaseLost(replica)
            if lease[0] != owner:
                raise LeaseTaken(replica, lease[0])

    async def write(
        self,
        writes: Sequence[tuple[ReplicaState, tuple[IndexEvent, ...]]],
        owner: str | None = None,
    ) -> None:
        self._fence({st.key.replica for st, _ in writes}, owner)
        behind = []
        for state, events in writes:
            before = self._snapshots.get(state.key)
            if (before.seq if before is not None else 0) != state.seq - 1:
                behind.append(state.key)
            state.kv.take_changes()
            state.state.take_changes()
            self._snapshots[state.key] = state.snapshot()
            self._append(BatchChange(state.key, state.seq, events))
        if behind:  # as RedisStore, though a snapshot here is never stale in part
            raise SeqMismatch(behind)

    async def reset(self, states: Sequence[ReplicaState], owner: str | None = None) -> None:
        self._fence({st.key.replica for st in states}, owner)
        for state in states:
            state.kv.take_changes()
            state.state.take_changes()
            self._snapshots[state.key] = state.snapshot()
            self._append(ResetChange(state.key, state.seq))

    async def reap(self, replica: str) -> bool:
        if (await self.leases([replica]))[replica] or not (
            replica in self._infos or replica in self._stored_names()
        ):
            return False
        await self.deregister(replica)
        return True

    def _stored_names(self) -> set[str]:
        return {k.replica for k in (*self._snapshots, *self._loads)}

    async def orphans(self) -> list[str]:
        names = self._stored_names() - set(self._infos)
        alive = await self.leases(sorted(names))
        return [n for n in sorted(names) if not alive[n]]

    async def publish_load(
        self, key: ReplicaKey, sample: LoadSample, owner: str | None = None
    ) -> None:
        self._fence({key.replica}, owner)
        self._loads[key] = sample
        self._append(LoadChange(key, sample))

    async def stored_seq(self, key: ReplicaKey) -> int | None:
        snap = self._snapshots.get(key)
        return snap.seq if snap is not None else None

    async def stored_seqs(self, keys: Sequence[ReplicaKey]) -> list[int | None]:
        return [await self.stored_seq(k) for k in keys]

    # ------------------------------------------------------------------ read side

    async def settle_shards(self) -> bool:
        return False  # one change list, no shards

    async def instance_token(self) -> str:
        return self._token

    async def cursor(self) -> object:
        return self._appended

    async def streams_behind(self, cursor: object) -> list[str]:
        return []  # one list that never loses entries

    async def list_replicas(self) -> list[ReplicaInfo]:
        return list(self._infos.values())

    async def registration(self, replica: str) -> ReplicaInfo | None:
        return self._infos.get(replica)

    async def read_replicas(
        self, keys: Sequence[ReplicaKey]
    ) -> list[ReplicaSnapshot | UnreadableSnapshot | None]:
        return [self._snapshots.get(k) if k.replica in self._infos else None for k in keys]

    async def read_changes(self, cursor: object, block_s: float, count: int) -> ChangeRead:
        pos = int(cursor)  # type: ignore[call-overload]
        if pos >= self._appended and block_s > 0:
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), block_s)
        first = self._appended - len(self._log)
        start = max(pos, first)
        items = [self._log[i - first] for i in range(start, min(self._appended, start + count))]
        return ChangeRead(items, start + len(items))

    async def leases(self, replicas: Sequence[str]) -> dict[str, bool]:
        now = self._clock()
        return {r: r in self._leases and self._leases[r][1] > now for r in replicas}

    async def close(self) -> None:
        return None
