"""``IndexSync``: keeps a router's local ``PrefixIndex`` equal to the shared store.

Start: take the change cursor, then read every registered replica's snapshot (so nothing
committed before the cursor is missed), apply them, and set ``ready``. Then follow the
change stream from the cursor, in one task that owns all index mutations:

* a batch whose ``seq`` was already applied is skipped; one that skips ahead (a gap: the
  stream was trimmed past us, or an entry was malformed) resyncs that replica key from its
  snapshot; a reset entry resyncs it too, unless the key was resynced since the read that
  brought the entry (that snapshot already holds it);
* every ``audit_interval_s`` the leases are checked: a replica whose lease expired is purged
  from the index (and the listener told) and, with ``reap_expired``, its keys are deleted
  from the store (atomically against the lease coming back); a registered replica we do not
  know is loaded (or reaped when its lease is gone: it died before we knew it), one whose
  registration changed unseen (its ReplicaUp trimmed from the stream) is adopted as a
  ReplicaUp would be; a new store instance token (Redis lost its data) or a new stored
  stream shard count (``IndexStore.settle_shards``, also followed at bootstrap) triggers a
  full re-bootstrap. Replicas without a live lease are skipped at bootstrap.
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
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from router.core.index import PrefixIndex
from router.core.load import EngineReport, LoadTracker
from router.core.types import ApplyOutcome, EventBatch, ReplicaKey
from router.store.base import (
    BatchChange,
    Change,
    IndexStore,
    LoadChange,
    LoadSample,
    ReplicaDown,
    ReplicaInfo,
    ReplicaUp,
    ResetChange,
    UnreadableSnapshot,
)
from router.store.load_gate import LoadGate, latest_loads

log = logging.getLogger(__name__)

UNREADABLE_RETRY_MAX_S = 60.0
"""The longest wait before reading again a key whose stored state did not parse."""

AUDIT_RETRY_MAX_S = 30.0
"""The longest wait before auditing again after audits that failed."""


class SyncListener(Protocol):
    """Told about fleet membership and load as the follower learns them."""

    def replica_up(self, info: ReplicaInfo) -> None: ...

    def replica_down(self, replica: str, keys: Sequence[ReplicaKey]) -> None: ...

    def load(self, key: ReplicaKey, sample: LoadSample, now: float) -> None:
        """``now``: when the sample was taken, by the follower's ``clock``."""
        ...


class NullListener:
    def replica_up(self, info: ReplicaInfo) -> None:
        return None

    def replica_down(self, replica: str, keys: Sequence[ReplicaKey]) -> None:
        return None

    def load(self, key: ReplicaKey, sample: LoadSample, now: float) -> None:
        return None


class LoadTrackerListener:
    """Feeds a ``LoadTracker``: replicas appear/disappear, engine reports stamped ``now``."""

    def __init__(self, load: LoadTracker) -> None:
        self.tracker = load

    def replica_up(self, info: ReplicaInfo) -> None:
        for key in info.replica_keys():
            self.tracker.add_replica(key)

    def replica_down(self, replica: str, keys: Sequence[ReplicaKey]) -> None:
        for key in keys:
            self.tracker.remove_replica(key)

    def load(self, key: ReplicaKey, sample: LoadSample, now: float) -> None:
        report = EngineReport(sample.running, sample.waiting, sample.kv_usage, now)
        self.tracker.engine_report(key, report)


@dataclass(slots=True)
class SyncStats:
    bootstraps: int = 0
    batches: int = 0
    duplicates: int = 0
    gaps: int = 0
    resyncs: int = 0
    purges: int = 0
    malformed: int = 0
    errors: int = 0
    entries_loaded: int = 0
    stale: int = 0  # keys found behind (or ahead of) a store that stood still: resynced
    kept_on_data_loss: int = 0  # replicas kept through a store's data loss (grace)
    downs_ignored: int = 0  # ReplicaDown entries of a replica whose lease lives: ignored
    orphans_reaped: int = 0  # replicas whose state outlived them, deleted by the sweep
    streams_reset: int = 0  # change streams found behind the cursor (lost): re-bootstrapped
    unreadable: int = 0  # snapshot reads of registered keys whose state did not parse
    loads_stale: int = 0  # load entries older than the key's last, or than load_max_age_s


