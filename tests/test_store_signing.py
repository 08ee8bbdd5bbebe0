"""Signed change entries: with a master secret on the router side, an entry counts only if it
is signed with the key of the replica it names, so a publisher that shares a stream shard
with another replica cannot forge that replica's blocks (real redis-server)."""

from __future__ import annotations

import time

import pytest

from router.core.types import BlocksStored, ReplicaKey
from router.store.base import BatchChange, ReplicaState
from router.store.codec import encode_change, replica_signing_key, sign_fields, verify_fields
from router.store.redis_store import RedisStore
from router.store.schema import KeySchema

MASTER = b"router-master-secret-0123456789ab"


def test_sign_and_verify_fields() -> None:
    change = BatchChange(ReplicaKey("a"), 3, (BlocksStored((1, 2, 3)),))
    fields = sign_fields(encode_change(change), replica_signing_key(MASTER, "a"))
    assert verify_fields(fields, MASTER)
    assert not verify_fields(fields, b"another master")
    tampered = {**fields, b"s": b"4"}
    assert not verify_fields(tampered, MASTER)
    forged = sign_fields(encode_change(change), replica_signing_key(MASTER, "b"))
    assert not verify_fields(forged, MASTER)  # b's key cannot sign for a
    assert not verify_fields(encode_change(change), MASTER)  # unsigned
    assert replica_signing_key(MASTER, "a") != replica_signing_key(MASTER, "b")


@pytest.mark.parametrize("server", ["redis", "redis_cluster"])
async def test_router_drops_entries_not_signed_by_the_named_replica(
    server: str, request: pytest.FixtureRequest, key_prefix: str
) -> None:
    redis_url = (
        request.getfixturevalue("redis_cluster").url
        if server == "redis_cluster"
        else request.getfixturevalue("redis_url")
    )
    schema = KeySchema(key_prefix, stream_shards=1)  # every replica shares the one shard
    honest = RedisStore.from_url(redis_url, schema, signing_key=replica_signing_key(MASTER, "a"))
    # "b"'s publisher holds only b's key but writes in a's name.
    forger = RedisStore.from_url(redis_url, schema, signing_key=replica_signing_key(MASTER, "b"))
    unsigned = RedisStore.from_url(redis_url, schema)
    router = RedisStore.from_url(redis_url, schema, verify_master=MASTER)
    try:
        cursor = await router.cursor()
        key = ReplicaKey("a")
        writers = ((honest, (1, 2)), (forger, (66, 67)), (unsigned, (99,)))
        for seq, (store, blocks) in enumerate(writers, 1):
            state = ReplicaState(key, seq=seq)  # (each following the stored seq)
            events = (BlocksStored(blocks),)
            state.apply(events)
            await store.write([(state, events)])
        read = await router.read_changes(cursor, 0.0, 100)
        got = [c.events[0].hashes for c in read.changes if isinstance(c, BatchChange)]
        assert got == [(1, 2)]
        assert read.malformed == 2
        # A router without a master (signing off) reads all three, as before.
        plain = RedisStore.from_url(redis_url, schema)
        everything = await plain.read_changes(cursor, 0.0, 100)
        assert len([c for c in everything.changes if isinstance(c, BatchChange)]) == 3
        await plain.close()
    finally:
        for store in (honest, forger, unsigned, router):
            await store.close()


@pytest.mark.parametrize("replica", ["r0", "kimi-k3-rack-a01-7"])
def test_router_reap_entries_are_signed_for_the_replica(replica: str) -> None:
    store = RedisStore.__new__(RedisStore)
    store.signing_key, store.verify_master = None, MASTER

    class Pipe:
        fields: dict[bytes, bytes] = {}

        def xadd(self, stream: str, fields: dict[bytes, bytes], **kw: object) -> None:
            Pipe.fields = fields

    store.schema = KeySchema("p", 4)
    store.stream_maxlen = 10
    from router.store.base import ReplicaDown

    store._xadd(Pipe(), replica, ReplicaDown(replica))
    assert verify_fields(Pipe.fields, MASTER)


