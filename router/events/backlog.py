"""``Backlog``: the live messages a subscriber's SUB socket received and its handler has not
taken yet, bounded in bytes (router/events/subscriber.py).

ZMQ bounds a socket's queue by message count only (``RCVHWM``), and one engine batch can be
megabytes (the token ids of every block a step stored), so a subscriber whose handler falls
behind (a long history load holding its lock, CPU starvation, a flood of large batches)
would buffer a count limit's worth of them. The subscriber keeps ZMQ's queue short and
moves every message into a ``Backlog`` as soon as it arrives; a message that would take the
backlog past ``max_bytes`` is dropped instead, not buffered. Drops in a row become one
:class:`Dropped` item in their place in the queue: the handler takes it as a gap up to the
last seq dropped and refills it from the engine's replay socket, or counts it lost, the
way a seq gap is (``ZmqEventSubscriber._refill``). Nothing is lost silently: every drop is
counted (``on_drop``) and each episode (from the first drop until the backlog is empty
again) logged once.

Contract: ``bytes`` (payload bytes plus ``MESSAGE_OVERHEAD`` per message) never exceeds
``max_bytes``, except by one message larger than ``max_bytes`` alone, which is taken when
the backlog holds no message (it could not be delivered live otherwise).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

MESSAGE_OVERHEAD = 256  # Python objects of one multipart message (a list, three bytes)
# a subscriber's budget unless configured (server.max_event_backlog_mb, the publisher's flag)
DEFAULT_MAX_BACKLOG_BYTES = 64 << 20


@dataclass(slots=True, frozen=True)
class Dropped:
    """``count`` messages dropped in a row; ``first`` and ``last``: the seqs of the first
    and the last of them with a readable seq (None: none had one, a malformed message)."""

    first: int | None
    last: int | None
    count: int


Item = list[bytes] | Dropped


def message_bytes(frames: list[bytes]) -> int:
    """What one message counts against the budget."""
    return MESSAGE_OVERHEAD + sum(len(f) for f in frames)


def _seq(frames: list[bytes]) -> int | None:
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return int.from_bytes(frames[1], "big")


class Backlog:
    """A FIFO of received messages and drop markers, at most ``max_bytes`` of messages.
    ``put`` is called by the socket's reader, ``get`` by the handler, in one event loop."""

    def __init__(
        self, max_bytes: int, name: str = "", on_drop: Callable[[], None] | None = None
    ) -> None:
        self.max_bytes = max_bytes
        self.name = name
        self.on_drop = on_drop or (lambda: None)
        self.bytes = 0  # of the messages queued
        self.peak_bytes = 0
        self.dropped = 0  # messages dropped over the budget, in all
        self._items: deque[Item] = deque()
        self._ready = asyncio.Event()
        self._error: BaseException | None = None
        self._episode = 0  # drops since the backlog was last empty (0: not dropping)

    def __len__(self) -> int:
        return len(self._items)

    def put(self, frames: list[bytes]) -> bool:
        """Queue ``frames``, or drop them when they would take the backlog past its budget
        (and it holds a message already); True if queued."""
        size = message_bytes(frames)
        if self.bytes and self.bytes + size > self.max_bytes:
            self._drop(frames)
            return False
        self._items.append(frames)
        self.bytes += size
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self._ready.set()
        return True

    def _drop(self, frames: list[bytes]) -> None:
        seq = _seq(frames)
        tail = self._items[-1] if self._items else None
        if isinstance(tail, Dropped):
            first = tail.first if tail.first is not None else seq
            last = seq if seq is not None else tail.last
            self._items[-1] = Dropped(first, last, tail.count + 1)
        else:
            self._items.append(Dropped(seq, seq, 1))
        self.dropped += 1
        self.on_drop()
        if not self._episode:
            log.warning(
                "%s: KV event backlog over %.1f MB: dropping live batches until it drains "
                "(refilled from the replay socket, or counted lost)",
                self.name, self.max_bytes / 2**20,
            )  # fmt: skip
        self._episode += 1

    async def get(self) -> Item:
        """The oldest item; waits for one. Raises what ended the reader (``fail``) once
        the items before it are taken."""
        while not self._items:
            if self._error is not None:
                raise self._error
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if not isinstance(item, Dropped):
            self.bytes -= message_bytes(item)
        if not self._items and self._episode:
            log.info("%s: KV event backlog drained; %d batches dropped", self.name, self._episode)
            self._episode = 0
        return item

    def fail(self, error: BaseException) -> None:
        """The reader ended with ``error``: ``get`` raises it when nothing is left."""
        self._error = error
        self._ready.set()
