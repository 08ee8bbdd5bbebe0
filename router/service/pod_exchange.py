"""Router pods share their in-flight load through Redis (``server.pods_exchange``).

Each pod routes with the load it sent itself plus what its other workers report over unix
sockets (router/service/load_share.py); without this exchange it knows nothing of the
requests other pods sent to the same replicas until the engines' own reports catch up
(about once a second), and N pods pile onto the replica each thinks is idle. With it, every
worker process of every pod (a *member*: ``<pod>/<pid>``) publishes a *snapshot* of its own
requests in flight per replica (the :class:`~router.core.load.PeerLoad` rows of
``/internal/load``) and takes the latest snapshot of every member of the *other* pods (its own
pod's workers come over the sockets, faster). Their sum is the ``pods`` source of the app's
:class:`~router.service.peer_sum.PeerSum`.

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

Staleness bound: a snapshot carries its member's sequence number; a member whose sequence has
not moved for ``pods_stale_s`` (by the reader's clock: no clock sync needed) stops counting,
so a pod that dies, or is cut off, stops weighing on the replicas within that bound. A stream
reader catching up on a backlog (it was cut off) dates each snapshot back by its entry's age
relative to the stream's newest entry (Redis stamps both), so a member that died meanwhile
does not count again. A member stopping cleanly publishes an empty snapshot first. While
Redis is away every view ages out the same way (the pod then routes on its own load and the
engines' reports) and the exchange resumes by itself when Redis answers again (a restarted,
empty Redis included).

A snapshot also carries the member's speculative index entries and session bindings made
since its previous one, and its withdrawals of those its replicas refused
(router/service/pod_share.py: same message, ``x`` / ``i`` / ``w`` fields; a pending
dispatch or withdrawal makes a message due); a reader drops, and counts, a message over
``MAX_MESSAGE_BYTES`` or one it cannot parse.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.core.load import LoadTracker, PeerLoad
from router.core.types import ReplicaKey
from router.service.keys import SETTINGS, STATE, WORKERS
from router.service.load_share import own_load, parse_load
from router.service.peer_sum import PEER_SUM, PeerSum, peer_sum, summed
from router.service.pod_share import FIELDS, MAX_MESSAGE_BYTES, PodShare
from router.service.workers import Workers
from router.store.schema import POD_TAG
from router.tasks import running, stop_all

_log = logging.getLogger(__name__)
SOURCE = "pods"
MODES = ("off", "stream", "hash")
STREAM_MAXLEN = 2000
READ_COUNT = 1000  # stream entries one XREAD returns at most
HASH_FORGET_S = 60.0  # a hash field unchanged this long is deleted (its member is gone)
GONE_MAX = 4096  # members remembered as gone (PodViews.gone)
_BLOCK_MS = 250


@dataclass(slots=True, frozen=True)
class Snapshot:
    """One member's own load at one moment (``seq`` grows with every snapshot it sends)."""

    member: str
    pod: str
    seq: int
    load: dict[ReplicaKey, PeerLoad]
    # the message's shared fields (router/service/pod_share.py FIELDS: rows, their ids,
    # withdrawals), unchecked; None: none
    shared: dict[str, object] | None = None
    # the sender's pod instance (``n``: shared by the worker processes of one pod, new at
    # every start); None: a sender that does not say (an earlier version)
    instance: str | None = None

    @property
    def sender(self) -> str:
        """Who sent it: its member, and its pod instance when it names one. Two pods
        configured with one ``pod_name`` may send as the same member (the same pids): every
        other pod counts each of them, not whichever spoke last."""
        return self.member if self.instance is None else f"{self.member}#{self.instance}"


def encode(
    member: str,
    pod: str,
    seq: int,
    load: LoadTracker,
    shared: Mapping[str, Any] | None = None,
    instance: str | None = None,
) -> bytes:
    """A snapshot: ``shared`` is ``Outbox.take``'s fields (router/service/pod_share.py),
    ``instance`` the sender's pod instance (:func:`pod_instance`)."""
    body: dict[str, Any] = own_load(load)
    body.update(m=member, p=pod, s=seq)
    if instance is not None:
        body["n"] = instance
    if shared:
        body.update(shared)
    return json.dumps(body, separators=(",", ":")).encode()


