"""Publisher sidecars + engines (vLLM wire format over real ZMQ) + real Redis + routers
(``IndexSync``): convergence, restarts, Redis data loss, lease expiry, malformed input."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from router.bench.redis_server import LocalRedis
from router.core.hashing import hash_prompt, root_hash
from router.core.index import PrefixIndex
from router.core.load import LoadTracker
from router.core.types import ReplicaKey
from router.events.ingest import EndpointSpec
from router.events.model import EngineBlockRemoved, EngineBlockStored
from router.events.zmq_pub import KVEventPublisher
from router.publisher.publisher import Publisher, PublisherCollector, PublisherSettings
from router.store.base import ReplicaDown, ReplicaInfo, ReplicaUp, ResetChange
from router.store.redis_store import RedisStore
from router.store.schema import KeySchema
from router.store.sync import IndexSync
from router.store.sync_listener import LoadTrackerListener
from tests.ports import free_port
from tests.waiting import eventually

B = 32
MODEL = "m"
FAST_SYNC = {"audit_interval_s": 0.1, "block_s": 0.05}


def canonical(tokens: list[int]) -> list[int]:
    return hash_prompt(tokens, B, root_hash(MODEL)).hashes


@dataclass
class FakeEngine:
    """A KV-event source in vLLM's format (engine blocks of ``be`` tokens)."""

    pub: KVEventPublisher
    be: int
    rng: random.Random

    def prompt(self, n_blocks: int) -> list[int]:
        return [self.rng.randrange(30_000) for _ in range(n_blocks * self.be)]

    def _h(self, tokens: list[int], i: int) -> int:
        return hash(tuple(tokens[: (i + 1) * self.be])) & (2**63 - 1)

    async def store(self, tokens: list[int], rank: int | None = None) -> None:
        n = len(tokens) // self.be
        hashes = tuple(self._h(tokens, i) for i in range(n))
        await self.pub.publish([EngineBlockStored(hashes, None, tuple(tokens), self.be)], rank)

    async def evict(self, tokens: list[int], keep_blocks: int) -> None:
        n = len(tokens) // self.be
        gone = tuple(self._h(tokens, i) for i in range(n - 1, keep_blocks - 1, -1))
        await self.pub.publish([EngineBlockRemoved(gone)])


async def _engine(be: int, seed: int, encoding: str = "array") -> FakeEngine:
    pub = KVEventPublisher(
        f"tcp://127.0.0.1:{free_port()}",
        f"tcp://127.0.0.1:{free_port()}",
        encoding=encoding,  # type: ignore[arg-type]
    )
    pub.start()
    return FakeEngine(pub, be, random.Random(seed))


def _publisher(
    store: RedisStore, name: str, eng: FakeEngine, metrics_url: str | None = None, **kw: object
) -> Publisher:
    info = ReplicaInfo(name, url=f"http://{name}", model=MODEL, block_size=B)
    spec = EndpointSpec(eng.pub.endpoint, eng.pub.replay_endpoint)
    options: dict[str, object] = {"heartbeat_s": 0.1, "lease_ttl_s": 1.0, "load_interval_s": 0.1}
    options.update(kw)
    settings = PublisherSettings(
        info,
        (spec,),
        engine_metrics_url=metrics_url,
        **options,  # type: ignore[arg-type]
    )
    return Publisher(settings, store)


async def _joined(*pairs: tuple[FakeEngine, Publisher]) -> None:
    """Until each publisher's SUB socket gets what its engine publishes (a ZMQ subscription
    reaches the PUB socket a moment after the connect): empty batches until one arrives."""
    for eng, pub in pairs:
        seen = pub.ingest.stats.payloads

        async def heard(eng: FakeEngine = eng, pub: Publisher = pub, seen: int = seen) -> bool:
            if pub.ingest.stats.payloads > seen:
                return True
            await eng.pub.publish([])
            return False

        await eventually(heard)


@pytest.fixture(params=["redis", "redis_cluster"])
async def stores(
    request: pytest.FixtureRequest, key_prefix: str
) -> AsyncIterator[Callable[[], RedisStore]]:
    """Store factories on the session's redis-server, then on its 3-node cluster."""
    if request.param == "redis_cluster":
        url = request.getfixturevalue("redis_cluster").url
    else:
        url = request.getfixturevalue("redis_url")
    made: list[RedisStore] = []

    def make() -> RedisStore:
        s = RedisStore.from_url(url, KeySchema(key_prefix, stream_shards=4))
        made.append(s)
        return s

    yield make
    for s in made:
        await s.close()


