"""``RedisStore``: the shared index in Redis (key schema in ``router.store.schema`` and
docs/redis.md). Works with ``redis://`` and ``rediss://`` URLs, AUTH (``user:pass@``) and a
``?db=`` or ``/db`` path, and with a Redis Cluster through ``redis+cluster://`` /
``rediss+cluster://`` (any node's address; the client discovers the rest).

Writes: per flush, one MULTI/EXEC per replica (all keys share the replica's hash tag, so
each transaction is single-slot), fenced by the writer's lease (``WATCH`` lease, ``GET``,
then the transaction: a superseded or lapsed writer cannot land a write, ``_fenced``), then
one pipeline of XADDs. The replicas' transactions run concurrently, each on its connection;
the client routes the XADDs to the shards' nodes. Unfenced writes (no owner: tests, bench)
share one round trip on a standalone Redis.

Reads of the change stream: standalone, one blocking XREAD over all shards. On a cluster the
shards live in different slots, so each shard is read on its own (concurrently, without
blocking); when none had anything new the call sleeps ``cluster_poll_s`` (default 50 ms)
before returning, so an idle router costs the cluster ``shards / cluster_poll_s`` cheap
XREADs a second and sees events at most that late.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
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
    ChangeRead,
    LeaseLost,
    LeaseTaken,
    LoadChange,
    LoadSample,
    ReplicaDown,
    ReplicaInfo,
    ReplicaSnapshot,
    ReplicaState,
    ReplicaUp,
    ResetChange,
    SeqMismatch,
    UnreadableSnapshot,
)
from router.store.codec import (
    decode_change,
    encode_change,
    replica_signing_key,
    sign_fields,
    verify_fields,
)
from router.store.packed import PackedTable, parse_records
from router.store.schema import RESERVED_NAMES, KeySchema

_T = TypeVar("_T")
DEFAULT_STREAM_MAXLEN = 50_000
DEFAULT_CLUSTER_POLL_S = 0.05
DEFAULT_SOCKET_TIMEOUT_S = 10.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
# a fenced write retried this often when its lease key changed between the check and EXEC
# (its own heartbeat renewing it, usually)
FENCE_ATTEMPTS = 8
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
# Deletes a replica's keys. KEYS[1] lease, KEYS[2] meta, KEYS[3..] load and kv:<dp>, st:<dp>
# of the ranks ARGV[3..]; ARGV[1] when: "reap" only while the lease is gone (and meta or
# load is there), "own" only while the lease is ARGV[2]'s or free, "any" always. A rank that has a
# seq:<dp> field in meta (so may have keys) and is not among ARGV[3..] is returned instead
# (the caller adds its keys and calls again); 1 deleted, 0 not allowed.
_DELETE = """
local lease = redis.call('GET', KEYS[1])
if ARGV[1] == 'reap' then
  if lease or redis.call('EXISTS', KEYS[2], KEYS[3]) == 0 then return 0 end
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


def _glob_escape(text: str) -> str:
    """``text`` matched literally by a Redis glob (SCAN MATCH)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def connect(url: str, **kwargs: Any) -> aioredis.Redis | RedisCluster:
    """A binary-safe client for ``url``: ``redis://[user:pass@]host:port/db``, ``rediss://``,
    or ``redis+cluster://[user:pass@]host:port`` / ``rediss+cluster://`` for a Redis Cluster
    (a cluster has only database 0)."""
    # A Redis (or cluster node) that stops answering must fail calls, not hang them: the
    # router's follower would stop auditing leases, a publisher would stop heartbeating. The
    # longest legitimate wait is a blocking XREAD of IndexSync.block_s (0.5 s by default).
    kwargs.setdefault("socket_timeout", DEFAULT_SOCKET_TIMEOUT_S)
    kwargs.setdefault("socket_connect_timeout", DEFAULT_CONNECT_TIMEOUT_S)
    scheme, sep, rest = url.partition("://")
    plain = _CLUSTER_SCHEMES.get(scheme.lower())
    if sep and plain is not None:
        return RedisCluster.from_url(f"{plain}://{rest}", decode_responses=False, **kwargs)
    return aioredis.Redis.from_url(url, decode_responses=False, **kwargs)


async def _all(coros: Iterable[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Run ``coros`` concurrently and let every one finish before raising the first error
    (a failed sibling must not leave the others running on as orphans)."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]


def _stream_id(raw: bytes | str) -> tuple[int, int]:
    """A stream entry id ``<ms>-<n>`` as a comparable pair."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, n = text.partition("-")
    return int(ms), int(n or 0)


def _seq(raw: Any) -> int | None:
    """A stored ``seq:<dp>``; None when absent or not an integer (a foreign write: no seq a
    writer stored, so a publisher republishes over it and a router's audit skips it)."""
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        return None


