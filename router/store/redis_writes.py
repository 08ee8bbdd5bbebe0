"""The write side of ``RedisStore`` (router/store/redis_store.py, which holds the
connection and the reads): the lease protocol, the fenced state writes and the change
entries they append. Key schema in ``router.store.schema`` and docs/redis.md.

``RedisWrites`` is a mixin, as redis-py keeps its commands apart from its connection: it
issues commands on ``self.redis`` under ``self.schema`` and never opens or closes a
connection. Its methods implement the write half of ``router.store.base.IndexStore``.

Leases: ``register``, ``heartbeat``, ``deregister``/``reap`` and ``publish_load`` check
the lease and act on what it guards in one Lua script over one replica's keys (all share
its hash tag: one slot), so the check and the change are one atomic step. A lease held by
another owner raises ``LeaseTaken`` (``register`` without ``take_over``, ``heartbeat``,
``publish_load`` with an owner) or refuses (``deregister``: False); a lease gone makes
``heartbeat`` return False and ``publish_load`` raise ``LeaseLost``.

State writes (``write``, ``reset``): per flush, one MULTI/EXEC per replica (single-slot),
fenced by the writer's lease (``WATCH`` lease, ``GET``, then the transaction: a superseded or
lapsed writer cannot land a write, ``_fenced``; an EXEC aborted because the lease key
changed, as its own heartbeat renewing it, is tried again, up to ``FENCE_ATTEMPTS`` times),
then one pipeline of XADDs for the replicas whose transaction landed. The replicas'
transactions run concurrently, each on its connection; the client routes the XADDs to the
shards' nodes. Unfenced writes (no owner: tests, bench) share one round trip on a
standalone Redis (``_transactions``). A state is always committed before its change entry
is appended, so a snapshot read after taking a stream cursor holds every batch older than
the cursor. After the entries: a refused replica raises ``LeaseTaken`` / ``LeaseLost``
(nothing of it was written), and a replaced ``seq:<dp>`` that was not ``seq - 1`` raises
``SeqMismatch`` (``write``; the state landed, but its untouched buckets may be stale).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import defaultdict
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import WatchError

from router.core.types import IndexEvent, ReplicaKey
from router.store.base import (
    BatchChange,
    Change,
    LeaseLost,
    LeaseTaken,
    LoadChange,
    LoadSample,
    ReplicaDown,
    ReplicaInfo,
    ReplicaState,
    ReplicaUp,
    ResetChange,
    SeqMismatch,
)
from router.store.codec import encode_change, replica_signing_key, sign_fields
from router.store.packed import PackedTable
from router.store.schema import KeySchema

_T = TypeVar("_T")
# a fenced write retried this often when its lease key changed between the check and EXEC
# (its own heartbeat renewing it, usually)
FENCE_ATTEMPTS = 8

# Deletes a replica's keys. KEYS[1] lease, KEYS[2] meta, KEYS[3..] load and kv:<dp>, st:<dp>
# of the ranks ARGV[3..]; ARGV[1] when: "reap" only while the lease is gone (and meta or
# load is there), "own" only while the lease is ARGV[2]'s or free, "any" always. A rank that has a
# seq:<dp> field in meta (so may have keys) and is not among ARGV[3..] is returned instead
# (the caller adds its keys and calls again); 1 deleted, 0 not allowed, 2 (reap) nothing
# of the replica left to delete.
_DELETE = """
local lease = redis.call('GET', KEYS[1])
if ARGV[1] == 'reap' then
  if lease then return 0 end
  if redis.call('EXISTS', KEYS[2], KEYS[3]) == 0 then return 2 end
elseif ARGV[1] == 'own' then
  if lease and lease ~= ARGV[2] then return 0 end