async def test_two_routers_two_publishers_converge_and_restarted_router_recovers(
    stores: Callable[[], RedisStore],
) -> None:
    e1, e2 = await _engine(16, 1, "array"), await _engine(128, 2, "map")
    p1, p2 = _publisher(stores(), "r1", e1), _publisher(stores(), "r2", e2)
    a, b = PrefixIndex(), PrefixIndex()
    try:
        async with p1, p2, IndexSync(stores(), a, **FAST_SYNC), IndexSync(stores(), b, **FAST_SYNC):
            await _joined((e1, p1), (e2, p2))
            x, y = e1.prompt(16), e2.prompt(3)  # 256 tokens on r1, 384 on r2
            await e1.store(x)
            await e2.store(y)
            cx, cy = canonical(x), canonical(y)
            for idx in (a, b):
                await eventually(lambda idx=idx: idx.match(cx).get(ReplicaKey("r1")).kv_blocks == 8)
                await eventually(
                    lambda idx=idx: idx.match(cy).get(ReplicaKey("r2")).kv_blocks == 12
                )
            await e1.evict(x, keep_blocks=6)  # 96 tokens stay: 3 router blocks
            await eventually(lambda: a.match(cx).get(ReplicaKey("r1")).kv_blocks == 3)
            await eventually(lambda: b.match(cx).get(ReplicaKey("r1")).kv_blocks == 3)
            # A router started now (a restarted one) recovers the same index from Redis.
            c = PrefixIndex()
            async with IndexSync(stores(), c, **FAST_SYNC):
                assert c.match(cx).get(ReplicaKey("r1")).kv_blocks == 3
                assert c.match(cy).get(ReplicaKey("r2")).kv_blocks == 12
    finally:
        await e1.pub.close()
        await e2.pub.close()


async def test_dropped_zmq_message_is_replayed_into_redis(stores: Callable[[], RedisStore]) -> None:
    eng = await _engine(16, 3)
    pub = _publisher(stores(), "rp", eng)
    index = PrefixIndex()
    try:
        async with pub, IndexSync(stores(), index, **FAST_SYNC):
            await _joined((eng, pub))
            x = eng.prompt(8)
            eng.pub.drop_next = 1
            await eng.store(x)
            z = eng.prompt(4)
            await eng.store(z)  # reveals the gap; the publisher replays x
            await eventually(lambda: index.match(canonical(x)).get(ReplicaKey("rp")).kv_blocks == 4)
            assert pub.ingest.stats.lost_batches == 0
    finally:
        await eng.pub.close()


async def test_malformed_events_are_counted_and_do_no_harm(
    stores: Callable[[], RedisStore],
) -> None:
    eng = await _engine(16, 4)
    pub = _publisher(stores(), "rm", eng)
    index = PrefixIndex()
    try:
        async with pub, IndexSync(stores(), index, **FAST_SYNC):
            await _joined((eng, pub))
            await eng.pub.publish_raw(b"\xc1\xc1")
            await eng.pub.publish_raw(b"\x92\xcb")
            await eng.pub.publish(
                [EngineBlockStored((1,), None, (1, 2), 16), EngineBlockRemoved((5,), "TAPE")]
            )
            x = eng.prompt(4)
            await eng.store(x)
            await eventually(lambda: index.match(canonical(x)).get(ReplicaKey("rm")).kv_blocks == 2)
            assert pub.ingest.stats.malformed_payloads == 2
            assert pub.ingest.stats.malformed_events == 2
            # well-formed but not indexable: a window store without its size, counted
            window = EngineBlockStored(
                (7,), None, tuple(range(16)), 16, group_idx=1, kv_cache_spec_kind="sliding_window"
            )
            await eng.pub.publish([window])
            await eventually(lambda: pub.ingest.not_indexed().get("unknown_window") == 1)
            page = generate_latest(_registry(pub)).decode()
            sample = 'kvrouter_publisher_blocks_not_indexed_total{reason="unknown_window"} 1.0'
            assert sample in page
    finally:
        await eng.pub.close()


