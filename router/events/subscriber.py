"""ZMQ subscriber for one engine endpoint, with replay to fill sequence gaps.

Delivers ``(seq, payload)`` in sequence order to ``on_payload``. On a gap it asks the
engine's replay socket (DEALER -> ROUTER) for the missing batches (the engine answers a start
seq with every buffered batch from it, its last ``buffer_steps``, 10,000 by default, then an
end marker with seq -1; both reply layouts are read, ``parse_replay_reply``); what the replay cannot
supply is reported through ``on_lost`` (the caller then clears that engine's state: stale
blocks are worse than missing ones). A seq that goes backwards means the engine restarted
(``on_restart``), unless the batch is the very one delivered under that seq (one of the last
``RECENT`` batches, the same payload): then it is a duplicate. A restarted engine counts from
0 again, so its first batches reuse seqs the old engine's had, with other payloads; the
payload, not the distance back, tells the two apart. A gap's replay starts one batch early,
at the last one delivered: when the engine holds another batch under that seq, it restarted
while nothing reached this subscriber and counted past the old seq. After a restart the new
engine's batches before the one seen are replayed from 0. With a replay socket, a restart
found also makes the SUB socket anew (``_run_socket``): batches of the old engine still
queued on it come before the new engine's and would pass for its own; the new socket
catches up from the replay socket. Malformed frames are counted and skipped; nothing here
raises on input.

Turns (``YIELD_EVERY``): the subscriber runs in the router's event loop, and pyzmq hands out
messages already queued on a socket without yielding to it, so a history, a replay or a
backlog of live batches would be applied in one go, requests and the other engines' events
waiting meanwhile. The event loop gets a turn after every ``YIELD_EVERY`` batches delivered,
and after any batch delivered ``YIELD_AFTER_S`` or more after its last turn.

History (``replay_history``): as soon as it has subscribed, the subscriber asks the replay
socket for everything the engine still buffers, so what the engine cached before the
subscriber started is known even if the engine stays idle afterwards (a publisher restarted
next to an idle engine, or one that started after the engine's last requests, would
otherwise wait for the next event to learn any of it). Live messages that were queued on the
SUB socket meanwhile and carry a batch the history already delivered (same seq, same
payload) are duplicates. ZMQ connects asynchronously: the engine's PUB drops what it
publishes before the subscription reaches it, so when the SUB socket's connection completes
(its first handshake, and each one after) the subscriber catches up from its last seq, or
loads the history if it has none yet; an engine that did not answer at start (it was down)
is caught up on when it comes. The first live message that shows a gap asks for the batches
before it too.

Backlog (``max_backlog_bytes``, router/events/backlog.py): ZMQ bounds the SUB socket's queue
by message count only, and one batch can be megabytes. The socket keeps a short queue
(``RCVHWM``: beyond it the engine's PUB holds the rest, or drops it, a gap) and a reader
task moves each message at once into a ``Backlog`` that the handler takes from; a message
that would take it past the budget is dropped there, a ``Dropped`` marker in its place, and
the handler takes the marker as a gap up to the last seq dropped (``_refill``): refilled
from the replay socket, or counted lost. Drops are counted (``stats.dropped``). Replay
reads keep the same budget (``_fetch``): what they read is delivered in chunks of at most
``max_backlog_bytes``, each before the next is read (``stats.max_replay_bytes``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from router.events.backlog import DEFAULT_MAX_BACKLOG_BYTES as DEFAULT_MAX_BACKLOG_BYTES
from router.events.backlog import MESSAGE_OVERHEAD, Backlog, Dropped

log = logging.getLogger(__name__)
END_SEQ = -1
RECENT = 16  # delivered batches kept (references) to recognise a repeated one
_MAX_REPLAY_ROUNDS = 1000  # replay requests of one fetch (each brings at least one batch)
YIELD_EVERY = 32  # batches delivered at most between two turns of the event loop
YIELD_AFTER_S = 0.005  # delivering since the last turn: the next batch is followed by one
# messages ZMQ queues on the SUB socket before its reader takes them into the byte-bounded
# backlog (the reader runs whenever the event loop does: this holds what arrives while it
# does not, e.g. a garbage collection); beyond it the engine's PUB queues them
RCVHWM = 128
Chunk = list[tuple[int, bytes]]  # replayed (seq, payload) pairs delivered together


@dataclass(slots=True)
class SubscriberStats:
    messages: int = 0
    malformed_frames: int = 0
    gaps: int = 0
    replayed: int = 0
    lost: int = 0
    restarts: int = 0
    duplicates: int = 0
    received: int = 0  # messages the SUB socket gave (before the backlog's budget)
    dropped: int = 0  # of them, dropped over the backlog's budget (refilled or lost)
    max_backlog_bytes: int = 0  # the most the backlog held (router/events/backlog.py)
    # the most replayed bytes held at once, read and not yet delivered (``_fetch``)
    max_replay_bytes: int = 0


@dataclass(slots=True)
class _Span:
    """A replayed ``[start, stop)`` delivered over several chunks; ``expected``: the next
    seq due (``_deliver_span``)."""

    start: int
    stop: int
    expected: int


@dataclass(slots=True)
class _Loaded:
    """A history or catch-up delivered over several chunks (``_deliver_history``):
    ``history`` the delivered seqs' payload hashes; ``lost_before``: a hole before the
    first one is lost too."""

    lost_before: bool
    history: dict[int, int]


class _UnlessRestarted:
    """A replay answer's chunks from seq ``last`` on, handed to ``deliver`` unless the first
    shows that the engine restarted: its batch ``last`` is not the one ``delivered`` under
    that seq (it restarted while nothing reached the subscriber, and counted past ``last``).
    Called per chunk; False stops the read. ``checked``: a chunk came."""

    def __init__(
        self,
        last: int,
        delivered: Callable[[int, bytes], bool],
        deliver: Callable[[list[tuple[int, bytes]]], Awaitable[None]],
    ) -> None:
        self.last = last
        self.delivered = delivered
        self.deliver = deliver
        self.checked = False
        self.restarted = False

    async def __call__(self, got: list[tuple[int, bytes]]) -> bool:
        if not self.checked:
            self.checked = True
            last = self.last
            self.restarted = got[0][0] == last and not self.delivered(last, got[0][1])
            if self.restarted:
                return False
        await self.deliver(got)
        return True


class ZmqEventSubscriber:
    def __init__(
        self,
        endpoint: str,
        on_payload: Callable[[int, bytes], None],
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        on_lost: Callable[[int], None] | None = None,
        on_restart: Callable[[], None] | None = None,
        replay_timeout_s: float = 1.0,
        replay_history: bool = True,
        context: zmq.asyncio.Context | None = None,
        max_backlog_bytes: int = DEFAULT_MAX_BACKLOG_BYTES,
        on_dropped: Callable[[], None] | None = None,
    ) -> None:
        if max_backlog_bytes <= 0:
            raise ValueError(f"max_backlog_bytes must be > 0, got {max_backlog_bytes}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.on_payload = on_payload
        self.on_lost = on_lost or (lambda n: None)
        self.on_restart = on_restart or (lambda: None)
        self.replay_timeout_s = replay_timeout_s
        self.replay_history = replay_history
        self.ctx = context or zmq.asyncio.Context.instance()
        self.max_backlog_bytes = max_backlog_bytes
        self.on_dropped = on_dropped or (lambda: None)
        self._backlog: Backlog | None = None  # of the SUB socket in use
        self.last_seq: int | None = None
        self.stats = SubscriberStats()
        self.connected = asyncio.Event()
        self._sub: zmq.asyncio.Socket | None = None
        # seq -> hash(payload) of the batches the start-up history fetch delivered, until a
        # live message goes past them (their live copies may still be queued on the SUB)
        self._history: dict[int, int] | None = None
        # (seq, payload) delivered; payload None: a seq passed over as lost (``_refill``)
        self._recent: deque[tuple[int, bytes | None]] = deque(maxlen=RECENT)
        self._since_turn = 0  # batches delivered since the event loop's last turn
        self._lock = asyncio.Lock()  # one delivery at a time: live batches or a catch-up
        self._turn_due = 0.0  # loop time after which a delivered batch is followed by one
        self._stale_socket = False  # a restart was found: what the SUB socket holds is old

    async def run(self) -> None:
        """Receive until cancelled."""
        while True:
            await self._run_socket()

    async def _run_socket(self) -> None:
        """Receive on a SUB socket of its own until cancelled, or until a restart of the
        engine is found (``_forget_engine``): what the socket still holds then came from
        the old engine (one pipe holds it before the new engine's batches), so it is closed
        unread and the next one catches up from the new engine's replay socket (without
        one, nothing would bring back the new engine's batches it holds: it is kept)."""
        self._stale_socket = False
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RCVHWM)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        watch: asyncio.Task[None] | None = None
        monitor: zmq.asyncio.Socket | None = None
        reader: asyncio.Task[None] | None = None
        backlog = self._backlog = Backlog(self.max_backlog_bytes, self.endpoint, self._dropped)
        try:
            if self.replay_endpoint:
                monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
                watch = asyncio.create_task(self._watch_reconnects(monitor))
            sub.connect(self.endpoint)
            self._sub = sub
            reader = asyncio.create_task(self._read(sub, backlog))
            self.connected.set()
            # what was published before: the first handshake catches up on what came between
            # this fetch and the subscription reaching the engine (``_watch_reconnects``)
            async with self._lock:
                if self.last_seq is not None and self.replay_endpoint:
                    await self._catch_up()  # run again after a failure
                elif self.replay_history and self.replay_endpoint:
                    await self._load_history()
            while not self._stale_socket:
                item = await backlog.get()
                async with self._lock:
                    if self._stale_socket:
                        break
                    if isinstance(item, Dropped):
                        await self._refill(item)
                        continue
                    await self._handle(item)
                await self._pace()
        finally:
            for task in (reader, watch):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            if monitor is not None:
                sub.disable_monitor()
                monitor.close(0)
            sub.close(0)
            self._sub = None
            self._backlog = None

    @property
    def backlog_bytes(self) -> int:
        """Bytes of live messages received and not yet handled (``Backlog.bytes``)."""
        return 0 if self._backlog is None else self._backlog.bytes

    def _dropped(self) -> None:
        self.stats.dropped += 1
        self.on_dropped()

    async def _read(self, sub: zmq.asyncio.Socket, backlog: Backlog) -> None:
        """Move every message the SUB socket receives into ``backlog`` at once (it drops
        what exceeds its budget); what ends this ends the handler's loop too."""
        try:
            while True:
                frames = await sub.recv_multipart()
                self.stats.received += 1
                backlog.put(frames)
                self.stats.max_backlog_bytes = max(self.stats.max_backlog_bytes, backlog.bytes)
        except BaseException as exc:
            backlog.fail(exc)
            raise

    async def _watch_reconnects(self, monitor: zmq.asyncio.Socket) -> None:
        """Each time the SUB socket connects to the engine, catch up from the last seq
        (``_catch_up``), or with none yet, load the history: ZMQ connects asynchronously,
        and what the engine published before the subscription reached it (after ``run``'s
        fetch, or while it did not answer: it was down) was dropped by its PUB socket. It
        connects again by itself (the engine restarted, or the connection was cut): a
        restarted engine is found before its first batch, and what was published while the
        connection was down comes back, even if the engine stays idle."""
        try:
            again = False
            while True:
                await monitor.recv_multipart()  # a handshake succeeded
                async with self._lock:
                    if self.last_seq is not None:
                        how = "reconnected" if again else "connected"
                        log.info("%s: %s; catching up from seq %d", self.endpoint, how,
                                 self.last_seq)  # fmt: skip
                        await self._catch_up()
                    elif self.replay_history:
                        await self._load_history()
                again = True
        except Exception:  # the subscriber goes on, seeing gaps and restarts by their seqs
            log.exception("%s: reconnection watch failed", self.endpoint)

    async def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.malformed_frames += 1
            return
        seq = int.from_bytes(frames[1], "big")
        payload = frames[2]
        self.stats.messages += 1
        if self._history is not None:
            if seq in self._history and self._history[seq] == hash(payload):
                self.stats.duplicates += 1  # its copy from the history was delivered
                return
            if self.last_seq is None or seq > self.last_seq:
                self._history = None  # live messages went past the history
        last = self.last_seq
        if last is None:
            if seq > 0 and self.replay_history and self.replay_endpoint:
                await self._replay(0, seq)
        elif seq <= last:
            if self._delivered(seq, payload):
                self.stats.duplicates += 1
                return
            log.warning("engine %s restarted (seq %d after %d)", self.endpoint, seq, last)
            await self._restarted(seq)
        elif seq > last + 1:
            await self._fill_gap(last, seq)
        self._deliver(seq, payload)

    async def _fill_gap(self, last: int, seq: int) -> None:
        """Deliver ``(last, seq)`` from the replay socket (a gap before ``seq``), or report
        it lost; a replay whose batch ``last`` is another one shows a restart."""
        self.stats.gaps += 1
        span = _Span(last + 1, seq, last + 1)

        async def deliver(got: list[tuple[int, bytes]]) -> None:
            await self._deliver_span(span, got)

        chunk = _UnlessRestarted(last, self._delivered, deliver)
        if self.replay_endpoint:
            await self._fetch(last, chunk, seq)
        if chunk.restarted:
            log.warning("engine %s restarted (seq %d is another batch)", self.endpoint, last)
            await self._restarted(seq)
        else:
            self._end_span(span)

    async def _refill(self, dropped: Dropped) -> None:
        """Messages the backlog dropped over its budget, taken in their place: a gap up to
        the last of them (``_fill_gap``: replayed, or lost), so that they come back even if
        no batch follows them. Seqs at or before the last delivered are duplicates, or an
        engine restart that the next batch or connection shows (as without the drop)."""
        last, upto = self.last_seq, dropped.last
        if upto is None:
            return  # malformed messages only
        restarts = self.stats.restarts
        if last is None:
            # none delivered yet: the dropped ones from their first (lost without replay)
            assert dropped.first is not None
            await self._replay(dropped.first, upto + 1)
        elif upto > last:
            await self._fill_gap(last, upto + 1)
        last = self.last_seq
        if last is not None and last < upto and self.stats.restarts == restarts:
            # the last ones were counted lost: the next batch follows them, no gap again
            self.last_seq = upto
            self._recent.append((upto, None))

    async def _restarted(self, seq: int) -> None:
        """The engine restarted: forget it (``on_restart``), then deliver what the new engine
        published before ``seq`` (its batches from 0, which this subscriber never saw)."""
        self._forget_engine()
        if seq > 0 and self.replay_endpoint:
            await self._replay(0, seq)

    def _forget_engine(self) -> None:
        self.stats.restarts += 1
        # ``_run_socket``: the SUB socket is made anew (what it holds comes back by replay)
        self._stale_socket = self.replay_endpoint is not None
        self.last_seq = None
        self._history = None
        self._recent.clear()
        self.on_restart()

    async def _catch_up(self) -> None:
        """Run again after a failure, its last seq kept: ask the replay socket from that seq
        at once (the engine may stay idle, and no live batch would show what was missed) and
        deliver what came after it, or, when the engine no longer holds that very batch under
        that seq (it restarted meanwhile), forget the engine and load the new one's
        history. Batches the buffer moved past are lost; with no answer, the next live batch
        or (``_watch_reconnects``) the next connection shows any gap or restart."""
        last = self.last_seq
        assert last is not None
        loaded = _Loaded(lost_before=True, history={})

        async def deliver(got: list[tuple[int, bytes]]) -> None:
            await self._deliver_history(loaded, got)

        chunk = _UnlessRestarted(last, self._delivered, deliver)
        if not await self._fetch(last, chunk):
            return
        if not chunk.checked or chunk.restarted:
            log.warning("engine %s restarted (batch %d is gone or another)", self.endpoint, last)
            self._forget_engine()
            await self._load_history()
            return
        self._end_history(loaded)

    async def _load_history(self) -> None:
        """Deliver the engine's whole replay buffer (nothing is lost before it: what the
        buffer no longer holds was never seen; a hole after its first batch, where the
        buffer moved on between two replay requests, is lost)."""
        loaded = _Loaded(lost_before=False, history={})

        async def chunk(got: list[tuple[int, bytes]]) -> bool:
            await self._deliver_history(loaded, got)
            return True

        await self._fetch(0, chunk)
        self._end_history(loaded)

    async def _deliver_history(self, loaded: _Loaded, got: list[tuple[int, bytes]]) -> None:
        """Deliver the replayed ``got`` (the next chunk of ``loaded``) past the last seq
        delivered; a hole is lost, before the first of them too with ``lost_before``."""
        history = loaded.history
        for seq, payload in got:
            last = self.last_seq
            if last is not None and seq <= last:
                continue
            if (history or loaded.lost_before) and last is not None and seq > last + 1:
                self.stats.lost += seq - last - 1
                self.on_lost(seq - last - 1)
            history[seq] = hash(payload)
            self.stats.replayed += 1
            self._deliver(seq, payload)
            await self._pace()

    def _end_history(self, loaded: _Loaded) -> None:
        """The batches ``loaded`` delivered are remembered against their live copies
        queued on the SUB socket (``_handle``)."""
        if loaded.history:
            self._history = loaded.history
            log.info(
                "%s: %d buffered batches loaded from replay", self.endpoint, len(loaded.history)
            )

    def _delivered(self, seq: int, payload: bytes) -> bool:
        """``payload`` is what was delivered under ``seq`` (among the last ``RECENT``), or
        ``seq`` was passed over as lost (whatever batch it names was counted so)."""
        return any(s == seq and (p is None or p == payload) for s, p in self._recent)

    def _deliver(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        self._recent.append((seq, payload))
        self.on_payload(seq, payload)

    async def _pace(self) -> None:
        """After a batch was delivered: give the event loop a turn when ``YIELD_EVERY``
        batches were delivered since its last one, or ``YIELD_AFTER_S`` went by."""
        self._since_turn += 1
        loop = asyncio.get_running_loop()
        if self._since_turn >= YIELD_EVERY or loop.time() >= self._turn_due:
            await asyncio.sleep(0)
            self._since_turn = 0
            self._turn_due = loop.time() + YIELD_AFTER_S

    async def _replay(self, start: int, stop: int) -> None:
        """Fetch ``[start, stop)`` from the replay socket and deliver it; report what is lost."""
        span = _Span(start, stop, start)

        async def chunk(got: list[tuple[int, bytes]]) -> bool:
            await self._deliver_span(span, got)
            return True

        if self.replay_endpoint:
            await self._fetch(start, chunk, stop)
        self._end_span(span)

    async def _deliver_span(self, span: _Span, got: list[tuple[int, bytes]]) -> None:
        """Deliver the replayed batches of ``span`` among ``got`` (its next chunk) in
        order; report a hole before them as lost (from a start past 0: before it nothing
        was seen, so nothing is lost)."""
        for seq, payload in got:
            if seq < span.expected or seq >= span.stop:
                continue
            if seq > span.expected and span.start > 0:
                self.stats.lost += seq - span.expected
                self.on_lost(seq - span.expected)
            self.stats.replayed += 1
            self._deliver(seq, payload)
            await self._pace()
            span.expected = seq + 1

    def _end_span(self, span: _Span) -> None:
        """The replay of ``span`` is over: what it did not bring up to its stop is lost."""
        if span.expected < span.stop and span.start > 0:
            self.stats.lost += span.stop - span.expected
            self.on_lost(span.stop - span.expected)

    async def _fetch(
        self, start: int, on_chunk: Callable[[Chunk], Awaitable[bool]], stop: int | None = None
    ) -> bool:
        """Pass the replayed ``(seq, payload)`` pairs from ``start`` (with ``stop``: up to
        ``stop - 1``) to ``on_chunk`` in order, in chunks of at most ``max_backlog_bytes``
        (as the live backlog counts them; one larger pair alone) as they are read: one
        chunk is delivered before the next is read (the rest waits in ZMQ's queue and the
        engine's), so a 10,000-batch replay of megabyte batches is never held whole.
        ``on_chunk`` returning False stops the replay (the socket is closed: the engine's
        ROUTER drops what it still holds for it). Returns whether the engine answered at
        all (an end marker alone is an answer: it holds nothing from ``start``).

        The engine answers a start seq with its whole buffer tail and an end marker,
        through a ROUTER socket that drops what exceeds its high-water mark (1,000 messages
        by default; vLLM 0.33-0.34 size it to the whole buffer) when the reader falls
        behind, anywhere in the burst: the end marker with the rest, or a run in the middle
        while later replies still arrive. The buffer is consecutive, so a reply that skips
        a seq, or stops short of its end marker, is asked again from the seq after the
        last one in order, until the end marker, ``stop - 1`` or nothing new comes."""
        assert self.replay_endpoint is not None
        first = start
        answered = False
        for _ in range(_MAX_REPLAY_ROUNDS):
            last, ended, stopped = await self._fetch_once(first, stop, on_chunk)
            answered = answered or ended or last is not None
            if stopped or ended or last is None:
                break
            first = last + 1
            if stop is not None and first >= stop:
                break
        return answered

    async def _fetch_once(
        self, start: int, stop: int | None, on_chunk: Callable[[Chunk], Awaitable[bool]]
    ) -> tuple[int | None, bool, bool]:
        """One replay request, its pairs passed to ``on_chunk`` (``_fetch``): the last seq
        of the consecutive run it brought (None: none), whether it reached its end (the
        end marker, or ``stop - 1``), and whether ``on_chunk`` stopped it. A seq skipped
        ends it (the rest of the burst is read again from there). Waits
        ``replay_timeout_s`` for the first reply, then a fraction of it between replies
        (the engine sends its buffer in one burst)."""
        assert self.replay_endpoint is not None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)  # as the SUB socket: the rest waits at the engine
        sock.connect(self.replay_endpoint)
        chunk: Chunk = []
        held = 0  # bytes of ``chunk``
        last: int | None = None
        wait_ms = int(self.replay_timeout_s * 1000)

        async def flush() -> bool:
            nonlocal chunk, held
            if not chunk:
                return True
            out, chunk, held = chunk, [], 0
            return await on_chunk(out)

        try:
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not await sock.poll(wait_ms):
                    if last is None:
                        log.warning("replay from %s timed out", self.replay_endpoint)
                    return last, False, not await flush()
                reply = parse_replay_reply(await sock.recv_multipart())
                if reply is None:
                    self.stats.malformed_frames += 1
                    continue
                seq, payload = reply
                if seq == END_SEQ or not payload:
                    return last, True, not await flush()
                if seq < start:
                    continue
                if last is not None and seq != last + 1:  # replies dropped on the way
                    return last, False, not await flush()
                size = MESSAGE_OVERHEAD + 8 + len(payload)
                if chunk and held + size > self.max_backlog_bytes and not await flush():
                    return last, False, True
                chunk.append((seq, payload))
                held += size
                self.stats.max_replay_bytes = max(self.stats.max_replay_bytes, held)
                last = seq
                if stop is not None and seq >= stop - 1:
                    return last, True, not await flush()
                if len(chunk) % YIELD_EVERY == 0:
                    await asyncio.sleep(0)  # queued replies come without a turn too
                wait_ms = max(20, int(self.replay_timeout_s * 200))
        finally:
            sock.close(0)


def parse_replay_reply(frames: list[bytes]) -> tuple[int, bytes] | None:
    """``(seq, payload)`` of one replay reply as a DEALER receives it, or None if malformed.

    The engine's ROUTER sends ``[client, b"", seq, payload]`` (vLLM <= 0.25, SGLang <= 0.5.21)
    or ``[client, b"", topic, seq, payload]`` (vLLM >= 0.26, SGLang >= 0.5.22); the DEALER
    sees them without the client identity, so 3 or 4 frames starting with the empty
    delimiter. The end marker is seq -1 with an empty payload (and an empty topic)."""
    if len(frames) == 4 and not frames[0]:
        seq_frame, payload = frames[2], frames[3]
    elif len(frames) == 3 and not frames[0]:
        seq_frame, payload = frames[1], frames[2]
    else:
        return None
    if len(seq_frame) != 8:
        return None
    return int.from_bytes(seq_frame, "big", signed=True), payload