class IndexSync:
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
        self.listener: SyncListener = listener or NullListener()
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
        self.infos: dict[str, ReplicaInfo] = {}
        # replicas kept through a store's data loss -> monotonic deadline to re-register by
        self._grace: dict[str, float] = {}
        # replicas this read's changes named that the registry does not hold alive: asked
        # once a read, not once an entry (a dead replica's backlog would re-read the whole
        # registry for each of its entries)
        self._not_alive: set[str] = set()
        self.stats = SyncStats()
        # the last turn reached the store (False from start until the bootstrap succeeds,
        # and while the store fails: the index then serves its last known content)
        self.up = False
        self._failed = False  # a turn failed since the last that reached the store
        # change-stream shards the last read could not reach (their cluster node down)
        self.shards_down: frozenset[str] = frozenset()
        self._audit_wait = 0.0  # the wait after the last audit, while audits fail
        self._outage_grace_until = 0.0  # (monotonic) see ``_after_outage``
        self.ready = asyncio.Event()
        self._cursor: object = None
        # Changes read and not yet handled, with the cursor of their read: a failure in the
        # middle of a read (the store unreachable during a resync) leaves the rest here for
        # the next turn, never skipped.
        self._backlog: deque[tuple[Change, object]] = deque()
        # Keys whose state must be read again: added before a resync's read, removed once it
        # applied; retried each turn until it succeeds (an applied gap batch is a duplicate
        # when handled again, so only this remembers that its resync is owed).
        self._owed: set[ReplicaKey] = set()
        # Keys resynced since the last read of the change streams: every entry handled now
        # was read before that snapshot, which holds it (a reset entry of such a key is no
        # reason to read its whole state again)
        self._fresh: set[ReplicaKey] = set()
        # keys whose last snapshot read did not parse (``_resync``) -> (monotonic time of the
        # next read, the wait before it): such a read succeeds with the key's whole state,
        # so it is retried with a backoff, not each turn; logged once per replica
        self._unreadable: dict[ReplicaKey, tuple[float, float]] = {}
        # each key's stored seq at the last audit (see ``_check_seqs``)
        self._audited_seqs: dict[ReplicaKey, int | None] = {}
        # the last read of the change streams returned less than ``read_count`` entries:
        # nothing written before it is still unread (see ``_check_seqs``)
        self._caught_up = False
        self._token: str | None = None
        self._streams_lost = False  # a change stream went back: bootstrap as after data loss
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

    async def _audit_logged(self) -> bool:
        """``audit``; one that fails is logged and counted, and the follower reads on (the
        replicas it could not check are kept as through an outage: ``_failed``)."""
        try:
            need_bootstrap = await self.audit()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._stopping:
                return False
            self._failed = True
            self.stats.errors += 1
            wait = min(max(self._audit_wait * 2, self.audit_interval_s), AUDIT_RETRY_MAX_S)
            self._audit_wait = wait
            self._next_audit = time.monotonic() + wait
            log.warning(
                "index sync: audit failed (%s: %s); reading on, audited again in %.1fs",
                type(exc).__name__,
                exc,
                wait,
            )
            return False
        self._audit_wait = 0.0
        return need_bootstrap

    def streams(self) -> list[str]:
        """The change streams the cursor follows (none for a store whose cursor names no
        streams, as the in-memory store's)."""
        return sorted(self._cursor) if isinstance(self._cursor, Mapping) else []

    def _after_outage(self) -> None:
        """The store answers again after failing: a lease that lapsed meanwhile may have
        lapsed only because its publisher could not reach the store either (Redis down,
        paused or cut off for longer than the lease TTL, and back with its data: no new
        instance token). Lapsed leases get the data-loss grace from now, so that the first
        audit does not purge the fleet while the publishers register again."""
        self._outage_grace_until = time.monotonic() + self.lost_store_grace_s

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

    async def audit(self) -> bool:
        """Lease and membership check. Returns True when a full re-bootstrap is needed."""
        self._next_audit = time.monotonic() + self.audit_interval_s
        if await self.store.instance_token() != self._token:
            log.warning("index sync: store instance changed (data lost?); re-bootstrapping")
            return True
        if await self.store.settle_shards():
            # the cursor names the old count's streams; publishers move to the new ones at
            # their next heartbeat and republish there in full
            log.warning("index sync: stream shard count changed; re-bootstrapping")
            return True
        if behind := await self.store.streams_behind(self._cursor):
            # its node lost it (the instance token lives on another): read on from the
            # cursor, the stream would show nothing until its new ids passed it
            log.warning(
                "index sync: change stream(s) %s went back (data lost?); re-bootstrapping",
                ", ".join(behind),
            )
            self.stats.streams_reset += 1
            self._streams_lost = True
            return True
        alive = await self.store.leases(list(self.infos))
        registered = await self.store.list_replicas()
        stored = {info.replica for info in registered}
        purged: set[str] = set()
        now = time.monotonic()
        for name, ok in alive.items():
            if ok:
                self._grace.pop(name, None)
                continue
            if name not in self._grace and name not in stored:
                # lease and registration gone together, and no ReplicaDown read: the store
                # lost the replica's keys (a cluster node restarted empty or failed over to
                # a replica that lacked them; the instance token lives on another node), or
                # a deregistration whose Down is on its way. Its publisher registers again
                # at its next heartbeat: the grace of a data loss, as for a new token.
                log.warning("index sync: %s vanished from the store (data lost?); keeping it", name)
                self._grace[name] = now + self.lost_store_grace_s
                self.stats.kept_on_data_loss += 1
            if self._grace.get(name, now) > now or now < self._outage_grace_until:
                continue  # the store lost it, or was away; its publisher has until then to
                # register again
            log.info("index sync: lease of %s expired; purging it", name)
            self._purge(name)
            purged.add(name)
            if self.reap_expired:
                await self._reap(name)
        registered = [i for i in registered if i.replica not in purged]  # reaped just now
        for info in registered:
            known = self.infos.get(info.replica)
            if known is not None and known != info:  # its ReplicaUp was trimmed past us
                log.info("index sync: %s registered again unseen; adopting it", info.replica)
                await self._up(info)
        fresh = [i for i in registered if i.replica not in self.infos]
        if fresh:
            alive = await self.store.leases([i.replica for i in fresh])
            for info in fresh:
                if alive.get(info.replica):
                    self._adopt(info)
                    await self._resync(info.replica_keys())
                elif self.reap_expired:  # died before this router knew it: nobody else will
                    await self._reap(info.replica)
        await self._check_seqs()
        if self.reap_expired and now >= self._next_sweep:
            self._next_sweep = now + self.orphan_sweep_s
            await self._sweep_orphans()
        return False

    async def _reap(self, name: str) -> bool:
        """Delete a dead replica's state, best effort: an error (a full Redis refuses the
        ReplicaDown entry after the keys went) is logged, not an outage of the store; the
        replica is already out of this index, and its registry entry makes the next audit
        try again."""
        try:
            return await self.store.reap(name)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("index sync: reaping %s failed: %s: %s", name, type(exc).__name__, exc)
            return False

    async def _sweep_orphans(self) -> None:
        """Delete the state of replicas that outlived them (``IndexStore.orphans``): a
        publisher that stalled past its lease can flush once more after the replica was
        reaped, and if it then dies nothing would ever delete that."""
        for name in await self.store.orphans():
            if name not in self.infos and await self._reap(name):
                self.stats.orphans_reaped += 1
                log.info("index sync: deleted the orphaned state of %s", name)

    async def _check_seqs(self) -> None:
        """Resync every key whose seq in the index differs from the store's where the store's
        has not moved for a whole audit interval: the change stream then has nothing more on
        the way, so what the index lacks was lost to it (the stream trimmed past this
        router's cursor while it lagged, its last batches with it; an idle replica sends
        nothing later that would show the gap), or the store went back (restored from a
        snapshot): the store is what every other router reads. A key the index holds no
        seq of (read while its replica was not registered) counts as differing; one whose
        stored state does not parse is left to its own backoff (``_settle_owed``).

        A key whose replica keeps writing is resynced too when the index has not reached, in
        a whole audit interval and with every stream read to its end, the seq the store held
        at the audit before: its entries do not reach this router (dropped: unsigned, or
        signed with another key, while signing rolls out), and no later batch shows a gap.
        So is a key the index holds a later seq of than the store held at this audit and
        the one before (a new publisher numbers below the old one, its reset entry missed:
        every later batch is taken for a duplicate; a store that went back, its publisher
        not republished within an audit)."""
        keys = [k for info in self.infos.values() for k in info.replica_keys()]
        stored = await self.store.stored_seqs(keys) if keys else []
        before, now = self._audited_seqs, dict(zip(keys, stored, strict=True))
        self._audited_seqs = now

        def lags(key: ReplicaKey, seq: int) -> bool:
            last, then = self.index.last_seq(key), before.get(key)
            if last == seq:
                return False
            if then == seq:  # the store stood still
                return True
            if last is not None and last > seq and then is not None and last > then:
                # ahead of the store at two audits (a state is committed before its entry is
                # appended: it cannot lead, but for a moment after the store went back)
                return True
            return self._caught_up and then is not None and (last is None or last < then)

        behind = [
            key
            for key, seq in now.items()
            if seq is not None and key not in self._unreadable and lags(key, seq)
        ]
        if behind:
            log.warning("index sync: %d replica key(s) behind the store; resyncing", len(behind))
            self.stats.stale += len(behind)
            await self._resync(behind)

    # ------------------------------------------------------------------ changes

    def _registered(self, key: ReplicaKey) -> bool:
        """``key`` is a DP rank of a replica as this router knows it registered."""
        info = self.infos.get(key.replica)
        return info is not None and key.dp_rank in info.dp_ranks

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

    async def _learn(self, replica: str) -> None:
        """A replica we have not seen registered: load its info and state if it is alive
        (asked once a read: ``_not_alive``)."""
        if replica in self._not_alive:
            return
        infos = {i.replica: i for i in await self.store.list_replicas()}
        info = infos.get(replica)
        if info is None or not (await self.store.leases([replica])).get(replica):
            self._not_alive.add(replica)
            return
        self._adopt(info)
        await self._resync(info.replica_keys())

    async def _up(self, info: ReplicaInfo) -> None:
        """A registration, new or changed: adopt it; read the state of a replica not known
        before, or of every key when its DP ranks changed."""
        known = self.infos.get(info.replica)
        self._adopt(info)
        if known is None or known.dp_ranks != info.dp_ranks:
            await self._resync(info.replica_keys())

    def _adopt(self, info: ReplicaInfo) -> None:
        self._grace.pop(info.replica, None)
        self._not_alive.discard(info.replica)
        old = self.infos.get(info.replica)
        self.infos[info.replica] = info
        if old is not None:
            for key in old.replica_keys():
                if key.dp_rank not in info.dp_ranks:
                    self.index.remove_replica(key)
                    self._forget_lag(key)
                    self._unreadable.pop(key, None)
        for key in info.replica_keys():
            self.index.add_replica(key)
        self.listener.replica_up(info)

    def _purge(self, replica: str) -> None:
        self._grace.pop(replica, None)
        info = self.infos.pop(replica, None)
        keys = info.replica_keys() if info else []
        for key in keys:
            self.index.remove_replica(key)
            self._forget_lag(key)
        self._unreadable = {k: v for k, v in self._unreadable.items() if k.replica != replica}
        self.stats.purges += 1
        self.listener.replica_down(replica, keys)

    def _forget_lag(self, key: ReplicaKey) -> None:
        self.loads.forget(key)
        if self.event_lag is not None:
            self.event_lag.pop(str(key), None)

    async def _settle_owed(self) -> None:
        """Resync the registered replicas owed one. A read that fails leaves them owed (tried
        again next turn) without stopping the follower: every other replica's changes are
        read meanwhile (a snapshot on a Cluster slot mid-migration can fail for a while)."""
        now = time.monotonic()
        waiting = {k for k in self._owed if self._unreadable.get(k, (0.0, 0.0))[0] > now}
        known = sorted(k for k in self._owed - waiting if self._registered(k))
        self._owed = waiting
        if not known:
            return
        try:
            await self._resync(known)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._owed.update(known)
            self.stats.errors += 1
            log.warning(
                "index sync: resync of %s failed (%s: %s); reading the other replicas' "
                "changes, retried next turn",
                ", ".join(map(str, known)),
                type(exc).__name__,
                exc,
            )

    async def _resync(self, keys: Sequence[ReplicaKey]) -> None:
        """Replace each key's content in the index with its stored snapshot. A key whose
        stored state does not parse keeps what the index holds and stays owed: read again
        each turn (``_settle_owed``) as after a failing read, but after a wait that doubles
        from ``unreadable_retry_s`` up to ``UNREADABLE_RETRY_MAX_S``."""
        self._owed.update(keys)
        snaps = await self.store.read_replicas(keys)
        for key, snap in zip(keys, snaps, strict=True):
            if isinstance(snap, UnreadableSnapshot):
                self._note_unreadable(snap)
                continue
            self._owed.discard(key)
            self._fresh.add(key)
            if self._unreadable.pop(key, None) is not None:
                log.info("index sync: the stored state of %s reads again", key)
            self.stats.resyncs += 1
            self.index.clear_replica(key)
            self.index.reset_sequence(key)
            if snap is None:
                continue
            self.index.apply(EventBatch(key, snap.events(), snap.seq))
            self.stats.entries_loaded += snap.entries

    def _note_unreadable(self, snap: UnreadableSnapshot) -> None:
        self.stats.unreadable += 1
        replica = snap.key.replica
        if not any(k.replica == replica for k in self._unreadable):
            log.warning(
                "index sync: the stored state of %s does not parse (%s); keeping what the "
                "index knew of it, read again with a backoff",
                snap.key,
                snap.reason,
            )
        last = self._unreadable.get(snap.key)
        wait = self.unreadable_retry_s if last is None else last[1] * 2
        wait = min(wait, UNREADABLE_RETRY_MAX_S)
        self._unreadable[snap.key] = (time.monotonic() + wait, wait)