def decode(data: bytes) -> Snapshot:
    """A snapshot from Redis; raises ValueError for anything else."""
    doc = json.loads(data)
    if not isinstance(doc, dict):
        raise ValueError("expected an object")
    member, pod, seq = doc.get("m"), doc.get("p"), doc.get("s")
    if not isinstance(member, str) or not isinstance(pod, str) or type(seq) is not int:
        raise ValueError("snapshot without m / p / s")
    shared = {k: doc[k] for k in FIELDS if k in doc}
    instance = doc.get("n")
    if instance is not None and not isinstance(instance, str):
        raise ValueError("snapshot with a non-string n")
    return Snapshot(member, pod, seq, parse_load(data), shared or None, instance)


def pod_instance(workers: Workers | None) -> str:
    """This pod's instance: the same for all its worker processes (derived from their
    private control directory, random per start), random per process without workers. A
    member's name (``<pod>/<pid>``) alone does not tell a namesake pod apart: two containers
    of one image number their processes alike."""
    if workers is None:
        return os.urandom(8).hex()
    return hashlib.blake2b(workers.directory.encode(), digest_size=8).hexdigest()


@dataclass(slots=True)
class _View:
    member: str
    pod: str
    seq: int
    moved_at: float  # reader's clock when ``seq`` last changed
    load: dict[ReplicaKey, PeerLoad]
    graced: bool = False  # ``moved_at`` moved to a stream gap's end (PodViews.lost)


