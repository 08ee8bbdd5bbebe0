"""Router pods share their in-flight load through Redis (``server.pods_exchange``).

Each pod routes with the load it sent itself plus what its other workers report over unix
sockets (router/service/load_share.py); without this exchange it knows nothing of the
requests other pods sent to the same replicas until the engines' own reports catch up
(about once a second), and N pods pile onto the replica each thinks is idle. With it, every
worker process of every pod (a *member*: ``<pod>/<pid>``) publishes a *snapshot* of its own
requests in flight per replica (router/service/pod_snapshot.py) and takes the latest
snapshot of every member of the *other* pods (router/service/pod_views.py; its own pod's
workers come over the sockets, faster). Their sum is the ``pods`` source of the app's
:class:`~router.service.peer_sum.PeerSum`; router/service/pod_exchange_app.py runs the
exchange in the app.

Two mechanisms, one key each, both a single hash slot (``{pods}``) so Redis Cluster serves
them as well as a standalone Redis (docs/pods.md compares them by measurement):

* ``stream`` (default): a member appends its snapshot to ``<prefix>:{pods}:load`` (XADD,
  trimmed to about ``STREAM_MAXLEN`` entries) when its own load changed, checked every
  ``pods_exchange_interval_s``, and at least every ``stale/4`` as a heartbeat; readers block
  on XREAD and take snapshots as they come (push: staleness is the check interval plus one
  Redis round trip). A reader that falls behind the trim loses entries: it counts the gap
  and does not drop a member for silence it could not hear (:meth:`PodViews.lost`).
* ``hash``: every ``pods_exchange_interval_s`` a member writes its snapshot into the hash
  ``<prefix>:{pods}:loads`` (HSET, field = member and pod instance: :attr:`Snapshot.sender`,
  so two namesakes write a field each) and reads the whole hash (HGETALL), one
  pipelined round trip (poll: staleness up to two intervals). A field read at the first
  poll, or at the first after a gap longer than ``pods_stale_s``, counts once its seq moves
  again: it may be the last word of a member long dead.

Staleness bound (router/service/pod_views.py): a member whose sequence number has not
moved for ``pods_stale_s`` stops counting. A stream reader catching up on a backlog (it was
cut off) dates each snapshot back by its entry's age relative to the stream's newest entry
(Redis stamps both), so a member that died meanwhile does not count again. A member
stopping cleanly publishes an empty snapshot first. While Redis is away every view ages out
the same way (the pod then routes on its own load and the engines' reports) and the
exchange resumes by itself when Redis answers again (a restarted, empty Redis included).

A pending dispatch or withdrawal of the member's shared rows (router/service/pod_share.py)
makes a message due; a reader drops, and counts, a message over ``MAX_MESSAGE_BYTES`` or one
it cannot parse.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.core.load import LoadTracker
from router.service.peer_sum import PeerSum
from router.service.pod_share import MAX_MESSAGE_BYTES, PodShare
from router.service.pod_snapshot import Snapshot, decode, encode, pod_instance
from router.service.pod_views import GONE_MAX, PodViews
from router.service.workers import Workers
from router.store.redis_store import xread_one
from router.store.schema import POD_TAG
from router.tasks import stop_all

_log = logging.getLogger(__name__)
SOURCE = "pods"
MODES = ("off", "stream", "hash")
STREAM_MAXLEN = 2000
READ_COUNT = 1000  # stream entries one XREAD returns at most
HASH_FORGET_S = 60.0  # a hash field unchanged this long is deleted (its member is gone)
BLOCK_MS = 250  # how long one XREAD waits for entries


@dataclass(slots=True, frozen=True)
class ExchangeSettings:
    mode: str
    key_prefix: str
    pod: str
    interval_s: float
    stale_s: float
    stream_maxlen: int = STREAM_MAXLEN  # entries the stream keeps, about (trimmed past it)

    @property
    def member(self) -> str:
        return f"{self.pod}/{os.getpid()}"

    @property
    def stream_key(self) -> str:
        return f"{self.key_prefix}:{{{POD_TAG}}}:load"

    @property
    def hash_key(self) -> str:
        return f"{self.key_prefix}:{{{POD_TAG}}}:loads"


@dataclass(slots=True)
class Counters:
    sent: int = 0
    received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    errors: int = 0
    rejected: int = 0  # messages too large or unparsable, ignored
    # the loops whose last Redis call failed: one failing is enough (a Redis that answers
    # reads but refuses writes takes this member's load to nobody)
    failing_loops: set[str] = field(default_factory=set)
    name_clashes: int = 0  # live members of another pod that uses this pod's name
    gaps: int = 0  # stream reads that found entries trimmed past the last id read

    @property
    def failing(self) -> bool:
        """Whether a loop's last Redis call failed."""
        return bool(self.failing_loops)