def _registry(pub: Publisher) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(PublisherCollector(pub))
    return registry


async def _metrics_server(text: str) -> tuple[web.AppRunner, str]:
    async def handler(_: web.Request) -> web.Response:
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/metrics"


async def test_crashed_publisher_lease_expires_and_load_is_published(
    stores: Callable[[], RedisStore],
) -> None:
    page = (
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 3\n'
        '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0"} 7\n'
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.42\n'
    )
    runner, url = await _metrics_server(page)
    eng = await _engine(16, 5)
    pub = _publisher(stores(), "rc", eng, metrics_url=url, deregister_on_stop=False)
    index, tracker = PrefixIndex(), LoadTracker()
    key = ReplicaKey("rc")
    try:
        async with IndexSync(stores(), index, listener=LoadTrackerListener(tracker), **FAST_SYNC):
            await pub.start()
            await eventually(lambda: tracker.view(key, 0).engine is not None)
            report = tracker.view(key, 0).engine
            assert report is not None and (report.running, report.waiting) == (3, 7)
            assert report.kv_usage == pytest.approx(0.42)
            # Crash: the tasks stop, nothing deregisters (``deregister_on_stop=False``);
            # the 1 s lease runs out. (``stop`` re-cancels until the tasks end: one cancel
            # can be swallowed by a Redis command in flight, and the heartbeat lives on.)
            await pub.stop()
            await eventually(lambda: key not in index, timeout=5)
            assert key not in tracker.replicas()
    finally:
        await pub.stop()
        await runner.cleanup()
        await eng.pub.close()


async def test_the_publisher_publishes_its_models_load_from_a_page_of_several(
    stores: Callable[[], RedisStore],
) -> None:
    """An engine page carrying another model's series too (two vLLM servers sharing a
    ``PROMETHEUS_MULTIPROC_DIR``): the load published is the publisher's model's, not the
    larger of the two models' figures."""
    page = "".join(
        f"# TYPE {name} gauge\n"
        f'{name}{{engine="0",model_name="{MODEL}"}} {mine}\n'
        f'{name}{{engine="0",model_name="other-model"}} {other}\n'
        for name, mine, other in (
            ("vllm:num_requests_running", 3, 30),
            ("vllm:num_requests_waiting", 7, 70),
            ("vllm:kv_cache_usage_perc", 0.42, 0.99),
        )
    )
    runner, url = await _metrics_server(page)
    eng = await _engine(16, 6)
    pub = _publisher(stores(), "rm", eng, metrics_url=url)
    tracker = LoadTracker()
    key = ReplicaKey("rm")
    try:
        listener = LoadTrackerListener(tracker)
        async with IndexSync(stores(), PrefixIndex(), listener=listener, **FAST_SYNC):
            await pub.start()
            await eventually(lambda: tracker.view(key, 0).engine is not None)
            report = tracker.view(key, 0).engine
            assert report is not None and (report.running, report.waiting) == (3, 7)
            assert report.kv_usage == pytest.approx(0.42)
    finally:
        await pub.stop()
        await runner.cleanup()
        await eng.pub.close()


