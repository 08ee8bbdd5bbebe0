"""The stream shard count is a fact of the key prefix (``<p>:stream-shards``, docs/redis.md):
publishers and routers configured with different counts follow the stored one, so a router
reads every shard a publisher writes. Real redis-server / 3-node cluster, real publishers
fed over ZMQ by a fake engine, real ``IndexSync`` routers."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import pytest

from router.bench.redis_server import LocalRedis
from router.core.index import PrefixIndex
from router.core.types import ReplicaKey
from router.store.memory import MemoryStore
from router.store.redis_store import RedisStore
from router.store.schema import KeySchema
from router.store.sync import IndexSync
from tests.test_publisher_e2e import _engine, _joined, _publisher, canonical
from tests.waiting import eventually

# no audit while a test runs: what reaches the index came over the change streams (the
# audit's seq check would repair a missed shard, late, with a full-state read each time)
STREAM_ONLY = {"audit_interval_s": 3600.0, "block_s": 0.05}
FAST = {"audit_interval_s": 0.1, "block_s": 0.05}


def _off(shards: int, below: int) -> str:
    """A replica name whose shard of ``shards`` is not one of the first ``below``, and not
    the shard ``below`` puts it on either: a router or publisher that used the other count
    would miss its entries (or drop them as written to the wrong shard)."""
    for i in range(1000):
        name = f"rep{i}"
        big = KeySchema("x", shards).shard_of(name)
        if big >= below and big != KeySchema("x", below).shard_of(name):
            return name
    raise AssertionError("no such name")


@pytest.fixture(params=["redis", "redis_cluster"])
async def url(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    if request.param == "redis_cluster":
        yield request.getfixturevalue("redis_cluster").url
    else:
        yield request.getfixturevalue("redis_url")


async def _stored(store: RedisStore) -> bytes | None:
    got: bytes | None = await store.redis.get(store.schema.shards_key)
    return got


async def _converge(
    make: Callable[[int], RedisStore], first: str, pub_shards: int, router_shards: int
) -> None:
    name = _off(max(pub_shards, router_shards), min(pub_shards, router_shards))
    eng = await _engine(16, 3)
    pub_store, router_store = make(pub_shards), make(router_shards)
    pub = _publisher(pub_store, name, eng)
    index = PrefixIndex()
    sync = IndexSync(router_store, index, **STREAM_ONLY)
    agreed = pub_shards if first == "publisher" else router_shards
    try:
        if first == "publisher":
            await pub.start()
            await sync.start()
        else:
            await sync.start()
            await pub.start()
        assert pub_store.schema.stream_shards == router_store.schema.stream_shards == agreed
        assert await _stored(pub_store) == str(agreed).encode()
        await _joined((eng, pub))
        x = eng.prompt(8)
        await eng.store(x)
        await eventually(lambda: index.match(canonical(x)).get(ReplicaKey(name)).kv_blocks == 4)
        assert sync.stats.gaps == sync.stats.stale == sync.stats.malformed == 0
    finally:
        await pub.stop()
        await sync.stop()
        await eng.pub.close()


@pytest.mark.parametrize("first", ["publisher", "router"])
async def test_publisher_and_router_with_different_counts_follow_the_stored_one(
    url: str, key_prefix: str, first: str, caplog: pytest.LogCaptureFixture
) -> None:
    made: list[RedisStore] = []

    def make(shards: int) -> RedisStore:
        made.append(RedisStore.from_url(url, KeySchema(key_prefix, shards)))
        return made[-1]

    try:
        with caplog.at_level(logging.WARNING):
            await _converge(make, first, pub_shards=4, router_shards=2)
        key = f"{key_prefix}:stream-shards"
        agreed, other = (4, 2) if first == "publisher" else (2, 4)
        told = [r.getMessage() for r in caplog.records if key in r.getMessage()]
        assert any(f"holds {agreed}" in m and f"configured {other}" in m for m in told), told
    finally:
        for s in made:
            await s.close()


async def test_the_count_survives_flushall_and_a_restart_stores_it_again(
    private_redis: LocalRedis,
) -> None:
    """FLUSHALL removes the key: running processes store the count they follow again; after
    another FLUSHALL, whoever starts first stores its own and the others follow it."""
    made: list[RedisStore] = []

    def make(shards: int) -> RedisStore:
        made.append(RedisStore.from_url(private_redis.url, KeySchema("kvr", shards)))
        return made[-1]

    name = _off(4, 2)
    eng = await _engine(16, 4)
    pub_store, router_store = make(4), make(2)
    pub = _publisher(pub_store, name, eng)
    index = PrefixIndex()
    key = ReplicaKey(name)
    try:
        async with pub, IndexSync(router_store, index, **FAST) as sync:
            await _joined((eng, pub))
            assert router_store.schema.stream_shards == 4
            await pub_store.redis.flushall()
            await eventually(lambda: sync.stats.bootstraps >= 2)
            await eventually(lambda: pub.stats.resets >= 2)
            assert await _stored(pub_store) == b"4"
            assert pub_store.schema.stream_shards == router_store.schema.stream_shards == 4
            x = eng.prompt(8)
            await eng.store(x)
            await eventually(lambda: index.match(canonical(x)).get(key).kv_blocks == 4)
        await pub_store.redis.flushall()
        # restarted after the flush: the router (configured 2) comes first this time
        await _converge(lambda n: make(n), "router", pub_shards=4, router_shards=2)
        assert await _stored(pub_store) == b"2"
    finally:
        await eng.pub.close()
        for s in made:
            await s.close()


async def test_an_operator_changes_the_count_and_every_process_follows(
    private_redis: LocalRedis,
) -> None:
    """``SET <p>:stream-shards`` while they run: routers re-bootstrap on the new shards at
    their next audit, publishers register again and republish on theirs at their next
    heartbeat; what the engine stores afterwards reaches the index."""
    pub_store = RedisStore.from_url(private_redis.url, KeySchema("kvr", 2))
    router_store = RedisStore.from_url(private_redis.url, KeySchema("kvr", 2))
    name = _off(4, 2)
    eng = await _engine(16, 5)
    pub = _publisher(pub_store, name, eng)
    index = PrefixIndex()
    key = ReplicaKey(name)
    try:
        async with pub, IndexSync(router_store, index, **FAST) as sync:
            await _joined((eng, pub))
            x = eng.prompt(4)
            await eng.store(x)
            await eventually(lambda: index.match(canonical(x)).get(key).kv_blocks == 2)
            await pub_store.redis.set(pub_store.schema.shards_key, "4")
            await eventually(lambda: router_store.schema.stream_shards == 4)
            await eventually(lambda: pub_store.schema.stream_shards == 4)
            await eventually(lambda: sync.stats.bootstraps >= 2)
            y = eng.prompt(8)
            await eng.store(y)
            await eventually(lambda: index.match(canonical(y)).get(key).kv_blocks == 4)
            assert index.match(canonical(x)).get(key).kv_blocks == 2
    finally:
        await eng.pub.close()
        await pub_store.close()
        await router_store.close()


async def test_a_full_redis_still_reads_the_count(private_redis: LocalRedis) -> None:
    """Redis at ``maxmemory`` (noeviction) refuses a ``SET NX`` even of a key that exists: a
    process that only needs to read the stored count reads it, and a router bootstraps."""
    first = RedisStore.from_url(private_redis.url, KeySchema("kvr", 4))
    late = RedisStore.from_url(private_redis.url, KeySchema("kvr", 2))
    try:
        assert await first.settle_shards() is False
        await first.instance_token()
        await first.redis.config_set("maxmemory", 1)
        try:
            assert await late.settle_shards() is True
            assert late.schema.stream_shards == 4
            async with IndexSync(late, PrefixIndex(), **FAST) as sync:
                assert sync.ready.is_set()
        finally:
            await first.redis.config_set("maxmemory", 0)
    finally:
        await first.close()
        await late.close()


async def test_a_stored_count_that_does_not_parse_is_an_error_naming_the_key(
    redis_url: str, key_prefix: str
) -> None:
    store = RedisStore.from_url(redis_url, KeySchema(key_prefix, 2))
    try:
        for bad in (b"eight", b"0", b"5000"):
            await store.redis.set(store.schema.shards_key, bad)
            with pytest.raises(ValueError, match=f"{key_prefix}:stream-shards"):
                await store.settle_shards()
            assert store.schema.stream_shards == 2
    finally:
        await store.close()


async def test_the_memory_store_has_no_shards_to_agree_on() -> None:
    assert await MemoryStore().settle_shards() is False