class PodExchange:
    """One member's exchange (see the module docstring). ``client``: a redis-py asyncio
    client (standalone or cluster); ``clock``: the event loop's."""

    def __init__(
        self,
        settings: ExchangeSettings,
        client: Any,
        load: LoadTracker,
        peers: PeerSum,
        clock: Callable[[], float],
        share: PodShare | None = None,
        workers: Workers | None = None,
    ) -> None:
        """``share``: also send this member's speculative entries and session bindings and
        apply the others' (router/service/pod_share.py); None: load only. ``workers``: this
        pod's worker processes (the other members of its name that are its own)."""
        self.settings = settings
        self.workers = workers
        self.instance = pod_instance(workers)
        self._siblings = {settings.member}  # members of this pod's name that are this pod
        self._foreign: dict[str, int] = {}  # other members of this name -> first seq seen
        self._clashed: set[str] = set()
        self.share = share
        self._applied: dict[str, int] = {}  # sender -> seq whose shared rows were applied
        self.client = client
        self.load = load
        self.peers = peers
        self.clock = clock
        self.member = settings.member
        self.views = PodViews(settings.pod, settings.stale_s)
        self.counters = Counters()
        self._seq = 0
        self._sent_changes = -1
        self._sent_at = -float("inf")
        self._last_id = b"$"
        self._heard_self_at = clock()  # when an own stream entry was last read back
        self._forgotten_at = 0.0
        self._polled_at = -float("inf")  # hash mode: when the last poll's answer came
        # hash mode: every field read at the last poll, its value and when that last changed
        # (this pod's own fields too, which the views leave out)
        self._fields: dict[bytes, tuple[bytes, float]] = {}

    @property
    def field(self) -> str:
        """This member's hash field: its :attr:`Snapshot.sender` (a namesake writes its own;
        an earlier version wrote its member's)."""
        return f"{self.member}#{self.instance}"

    # ------------------------------------------------------------------ writing

    def _due(self, now: float) -> bool:
        return (
            self.load.own_changes != self._sent_changes
            or now - self._sent_at >= self.settings.stale_s / 4
            or (self.share is not None and bool(self.share.outbox))
        )

    def _snapshot(self, now: float) -> bytes:
        self._seq += 1
        self._sent_changes = self.load.own_changes
        self._sent_at = now
        shared = self.share.outbox.take(now) if self.share is not None else None
        data = encode(self.member, self.settings.pod, self._seq, self.load, shared, self.instance)
        self.counters.sent += 1
        self.counters.bytes_sent += len(data)
        return data

    def _unsent(self) -> None:
        """The last snapshot never got through (refused, unanswered, or its call cancelled
        by a stop): its load goes again at the next check, its shared rows and withdrawals
        in the next message, the leaving one included (router/service/pod_share.py)."""
        self._sent_changes = -1
        if self.share is not None:
            self.share.outbox.put_back()

    async def publish(self, now: float) -> None:
        """Stream mode: append a snapshot if this member's load changed (or a heartbeat is
        due)."""
        if self._due(now):
            data = self._snapshot(now)
            try:
                await self.client.xadd(
                    self.settings.stream_key,
                    {b"s": data},
                    maxlen=self.settings.stream_maxlen,
                    approximate=True,
                )
            except BaseException:  # a stop cancelling it too: the leaving message carries it
                self._unsent()
                raise

    async def read_stream(self) -> None:
        """Stream mode: wait (up to 250 ms) for the next snapshots and take them."""
        key = self.settings.stream_key
        cursor = self._last_id
        got = await xread_one(self.client, key, cursor, count=READ_COUNT, block_ms=BLOCK_MS)
        now = self.clock()
        for _, entries in got or ():
            # entry ids start with Redis's clock (ms) at XADD: an entry's age relative to the
            # stream's newest is a lower bound of its age (a reader catching up after an
            # outage). A full read is a backlog's oldest part, as old as its own newest
            # entry: the stream's last entry dates it then (one more round trip, only
            # then). Only a full read can follow a gap: the trim keeps at least maxlen
            # entries, all of them after the cursor if it passed the cursor
            newest = _id_ms(entries[-1][0]) if entries else 0
            if len(entries) >= min(READ_COUNT, self.settings.stream_maxlen):
                pipe = self.client.pipeline(transaction=False)
                pipe.xrange(key, count=1)
                pipe.xrevrange(key, count=1)
                head, tail = await pipe.execute()
                if tail:
                    newest = max(newest, _id_ms(tail[0][0]))
                if head and cursor != b"$" and _id(head[0][0]) > _id(cursor):
                    self._gap(now, newest, cursor, entries[0][0])
            for entry_id, fields in entries:
                self._last_id = entry_id
                age_s = max(newest - _id_ms(entry_id), 0) / 1000
                if self._take(fields.get(b"s", b""), now, age_s):
                    self._heard_self_at = now
        if now - self._heard_self_at > self.settings.stale_s and self._last_id != b"$":
            # this member's own heartbeats (every stale/4) no longer come back: the stream's
            # ids went behind the last one read (a Redis restarted with its clock behind the
            # ids it stamped before): read what comes next, not what comes after that id
            self._last_id = b"$"
            self._heard_self_at = now
        self.apply(now)

    def _gap(self, now: float, newest: int, cursor: bytes, first: bytes) -> None:
        """The stream's first entry is past ``cursor``, the last id read: entries between it
        and ``first``, this read's first, may have been trimmed unread (the cursor's own
        trimmed with nothing after it lost looks the same: at worst one bound more for the
        members then counting)."""
        self.counters.gaps += 1
        # the stream runs ahead of the cursor, not behind it: this member's own heartbeats
        # may be among the lost, no reason to read on from the newest entry
        self._heard_self_at = now
        since = now - max(newest - _id_ms(cursor), 0) / 1000
        self.views.lost(since, now - max(newest - _id_ms(first), 0) / 1000)

    async def poll_hash(self, now: float) -> None:
        """Hash mode: one round trip writing this member's snapshot and reading all."""
        key = self.settings.hash_key
        pipe = self.client.pipeline(transaction=False)
        writing = self._due(now)
        if writing:
            pipe.hset(key, self.field, self._snapshot(now))
        pipe.hgetall(key)
        try:
            results = await pipe.execute()
        except BaseException:
            if writing:
                self._unsent()
            raise
        now = self.clock()
        # a field's seq has no date: one that moved since a poll older than the bound (or
        # read at the first poll) may have moved long ago (a member that wrote, then died,
        # before this one started or while it could not poll): no sign of life until it
        # moves again (a live member writes at least every stale/4)
        dated = now - self._polled_at <= self.settings.stale_s
        self._polled_at = now
        if not dated:  # views moved at polls that old at the latest: none counts on
            self.views.expire(now)
        fields: dict[bytes, bytes] = results[-1]
        for data in fields.values():
            self._take(data, now, dated=dated)
        # a field deleted (a member that stopped cleanly, or forgotten) stops counting now
        self.views.keep_only({m.decode(errors="replace") for m in fields})
        self.apply(now)
        self._note(fields, now)
        if now - self._forgotten_at > HASH_FORGET_S:
            self._forgotten_at = now
            await self._forget_gone(key, now)

    def _note(self, fields: dict[bytes, bytes], now: float) -> None:
        """Remember when each field's value last changed (a live sender writes a new seq at
        least every ``stale/4``)."""
        seen = self._fields
        for name, data in fields.items():
            was = seen.get(name)
            if was is None or was[0] != data:
                seen[name] = (data, now)
        if len(seen) > len(fields):
            for name in [n for n in seen if n not in fields]:
                del seen[name]

    async def _forget_gone(self, key: str, now: float) -> None:
        """Delete the hash fields whose value has not changed for ``HASH_FORGET_S``: their
        senders are gone. Any field but this member's own, this pod's included (a worker
        killed and replaced, the pod's life before a restart): the views leave those out,
        and with no other pod running nobody else would delete them."""
        own = self.field.encode()
        gone = sorted(
            name
            for name, (_, changed_at) in self._fields.items()
            if now - changed_at > HASH_FORGET_S and name != own
        )
        if gone:
            await self.client.hdel(key, *gone)

    def _take(self, data: bytes, now: float, age_s: float = 0.0, dated: bool = True) -> bool:
        """Take one message read at ``now``, known to be at least ``age_s`` old (``dated``:
        :meth:`PodViews.take`); whether it was this member's own (not a namesake's that has
        its name)."""
        self.counters.received += 1
        self.counters.bytes_received += len(data)
        if len(data) > MAX_MESSAGE_BYTES:
            self.counters.rejected += 1
            return False
        try:
            snap = decode(data)
        except (ValueError, TypeError, RecursionError) as exc:
            self.counters.rejected += 1
            _log.debug("bad load snapshot in Redis: %s", exc)
            return False
        mine = snap.instance == self.instance
        # this pod's name but not this pod: by its instance, else (an earlier version) its pid
        known = snap.instance is None and snap.member in self._siblings
        if snap.pod == self.settings.pod and not mine and not known:
            self._same_name(snap)
        # a snapshot read late (a reader catching up on a backlog) moved when it was sent:
        # a member that died meanwhile must not count again for a whole bound
        self.views.take(snap, now - age_s, dated)
        own = snap.member == self.member and (mine or snap.instance is None)
        if self.share is not None and snap.shared is not None and not own:
            self._apply_shared(self.share, snap, now, age_s, dated)
        return own

    def _same_name(self, snap: Snapshot) -> None:
        """A member of this pod's name that is none of this pod's processes is another pod
        configured with the same ``pod_name``: the two ignore each other's load. Counted and
        logged once it shows it is alive (its seq moves; a dead namesake's leftover entry
        does not). A sender that names its pod instance is this pod's only with this pod's
        instance, whatever its pid; one that does not (an earlier version) by its pid."""
        member = snap.member
        if snap.instance is not None:  # a namesake may have this pod's very pids
            member = f"{member}#{snap.instance}"
        if member in self._clashed:
            return
        if snap.instance is None and self.workers is not None and member not in self._foreign:
            pids, _ = self.workers.peers()
            self._siblings.update(f"{self.settings.pod}/{pid}" for pid in pids)
            if member in self._siblings:
                return
        if len(self._foreign) >= GONE_MAX:
            self._foreign.clear()
        first = self._foreign.setdefault(member, snap.seq)
        if first == snap.seq or len(self._clashed) >= GONE_MAX:
            return
        self._clashed.add(member)
        self.counters.name_clashes += 1
        _log.error(
            "pod exchange: %s also calls itself pod %r; the two pods ignore each other's "
            "load: give each its own server.pod_name",
            member,
            self.settings.pod,
        )

    def _apply_shared(
        self, share: PodShare, snap: Snapshot, now: float, age_s: float, dated: bool
    ) -> None:
        """Another member's rows, each message's once (a hash re-read shows the same seq
        again; this member's own stream entries come back to it too). ``dated``: the read
        can tell the message is recent (:meth:`PodViews.take`)."""
        sender = snap.sender  # namesakes' seqs may coincide
        if self._applied.get(sender) == snap.seq:
            return
        if len(self._applied) > 4096:
            self._applied.clear()
        self._applied[sender] = snap.seq
        shared = snap.shared
        if not dated and shared:
            # a hash field read at the first poll, or at the first after a gap past the
            # bound, may have been written long ago (its member dead since, up to
            # HASH_FORGET_S): its rows' TTLs are no longer what they say. Its withdrawals
            # only take back what this member took of earlier rows: they still apply
            shared = {"w": shared["w"]} if "w" in shared else None
        if shared:
            share.apply(shared, now, age_s, snap.member)

    def apply(self, now: float) -> None:
        self.peers.update(SOURCE, self.views.total(now))

    async def leave(self) -> None:
        """Tell the others this member has nothing in flight any more (clean stop); in stream
        mode the message also carries what the outbox still held (withdrawals of dispatches
        refused in the last moments, rows), which would otherwise last their whole TTL on
        the other pods."""
        self._seq += 1
        doc: dict[str, Any] = {
            "load": [], "m": self.member, "p": self.settings.pod, "s": self._seq,
            "n": self.instance,
        }  # fmt: skip
        if self.share is not None and self.settings.mode == "stream":
            doc.update(self.share.outbox.take(self.clock()) or {})
        body = json.dumps(doc, separators=(",", ":"))
        with contextlib.suppress(Exception):
            if self.settings.mode == "stream":
                await self.client.xadd(self.settings.stream_key, {b"s": body.encode()})
            else:
                await self.client.hdel(self.settings.hash_key, self.field)

    # ------------------------------------------------------------------ loops

    async def _guarded(self, what: str, step: Callable[[], Any]) -> None:
        """Run ``step`` forever; a failure (Redis away) is counted, logged once per outage,
        and retried after a short pause while the views age out on their own."""
        failing = False
        while True:
            try:
                await step()
                if failing:
                    _log.info("pod load exchange: %s works again", what)
                failing = False
                self.counters.failing_loops.discard(what)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    # a cancellation the Redis client turned into its own error: stopping
                    # must stop (the loop would otherwise swallow it and never end)
                    raise asyncio.CancelledError from exc
                self.counters.errors += 1
                if not failing:
                    _log.warning("pod load exchange: %s failed: %s", what, exc)
                failing = True
                self.counters.failing_loops.add(what)
                self.apply(self.clock())
                await asyncio.sleep(min(self.settings.stale_s / 4, 0.25))

    async def age_out(self) -> None:
        """Drop stale views on time, whatever Redis does: a call that hangs (a Redis that
        stopped answering, up to the client's timeouts and retries) must not keep them."""
        pause = min(self.settings.stale_s / 4, 0.25)
        while True:
            await asyncio.sleep(pause)
            now = self.clock()
            if self.views.expire(now):
                self.apply(now)

    async def run(self) -> None:
        interval = self.settings.interval_s
        if self.settings.mode == "stream":

            async def write() -> None:
                await asyncio.sleep(interval)
                await self.publish(self.clock())

            loops = [
                asyncio.create_task(self._guarded("publishing", write)),
                asyncio.create_task(self._guarded("reading", self.read_stream)),
            ]
        else:

            async def poll() -> None:
                await asyncio.sleep(interval)
                await self.poll_hash(self.clock())

            loops = [asyncio.create_task(self._guarded("polling", poll))]
        loops.append(asyncio.create_task(self.age_out()))
        try:
            await asyncio.gather(*loops)
        finally:  # however it ends, no loop outlives the exchange
            await stop_all(loops)


def _id_ms(entry_id: bytes) -> int:
    ms, _, _ = entry_id.partition(b"-")
    return int(ms) if ms.isdigit() else 0


def _id(entry_id: bytes) -> tuple[int, int]:
    """A stream entry id, ordered as Redis orders them."""
    _, _, seq = entry_id.partition(b"-")
    return _id_ms(entry_id), int(seq) if seq.isdigit() else 0