def test_router_setting_is_validated() -> None:
    from router.core.errors import ConfigError
    from router.service.config import build_settings

    ok = build_settings({"server": {"redis_signing_master": MASTER.hex()}})
    assert bytes.fromhex(ok.server.redis_signing_master or "") == MASTER
    for bad in ("not-hex", "abcd"):
        with pytest.raises(ConfigError, match="redis_signing_master"):
            build_settings({"server": {"redis_signing_master": bad}})


def test_signing_key_command_derives_the_replica_key() -> None:
    from tests.inprocess import kvrouter

    out = kvrouter("signing-key", "--replica", "a", "--master", MASTER.hex())
    assert out.returncode == 0, out.stderr
    assert bytes.fromhex(out.stdout.strip()) == replica_signing_key(MASTER, "a")


async def test_a_registration_entry_signed_in_one_name_cannot_carry_another(
    redis_url: str, key_prefix: str
) -> None:
    """A ``U`` entry names its replica twice: the signed ``r`` field and the info's own
    ``replica``. ``a``'s publisher signs with its own key (``r`` = ``a``) but puts ``b``'s
    registration in the info, pointing ``b`` at its own address: the router must drop it,
    not adopt it as ``b``'s (a signed entry speaks only for the replica it is signed for)."""
    from router.store.base import ReplicaInfo, ReplicaUp

    schema = KeySchema(key_prefix, stream_shards=1)  # a and b share the one shard
    forger = RedisStore.from_url(redis_url, schema, signing_key=replica_signing_key(MASTER, "a"))
    router = RedisStore.from_url(redis_url, schema, verify_master=MASTER)
    try:
        cursor = await router.cursor()
        fields = encode_change(ReplicaUp(ReplicaInfo("b", url="http://evil:1", model="m")))
        fields[b"r"] = b"a"  # the name it can sign for
        await forger.redis.xadd(schema.stream(0), sign_fields(fields, forger.signing_key or b""))
        assert verify_fields(fields, MASTER)  # a genuine signature, of a
        read = await router.read_changes(cursor, 0.0, 100)
        assert [c for c in read.changes if isinstance(c, ReplicaUp)] == []
        assert read.malformed == 1
    finally:
        await forger.close()
        await router.close()


async def test_a_busy_replica_whose_entries_are_all_dropped_is_read_from_its_snapshot(
    redis_url: str, key_prefix: str
) -> None:
    """Signing rolled out to routers before one publisher has its key (or a key derived from
    another master): the router drops every entry of that replica. Its state in Redis (which
    ACLs protect, not signatures) is right, but while the replica keeps writing no later
    batch shows a gap and its stored seq never stands still for an audit: the index stayed
    at the bootstrap snapshot for as long as the replica was busy. The audit now also resyncs
    a key the index has not brought up to the seq the store held an audit earlier."""
    import asyncio
    import re

    from prometheus_client import CollectorRegistry, generate_latest

    from router.core.index import PrefixIndex
    from router.service.background import _IndexSyncCollector
    from router.store.base import ReplicaInfo
    from router.store.sync import IndexSync
    from router.store.writer import StoreWriter
    from tests.waiting import eventually

    schema = KeySchema(key_prefix, stream_shards=1)
    unsigned = RedisStore.from_url(redis_url, schema)  # the publisher without its key yet
    router = RedisStore.from_url(redis_url, schema, verify_master=MASTER)
    key = ReplicaKey("busy")
    info = ReplicaInfo("busy", url="http://busy", model="m")
    await unsigned.register(info, owner="pub-busy", lease_ttl_s=30)
    writer = StoreWriter(unsigned, info.replica_keys(), owner="pub-busy")
    await writer.flush()
    index = PrefixIndex()
    stop = asyncio.Event()

    async def busy() -> None:  # a flush per Redis round trip: the stored seq never rests
        block = 1
        while not stop.is_set():
            writer.add(key, [BlocksStored((block,))])
            await writer.flush()
            block += 1

    try:
        async with IndexSync(router, index, audit_interval_s=0.1, block_s=0.05) as sync:
            task = asyncio.create_task(busy())
            try:
                await eventually(lambda: sync.stats.malformed > 10)  # dropped, all of them
                await eventually(
                    lambda: index.match([1]).get(key).kv_blocks == 1,
                    message="the index never read the busy replica's state again",
                )
                assert sync.stats.batches == 0
                # and the operator sees it: entries dropped, the key read again and again
                registry = CollectorRegistry()
                registry.register(_IndexSyncCollector(sync))
                page = generate_latest(registry).decode()
                dropped = re.search(
                    r"^kvrouter_index_sync_dropped_entries_total (\S+)$", page, re.M
                )
                assert dropped and float(dropped[1]) > 10, page
                resyncs = re.search(r"^kvrouter_index_sync_key_resyncs_total (\S+)$", page, re.M)
                assert resyncs and float(resyncs[1]) >= 2, page  # bootstrap, then an audit
            finally:
                stop.set()
                await task
    finally:
        await unsigned.close()
        await router.close()


