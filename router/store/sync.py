"""``IndexSync``: keeps a router's local ``PrefixIndex`` equal to the shared store.

Start: take the change cursor, then read every registered replica's snapshot (so nothing
committed before the cursor is missed), apply them, and set ``ready``. Then follow the
change stream from the cursor, in one task that owns all index mutations:

* a batch whose ``seq`` was already applied is skipped; one that skips ahead (a gap: the
  stream was trimmed past us, or an entry was malformed) resyncs that replica key from its
  snapshot; a reset entry resyncs it too, unless the key was resynced since the read that
  brought the entry (that snapshot already holds it);
* every ``audit_interval_s`` the leases and registrations are checked against the store
  (router/store/lease_audit.py): expired leases purged (and reaped), registrations not seen
  adopted; a new store instance token (Redis lost its data) or a new stored stream shard
  count (``IndexStore.settle_shards``, also followed at bootstrap) triggers a full
  re-bootstrap. Replicas without a live lease are skipped at bootstrap.
* a ReplicaDown purges the replica only if its lease is gone: one whose publisher registered
  it again while it was being deleted (the Down lands after the new Up) stays; a ReplicaUp
  counts only while its lease lives (read late, after its publisher died, it is skipped).
* a store that lost its data does not end any replica's lease early: a replica known before
  and missing from the new store stays (index content, listener not told) for up to
  ``lost_store_grace_s`` (the publishers' default lease TTL) while its publisher notices at
  its next heartbeat and registers again; purged only if it has not by then. So does one
  whose lease lapsed while the store was unreachable (its publisher could not renew it), and
  one whose lease and registration vanished together with no ReplicaDown (a cluster node
  that restarted empty: the instance token is on another node).

Store errors (Redis down, restarting) are logged and retried with backoff; the index keeps
serving its last known content meanwhile. A read that reached only some change-stream shards
(a Redis Cluster node down: ``ChangeRead.unread``) is handled as any other: the shards on
the other nodes are followed on, the unread ones are named in ``shards_down`` (logged when
that changes) and read from their cursor once their node answers; their replicas keep their
last known content, as through an outage of the whole store, and when every shard reads
again lapsed leases get the outage grace (``_after_outage``). No audit runs while a shard is
down (it would stall the reads for as long as the client's retries on that node take, and
could not tell a dead replica from one on that node): as through an outage, nothing is
purged meanwhile. An audit that fails (a lease or registration on a node that is down) is
logged and counted and does not stop the reads; the next waits from ``audit_interval_s``
doubling up to ``AUDIT_RETRY_MAX_S`` while they fail. ``clock`` is the router's monotonic
clock, used to stamp load samples.

``event_lag`` (the service passes ``RouterState.event_lag_s``, exported as
``kvrouter_index_event_lag_seconds``): per replica key, set when a batch or reset entry is
applied to ``wall_clock()`` minus the entry's time, at least 0; removed when the replica is
purged. The change entries carry no timestamp of their own, but a Redis stream entry's ID is
``<ms>-<n>``, the Redis server's wall clock at ``XADD``: the time used is that of the newest
entry of the replica's stream shard in the same read (so a read that catches up on a backlog
can under-state the lag by up to the span of that read, at most ``read_count`` entries).
Stores whose cursor carries no time (the in-memory store) set nothing.

Load entries (``L``) say what a replica's load was when its publisher sampled it (the
sample's ``wall_ts``), not what it is when the router reads them: a read that catches up on
a backlog (the store was away, the router lagged) or an entry appended again (a signature
proves who wrote an entry, not when) brings old samples. Of a read, only each key's newest
sample is handled. A sample older than the one the router holds for its key is ignored;
one later than ``load_max_age_s`` is not applied at all (the router drops a report that old
anyway: ``LoadTracker.forget_stale_reports``); the others reach the listener stamped
``clock()`` less how late they are, so the policies' ``report_max_age_s`` judges them as
old as they are. How late compares the publisher's wall clock with ``wall_clock`` less the
offset the key's recent samples show (router/store/load_gate.py), so hosts
whose clocks disagree by a few seconds are not taken as stale. Both are counted
(``SyncStats.loads_stale``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, MutableMapping

from router.core.index import PrefixIndex
from router.core.types import ApplyOutcome, EventBatch, ReplicaKey
from router.store.base import (
    BatchChange,
    Change,
    IndexStore,
    LoadChange,
    LoadSample,
    ReplicaDown,
    ReplicaUp,
    ResetChange,
)
from router.store.lease_audit import LeaseAudit
from router.store.load_gate import LoadGate, latest_loads
from router.store.sync_listener import NullListener, SyncListener
from router.store.sync_stats import SyncStats

log = logging.getLogger(__name__)


class IndexSync(LeaseAudit):
    """Bootstrap-then-follow synchroniser; ``async with IndexSync(...)`` or start()/stop()."""

    def __init__(
        self,
        store: IndexStore,
        index: PrefixIndex,
        clock: Callable[[], float] = time.monotonic,
        listener: SyncListener | None = None,
        *,
        audit_interval_s: float = 1.0,
        block_s: float = 0.5,
        read_count: int = 1000,
        bootstrap_chunk: int = 16,
        reap_expired: bool = True,
        event_lag: MutableMapping[str, float] | None = None,
        wall_clock: Callable[[], float] = time.time,
        lost_store_grace_s: float = 10.0,
        orphan_sweep_s: float = 300.0,
        unreadable_retry_s: float = 1.0,
        load_max_age_s: float = 10.0,
    ) -> None:
        self.store = store
        self.index = index
        self.clock = clock
        self.listener = listener or NullListener()
        self.audit_interval_s = audit_interval_s
        self.block_s = block_s
        self.read_count = read_count
        self.bootstrap_chunk = bootstrap_chunk
        self.reap_expired = reap_expired
        self.event_lag = event_lag
        self.wall_clock = wall_clock
        self.lost_store_grace_s = lost_store_grace_s
        self.orphan_sweep_s = orphan_sweep_s
        self.unreadable_retry_s = unreadable_retry_s
        self.loads = LoadGate(load_max_age_s)
        self._next_sweep = 0.0
        self.infos = {}
        self._grace = {}  # see ``ReplicaMirror`` for this and the mirror's other state
        self._not_alive = set()
        self.stats = SyncStats()
        # the last turn reached the store (False from start until the bootstrap succeeds,
        # and while the store fails: the index then serves its last known content)
        self.up = False
        self._failed = False  # a turn failed since the last that reached the store
        # change-stream shards the last read could not reach (their cluster node down)
        self.shards_down: frozenset[str] = frozenset()
        self._audit_wait = 0.0
        self._outage_grace_until = 0.0
        self.ready = asyncio.Event()
        self._cursor = None
        # Changes read and not yet handled, with the cursor of their read: a failure in the
        # middle of a read (the store unreachable during a resync) leaves the rest here for
        # the next turn, never skipped.
        self._backlog: deque[tuple[Change, object]] = deque()
        self._owed = set()
        self._fresh = set()
        self._unreadable = {}
        self._audited_seqs = {}
        # the last read of the change streams returned less than ``read_count`` entries:
        # nothing written before it is still unread (see ``_check_seqs``)
        self._caught_up = False
        self._token = None  # the store's instance token as of the last bootstrap
        self._streams_lost = False
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._next_audit = 0.0

    # ------------------------------------------------------------------ lifecycle

    async def start(self, wait: bool = True) -> None:
        """Start following; with ``wait``, return once the bootstrap is done (retrying while
        the store is unreachable). Without it, watch ``ready``."""
        if self._task is not None:
            return
        self._task = asyncio.create_task(self._run(), name="kvrouter-index-sync")
        if not wait:
            return
        waiter = asyncio.ensure_future(self.ready.wait())
        done, _ = await asyncio.wait({waiter, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if self._task in done:
            waiter.cancel()
            self._task.result()  # re-raise a crash at start-up

    async def stop(self) -> None:
        """Let the loop finish its current read (at most ``block_s``), then cancel."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping = True
        try:
            await asyncio.wait_for(asyncio.shield(task), self.block_s + 2.0)
        except (TimeoutError, asyncio.CancelledError):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(task, 2.0)
        finally:
            self._stopping = False

    async def __aenter__(self) -> IndexSync:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ main loop

    async def _run(self) -> None:
        backoff = 0.05
        need_bootstrap = True
        while not self._stopping:
            try:
                if need_bootstrap:
                    await self.bootstrap()
                    need_bootstrap = False
                    self.ready.set()
                if self._owed:
                    await self._settle_owed()
                backlog = self._backlog
                read = await self.store.read_changes(self._cursor, self.block_s, self.read_count)
                self._fresh.clear()
                self._note_shards(frozenset(read.unread))
                if self._failed and not read.unread:
                    self._failed = False
                    self._after_outage()
                self._failed = self._failed or bool(read.unread)
                self.up = True
                self._cursor = read.cursor
                self._not_alive.clear()
                self.stats.malformed += read.malformed
                self._caught_up = len(read.changes) + read.malformed < self.read_count
                backlog.extend((change, read.cursor) for change in latest_loads(read.changes))
                while backlog:
                    change, cursor = backlog[0]
                    await self._handle(change, cursor)
                    backlog.popleft()
                if time.monotonic() >= self._next_audit and not self.shards_down:
                    need_bootstrap = await self._audit_logged()
                backoff = 0.05
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # store unreachable, restarting, ...: retry
                if self._stopping:
                    return
                self.up = False
                self._failed = True
                self.stats.errors += 1
                log.warning(
                    "index sync: %s: %s (retrying in %.2fs)", type(exc).__name__, exc, backoff
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    def _note_shards(self, down: frozenset[str]) -> None:
        if down == self.shards_down:
            return
        if down:
            log.warning(
                "index sync: change stream(s) %s unreachable; following the others",
                ", ".join(sorted(down)),
            )
        else:
            log.info("index sync: every change stream reads again")
        self.shards_down = down

    def streams(self) -> list[str]:
        """The change streams the cursor follows (none for a store whose cursor names no
        streams, as the in-memory store's)."""
        return sorted(self._cursor) if isinstance(self._cursor, Mapping) else []

    async def bootstrap(self) -> None:
        """Rebuild the index's view of every stored replica from the store. The store's
        instance token is taken as seen only once this succeeds: a re-bootstrap after a data
        loss that fails midway is retried as one after a data loss (its replicas keep their
        grace)."""
        token = await self.store.instance_token()
        lost = self._token is not None and (self._token != token or self._streams_lost)
        await self.store.settle_shards()  # before the cursor: it covers the stored count
        self._cursor = await self.store.cursor()
        self._backlog.clear()  # read before the new cursor: the snapshots below hold it
        self._owed.clear()
        listed = await self.store.list_replicas()
        alive = await self.store.leases([i.replica for i in listed])
        infos = {info.replica: info for info in listed if alive.get(info.replica)}
        deadline = time.monotonic() + self.lost_store_grace_s
        for name in [n for n in self.infos if n not in infos]:
            if lost and name not in self._grace:
                self._grace[name] = deadline
                self.stats.kept_on_data_loss += 1
            if name not in self._grace:
                self._purge(name)
        for info in infos.values():
            self._adopt(info)
        keys = [k for info in infos.values() for k in info.replica_keys()]
        for i in range(0, len(keys), self.bootstrap_chunk):
            await self._resync(keys[i : i + self.bootstrap_chunk])
            await asyncio.sleep(0)  # let the owner's other tasks run between chunks
        self._token = token
        self._streams_lost = False
        self.stats.bootstraps += 1
        self._next_audit = time.monotonic() + self.audit_interval_s

    # ------------------------------------------------------------------ changes

    async def _handle(self, change: Change, cursor: object = None) -> None:
        if isinstance(change, (BatchChange, ResetChange)) and not self._registered(change.key):
            if change.key.replica not in self.infos:
                await self._learn(change.key.replica)
            # else a rank the registration does not list (dropped, or added by a registration
            # not seen yet: its Up, or the audit, reads every rank's state then): the index
            # must not gain a key that no purge would remove
            return
        if isinstance(change, BatchChange):
            outcome = self.index.apply(EventBatch(change.key, change.events, change.seq))
            if outcome is ApplyOutcome.DUPLICATE:
                self.stats.duplicates += 1
                return
            if outcome is ApplyOutcome.GAP:
                self.stats.gaps += 1
                await self._resync([change.key])
            else:
                self.stats.batches += 1
            self._note_lag(change.key, cursor)
        elif isinstance(change, ResetChange):
            if change.key in self._fresh:
                self.stats.duplicates += 1
            else:
                await self._resync([change.key])
            self._note_lag(change.key, cursor)
        elif isinstance(change, LoadChange):
            if self._registered(change.key):
                self._load(change.key, change.sample)
        elif isinstance(change, ReplicaUp):
            # The entry says the registration changed; what it is, the store says: a
            # signature proves who wrote an entry, not when, and an old one appended again
            # (by a publisher sharing the stream shard) must not bring back the address and
            # DP ranks it carries. The store's is as new as any entry read before it.
            name = change.info.replica
            info = await self.store.registration(name)
            if info is None or not (await self.store.leases([name])).get(name):
                # its publisher died before we read it (we lagged, or the store was away):
                # no address to route to; the audit purges what we knew of it
                return
            await self._up(info)
        elif isinstance(change, ReplicaDown):
            if (await self.store.leases([change.replica])).get(change.replica):
                # registered again after the deletion this announces (a publisher restarted
                # as the old one's keys went): the newer Up came or is on its way
                self.stats.downs_ignored += 1
                return
            self._purge(change.replica)

    def _load(self, key: ReplicaKey, sample: LoadSample) -> None:
        """Pass a load sample on stamped with its age, unless it is older than the key's
        last or than ``load_max_age_s`` (module docstring)."""
        taken = self.loads.admit(key, sample, self.clock(), self.wall_clock())
        if taken is None:
            self.stats.loads_stale += 1
            return
        self.listener.load(key, sample, taken)

    def _note_lag(self, key: ReplicaKey, cursor: object) -> None:
        if self.event_lag is None:
            return
        at = self._entry_time(cursor, key.replica)
        if at is not None:
            self.event_lag[str(key)] = max(0.0, self.wall_clock() - at)

    def _entry_time(self, cursor: object, replica: str) -> float | None:
        """Wall-clock time (s) of the newest entry read from ``replica``'s stream shard, from
        a Redis cursor (stream -> last entry ID ``<ms>-<n>``); None without one."""
        schema = getattr(self.store, "schema", None)
        if not isinstance(cursor, Mapping) or schema is None:
            return None
        entry_id = cursor.get(schema.stream(schema.shard_of(replica)))
        if isinstance(entry_id, bytes):
            entry_id = entry_id.decode("ascii", "replace")
        if not isinstance(entry_id, str):
            return None
        ms, _, _ = entry_id.partition("-")
        try:
            at = int(ms) / 1000.0
        except ValueError:
            return None
        return at if at > 0 else None
