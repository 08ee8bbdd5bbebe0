"""``RedisStore``: the shared index in Redis, its connection and its reads (key schema in
``router.store.schema`` and docs/redis.md). The write side (the lease protocol, fenced state
writes, change entries) is the ``RedisWrites`` mixin of router/store/redis_writes.py.

``connect`` opens ``redis://`` and ``rediss://`` URLs, AUTH (``user:pass@``) and a ``?db=``
or ``/db`` path, and a Redis Cluster through ``redis+cluster://`` / ``rediss+cluster://``
(any node's address; the client discovers the rest); every client it returns is
binary-safe and times out a call that Redis stops answering (``socket_timeout``).

Snapshots (``read_replicas``): one MULTI/EXEC per key, so a replica's seq and its records
are read at one instant. Reads of the change stream: standalone, one blocking XREAD over all
shards. On a cluster the shards live in different slots, so each shard is read on its own
(concurrently, without blocking); when none had anything new the call sleeps
``cluster_poll_s`` (default 50 ms) before returning, so an idle router costs the cluster
``shards / cluster_poll_s`` cheap XREADs a second and sees events at most that late. A
shard whose read fails, or has not answered within ``shard_wait_s`` (its node down or
unreachable: the client's own retries take seconds), is left out of that read and named in
``ChangeRead.unread``, its cursor kept; a read still under way is not started again, and
its entries are taken by a later call once it answers (when the cursor has not moved
meanwhile). A call fails only when no shard was read and one failed. An
entry that does not parse, is not signed for its replica (with ``verify_master``), or names
a replica of another shard is dropped and counted as malformed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import uuid
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from router.core.errors import ConfigError
from router.core.types import ReplicaKey
from router.store.base import (
    Change,
    ChangeRead,
    ReplicaDown,
    ReplicaInfo,
    ReplicaSnapshot,
    ReplicaUp,
    UnreadableSnapshot,
)
from router.store.codec import decode_change, verify_fields
from router.store.packed import parse_records
from router.store.redis_writes import RedisWrites
from router.store.schema import RESERVED_NAMES, KeySchema

DEFAULT_STREAM_MAXLEN = 50_000
DEFAULT_CLUSTER_POLL_S = 0.05
DEFAULT_SHARD_WAIT_S = 0.5
DEFAULT_SOCKET_TIMEOUT_S = 10.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

log = logging.getLogger(__name__)


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


async def xread_one(
    client: aioredis.Redis | RedisCluster,
    stream: str,
    last: bytes | str,
    *,
    count: int,
    block_ms: int | None = None,
) -> Any:
    """``XREAD [COUNT count] [BLOCK block_ms] STREAMS stream last``, as redis-py's ``xread``
    answers it. On a cluster it is sent to the node serving ``stream``'s slot: redis-py finds
    XREAD's keys by asking one node (its commands parser's, the URL's node unless a topology
    refresh moved it) with ``COMMAND GETKEYS`` before each XREAD, since XREAD's key spec is a
    keyword search it does not evaluate; that is a round trip more per read, and with that
    node down no XREAD of any node succeeds. A MOVED reply is still followed."""
    if not isinstance(client, RedisCluster):
        return await client.xread({stream: last}, count=count, block=block_ms)
    await client.initialize()  # (at once once the topology is known)
    node = client.get_node_from_key(stream)
    args: list[Any] = ["XREAD", "COUNT", count]
    if block_ms is not None:
        args += ["BLOCK", block_ms]
    return await client.execute_command(*args, "STREAMS", stream, last, target_nodes=node)


def _stream_id(raw: bytes | str) -> tuple[int, int]:
    """A stream entry id ``<ms>-<n>`` as a comparable pair."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, n = text.partition("-")
    return int(ms), int(n or 0)


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _text(raw: bytes) -> str | None:
    """A stored name as text; None when it is not UTF-8."""
    try:
        return bytes(raw).decode()
    except UnicodeDecodeError:
        return None


