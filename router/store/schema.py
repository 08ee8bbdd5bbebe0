"""Redis key schema (documented in docs/redis.md).

Every key of one replica carries the hash tag ``{<replica>}`` so the whole family lives in
one Redis Cluster slot (multi-key transactions per replica are legal) while different
replicas spread over the shards::

    <p>:{<r>}:meta        HASH  info (JSON), seq:<dp> (last batch folded into the state keys)
    <p>:{<r>}:kv:<dp>     HASH  bucket id -> packed 9-byte records (8-byte BE hash, tier mask)
    <p>:{<r>}:st:<dp>     HASH  bucket id -> packed records of recurrent-state checkpoints
    <p>:{<r>}:load        HASH  <dp> -> JSON load sample
    <p>:{<r>}:lease       STRING owner id, PX TTL renewed by the publisher's heartbeat
    <p>:{pods}:load       STREAM / <p>:{pods}:loads HASH: the router pods' load exchange
                                 (router/service/pod_exchange.py; ``pods`` is no replica name)
    <p>:replicas          SET   registered replica names
    <p>:stream:{<s>}      STREAM change stream shard s (replicas hash onto shards)
    <p>:instance          STRING random token; a new one means Redis lost its data
    <p>:stream-shards     STRING the stream shard count every process of the prefix follows
                                 (stored by the first to start; RedisStore.settle_shards)
    <p>:resp:<id>         STRING the model and replica holding stored response <id>, PX TTL
                                 (router/store/response_ids.py; no hash tag: ids spread)
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

from router.core.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9._:@/-]{1,200}$")
# the hash tag of the router pods' load exchange (``<p>:{pods}:load``, router/service/
# pod_exchange.py): a replica of that name would share its keys
POD_TAG = "pods"
RESERVED_NAMES = frozenset({POD_TAG})


# the URL schemes router.store.redis_store.connect opens (``unix://`` a socket path)
REDIS_URL_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster", "unix")


def check_redis_url(url: str) -> str:
    """``url`` when its scheme is one of :data:`REDIS_URL_SCHEMES`, else a ConfigError that
    names the scheme (never the URL: it may carry a password)."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme.lower() not in REDIS_URL_SCHEMES:
        raise ConfigError(
            f"scheme {scheme if sep else '(none)'!r} is not one of "
            + ", ".join(f"{s}://" for s in REDIS_URL_SCHEMES)
        )
    return url


def check_replica_name(name: str) -> str:
    """Replica names become hash tags: no braces, no ``#`` (ReplicaKey uses ``#dp``), none
    of :data:`RESERVED_NAMES`."""
    if not _NAME.match(name):
        raise ConfigError(
            f"invalid replica name {name!r}: use 1-200 of [A-Za-z0-9._:@/-] (no braces or '#')"
        )
    if name in RESERVED_NAMES:
        raise ConfigError(f"invalid replica name {name!r}: reserved for the router's own keys")
    return name


MAX_STREAM_SHARDS = 1024


def prefix_problem(prefix: str) -> str | None:
    """What is wrong with ``prefix`` as a key prefix (None: nothing): keys need one, and a
    brace would make it a Redis Cluster hash tag, so that every key shared one slot."""
    if not prefix:
        return "empty"
    if "{" in prefix or "}" in prefix:
        return f"{prefix!r} holds '{{' or '}}' (a Redis Cluster hash tag: one slot for all)"
    return None


def shards_problem(stream_shards: int) -> str | None:
    """What is wrong with ``stream_shards`` as a change-stream shard count (None: nothing)."""
    if 1 <= stream_shards <= MAX_STREAM_SHARDS:
        return None
    return f"must be in [1, {MAX_STREAM_SHARDS}], got {stream_shards}"


@dataclass(slots=True, frozen=True)
class KeySchema:
    """Names of every key for one deployment (``prefix``) and stream sharding."""

    prefix: str = "kvr"
    stream_shards: int = 8

    def __post_init__(self) -> None:
        if problem := prefix_problem(self.prefix):
            raise ConfigError(f"key prefix: {problem}")
        if problem := shards_problem(self.stream_shards):
            raise ConfigError(f"stream shards: {problem}")

    def _r(self, replica: str) -> str:
        return f"{self.prefix}:{{{replica}}}"

    def meta(self, replica: str) -> str:
        return f"{self._r(replica)}:meta"

    def kv(self, replica: str, dp_rank: int) -> str:
        return f"{self._r(replica)}:kv:{dp_rank}"

    def state(self, replica: str, dp_rank: int) -> str:
        return f"{self._r(replica)}:st:{dp_rank}"

    def load(self, replica: str) -> str:
        return f"{self._r(replica)}:load"

    def lease(self, replica: str) -> str:
        return f"{self._r(replica)}:lease"

    @property
    def registry(self) -> str:
        return f"{self.prefix}:replicas"

    @property
    def instance(self) -> str:
        return f"{self.prefix}:instance"

    @property
    def shards_key(self) -> str:
        """The shard count of the prefix's change streams, decimal: one key (no hash tag,
        so any node of a cluster; no replica's ACL pattern covers it)."""
        return f"{self.prefix}:stream-shards"

    def response(self, response_id: str) -> str:
        """A stored Responses API response's holder (router/store/response_ids.py)."""
        return f"{self.prefix}:resp:{response_id}"

    def shard_of(self, replica: str) -> int:
        """Stable shard of a replica: crc32 of its name modulo the shard count."""
        return zlib.crc32(replica.encode()) % self.stream_shards

    def stream(self, shard: int) -> str:
        return f"{self.prefix}:stream:{{{shard}}}"

    def streams(self) -> list[str]:
        return [self.stream(s) for s in range(self.stream_shards)]

    @staticmethod
    def seq_field(dp_rank: int) -> str:
        return f"seq:{dp_rank}"
