"""Faults of one node of a Redis Cluster, on a private 3-node cluster of this module (nodes
are restarted: the session's ``redis_cluster`` is shared by other tests)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest

from router.bench.redis_server import LocalRedis, LocalRedisCluster
from router.core.index import PrefixIndex
from router.core.types import BlocksStored, ReplicaKey
from router.service.background import _IndexSyncCollector
from router.store.base import LoadSample, ReplicaInfo
from router.store.redis_store import RedisStore
from router.store.schema import KeySchema
from router.store.sync import IndexSync
from router.store.sync_listener import NullListener
from router.store.writer import StoreWriter
from tests.waiting import eventually

FAST = {"audit_interval_s": 0.1, "block_s": 0.05}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    c = LocalRedisCluster(tmp_path_factory.mktemp("fault-cluster"))
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def schema(key_prefix: str) -> KeySchema:
    return KeySchema(key_prefix, stream_shards=4)


def _node_of(cluster: LocalRedisCluster, key: str) -> LocalRedis:
    """The node that serves ``key``'s slot (the others answer MOVED)."""
    for server in cluster.servers:
        with redis.Redis(port=server.port) as r:
            try:
                r.exists(key)
            except redis.ResponseError:
                continue
            return server
    raise AssertionError(f"no node serves {key}")


def _cluster_ok(cluster: LocalRedisCluster) -> bool:
    for server in cluster.servers:
        try:
            with redis.Redis(port=server.port) as r:
                if b"cluster_state:ok" not in r.execute_command("CLUSTER", "INFO"):
                    return False
        except redis.RedisError:
            return False
    return True


async def test_a_node_restarted_empty_does_not_purge_its_live_replicas(
    cluster: LocalRedisCluster, schema: KeySchema
) -> None:
    """The node holding a replica's keys restarts empty (the instance token lives on another
    node, so no router sees a new token): the replica's lease and registration are gone
    with it, its publisher registers again at its next heartbeat. Routers keep it (index
    content and routing) for the data-loss grace instead of purging a live replica at once,
    and count it; then converge to what the publisher republished."""
    store = RedisStore.from_url(cluster.url, schema)
    router_store = RedisStore.from_url(cluster.url, schema)
    downs: list[str] = []

    class Downs(NullListener):
        def replica_down(self, replica: str, keys: Sequence[ReplicaKey]) -> None:
            downs.append(replica)

    try:
        # a replica whose keys are on another node than the instance token
        token_node = _node_of(cluster, schema.instance)
        name = next(
            n
            for n in (f"r{i}" for i in range(100))
            if _node_of(cluster, schema.lease(n)) is not token_node
        )
        node = _node_of(cluster, schema.lease(name))
        info = ReplicaInfo(name, model="m")
        await store.register(info, owner="p", lease_ttl_s=30)
        writer = StoreWriter(store, info.replica_keys(), owner="p")
        writer.add(ReplicaKey(name), [BlocksStored((1, 2))])
        await writer.flush()
        index = PrefixIndex()
        sync = IndexSync(router_store, index, listener=Downs(), lost_store_grace_s=1.0, **FAST)
        async with sync:
            await eventually(lambda: ReplicaKey(name) in index)
            node.restart()  # same port, same cluster config, no data
            await eventually(lambda: _cluster_ok(cluster), 15)
            # the router notices the loss (after its own outage grace, if it saw errors)
            await eventually(lambda: sync.stats.kept_on_data_loss >= 1 or downs, 10)
            assert downs == []
            assert index.match([1, 2]).get(ReplicaKey(name)).kv_blocks == 2
            # the publisher's next heartbeat finds its lease gone: register, republish
            assert not await store.heartbeat(name, "p", 30)
            await store.register(info, owner="p", lease_ttl_s=30, take_over=False)
            writer.add(ReplicaKey(name), [BlocksStored((3,))])
            await writer.reset()

            def republished() -> bool:
                got = index.match([1, 2, 3]).get(ReplicaKey(name))
                return got is not None and got.kv_blocks == 3

            await eventually(republished)
            assert downs == []
    finally:
        await store.close()
        await router_store.close()