end
local covered = {}
for i = 3, #ARGV do covered[tonumber(ARGV[i])] = true end
local missing = {}
for _, f in ipairs(redis.call('HKEYS', KEYS[2])) do
  local dp = string.match(f, '^seq:(%d+)$')
  if dp and not covered[tonumber(dp)] then missing[#missing + 1] = dp end
end
if #missing > 0 then return missing end
for i = 1, #KEYS do redis.call('UNLINK', KEYS[i]) end
return 1
"""
# Registers. KEYS[1] lease, KEYS[2] meta, KEYS[3] load, KEYS[4..] kv:<dp>, st:<dp> of the DP
# ranks ARGV[5..] the registration drops; ARGV[1] owner, ARGV[2] ttl ms, ARGV[3] "1" to take
# the lease from another owner, ARGV[4] info. 1 registered, else the holder (not taken).
_REGISTER = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] and ARGV[3] ~= '1' then return cur end
for i = 4, #KEYS do redis.call('UNLINK', KEYS[i]) end
for i = 5, #ARGV do
  redis.call('HDEL', KEYS[2], 'seq:' .. ARGV[i])
  redis.call('HDEL', KEYS[3], ARGV[i])
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('HSET', KEYS[2], 'info', ARGV[4])
return 1
"""
# KEYS[1] lease; ARGV owner, ttl ms. 1 renewed, 0 gone, else the holder (another owner)
_HEARTBEAT = """
local cur = redis.call('GET', KEYS[1])
if not cur then return 0 end
if cur ~= ARGV[1] then return cur end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
# A load sample, fenced by the writer's lease: KEYS[1] lease, KEYS[2] load; ARGV owner (''
# unchecked), dp, sample. 1 written, 0 lease gone, else the holder.
_LOAD = """
if ARGV[1] ~= '' then
  local cur = redis.call('GET', KEYS[1])
  if not cur then return 0 end
  if cur ~= ARGV[1] then return cur end
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
return 1
"""


async def gather_all(coros: Iterable[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Run ``coros`` concurrently and let every one finish before raising the first error
    (a failed sibling must not leave the others running on as orphans)."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]


def _seq(raw: Any) -> int | None:
    """A stored ``seq:<dp>``; None when absent or not an integer (a foreign write: no seq a
    writer stored, so a publisher republishes over it and a router's audit skips it)."""
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        return None


class RedisWrites:
    """The write half of ``IndexStore`` over Redis, mixed into ``RedisStore``: the class
    that mixes it in sets the attributes below (``RedisStore.__init__``)."""

    redis: aioredis.Redis | RedisCluster
    schema: KeySchema
    # ``XADD MAXLEN ~`` of every change entry appended
    stream_maxlen: int
    # a publisher's own derived key: every change entry it appends is signed with it
    signing_key: bytes | None
    # a router's master secret: entries it appends in a replica's name (a reap) are signed
    # with that replica's key derived from it
    verify_master: bytes | None
    # a Redis Cluster: per-replica transactions cannot share one pipeline
    cluster: bool

    def _xadd(self, pipe: Any, replica: str, change: Change) -> None:
        """Queue on ``pipe`` the XADD of ``change`` to the stream shard of ``replica``,
        signed when a key is at hand (``signing_key``, else one derived from
        ``verify_master``)."""
        fields = encode_change(change)
        key = self.signing_key
        if key is None and self.verify_master is not None:
            # a router writing in a replica's name (reaping an expired lease) holds the master
            key = replica_signing_key(self.verify_master, replica)
        if key is not None:
            sign_fields(fields, key)
        pipe.xadd(
            self.schema.stream(self.schema.shard_of(replica)),
            fields,
            maxlen=self.stream_maxlen,
            approximate=True,
        )

    # ------------------------------------------------------------------ write side

    async def _stored_ranks(self, replica: str, pipe: Any = None) -> set[int]:
        """The DP ranks that may have keys in the store: those of the stored registration (if
        readable) and every rank with a ``seq:<dp>`` field (written with its kv/st keys).
        With ``pipe``, its commands are run too (ahead of the two reads)."""
        meta = self.schema.meta(replica)
        if pipe is None:
            async with self.redis.pipeline(transaction=False) as own:
                return await self._stored_ranks(replica, own)
        pipe.hget(meta, "info")
        pipe.hkeys(meta)
        *_, raw, fields = await pipe.execute()
        ranks: set[int] = set()
        if raw:
            with contextlib.suppress(ValueError):  # unreadable: the seq fields still tell
                ranks.update(ReplicaInfo.from_json(raw).dp_ranks)
        for f in fields or []:
            name, _, dp = bytes(f).decode(errors="replace").partition(":")
            if name == "seq" and dp.isascii() and dp.isdigit():
                ranks.add(int(dp))
        return ranks

    async def register(
        self, info: ReplicaInfo, owner: str, lease_ttl_s: float, *, take_over: bool = True
    ) -> None:
        """Lease and info first, in one script that also deletes the state of DP ranks the
        registration no longer has; then the registry and the ReplicaUp entry. So a reaper
        or deregistration that finds the lease gone deletes either nothing of this
        registration or all of the one before it, and a Up entry always follows its lease."""
        s = self.schema
        r = info.replica
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(s.instance, uuid.uuid4().hex, nx=True)
            dropped = sorted((await self._stored_ranks(r, pipe)) - set(info.dp_ranks))

        keys = [s.lease(r), s.meta(r), s.load(r)]
        keys += [k for d in dropped for k in (s.kv(r, d), s.state(r, d))]
        ttl = max(1, int(lease_ttl_s * 1000))
        args = [owner, ttl, "1" if take_over else "0", info.to_json(), *map(str, dropped)]
        got = await self.redis.eval(_REGISTER, len(keys), *keys, *args)
        if isinstance(got, bytes):
            raise LeaseTaken(r, got.decode(errors="replace"))
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.sadd(s.registry, r)
            self._xadd(pipe, r, ReplicaUp(info))
            await pipe.execute()

    async def heartbeat(self, replica: str, owner: str, lease_ttl_s: float) -> bool:
        s = self.schema
        got = await self.redis.eval(
            _HEARTBEAT, 1, s.lease(replica), owner, max(1, int(lease_ttl_s * 1000))
        )
        if isinstance(got, bytes):
            raise LeaseTaken(replica, got.decode(errors="replace"))
        if got:
            await self.redis.sadd(s.registry, replica)  # heals a registry entry lost to a reaper
        return bool(got)

    async def deregister(self, replica: str, owner: str | None = None) -> bool:
        if await self._delete(replica, "any" if owner is None else "own", owner or "") != 1:
            return False
        await self._announce_down(replica)
        return True

    async def reap(self, replica: str) -> bool:
        """Delete a replica whose lease is gone (a crashed publisher): atomic against the
        lease coming back (one script over the replica's slot). True when it was deleted,
        or when only its registry entry was left (its keys lost with a cluster node: the
        registry set lives in another slot) and is now removed."""
        got = await self._delete(replica, "reap")
        if got == 2:
            return await self._unlist(replica)
        if got != 1:
            return False
        await self._announce_down(replica)
        return True

    async def _unlist(self, replica: str) -> bool:
        """Remove ``replica`` from the registry unless a registration came back meanwhile
        (its lease exists again: put back, as in ``_announce_down``). No ReplicaDown: routers
        that keep it through a data loss's grace purge it when that ends."""
        s = self.schema
        if not await self.redis.srem(s.registry, replica):
            return False
        if await self.redis.exists(s.lease(replica)):
            await self.redis.sadd(s.registry, replica)
            return False
        return True

    async def _delete(self, replica: str, when: str, owner: str = "") -> int:
        """Run ``_DELETE`` over every key of the replica, of every DP rank that has any
        (``_stored_ranks``, plus what the script finds that a concurrent write added); its
        answer: 1 deleted, 0 not allowed, 2 nothing left to reap."""
        s = self.schema
        ranks = await self._stored_ranks(replica)
        for _ in range(16):
            keys = [s.lease(replica), s.meta(replica), s.load(replica)]
            for d in sorted(ranks):
                keys += [s.kv(replica, d), s.state(replica, d)]
            args = [when, owner, *(str(d) for d in sorted(ranks))]
            got = await self.redis.eval(_DELETE, len(keys), *keys, *args)
            if not isinstance(got, list):
                return int(got)
            ranks.update(int(d) for d in got)
        raise RuntimeError(f"replica {replica!r}: DP ranks keep appearing while deleting it")

    async def _announce_down(self, replica: str) -> None:
        """After the keys went: leave the registry and append ReplicaDown, unless a publisher
        registered the replica again meanwhile (its lease is back). A registration's lease
        precedes its SADD, so when the SREM removed that SADD, the EXISTS after it sees the
        lease and puts the name back. A registration between the EXISTS and the XADD still
        puts a Down after its Up: routers ignore a Down while the lease lives (IndexSync)."""
        s = self.schema
        await self.redis.srem(s.registry, replica)
        if await self.redis.exists(s.lease(replica)):
            await self.redis.sadd(s.registry, replica)
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            self._xadd(pipe, replica, ReplicaDown(replica))
            await pipe.execute()

    @staticmethod
    def _table_cmds(key: str, table: PackedTable, full: bool) -> list[tuple[Any, ...]]:
        """The commands that bring ``key`` to ``table`` (its changes, or all of it)."""
        rebuilt, buckets = table.take_changes()
        if full:
            rebuilt, buckets = True, table.all_buckets()
        cmds: list[tuple[Any, ...]] = []
        if rebuilt:
            cmds.append(("UNLINK", key))
        put = [x for b, v in buckets.items() if v for x in (str(b), v)]
        gone = [str(b) for b, v in buckets.items() if not v]
        if put:
            cmds.append(("HSET", key, *put))
        if gone and not rebuilt:
            cmds.append(("HDEL", key, *gone))
        return cmds

    async def _fenced(
        self, replica: str, owner: str, cmds: Sequence[tuple[Any, ...]]
    ) -> list[Any] | str | None:
        """Run ``cmds`` in one MULTI/EXEC only while ``replica``'s lease is ``owner``'s:
        ``WATCH`` the lease, read it, then the transaction, which Redis aborts when the lease
        changed meanwhile (taken by another owner, renewed: checked again). The replies, or
        what refused it: the holder, None when the lease is gone."""
        lease = self.schema.lease(replica)
        mine = owner.encode()
        pipe: Any  # (redis-py's pipeline methods are untyped)
        async with self.redis.pipeline(transaction=True) as pipe:
            for _ in range(FENCE_ATTEMPTS):
                try:
                    await pipe.watch(lease)
                    cur: Any = await pipe.get(lease)
                    if cur != mine:
                        await pipe.reset()
                        return None if cur is None else bytes(cur).decode(errors="replace")
                    pipe.multi()
                    for cmd in cmds:
                        pipe.execute_command(*cmd)
                    return list(await pipe.execute())
                except WatchError:
                    continue
        raise WatchError(f"replica {replica!r}: its lease kept changing during a write")

    async def _commit(
        self, states: Sequence[ReplicaState], full: bool, owner: str | None = None
    ) -> tuple[list[ReplicaKey], dict[str, str | None]]:
        """Write the states (``full``: replace them whole) with their seqs, one transaction
        per replica, fenced by ``owner``'s lease (None: unchecked; ``_fenced``). Returns the
        keys whose stored seq before it (0 when none) was not ``seq - 1`` (or did not parse),
        and the replicas whose write was refused (nothing of it written): the lease's holder,
        None when gone."""
        s = self.schema
        by_replica: dict[str, list[ReplicaState]] = defaultdict(list)
        for st in states:
            by_replica[st.key.replica].append(st)
        items: list[tuple[str, list[ReplicaState], list[tuple[Any, ...]]]] = []
        for replica, group in by_replica.items():
            meta = s.meta(replica)
            # the seqs replaced, first: the first len(group) replies
            cmds: list[tuple[Any, ...]] = [
                ("HGET", meta, s.seq_field(st.key.dp_rank)) for st in group
            ]
            for st in group:
                dp = st.key.dp_rank
                cmds += self._table_cmds(s.kv(replica, dp), st.kv, full)
                cmds += self._table_cmds(s.state(replica, dp), st.state, full)
                cmds.append(("HSET", meta, s.seq_field(dp), str(st.seq)))
            items.append((replica, group, cmds))
        replies: list[list[Any] | str | None]
        if owner is None:

            def queue(pipe: Any, item: tuple[str, Any, list[tuple[Any, ...]]]) -> None:
                for cmd in item[2]:
                    pipe.execute_command(*cmd)

            replies = list(await self._transactions(items, queue))
        else:
            replies = await gather_all(self._fenced(r, owner, cmds) for r, _, cmds in items)
        behind: list[ReplicaKey] = []
        refused: dict[str, str | None] = {}
        for (replica, group, _), got in zip(items, replies, strict=True):
            if not isinstance(got, list):
                refused[replica] = got
                continue
            # a seq that does not parse (a foreign write) was not ``seq - 1``: behind
            behind += [
                st.key
                for st, before in zip(group, got, strict=False)
                if (0 if before is None else _seq(before)) != st.seq - 1
            ]
        return behind, refused

    @staticmethod
    def _raise_refused(refused: dict[str, str | None]) -> None:
        for replica, holder in refused.items():
            if holder is not None:
                raise LeaseTaken(replica, holder)
        for replica in refused:
            raise LeaseLost(replica)

    async def _transactions(
        self, items: Sequence[_T], queue: Callable[[Any, _T], None]
    ) -> list[list[Any]]:
        """One MULTI/EXEC per item (``queue`` adds its commands, all in one slot: one
        replica's keys); returns each transaction's replies. A standalone Redis gets them all
        in one round trip; a cluster one transactional pipeline per item, concurrently."""
        if self.cluster:

            async def one(item: _T) -> list[Any]:
                async with self.redis.pipeline(transaction=True) as pipe:
                    queue(pipe, item)
                    return list(await pipe.execute())

            return await gather_all(one(item) for item in items)
        exec_at: list[int] = []  # index of each EXEC reply
        async with self.redis.pipeline(transaction=False) as pipe:
            for item in items:
                pipe.execute_command("MULTI")
                queue(pipe, item)
                pipe.execute_command("EXEC")
                exec_at.append(len(pipe.command_stack) - 1)  # type: ignore[union-attr]  # (standalone)
            replies = await pipe.execute()
        return [list(replies[i]) for i in exec_at]

    async def write(
        self,
        writes: Sequence[tuple[ReplicaState, tuple[IndexEvent, ...]]],
        owner: str | None = None,
    ) -> None:
        if not writes:
            return
        behind, refused = await self._commit([st for st, _ in writes], False, owner)
        async with self.redis.pipeline(transaction=False) as pipe:
            for st, events in writes:
                if st.key.replica not in refused:
                    self._xadd(pipe, st.key.replica, BatchChange(st.key, st.seq, events))
            await pipe.execute()
        self._raise_refused(refused)
        if behind:  # the buckets this write left alone may not be the writer's
            raise SeqMismatch(behind)

    async def reset(self, states: Sequence[ReplicaState], owner: str | None = None) -> None:
        if not states:
            return
        _, refused = await self._commit(states, True, owner)
        async with self.redis.pipeline(transaction=False) as pipe:
            for st in states:
                if st.key.replica not in refused:
                    self._xadd(pipe, st.key.replica, ResetChange(st.key, st.seq))
            await pipe.execute()
        self._raise_refused(refused)

    async def publish_load(
        self, key: ReplicaKey, sample: LoadSample, owner: str | None = None
    ) -> None:
        s = self.schema
        keys = (s.lease(key.replica), s.load(key.replica))
        got = await self.redis.eval(_LOAD, 2, *keys, owner or "", key.dp_rank, sample.to_json())
        self._raise_refused(
            {} if got == 1 else {key.replica: got.decode(errors="replace") if got else None}
        )
        async with self.redis.pipeline(transaction=False) as pipe:
            self._xadd(pipe, key.replica, LoadChange(key, sample))
            await pipe.execute()

    async def stored_seq(self, key: ReplicaKey) -> int | None:
        raw = await self.redis.hget(
            self.schema.meta(key.replica), self.schema.seq_field(key.dp_rank)
        )
        return _seq(raw)

    async def stored_seqs(self, keys: Sequence[ReplicaKey]) -> list[int | None]:
        s = self.schema
        raws: list[Any]
        if self.cluster:  # the keys live in different slots
            ints = await gather_all(self.stored_seq(k) for k in keys)
            return ints
        else:
            async with self.redis.pipeline(transaction=False) as pipe:
                for k in keys:
                    pipe.hget(s.meta(k.replica), s.seq_field(k.dp_rank))
                raws = await pipe.execute()
        return [_seq(raw) for raw in raws]