async def test_a_restarted_publisher_is_not_taken_for_the_old_one_by_a_lagging_router(
    stores: Callable[[], RedisStore],
) -> None:
    """A publisher stops (deregistering: its keys and stored seq go) and another starts for
    the same replica name, while a router lags so far behind that the stream is trimmed past
    the old one's Down and the new one's Up and reset entries. The new publisher's batches
    must not look like old ones to that router: numbered from 1 again, they were duplicates
    of seqs it had applied, dropped while the replica stayed busy (the audit's stale check
    needs an idle replica; turned off here), and the old engine's blocks stayed indexed."""
    old_eng, new_eng = await _engine(16, 41), await _engine(16, 42)
    old_store, new_store = stores(), stores()
    old = _publisher(old_store, "again", old_eng)
    new = _publisher(new_store, "again", new_eng)
    key = ReplicaKey("again")
    index = PrefixIndex()
    busy = {"audit_interval_s": 3600.0, "block_s": 0.05}

    def held(tokens: list[int]) -> int:
        m = index.match(canonical(tokens)).get(key)
        return 0 if m is None else m.kv_blocks

    def losing(store: RedisStore, lost: tuple[type, ...]) -> Callable[[], None]:
        xadd = store._xadd
        store._xadd = lambda pipe, r, change: (  # type: ignore[method-assign]
            None if isinstance(change, lost) else xadd(pipe, r, change)
        )
        return lambda: setattr(store, "_xadd", xadd)

    try:
        async with IndexSync(stores(), index, **busy):
            await old.start()
            await _joined((old_eng, old))
            olds = [old_eng.prompt(4) for _ in range(6)]
            for x in olds:  # one flush each: the old seq climbs
                await old_eng.store(x)
                await eventually(lambda x=x: held(x) == len(canonical(x)))
            restore = losing(old_store, (ReplicaDown,))
            await old.stop()
            restore()
            restore = losing(new_store, (ReplicaUp, ResetChange))
            await new.start()
            restore()
            await _joined((new_eng, new))
            y = new_eng.prompt(4)
            await new_eng.store(y)
            await eventually(lambda: _stored_holds(new_store, key, canonical(y), ()))
            await eventually(lambda: held(y) == len(canonical(y)))
            # (a gap's resync follows the batch that showed it)
            await eventually(lambda: [held(x) for x in olds] == [0] * len(olds))
    finally:
        await new.stop()
        await old.stop()
        await old_eng.pub.close()
        await new_eng.pub.close()


class _DownButHeartbeats:
    """A store that fails every call but heartbeats while ``down``: Redis answering again
    just as the publisher's heartbeat comes round, before its flush loop's next retry."""

    def __init__(self, inner: RedisStore) -> None:
        self.inner = inner
        self.down = True
        self.heartbeats = 0

    def __getattr__(self, name: str) -> object:
        attr = getattr(self.inner, name)
        if name == "heartbeat":
            self.heartbeats += 1
        if not self.down or name == "heartbeat" or not callable(attr):
            return attr

        async def fail(*args: object, **kw: object) -> object:
            raise ConnectionError("Redis unreachable")

        return fail


async def test_a_publisher_started_while_redis_is_down_numbers_after_the_stored_seq(
    stores: Callable[[], RedisStore],
) -> None:
    """The stored seq is resumed when the publisher first registers, not only when its
    start did: with Redis down at start, it numbered from 1 under the old publisher's seq."""
    old_eng, new_eng = await _engine(16, 43), await _engine(16, 44)
    store = stores()
    old = _publisher(store, "late", old_eng, deregister_on_stop=False)
    key = ReplicaKey("late")
    down = _DownButHeartbeats(stores())
    new = _publisher(down, "late", new_eng)  # type: ignore[arg-type]
    try:
        await old.start()
        await old.stop()  # (its keys and seq stay: as after a crash)
        (before,) = await store.stored_seqs([key])
        assert before is not None
        await new.start()
        assert new.stats.store_errors == 1
        down.down = False
        await eventually(lambda: new.stats.resets == 1)
        (after,) = await store.stored_seqs([key])
        assert after is not None and after > before
    finally:
        await new.stop()
        await old_eng.pub.close()
        await new_eng.pub.close()


async def test_a_publisher_started_while_redis_is_down_does_not_stand_down_for_its_predecessor(
    stores: Callable[[], RedisStore],
) -> None:
    """A publisher restarts while Redis is unreachable; its predecessor's lease still runs.
    Until it has registered, the lease's other holder is no successor that took the replica
    over: its heartbeat must not make it stand down (it stood down for good, writing
    nothing, and the replica left every router once the old lease expired)."""
    old_eng, new_eng = await _engine(16, 45), await _engine(16, 46)
    old = _publisher(stores(), "restarted", old_eng, deregister_on_stop=False, lease_ttl_s=30.0)
    down = _DownButHeartbeats(stores())
    new = _publisher(down, "restarted", new_eng)  # type: ignore[arg-type]
    try:
        await old.start()
        await old.stop()  # (its lease runs on: as after a crash)
        await new.start()
        await eventually(lambda: down.heartbeats >= 2)
        down.down = False
        await eventually(lambda: new.stats.resets == 1)
        assert not new.stats.superseded
    finally:
        await new.stop()
        await old_eng.pub.close()
        await new_eng.pub.close()