@dataclass(slots=True)
class PodViews:
    """The latest snapshot of every member of the other pods, and when each last moved,
    by sender (:attr:`Snapshot.sender`). No I/O, no clock: ``now`` comes in."""

    pod: str
    stale_s: float
    views: dict[str, _View] = field(default_factory=dict)
    # senders dropped as stale, their last view; the same seq read again (a dead member's
    # hash field, re-read every poll) is no sign of life
    gone: dict[str, _View] = field(default_factory=dict)

    def take(self, snap: Snapshot, now: float, dated: bool = True) -> None:
        """Take ``snap``, read at ``now``. ``dated``: the read can tell when a new seq was
        sent (hash mode: the previous poll was within the bound); if not, a sender not
        counted now is taken as gone at this seq, and counts once it moves again."""
        if snap.pod == self.pod:
            return
        sender = snap.sender
        old = self.views.get(sender)
        if old is None:
            dead = self.gone.get(sender)
            if dead is not None and dead.seq == snap.seq:
                return
            if not dated:
                self.gone[sender] = _View(snap.member, snap.pod, snap.seq, now, snap.load)
                return
            self.gone.pop(sender, None)
        if old is None or old.seq != snap.seq:
            self.views[sender] = _View(snap.member, snap.pod, snap.seq, now, snap.load)

    def expire(self, now: float) -> bool:
        """Drop the senders silent past ``stale_s``; whether any was dropped."""
        stale = [m for m, v in self.views.items() if now - v.moved_at > self.stale_s]
        for sender in stale:
            self.gone[sender] = self.views.pop(sender)
        if len(self.gone) > GONE_MAX:  # oldest first (insertion order): bounded memory
            for member in list(self.gone)[: len(self.gone) - GONE_MAX]:
                del self.gone[member]
        return bool(stale)

    def lost(self, since: float, until: float) -> None:
        """Whatever was sent between ``since`` and ``until`` (reader's clock) may be lost (a
        stream reader that fell behind the trim). A sender counting at ``since``, dropped
        since or not, counts as if it had spoken at ``until``: one bound from the gap, once
        per seq (a member never heard again still stops counting, however many gaps follow).
        A loss longer than the bound is an outage, not a lag: no sender is assumed alive
        through it (each counts again from its next snapshot, as after an outage)."""
        if until - since > self.stale_s:
            return
        for sender, v in list(self.gone.items()):
            if not v.graced and v.moved_at + self.stale_s >= since and sender not in self.views:
                self.views[sender] = self.gone.pop(sender)
        for v in self.views.values():
            if not v.graced and v.moved_at + self.stale_s >= since and v.moved_at < until:
                v.moved_at = until
                v.graced = True

    def keep_only(self, fields: set[str]) -> None:
        """Forget every sender whose field is not in ``fields`` (hash mode: the fields
        present; a field is its sender, or its member for a sender of an earlier version)."""
        for sender in [k for k, v in self.views.items() if not {k, v.member} & fields]:
            del self.views[sender]
        for sender in [k for k, g in self.gone.items() if not {k, g.member} & fields]:
            del self.gone[sender]

    def total(self, now: float) -> dict[ReplicaKey, PeerLoad]:
        """What the live members have in flight, per replica (stale ones dropped first)."""
        self.expire(now)
        return summed(v.load for v in self.views.values())

    def ages(self, now: float) -> dict[str, float]:
        """Per other pod, the age of its freshest member's view (seconds)."""
        out: dict[str, float] = {}
        for v in self.views.values():
            age = now - v.moved_at
            out[v.pod] = min(age, out.get(v.pod, age))
        return out


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
        """The last snapshot never got through: its load goes again at the next check, its
        shared rows and withdrawals in the next message (router/service/pod_share.py)."""
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
            except Exception:
                self._unsent()
                raise

    async def read_stream(self) -> None:
        """Stream mode: wait (up to 250 ms) for the next snapshots and take them."""
        key = self.settings.stream_key
        cursor = self._last_id
        got = await self.client.xread({key: cursor}, count=READ_COUNT, block=_BLOCK_MS)
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
        except Exception:
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
        if now - self._forgotten_at > HASH_FORGET_S:
            self._forgotten_at = now
            await self._forget_gone(key, now)

    async def _forget_gone(self, key: str, now: float) -> None:
        """Delete hash fields of senders gone for ``HASH_FORGET_S`` (seen unmoving so long):
        each one's field, or its member's for an earlier version (not one a live sender
        writes now)."""
        live = {*self.views.views, *(v.member for v in self.views.views.values())}
        gone = {
            name
            for sender, g in self.views.gone.items()
            if now - g.moved_at > HASH_FORGET_S
            for name in (sender, g.member)
        }
        if gone - live:
            await self.client.hdel(key, *sorted(gone - live))

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
            self._apply_shared(self.share, snap, now, age_s)
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

    def _apply_shared(self, share: PodShare, snap: Snapshot, now: float, age_s: float) -> None:
        """Another member's rows, each message's once (a hash re-read shows the same seq
        again; this member's own stream entries come back to it too)."""
        sender = snap.sender  # namesakes' seqs may coincide
        seen = self._applied.get(sender)
        if seen == snap.seq:
            return
        if len(self._applied) > 4096:
            self._applied.clear()
        self._applied[sender] = snap.seq
        # a hash field read for the first time may have sat there for long (its member
        # dead, up to HASH_FORGET_S): its rows' TTLs are no longer what they say; a stream
        # reader reads only entries appended after it started
        if seen is None and self.settings.mode == "hash":
            return
        share.apply(snap.shared, now, age_s, snap.member)

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