def _replica_of(change: Change) -> str:
    if isinstance(change, ReplicaUp):
        return change.info.replica
    if isinstance(change, ReplicaDown):
        return change.replica
    return change.key.replica


class RedisStore(RedisWrites):
    """See ``router.store.base.IndexStore``: the reads here, the writes in ``RedisWrites``.
    ``stream_maxlen`` trims each stream shard approximately (``XADD MAXLEN ~``)."""

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        schema: KeySchema | None = None,
        stream_maxlen: int = DEFAULT_STREAM_MAXLEN,
        *,
        signing_key: bytes | None = None,
        verify_master: bytes | None = None,
        cluster_poll_s: float = DEFAULT_CLUSTER_POLL_S,
        shard_wait_s: float = DEFAULT_SHARD_WAIT_S,
    ) -> None:
        """``signing_key``: a publisher's own derived key; every change entry it writes is
        signed (codec.sign_fields). ``verify_master``: a router's master secret; change
        entries not signed with the key of the replica they name are dropped and counted as
        malformed."""
        self.redis = client
        self.schema = schema or KeySchema()
        # the count this process was configured with; ``schema`` follows the stored one
        self.configured_shards = self.schema.stream_shards
        self.stream_maxlen = stream_maxlen
        self.signing_key = signing_key
        self.verify_master = verify_master
        self.cluster = isinstance(client, RedisCluster)
        self.cluster_poll_s = cluster_poll_s
        self.shard_wait_s = shard_wait_s
        # cluster: each shard's read under way -> (the id it reads after, the read)
        self._shard_reads: dict[str, tuple[bytes, asyncio.Task[list[Any]]]] = {}

    @classmethod
    def from_url(cls, url: str, schema: KeySchema | None = None, **kwargs: Any) -> RedisStore:
        return cls(connect(url), schema, **kwargs)

    async def close(self) -> None:
        for _, task in self._shard_reads.values():
            task.cancel()
        self._shard_reads.clear()
        await self.redis.aclose()

    async def settle_shards(self) -> bool:
        """Follow the shard count stored under the prefix (``schema.shards_key``); when none
        is stored, store the one in use (``SET NX``: the first process to start, or the
        first to find it gone after Redis lost its data, decides: :meth:`_get_or_create`).
        A stored count that is not one raises ``ValueError`` naming the key (the caller
        retries, logged: nothing runs on a count nobody agreed to). Following a count other
        than the configured one is logged as a warning each time ``schema`` changes."""
        key = self.schema.shards_key
        raw = await self._get_or_create(key, str(self.schema.stream_shards))
        text = bytes(raw or b"").decode(errors="replace")
        try:
            stored = dataclasses.replace(self.schema, stream_shards=int(text))
        except (ValueError, ConfigError):
            raise ValueError(
                f"{key} holds {text!r}, not a stream shard count in [1, 1024]: SET it to the"
                f" count every publisher and router of the prefix uses (this one is configured"
                f" with {self.configured_shards})"
            ) from None
        if stored.stream_shards == self.schema.stream_shards:
            return False
        log.warning(
            "%s holds %d stream shards; configured %d, using %d until now: following %d"
            " (set --stream-shards / server.redis_stream_shards to %d, docs/redis.md)",
            key,
            stored.stream_shards,
            self.configured_shards,
            self.schema.stream_shards,
            stored.stream_shards,
            stored.stream_shards,
        )
        self.schema = stored
        return True

    # ------------------------------------------------------------------ read side

    async def instance_token(self) -> str:
        """The store's instance token, created when missing (the audit that starts here
        must go on purging dead replicas while Redis is full: :meth:`_get_or_create`)."""
        raw = await self._get_or_create(self.schema.instance, uuid.uuid4().hex)
        return bytes(raw).decode() if raw else ""

    async def _get_or_create(self, key: str, value: str) -> Any:
        """``key``'s value, stored as ``value`` first when missing (``SET NX``: whoever comes
        first decides). Read first: a Redis at ``maxmemory`` refuses ``SET`` even of a key
        that exists, and a process that only needs to read it must not stop there."""
        raw: Any = await self.redis.get(key)
        if raw is None:
            await self.redis.set(key, value, nx=True)
            raw = await self.redis.get(key)
        return raw

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
        # (any publisher may add a member: one that is no UTF-8 is nobody's name)
        names = sorted(n for n in map(_text, members) if n is not None)
        if not names:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hget(self.schema.meta(name), "info")
            raws = await pipe.execute()
        out = []
        for name, raw in zip(names, raws, strict=True):
            if raw is None:
                continue
            try:
                info = ReplicaInfo.from_json(raw)
            except ValueError:
                continue
            # a registration speaks only for the replica whose key holds it: a publisher's
            # ACL lets it write its own meta, not what that meta names (as registration())
            if info.replica == name:
                out.append(info)
        return out

    async def registration(self, replica: str) -> ReplicaInfo | None:
        raw: Any = await self.redis.hget(self.schema.meta(replica), "info")
        if raw is None:
            return None
        try:
            info = ReplicaInfo.from_json(raw)
        except ValueError:
            return None
        return info if info.replica == replica else None

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
        unread: tuple[str, ...] = ()
        if self.cluster:
            reply, unread = await self._read_shards(ids, block_s, count)
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
        return ChangeRead(changes, ids, malformed, unread)

    async def _read_shards(
        self, ids: dict[str, bytes], block_s: float, count: int
    ) -> tuple[list[Any], tuple[str, ...]]:
        """Cluster: every shard read on its own (they are in different slots), concurrently;
        with nothing new, sleep up to ``cluster_poll_s`` (and at most ``block_s``). Returns
        the entries and the shards not read (module docstring)."""

        async def one(stream: str, last: bytes) -> list[Any]:
            got: Any = await xread_one(self.redis, stream, last, count=count)
            return list(got or [])

        for stream in [st for st in self._shard_reads if st not in ids]:  # shard count changed
            self._shard_reads.pop(stream)[1].cancel()
        new = []
        for stream, last in ids.items():
            started = self._shard_reads.get(stream)
            if started is not None and started[0] != last:  # the cursor moved (bootstrap)
                started[1].cancel()
                started = None
            if started is None:
                task = asyncio.create_task(one(stream, last))
                task.add_done_callback(_retrieve)  # (one cancelled once done: not logged)
                self._shard_reads[stream] = (last, task)
                new.append(task)
        if new:
            await asyncio.wait(new, timeout=self.shard_wait_s)
        reply: list[Any] = []
        unread: list[str] = []
        errors: list[BaseException] = []
        for stream in ids:
            task = self._shard_reads[stream][1]
            if not task.done():
                unread.append(stream)
                continue
            del self._shard_reads[stream]
            exc = asyncio.CancelledError() if task.cancelled() else task.exception()
            if exc is not None:
                unread.append(stream)
                errors.append(exc)
                continue
            reply.extend(task.result())
        if errors and len(unread) == len(ids):
            raise errors[0]
        if not reply and block_s > 0:
            await asyncio.sleep(min(block_s, self.cluster_poll_s))
        return reply, tuple(unread)

    async def orphans(self) -> list[str]:
        """SCANs the keyspace for meta and load keys (every primary of a cluster): a
        sweep's cost, not a request's. Also registered names without a readable
        registration (their keys lost with a cluster node, or ``info`` that does not parse):
        no audit lists them, so only the sweep reaps them once their lease is gone."""
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
        members: Any = await self.redis.smembers(s.registry)
        registered = {bytes(n).decode(errors="replace") for n in members}
        listed = {info.replica for info in await self.list_replicas()} if registered else set()
        candidates = sorted((names - registered) | (registered - listed))
        if not candidates:
            return []
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
