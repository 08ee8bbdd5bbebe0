"""The event core: a heap of ``(time, priority, seq)``-ordered events.

Ties in time are broken by ``priority`` (lower first: engine steps finish before index
events are delivered, which happen before new arrivals) and then by ``seq``, the insertion
order, so a run is a deterministic function of its inputs and seed. No global state: every
simulation owns its queue.
"""

from __future__ import annotations

import heapq
from typing import Any

ENGINE = 0  # an engine's step or decode run ends
DELIVER = 1  # index events / reports reach the routers
ARRIVAL = 2  # a request reaches a router
TRANSFER = 3  # a disaggregated request moves to its decode replica (which pulls its KV)
TICK = 4  # a router's admission pump looks at its held requests (router.core.admission TICK_S)


class EventQueue:
    """Min-heap of events; ``payload`` is opaque to the queue."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0

    def push(self, time: float, priority: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time, priority, self._seq, payload))

    def pop(self) -> tuple[float, int, Any]:
        """The earliest event as ``(time, priority, payload)``; IndexError when empty."""
        time, priority, _, payload = heapq.heappop(self._heap)
        return time, priority, payload

    def peek_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)
