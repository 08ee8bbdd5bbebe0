"""Decode-stall allowances per replica: how much more prefill a replica can take before one
of its requests misses its TPOT target.

Continuous batching runs prefill chunks in the same steps as decoding, so every second of
prefill a replica runs while a request decodes adds a second to that request's decode time:
a request with ``n`` output tokens, decoding at ``step_s`` a token, meets a TPOT target
``tpot_s`` while at most ``(tpot_s - step_s) * (n - 1)`` seconds of prefill run during its
decode (its *allowance*). Prefill that runs before its first token does not count (chunked
prefill is FCFS: what was dispatched before it is done before it decodes).

The ledger keeps, per replica, a *clock*: the prefill seconds dispatched to it so far. A
request dispatched there at clock ``c`` (its own prefill included) has used up its allowance
when the clock reaches ``c + allowance``; the replica's *headroom* is the least of those
limits minus the clock (infinite without requests to protect). Pure bookkeeping: no time.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable

from router.core.types import ReplicaKey


class StallLedger:
    """Prefill clocks and TPOT allowances per replica (module docstring)."""

    __slots__ = ("_clock", "_heaps", "_where")

    def __init__(self) -> None:
        self._clock: dict[ReplicaKey, float] = {}
        self._heaps: dict[ReplicaKey, list[tuple[float, int, Hashable]]] = {}
        # each tracked request: its replica, its limit there and its allowance (for ``move``)
        self._where: dict[Hashable, tuple[ReplicaKey, float, float]] = {}

    def __len__(self) -> int:
        """Requests whose allowance is tracked."""
        return len(self._where)

    def __contains__(self, key: Hashable) -> bool:
        """Whether request ``key``'s allowance is tracked."""
        return key in self._where

    def headroom(self, replica: ReplicaKey) -> float:
        """Prefill seconds ``replica`` can take before a tracked request's allowance runs out
        (negative: already over; ``inf``: nothing to protect)."""
        heap = self._heaps.get(replica)
        if not heap:
            return math.inf
        while heap:
            limit, _, key = heap[0]
            if self._holds(key, replica, limit):
                return limit - self._clock.get(replica, 0.0)
            heapq.heappop(heap)  # finished, or moved: a stale entry
        return math.inf

    def _holds(self, key: Hashable, replica: ReplicaKey, limit: float) -> bool:
        """Whether the heap entry ``(limit, key)`` of ``replica`` is ``key``'s current one."""
        where = self._where.get(key)
        return where is not None and where[0] == replica and where[1] == limit

    def add(self, key: Hashable, replica: ReplicaKey, prefill_s: float, allowance_s: float) -> None:
        """Request ``key`` was dispatched to ``replica`` with ``prefill_s`` of prefill and may
        stand ``allowance_s`` of prefill while it decodes (``inf``: not tracked)."""
        clock = self._clock.get(replica, 0.0) + max(prefill_s, 0.0)
        self._clock[replica] = clock
        if not math.isfinite(allowance_s):
            self._where.pop(key, None)
            return
        limit = clock + max(allowance_s, 0.0)
        self._where[key] = (replica, limit, allowance_s)
        heap = self._heaps.setdefault(replica, [])
        heapq.heappush(heap, (limit, id(key), key))
        if len(heap) > 64 and len(heap) > 4 * len(self._where):  # stale entries: compact
            live = [e for e in heap if self._holds(e[2], replica, e[0])]
            heapq.heapify(live)
            self._heaps[replica] = live

    def move(self, key: Hashable, replica: ReplicaKey, prefill_s: float) -> None:
        """Tracked request ``key`` is retried on ``replica`` with ``prefill_s`` of prefill:
        its allowance protects it there, no longer on the replica it left (whose clock keeps
        its prefill: some of it may have run). Untracked keys are ignored."""
        where = self._where.get(key)
        if where is not None and where[0] != replica:
            self.add(key, replica, prefill_s, where[2])

    def remove(self, key: Hashable) -> None:
        """Request ``key`` finished, failed or was cancelled (unknown keys are ignored)."""
        self._where.pop(key, None)

    def forget(self, replica: ReplicaKey) -> None:
        """``replica`` left the fleet."""
        self._clock.pop(replica, None)
        self._heaps.pop(replica, None)
        for key in [k for k, where in self._where.items() if where[0] == replica]:
            del self._where[key]