async def test_redis_flush_and_restart_publisher_republishes_router_resyncs(
    private_redis: LocalRedis,
) -> None:
    schema = KeySchema("kvr", stream_shards=2)
    pub_store = RedisStore.from_url(private_redis.url, schema)
    router_store = RedisStore.from_url(private_redis.url, schema)
    eng = await _engine(16, 6)
    pub = _publisher(pub_store, "rf", eng)
    index = PrefixIndex()
    key = ReplicaKey("rf")
    try:
        async with pub, IndexSync(router_store, index, **FAST_SYNC) as sync:
            await _joined((eng, pub))
            x = eng.prompt(8)
            await eng.store(x)
            cx = canonical(x)
            await eventually(lambda: index.match(cx).get(key).kv_blocks == 4)
            await pub_store.redis.flushall()
            # Routers keep it, the publisher notices and republishes in full: its heartbeat
            # finds the lease gone, or (first, on a loaded machine) its seq check the seqs
            await eventually(lambda: pub.stats.lease_losses + pub.stats.seq_mismatches >= 1)
            assert sync.stats.purges == 0
            await eventually(lambda: index.match(cx).get(key).kv_blocks == 4)
            private_redis.restart()
            await eventually(lambda: pub.stats.lease_losses >= 2 or pub.stats.store_errors >= 1)
            y = eng.prompt(4)
            await eng.store(y)
            await eventually(lambda: index.match(canonical(y)).get(key).kv_blocks == 2, 15)
            await eventually(lambda: index.match(cx).get(key).kv_blocks == 4, 15)
            # the instance change re-bootstraps; it is counted when it ends, which may be after
            # the publisher's republished stream already restored the index
            await eventually(lambda: sync.stats.bootstraps >= 2, 15)
    finally:
        await eng.pub.close()
        await pub_store.close()
        await router_store.close()


async def test_a_store_rolled_back_under_a_live_lease_is_republished_and_resynced(
    redis_url: str, key_prefix: str
) -> None:
    """Redis restored from an older snapshot (persistence on, a restart within the lease)
    keeps the lease and loses the later writes: the publisher finds the stored seq behind
    its own and republishes, and a router that starts afterwards sees the engine's cache."""
    schema = KeySchema(key_prefix, stream_shards=2)
    pub_store = RedisStore.from_url(redis_url, schema)
    eng = await _engine(16, 8)
    pub = _publisher(pub_store, "rb", eng)
    key = ReplicaKey("rb")
    redis = pub_store.redis
    state_keys = [schema.meta("rb"), schema.kv("rb", 0), schema.state("rb", 0)]
    try:
        async with pub:
            await _joined((eng, pub))
            x, y = eng.prompt(8), eng.prompt(8)
            await eng.store(x)
            await eventually(lambda: _stored_holds(pub_store, key, canonical(x), ()))
            saved = {k: await redis.dump(k) for k in state_keys}  # the snapshot
            await eng.evict(x, 0)
            await eng.store(y)
            await eventually(lambda: _stored_holds(pub_store, key, canonical(y), canonical(x)))
            resets = pub.stats.resets
            for k, blob in saved.items():  # restored: x whole, y absent
                if blob is not None:
                    await redis.restore(k, 0, blob, replace=True)
            await eventually(lambda: pub.stats.seq_mismatches >= 1)
            await eventually(lambda: pub.stats.resets > resets)
            router_store = RedisStore.from_url(redis_url, schema)
            index = PrefixIndex()
            try:
                async with IndexSync(router_store, index, **FAST_SYNC):
                    await eventually(lambda: index.match(canonical(y)).get(key).kv_blocks == 4)
                    assert index.match(canonical(x)).get(key).kv_blocks == 0
            finally:
                await router_store.close()
    finally:
        await eng.pub.close()
        await pub_store.close()


