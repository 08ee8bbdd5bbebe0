"""``LeaseAudit``: the periodic check of ``IndexSync`` (router/store/sync.py) that the
index still mirrors the store where the change streams cannot show it.

Every ``audit_interval_s`` (``audit``) the leases are checked: a replica whose lease expired
is purged from the index (and the listener told) and, with ``reap_expired``, its keys are
deleted from the store (atomically against the lease coming back); a registered replica we
do not know is loaded (or reaped when its lease is gone: it died before we knew it), one
whose registration changed unseen (its ReplicaUp trimmed from the stream) is adopted as a
ReplicaUp would be; a new store instance token (Redis lost its data), a new stored stream
shard count (``IndexStore.settle_shards``) or a change stream that went back asks for a
full re-bootstrap. A replica whose lease and registration vanished together with no
ReplicaDown (a cluster node that restarted empty) is kept for ``lost_store_grace_s``, as
after a data loss, and so is one whose lease lapsed while the store was unreachable
(``_after_outage``). Keys whose seq in the index disagrees with the store's are resynced
(``_check_seqs`` says when); every ``orphan_sweep_s`` the state of replicas that outlived
them is deleted (``_sweep_orphans``). An audit that fails is logged and counted and does not
stop the reads (``_audit_logged``); the next waits from ``audit_interval_s`` doubling up to
``AUDIT_RETRY_MAX_S`` while they fail.

A mixin over ``ReplicaMirror``: it declares the state it works on, which
``IndexSync.__init__`` sets.
"""

from __future__ import annotations

import asyncio
import logging
import time

from router.core.types import ReplicaKey
from router.store.replica_mirror import ReplicaMirror

# the follower's one logger (router/store/sync.py), whichever of its parts logs
log = logging.getLogger("router.store.sync")

AUDIT_RETRY_MAX_S = 30.0
"""The longest wait before auditing again after audits that failed."""


class LeaseAudit(ReplicaMirror):
    """The lease and membership audit of the follower (module docstring)."""

    audit_interval_s: float
    reap_expired: bool
    lost_store_grace_s: float
    orphan_sweep_s: float
    _next_audit: float
    _next_sweep: float
    _audit_wait: float  # the wait after the last audit, while audits fail
    _outage_grace_until: float  # (monotonic) see ``_after_outage``
    # each key's stored seq at the last audit (see ``_check_seqs``)
    _audited_seqs: dict[ReplicaKey, int | None]
    _streams_lost: bool  # a change stream went back: bootstrap as after data loss
    # the follower's, read here: the instance token of the last bootstrap, the cursor, a
    # turn failed, the last read reached the streams' end, stopping
    _token: str | None
    _cursor: object
    _failed: bool
    _caught_up: bool
    _stopping: bool

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

    def _after_outage(self) -> None:
        """The store answers again after failing: a lease that lapsed meanwhile may have
        lapsed only because its publisher could not reach the store either (Redis down,
        paused or cut off for longer than the lease TTL, and back with its data: no new
        instance token). Lapsed leases get the data-loss grace from now, so that the first
        audit does not purge the fleet while the publishers register again."""
        self._outage_grace_until = time.monotonic() + self.lost_store_grace_s

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