async def test_a_replayed_registration_entry_does_not_bring_back_an_old_registration(
    redis_url: str, key_prefix: str
) -> None:
    """A signature proves who wrote an entry, not when: a publisher sharing a stream shard
    with ``x`` copies one of ``x``'s old ``U`` entries (its registration at another address,
    with one DP rank) and appends it again. ``x``'s lease lives, so the router took the
    entry's registration as ``x``'s: it routed ``x``'s traffic to the old address and dropped
    rank 1 (which the old registration lacks) from the index, until the next audit and for
    as long as the replays went on.
    A ``U`` entry now makes the router read the registration Redis holds (which ACLs
    protect), never adopt the entry's own."""
    from router.core.index import PrefixIndex
    from router.store.base import LoadSample, ReplicaInfo
    from router.store.sync import IndexSync
    from router.store.sync_listener import NullListener
    from router.store.writer import StoreWriter
    from tests.waiting import eventually

    class Seen(NullListener):
        def __init__(self) -> None:
            self.urls: list[str] = []
            self.loads: list[float] = []

        def replica_up(self, info: ReplicaInfo) -> None:
            self.urls.append(info.url)

        def load(self, key: ReplicaKey, sample: LoadSample, now: float) -> None:
            self.loads.append(sample.wall_ts)

    schema = KeySchema(key_prefix, stream_shards=1)  # x and the replayer share the one shard
    x = RedisStore.from_url(redis_url, schema, signing_key=replica_signing_key(MASTER, "x"))
    router = RedisStore.from_url(redis_url, schema, verify_master=MASTER)
    old = ReplicaInfo("x", url="http://old-host:8000", model="m", dp_ranks=(0,))
    new = ReplicaInfo("x", url="http://new-host:8000", model="m", dp_ranks=(0, 1))
    try:
        await x.register(old, owner="pub-x", lease_ttl_s=30)
        old_entry = (await x.redis.xrange(schema.stream(0)))[-1][1]  # x's signed U
        await x.register(new, owner="pub-x2", lease_ttl_s=30)
        writer = StoreWriter(x, new.replica_keys(), owner="pub-x2")
        writer.add(ReplicaKey("x", 1), [BlocksStored((5, 6))])
        await writer.flush()
        index, seen = PrefixIndex(), Seen()
        async with IndexSync(router, index, listener=seen, audit_interval_s=60, block_s=0.05):
            assert seen.urls == [new.url]
            assert verify_fields(old_entry, MASTER)  # genuinely x's
            await x.redis.xadd(schema.stream(0), old_entry)  # the replay
            stamp = time.time()  # (a sample older than load_max_age_s is not passed on)
            await x.publish_load(ReplicaKey("x", 0), LoadSample(0, 0, 0.0, stamp), "pub-x2")
            await eventually(lambda: stamp in seen.loads)  # read past the replay
            assert seen.urls[-1] == new.url, seen.urls
            assert old.url not in seen.urls
            assert ReplicaKey("x", 1) in index
            assert index.match([5, 6]).get(ReplicaKey("x", 1)).kv_blocks == 2
    finally:
        await x.close()
        await router.close()