class _ExchangeCollector(Collector):
    def __init__(self, exchange: PodExchange) -> None:
        self.exchange = exchange

    def collect(self) -> Iterable[Metric]:
        ex = self.exchange
        age = GaugeMetricFamily(
            "kvrouter_peer_view_age_seconds",
            "Age of the freshest load snapshot of another router pod (pods_exchange); a view "
            "older than pods_stale_s is dropped",
            labels=["peer"],
        )
        for pod, seconds in sorted(ex.views.ages(ex.clock()).items()):
            age.add_metric([pod], seconds)
        views = GaugeMetricFamily(
            "kvrouter_peer_views", "Members of other router pods whose load this one counts"
        )
        views.add_metric([], len(ex.views.views))
        c = ex.counters
        snaps = CounterMetricFamily(
            "kvrouter_pod_exchange_snapshots",
            "Load snapshots sent to / received from Redis (pods_exchange)",
            labels=["direction"],
        )
        snaps.add_metric(["sent"], c.sent)
        snaps.add_metric(["received"], c.received)
        nbytes = CounterMetricFamily(
            "kvrouter_pod_exchange_bytes",
            "Bytes of load snapshots sent to / received from Redis",
            labels=["direction"],
        )
        nbytes.add_metric(["sent"], c.bytes_sent)
        nbytes.add_metric(["received"], c.bytes_received)
        errors = CounterMetricFamily(
            "kvrouter_pod_exchange_errors", "Failed Redis calls of the pod load exchange"
        )
        errors.add_metric([], c.errors)
        up = GaugeMetricFamily(
            "kvrouter_pod_exchange_redis_up",
            "1 while the pods exchange's Redis calls succeed, 0 while Redis is unreachable or "
            "refuses its writes or its reads",
        )
        up.add_metric([], 0.0 if c.failing else 1.0)
        rejected = CounterMetricFamily(
            "kvrouter_pod_exchange_rejected",
            "Messages (or their shared rows) of other members ignored: too large or malformed",
        )
        rejected.add_metric([], c.rejected + (ex.share.counters.rejected if ex.share else 0))
        clashes = CounterMetricFamily(
            "kvrouter_pod_exchange_name_clashes",
            "Live members of another pod that uses this pod's name (each ignores the other)",
        )
        clashes.add_metric([], c.name_clashes)
        gaps = CounterMetricFamily(
            "kvrouter_pod_exchange_gaps",
            "Stream reads that found entries trimmed unread past the last one read (the "
            "reader fell behind by more than the stream keeps)",
        )
        gaps.add_metric([], c.gaps)
        yield from (age, views, snaps, nbytes, errors, up, rejected, clashes, gaps)
        if ex.share is not None:
            shared = CounterMetricFamily(
                "kvrouter_pod_exchange_shared",
                "Speculative entries / session bindings of other members applied here, those "
                "taken back since (withdrawn), and own dispatches or withdrawals dropped "
                "unsent (outbox full)",
                labels=["kind"],
            )
            shared.add_metric(["speculative"], ex.share.counters.applied_spec)
            shared.add_metric(["session"], ex.share.counters.applied_sessions)
            shared.add_metric(["withdrawn"], ex.share.counters.withdrawn)
            shared.add_metric(["dropped"], ex.share.outbox.dropped)
            yield shared


def pod_name(configured: str | None, port: int) -> str:
    """``server.pod_name``, else ``<hostname>:<port>`` (unique per pod, and per router
    process when several run on one host)."""
    return configured or f"{socket.gethostname()}:{port}"


def pod_exchange_ctx(app: web.Application) -> Callable[[web.Application], AsyncIterator[None]]:
    """A ``cleanup_ctx`` running this process's exchange while ``app`` (not started yet)
    runs; with ``server.redis_url`` and ``server.pods_exchange`` other than ``off``."""
    peer_sum(app)

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        from router.store.redis_store import connect

        s = app[SETTINGS].server
        state = app[STATE]
        settings = ExchangeSettings(
            s.pods_exchange,
            s.redis_key_prefix,
            pod_name(s.pod_name, s.port),
            s.pods_exchange_interval_s,
            s.pods_stale_s,
        )
        client = connect(s.redis_url or "", socket_timeout=max(2.0, 2 * _BLOCK_MS / 1000))
        loop = asyncio.get_running_loop()
        share = PodShare(
            state.engines,
            lambda model, key: key in state.registry.keys_for(model),
            lambda model: max(state.speculative_ttl.get(model, (0.0, 0.0))),
        )
        share.attach()
        exchange = PodExchange(
            settings, client, state.load, app[PEER_SUM], loop.time, share, app.get(WORKERS)
        )
        collector = _ExchangeCollector(exchange)
        state.metrics.registry.register(collector)
        _log.info(
            "pod load exchange: %s as %s every %g s (stale after %g s)",
            settings.mode,
            exchange.member,
            settings.interval_s,
            settings.stale_s,
        )
        try:
            async with running(exchange.run(), name=f"pod-exchange-{os.getpid()}"):
                yield
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(exchange.leave(), 1.0)
        finally:
            state.metrics.registry.unregister(collector)
            with contextlib.suppress(Exception):
                await client.aclose()

    return ctx