async def test_a_store_rolled_back_is_republished_even_when_a_flush_comes_first(
    redis_url: str, key_prefix: str
) -> None:
    """The engine goes on publishing after the store went back: the next flush writes the
    seq that follows the publisher's own, so a seq check after it finds the stored seq
    equal to the writer's while the buckets the lost writes changed are stale. The flush
    itself must notice that the stored seq it follows is not the one it wrote last."""
    schema = KeySchema(key_prefix, stream_shards=2)
    pub_store = RedisStore.from_url(redis_url, schema)
    eng = await _engine(16, 9)
    pub = _publisher(pub_store, "rb2", eng, heartbeat_s=60.0)  # no seq check on its own
    key = ReplicaKey("rb2")
    redis = pub_store.redis
    state_keys = [schema.meta("rb2"), schema.kv("rb2", 0), schema.state("rb2", 0)]
    try:
        async with pub:
            await _joined((eng, pub))
            # enough blocks for many buckets: z's flush rewrites only a few of them
            base, x, y, z = eng.prompt(1200), eng.prompt(80), eng.prompt(80), eng.prompt(2)
            await eng.store(base)
            await eng.store(x)
            await eventually(lambda: _stored_holds(pub_store, key, canonical(x), ()))
            saved = {k: await redis.dump(k) for k in state_keys}  # the snapshot
            await eng.evict(x, 0)
            await eng.store(y)
            await eventually(lambda: _stored_holds(pub_store, key, canonical(y), canonical(x)))
            for k, blob in saved.items():  # restored: x whole, y absent
                if blob is not None:
                    await redis.restore(k, 0, blob, replace=True)
            await eng.store(z)  # flushed before any heartbeat
            await eventually(lambda: _stored_holds(pub_store, key, canonical(z), ()))
            pub._check_seqs = True  # (what the next heartbeat sets)
            held = canonical(y) + canonical(z)
            await eventually(lambda: _stored_holds(pub_store, key, held, canonical(x)))
            assert pub.stats.seq_mismatches >= 1
    finally:
        await eng.pub.close()
        await pub_store.close()


async def test_a_second_publisher_for_a_replica_supersedes_the_first(
    stores: Callable[[], RedisStore],
) -> None:
    """Two sidecars publishing one replica name (a restart that overlapped the old one, or a
    copy-paste in the deployment): the last to register owns the lease; the first stands
    down at its next heartbeat, writes nothing more, and its stop leaves the successor's
    registration and state in place."""
    old_eng, new_eng = await _engine(16, 11), await _engine(16, 12)
    old_store, new_store = stores(), stores()
    old, new = _publisher(old_store, "dup", old_eng), _publisher(new_store, "dup", new_eng)
    key = ReplicaKey("dup")
    try:
        await old.start()
        try:
            await _joined((old_eng, old))
            x = old_eng.prompt(8)
            await old_eng.store(x)
            await eventually(lambda: _stored_holds(old_store, key, canonical(x), ()))
            async with new:
                await eventually(lambda: old.stats.superseded)
                assert not new.stats.superseded
                await _joined((new_eng, new))
                y = new_eng.prompt(8)
                await new_eng.store(y)
                await old_eng.store(old_eng.prompt(8))  # the old one no longer writes
                await eventually(lambda: _stored_holds(new_store, key, canonical(y), canonical(x)))
                await old.stop()
                assert [i.replica for i in await new_store.list_replicas()] == ["dup"]
                assert await _stored_holds(new_store, key, canonical(y), canonical(x))
                await asyncio.sleep(0.3)  # heartbeats go on: the new one keeps its lease
                assert not new.stats.superseded and new.stats.lease_losses == 0
            assert await new_store.list_replicas() == []  # its own stop deregisters
        finally:
            await old.stop()
    finally:
        await old_eng.pub.close()
        await new_eng.pub.close()


async def test_a_superseded_publisher_never_takes_the_lease_back(
    stores: Callable[[], RedisStore],
) -> None:
    """The old publisher's heartbeat succeeded just before the new one registered, so the
    flush loop's seq check runs after the new one's reset and finds the stored seq not its
    own: the old one must stand down, not register again over its successor (which then
    stood down itself, and the old one's stop deregistered the replica)."""
    old_eng, new_eng = await _engine(16, 21), await _engine(16, 22)
    old_store, new_store = stores(), stores()
    # heartbeats too rare to notice the takeover: only the seq check can
    old = _publisher(old_store, "dup2", old_eng, heartbeat_s=60.0)
    new = _publisher(new_store, "dup2", new_eng)
    try:
        await old.start()
        try:
            async with new:
                old._check_seqs = True  # (what its last heartbeat before the takeover set)
                await eventually(lambda: old.stats.superseded)
                await asyncio.sleep(0.5)  # new's heartbeats (0.1 s) keep the lease
                assert not new.stats.superseded and new.stats.lease_losses == 0
                await old.stop()
                assert [i.replica for i in await new_store.list_replicas()] == ["dup2"]
        finally:
            await old.stop()
    finally:
        await old_eng.pub.close()
        await new_eng.pub.close()


