"""``ReplicaMirror``: the index's copy of the registered replicas, the part of ``IndexSync``
(router/store/sync.py) that the change handling and the lease audit share.

Membership: ``_adopt`` takes a registration (its DP ranks' keys added to the index, those of
ranks it dropped removed, the listener told), ``_purge`` drops a replica (its keys removed,
the listener told), ``_up`` adopts a new or changed registration and reads the state that
needs reading, and ``_learn`` loads a replica a change entry names before its registration
was seen, if its lease lives. State: ``_resync`` replaces keys' content in the index with
their stored snapshots. A key is owed a resync from before its read until it applied
(``_owed``: one whose read failed is retried each turn by ``_settle_owed``), and a key whose
stored state does not parse is read again after a backoff (``_unreadable``).

A mixin, as ``RedisWrites`` is one of ``RedisStore``: it declares the state it works on,
which ``IndexSync.__init__`` sets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import MutableMapping, Sequence

from router.core.index import PrefixIndex
from router.core.types import EventBatch, ReplicaKey
from router.store.base import IndexStore, ReplicaInfo, UnreadableSnapshot
from router.store.load_gate import LoadGate
from router.store.sync_listener import SyncListener
from router.store.sync_stats import SyncStats

# the follower's one logger (router/store/sync.py), whichever of its parts logs
log = logging.getLogger("router.store.sync")

UNREADABLE_RETRY_MAX_S = 60.0
"""The longest wait before reading again a key whose stored state did not parse."""


class ReplicaMirror:
    """The registered replicas as the index holds them (module docstring)."""

    store: IndexStore
    index: PrefixIndex
    listener: SyncListener
    event_lag: MutableMapping[str, float] | None
    unreadable_retry_s: float
    loads: LoadGate
    stats: SyncStats
    infos: dict[str, ReplicaInfo]
    # replicas kept through a store's data loss -> monotonic deadline to re-register by
    _grace: dict[str, float]
    # replicas this read's changes named that the registry does not hold alive: asked
    # once a read, not once an entry (a dead replica's backlog would re-read the whole
    # registry for each of its entries)
    _not_alive: set[str]
    # Keys whose state must be read again: added before a resync's read, removed once it
    # applied; retried each turn until it succeeds (an applied gap batch is a duplicate
    # when handled again, so only this remembers that its resync is owed).
    _owed: set[ReplicaKey]
    # Keys resynced since the last read of the change streams: every entry handled now
    # was read before that snapshot, which holds it (a reset entry of such a key is no
    # reason to read its whole state again)
    _fresh: set[ReplicaKey]
    # keys whose last snapshot read did not parse (``_resync``) -> (monotonic time of the
    # next read, the wait before it): such a read succeeds with the key's whole state,
    # so it is retried with a backoff, not each turn; logged once per replica
    _unreadable: dict[ReplicaKey, tuple[float, float]]

    def _registered(self, key: ReplicaKey) -> bool:
        """``key`` is a DP rank of a replica as this router knows it registered."""
        info = self.infos.get(key.replica)
        return info is not None and key.dp_rank in info.dp_ranks

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