def _replica_of(change: Change) -> str:
    if isinstance(change, ReplicaUp):
        return change.info.replica
    if isinstance(change, ReplicaDown):
        return change.replica
    return change.key.replica


class RedisStore:
    """See ``router.store.base.IndexStore``. ``stream_maxlen`` trims each stream shard
    approximately (``XADD MAXLEN ~``)."""

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        schema: KeySchema | None = None,
        stream_maxlen: int = DEFAULT_STREAM_MAXLEN,
        *,
        signing_key: bytes | None = None,
        verify_master: bytes | None = None,
        cluster_poll_s: float = DEFAULT_CLUSTER_POLL_S,
    ) -> None:
        """``signing_key``: a publisher's own derived key; every change entry it writes is
        signed (codec.sign_fields). ``verify_master``: a router's master secret; change
        entries not signed with the key of the replica they name are dropped and counted as
        malformed."""
        self.redis = client
        self.schema = schema or KeySchema()
        self.stream_maxlen = stream_maxlen
        self.signing_key = signing_key
        self.verify_master = verify_master
        self.cluster = isinstance(client, RedisCluster)
        self.cluster_poll_s = cluster_poll_s

    @classmethod
    def from_url(cls, url: str, schema: KeySchema | None = None, **kwargs: Any) -> RedisStore:
        return cls(connect(url), schema, **kwargs)

    async def close(self) -> None:
        await self.redis.aclose()

    def _xadd(self, pipe: Any, replica: str, change: Change) -> None:
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
        if not await self._delete(replica, "any" if owner is None else "own", owner or ""):
            return False
        await self._announce_down(replica)
        return True

    async def reap(self, replica: str) -> bool:
        """Delete a replica whose lease is gone (a crashed publisher): atomic against the
        lease coming back (one script over the replica's slot). True when it was deleted."""
        if not await self._delete(replica, "reap"):
            return False
        await self._announce_down(replica)
        return True

    async def _delete(self, replica: str, when: str, owner: str = "") -> bool:
        """Run ``_DELETE`` over every key of the replica, of every DP rank that has any
        (``_stored_ranks``, plus what the script finds that a concurrent write added)."""
        s = self.schema
        ranks = await self._stored_ranks(replica)
        for _ in range(16):
            keys = [s.lease(replica), s.meta(replica), s.load(replica)]
            for d in sorted(ranks):
                keys += [s.kv(replica, d), s.state(replica, d)]
            args = [when, owner, *(str(d) for d in sorted(ranks))]
            got = await self.redis.eval(_DELETE, len(keys), *keys, *args)
            if not isinstance(got, list):
                return bool(got)
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
            replies = await _all(self._fenced(r, owner, cmds) for r, _, cmds in items)
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

            return await _all(one(item) for item in items)
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
            ints = await _all(self.stored_seq(k) for k in keys)
            return ints
        else:
            async with self.redis.pipeline(transaction=False) as pipe:
                for k in keys:
                    pipe.hget(s.meta(k.replica), s.seq_field(k.dp_rank))
                raws = await pipe.execute()
        return [_seq(raw) for raw in raws]

    # ------------------------------------------------------------------ read side

    async def instance_token(self) -> str:
        await self.redis.set(self.schema.instance, uuid.uuid4().hex, nx=True)
        raw: Any = await self.redis.get(self.schema.instance)
        return bytes(raw).decode() if raw else ""

    async def cursor(self) -> object:
        return await self._tails()

    async def _tails(self) -> dict[str, bytes]:
        """Every stream's newest entry id (``0-0`` when empty or missing)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream in self.schema.streams():
                pipe.xrevrange(stream, count=1)
            tails = await pipe.execute()
        return {
            stream: (tail[0][0] if tail else b"0-0")
            for stream, tail in zip(self.schema.streams(), tails, strict=True)
        }

    async def streams_behind(self, cursor: object) -> list[str]:
        tails = await self._tails()
        ids: dict[str, Any] = dict(cursor)  # type: ignore[call-overload]
        return [
            stream
            for stream, last in ids.items()
            if _stream_id(tails.get(stream, b"0-0")) < _stream_id(last)
        ]

    async def list_replicas(self) -> list[ReplicaInfo]:
        members: Any = await self.redis.smembers(self.schema.registry)
        names = sorted(bytes(n).decode() for n in members)
        if not names:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hget(self.schema.meta(name), "info")
            raws = await pipe.execute()
        out = []
        for raw in raws:
            if raw is None:
                continue
            try:
                out.append(ReplicaInfo.from_json(raw))
            except ValueError:
                continue
        return out

    async def read_replicas(
        self, keys: Sequence[ReplicaKey]
    ) -> list[ReplicaSnapshot | UnreadableSnapshot | None]:
        """Snapshots read atomically per key (MULTI/EXEC); None when not registered,
        ``UnreadableSnapshot`` when registered and its records or seq do not parse."""
        s = self.schema

        def queue(pipe: Any, key: ReplicaKey) -> None:
            pipe.hget(s.meta(key.replica), s.seq_field(key.dp_rank))
            pipe.hvals(s.kv(key.replica, key.dp_rank))
            pipe.hvals(s.state(key.replica, key.dp_rank))
            # HSTRLEN, not HEXISTS: redis-py's cluster transactions mis-apply HEXISTS's reply
            # callback; a registered replica's info is a non-empty JSON string
            pipe.hstrlen(s.meta(key.replica), "info")

        snapshots = await self._transactions(keys, queue)
        out: list[ReplicaSnapshot | UnreadableSnapshot | None] = []
        for key, snapshot in zip(keys, snapshots, strict=True):
            seq_raw, kv_vals, st_vals, registered = snapshot
            if not registered:
                out.append(None)
                continue
            try:
                kv_h, kv_m = parse_records(kv_vals)
                st_h, _ = parse_records(st_vals)
                seq = int(seq_raw) if seq_raw is not None else 0
            except ValueError as exc:
                out.append(UnreadableSnapshot(key, str(exc)))
                continue
            out.append(ReplicaSnapshot(key, seq, kv_h, kv_m, st_h))
        return out

    async def read_changes(self, cursor: object, block_s: float, count: int) -> ChangeRead:
        ids: dict[str, bytes] = dict(cursor)  # type: ignore[call-overload]
        reply: Any
        if self.cluster:
            reply = await self._read_shards(ids, block_s, count)
        else:
            block = int(block_s * 1000) if block_s > 0 else None
            reply = await self.redis.xread(ids, count=count, block=block)  # type: ignore[arg-type]
        changes: list[Change] = []
        malformed = 0
        for stream, entries in reply or []:
            name = stream.decode() if isinstance(stream, bytes) else stream
            for entry_id, fields in entries:
                ids[name] = entry_id
                if self.verify_master is not None and not verify_fields(fields, self.verify_master):
                    malformed += 1  # unsigned, or signed by another replica's publisher
                    continue
                try:
                    change = decode_change(fields)
                except ValueError:
                    malformed += 1
                    continue
                # an entry naming a replica of another shard was not written by that replica's
                # publisher (with per-replica ACLs a publisher can append only to its own
                # replica's shard, docs/redis.md): drop it
                if self.schema.stream(self.schema.shard_of(_replica_of(change))) != name:
                    malformed += 1
                    continue
                changes.append(change)
        return ChangeRead(changes, ids, malformed)

    async def _read_shards(self, ids: dict[str, bytes], block_s: float, count: int) -> list[Any]:
        """Cluster: every shard read on its own (they are in different slots), concurrently;
        with nothing new, sleep up to ``cluster_poll_s`` (and at most ``block_s``)."""

        async def one(stream: str, last: bytes) -> list[Any]:
            got: Any = await self.redis.xread({stream: last}, count=count)
            return list(got or [])

        replies = await _all(one(st, last) for st, last in ids.items())
        reply = [item for part in replies for item in part]
        if not reply and block_s > 0:
            await asyncio.sleep(min(block_s, self.cluster_poll_s))
        return reply

    async def orphans(self) -> list[str]:
        """SCANs the keyspace for meta and load keys (every primary of a cluster): a
        sweep's cost, not a request's."""
        s = self.schema
        names: set[str] = set()
        for suffix in ("}:meta", "}:load"):  # a stalled flush writes meta, a load sample load
            pattern = _glob_escape(s.prefix) + ":{*" + suffix
            async for raw in self.redis.scan_iter(match=pattern, count=1000):
                key = bytes(raw).decode(errors="replace")
                head, tail = len(s.prefix) + 2, len(key) - len(suffix)
                if key.startswith(s.prefix + ":{") and key.endswith(suffix) and head < tail:
                    names.add(key[head:tail])
        names -= RESERVED_NAMES  # the pods' load stream is no replica's
        if not names:
            return []
        members: Any = await self.redis.smembers(s.registry)
        registered = {bytes(n).decode(errors="replace") for n in members}
        candidates = sorted(names - registered)
        alive = await self.leases(candidates)
        return [n for n in candidates if not alive[n]]

    async def leases(self, replicas: Sequence[str]) -> dict[str, bool]:
        if not replicas:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for r in replicas:
                pipe.exists(self.schema.lease(r))
            alive = await pipe.execute()
        return {r: bool(a) for r, a in zip(replicas, alive, strict=True)}