async def test_a_superseded_publisher_cannot_land_a_write_after_the_takeover(
    stores: Callable[[], RedisStore],
) -> None:
    """The old publisher flushes after its successor registered but before any heartbeat of
    its own told it so. Its write must be refused in the same step that checks the lease:
    otherwise its buckets land under the successor's seq (the old one's seq + 1 is the
    successor's reset seq), the successor's next flush finds the seq it expects, and the
    old engine's blocks stay in the store (and in every router that bootstraps from it)."""
    old_eng, new_eng = await _engine(16, 31), await _engine(16, 32)
    old_store, new_store = stores(), stores()
    old = _publisher(old_store, "dup3", old_eng, heartbeat_s=60.0)  # never notices by heartbeat
    new = _publisher(new_store, "dup3", new_eng, heartbeat_s=60.0)
    key = ReplicaKey("dup3")
    try:
        await old.start()
        try:
            await _joined((old_eng, old))
            x = old_eng.prompt(8)
            await old_eng.store(x)
            await eventually(lambda: _stored_holds(old_store, key, canonical(x), ()))
            async with new:  # registered (took the lease) and reset when start returns
                # enough blocks for several buckets: the successor's small flush rewrites one
                z = old_eng.prompt(512)
                await old_eng.store(z)  # the old one flushes z: its write after the takeover
                await eventually(lambda: old.stats.superseded)
                await _joined((new_eng, new))
                y = new_eng.prompt(8)
                await new_eng.store(y)
                await eventually(lambda: _stored_holds(new_store, key, canonical(y), ()))
                assert await _stored_holds(
                    new_store, key, canonical(y), canonical(z) + canonical(x)
                )
                index = PrefixIndex()  # a router starting now
                async with IndexSync(stores(), index, **FAST_SYNC):
                    assert index.match(canonical(z)).get(key).kv_blocks == 0
                    assert index.match(canonical(y)).get(key).kv_blocks == 4
        finally:
            await old.stop()
    finally:
        await old_eng.pub.close()
        await new_eng.pub.close()


async def _stored_holds(
    store: RedisStore, key: ReplicaKey, held: Sequence[int], gone: Sequence[int]
) -> bool:
    """The stored snapshot of ``key`` holds every block of ``held`` and none of ``gone``."""
    (snap,) = await store.read_replicas([key])
    stored = set() if snap is None else set(snap.kv_hashes)
    return stored >= set(held) and not stored & set(gone)


async def test_stop_ends_a_heartbeat_whose_cancel_the_client_turned_into_an_error(
    redis_url: str, key_prefix: str
) -> None:
    """redis-py may answer a cancel that lands mid-command with a connection error; the
    heartbeat loop must still end (it used to log the error and sleep again, and ``stop``
    waited for it forever)."""
    import redis.exceptions

    eng = await _engine(16, 5)
    store = RedisStore.from_url(redis_url, KeySchema(key_prefix, stream_shards=4))
    pub = _publisher(store, "rh", eng)
    calls = 0
    in_call = asyncio.Event()

    async def heartbeat(*args: object) -> bool:
        nonlocal calls
        calls += 1
        in_call.set()
        try:
            await asyncio.Event().wait()  # a command that is still in flight
        except asyncio.CancelledError:
            raise redis.exceptions.ConnectionError("Connection closed by server.") from None
        return True

    store.heartbeat = heartbeat  # type: ignore[method-assign]
    try:
        await pub.start()
        await asyncio.wait_for(in_call.wait(), 5.0)
        await asyncio.wait_for(pub.stop(), 5.0)
        assert calls == 1
    finally:
        await eng.pub.close()
        await store.close()


