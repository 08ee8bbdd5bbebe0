"""The process's stop (SIGTERM / SIGINT, ``Running.cleanup``): whether its drain has begun
and its deadline. What must say so at once reads it (``/ready``, the gRPC health service),
and what must end by the deadline (the gRPC server's grace) takes the time left."""

from __future__ import annotations

import asyncio
import math


class Stopping:
    """One per application object (``keys.STOPPING``); begun once, never undone."""

    __slots__ = ("deadline", "event")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.deadline = math.inf  # loop time by which requests in flight are cut

    @property
    def started(self) -> bool:
        return self.event.is_set()

    def begin(self, deadline: float) -> None:
        """The drain begins; requests in flight may run until ``deadline`` (loop time)."""
        if not self.event.is_set():
            self.deadline = deadline
            self.event.set()

    def cut(self, now: float) -> None:
        """The drain ends now (a second SIGTERM / SIGINT): the deadline moves to ``now``."""
        self.begin(now)
        self.deadline = min(self.deadline, now)

    def left(self, now: float) -> float:
        """Seconds until the deadline (0 past it)."""
        return max(self.deadline - now, 0.0)