async def test_a_stream_that_went_back_is_followed_again(
    cluster: LocalRedisCluster, schema: KeySchema
) -> None:
    """A change-stream shard's node is replaced by one whose entry ids are below the router's
    cursor (restarted empty, or failed over, on a host whose clock is behind the old one's:
    the old node wrote an id ahead of the new clock). Reading on from the cursor would wait
    for ever for ids above it; the audit sees the stream's newest id below the cursor and
    re-bootstraps, so the replica's later entries (a load sample, which no audit re-reads)
    reach the router again."""
    token_node = _node_of(cluster, schema.instance)

    def fits(n: str) -> bool:
        stream_node = _node_of(cluster, schema.stream(schema.shard_of(n)))
        return stream_node is not token_node and stream_node is not _node_of(
            cluster, schema.lease(n)
        )

    name = next(n for n in (f"s{i}" for i in range(200)) if fits(n))
    stream = schema.stream(schema.shard_of(name))
    store = RedisStore.from_url(cluster.url, schema)
    router_store = RedisStore.from_url(cluster.url, schema)
    loads: list[int] = []

    class Loads(NullListener):
        def load(self, key: ReplicaKey, sample: LoadSample, now: float) -> None:
            loads.append(sample.running)

    try:
        info = ReplicaInfo(name, model="m")
        await store.register(info, owner="p", lease_ttl_s=30)
        index = PrefixIndex()
        sync = IndexSync(router_store, index, listener=Loads(), **FAST)
        async with sync:
            await eventually(lambda: ReplicaKey(name) in index)
            await store.publish_load(
                ReplicaKey(name), LoadSample(1, 0, 0.0, time.time()), owner="p"
            )
            await eventually(lambda: 1 in loads)
            # the old node's clock an hour ahead: an entry the router reads (malformed)
            future = f"{int(time.time() * 1000) + 3_600_000}-0"
            await store.redis.xadd(stream, {"t": "?"}, id=future)
            await eventually(lambda: sync.stats.malformed >= 1)
            _node_of(cluster, stream).restart()  # its clock is right: ids now below the cursor
            await eventually(lambda: _cluster_ok(cluster), 15)

            async def sample_seen() -> bool:
                with contextlib.suppress(redis.RedisError, OSError):
                    await store.publish_load(
                        ReplicaKey(name), LoadSample(2, 0, 0.0, time.time()), owner="p"
                    )
                return 2 in loads

            await eventually(sample_seen, 10)
            assert ReplicaKey(name) in index
    finally:
        await store.close()
        await router_store.close()