async def test_stop_ends_a_heartbeat_whose_cancel_the_client_swallowed(
    redis_url: str, key_prefix: str
) -> None:
    """A cancel that lands mid-command and that the client swallows whole (the command
    returns as if nothing happened): the loop sleeps again, and ``stop`` must still end it
    (CI once hung here: the task 'cancelling' in its sleep, ``stop`` awaiting it)."""
    eng = await _engine(16, 5)
    store = RedisStore.from_url(redis_url, KeySchema(key_prefix, stream_shards=4))
    pub = _publisher(store, "rs", eng)
    in_call = asyncio.Event()

    async def heartbeat(*args: object) -> bool:
        if in_call.is_set():
            return True  # later commands answer at once
        in_call.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()  # the first is in flight when the cancel lands
        return True

    store.heartbeat = heartbeat  # type: ignore[method-assign]
    try:
        await pub.start()
        loops = list(pub._tasks)
        await asyncio.wait_for(in_call.wait(), 5.0)
        # not wait_for: its own cancel on timeout would end the loop and hide the hang
        stopping = asyncio.create_task(pub.stop())
        done, _ = await asyncio.wait({stopping}, timeout=10.0)
        if not done:
            stopping.cancel()
        assert done and all(task.done() for task in loops), loops
    finally:
        await eng.pub.close()
        await store.close()


async def test_a_load_sample_redis_refuses_is_a_store_error_not_a_scrape_error(
    private_redis: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis down while the engine's page answers: the load samples that cannot be written
    count in ``_store_errors_total`` (the alert on failing writes), not in
    ``_scrape_errors_total``, which says the engine's ``/metrics`` failed (before, every
    sample Redis refused was counted, and logged, as a failed scrape of a healthy engine)."""
    page = (
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 3\n'
        '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0"} 7\n'
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.42\n'
    )
    runner, url = await _metrics_server(page)
    store = RedisStore.from_url(private_redis.url, KeySchema("kvr"))
    eng = await _engine(16, 9)
    # a heartbeat far off: the store errors below are the load loop's
    pub = _publisher(store, "rs", eng, metrics_url=url, heartbeat_s=3600, lease_ttl_s=7200)
    try:
        async with pub:
            await eventually(lambda: pub.stats.loads_published >= 1)
            private_redis.stop()
            caplog.clear()

            def load_loop_failed() -> bool:
                return any(
                    r.levelname == "WARNING" and r.getMessage().startswith("publisher: load")
                    for r in caplog.records
                )

            await eventually(load_loop_failed, timeout=10)
            assert pub.stats.scrape_errors == 0
            assert pub.stats.store_errors >= 1
    finally:
        await runner.cleanup()
        await eng.pub.close()
        await store.close()


async def test_an_adapters_publisher_reads_its_base_models_series_on_a_page_of_several(
    stores: Callable[[], RedisStore],
) -> None:
    """vLLM labels every series with its served model's name, an adapter's requests
    included (``model_name`` = ``served_model_name``: vllm/v1/metrics/loggers.py:499-505):
    a publisher for adapter ``A`` on base ``m`` (``--lora-base m``) reads ``m``'s series on a
    page that carries another model's too (before, ``A`` was on none of them and the page
    was refused: no load published at all)."""
    page = "".join(
        f"# TYPE {name} gauge\n"
        f'{name}{{engine="0",model_name="{MODEL}"}} {mine}\n'
        f'{name}{{engine="0",model_name="other-model"}} {other}\n'
        for name, mine, other in (
            ("vllm:num_requests_running", 3, 30),
            ("vllm:num_requests_waiting", 7, 70),
            ("vllm:kv_cache_usage_perc", 0.42, 0.99),
        )
    )
    runner, url = await _metrics_server(page)
    eng = await _engine(16, 10)
    info = ReplicaInfo("ra", url="http://ra", model="A", block_size=B)
    spec = EndpointSpec(eng.pub.endpoint, eng.pub.replay_endpoint)
    settings = PublisherSettings(
        info, (spec,), engine_metrics_url=url, load_interval_s=0.1, lora_base=MODEL
    )
    pub = Publisher(settings, stores())
    tracker = LoadTracker()
    key = ReplicaKey("ra")
    try:
        listener = LoadTrackerListener(tracker)
        async with IndexSync(stores(), PrefixIndex(), listener=listener, **FAST_SYNC):
            await pub.start()
            await eventually(lambda: pub.stats.loads_published + pub.stats.scrape_errors >= 1)
            assert pub.stats.scrape_errors == 0
            await eventually(lambda: tracker.view(key, 0).engine is not None)
            report = tracker.view(key, 0).engine
            assert report is not None and (report.running, report.waiting) == (3, 7)
    finally:
        await pub.stop()
        await runner.cleanup()
        await eng.pub.close()