@pytest.fixture(scope="module")
def partial_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    """A cluster whose nodes go on serving their slots while another is down (the redis.conf
    default, ``cluster-require-full-coverage yes``, makes every node refuse every key once a
    slot has no node)."""
    c = LocalRedisCluster(
        tmp_path_factory.mktemp("partial-cluster"),
        extra_args=("--cluster-require-full-coverage", "no"),
    )
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.mark.parametrize("url_node", [False, True], ids=["another-node", "the-urls-node"])
async def test_a_node_down_does_not_stop_the_other_shards(
    partial_cluster: LocalRedisCluster, key_prefix: str, url_node: bool
) -> None:
    """One node of the cluster stops, another one or the one the URL names (redis-py's
    commands parser asks that one for every XREAD's keys: ``xread_one``). The change-stream
    shards on the other nodes are read on: a replica whose keys and shard live there keeps
    its index current, and the follower reports which shards it cannot read
    (``shards_down``) while ``up`` stays 1."""
    cluster = partial_cluster

    def shared(schema: KeySchema) -> set[int]:  # the nodes of the keys of no replica
        keys = (schema.instance, schema.registry, schema.shards_key)
        return {_node_of(cluster, k).port for k in keys}

    stoppable = cluster.servers[:1] if url_node else cluster.servers[1:]
    schema = next(
        sc
        for sc in (KeySchema(f"{key_prefix}{i}", stream_shards=4) for i in range(100))
        if any(s.port not in shared(sc) for s in stoppable)
    )
    down = next(s for s in stoppable if s.port not in shared(schema))

    def on(n: str) -> LocalRedis:
        return _node_of(cluster, schema.stream(schema.shard_of(n)))

    healthy = next(
        n
        for n in (f"h{i}" for i in range(200))
        if on(n) is not down and _node_of(cluster, schema.lease(n)) is not down
    )
    lost = next(
        n
        for n in (f"d{i}" for i in range(200))
        if on(n) is down and _node_of(cluster, schema.lease(n)) is down
    )
    store = RedisStore.from_url(cluster.url, schema)
    router_store = RedisStore.from_url(cluster.url, schema)
    try:
        writers = {}
        for name in (healthy, lost):
            info = ReplicaInfo(name, model="m")
            await store.register(info, owner="p", lease_ttl_s=30)
            writers[name] = StoreWriter(store, info.replica_keys())
            writers[name].add(ReplicaKey(name), [BlocksStored((1,))])
            await writers[name].flush()
        index = PrefixIndex()
        sync = IndexSync(router_store, index, **FAST)
        async with sync:
            await eventually(lambda: all(ReplicaKey(n) in index for n in (healthy, lost)))
            down.stop()
            writers[healthy].add(ReplicaKey(healthy), [BlocksStored((1, 2))])
            await writers[healthy].flush()

            def followed() -> bool:
                got = index.match([1, 2]).get(ReplicaKey(healthy))
                return got is not None and got.kv_blocks == 2

            await eventually(followed, 8)
            # (a read the node answered just before it stopped may be taken after)
            await eventually(lambda: schema.stream(schema.shard_of(lost)) in sync.shards_down)
            assert sync.up
            assert schema.stream(schema.shard_of(healthy)) not in sync.shards_down
            assert ReplicaKey(lost) in index  # its last known content, as with Redis lost
            registry = CollectorRegistry()
            registry.register(_IndexSyncCollector(sync))
            text = generate_latest(registry).decode()
            for name, up in ((lost, 0), (healthy, 1)):
                stream = schema.stream(schema.shard_of(name))
                assert f'kvrouter_index_sync_shard_up{{stream="{stream}"}} {up}.0' in text
    finally:
        await store.close()
        await router_store.close()
        down.start()  # (its port and cluster config: the next case finds the cluster whole)
        await eventually(lambda: _cluster_ok(cluster), 15)


async def test_shard_reads_ask_no_node_for_their_keys(
    cluster: LocalRedisCluster, schema: KeySchema
) -> None:
    """Each shard's XREAD goes straight to the node serving its slot: none asks a node for
    the command's keys first (``COMMAND GETKEYS``, redis-py's way for XREAD, which also made
    every read fail while the node it asks, the URL's, was down)."""

    def getkeys() -> int:
        calls = 0
        for server in cluster.servers:
            with redis.Redis(port=server.port) as r:
                stats = r.info("commandstats").get("cmdstat_command|getkeys", {})
                calls += int(stats.get("calls", 0))
        return calls

    store = RedisStore.from_url(cluster.url, schema)
    try:
        info = ReplicaInfo("r0", model="m")
        await store.register(info, owner="p", lease_ttl_s=30)
        writer = StoreWriter(store, info.replica_keys())
        cursor = await store.cursor()
        writer.add(ReplicaKey("r0"), [BlocksStored((1, 2))])
        await writer.flush()
        before = getkeys()
        read = await store.read_changes(cursor, block_s=0, count=100)
        assert len(read.changes) == 1 and not read.unread
        assert getkeys() == before
    finally:
        await store.close()
