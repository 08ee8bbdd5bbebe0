"""Store contract + IndexSync, on the in-memory store, a real redis-server and a real 3-node
Redis Cluster."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from router.bench.redis_server import LocalRedis
from router.core.index import PrefixIndex
from router.core.load import LoadTracker
from router.core.types import (
    AllCleared,
    ApplyOutcome,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    Kind,
    ReplicaKey,
    Tier,
)
from router.service.background import _IndexSyncCollector
from router.store.base import (
    IndexStore,
    LeaseLost,
    LeaseTaken,
    LoadSample,
    ReplicaDown,
    ReplicaInfo,
    ReplicaSnapshot,
    ReplicaUp,
    SeqMismatch,
    UnreadableSnapshot,
)
from router.store.memory import MemoryStore
from router.store.redis_store import RedisStore
from router.store.schema import KeySchema
from router.store.sync import IndexSync
from router.store.sync_listener import LoadTrackerListener, NullListener
from router.store.writer import StoreWriter
from tests.waiting import eventually

FAST = {"audit_interval_s": 0.1, "block_s": 0.05}


def chain(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


def content(index: PrefixIndex, chains: dict[str, list[int]]) -> dict[str, Any]:
    """What the index says about each chain on each replica (comparable across indexes)."""
    out: dict[str, Any] = {}
    for name, hashes in chains.items():
        matches = index.match(hashes)
        out[name] = sorted((str(k), m) for k, m in matches.items())
    out["_replicas"] = sorted(str(k) for k in index.replicas())
    out["_sizes"] = sorted((str(k), index.replica_size(k)) for k in index.replicas())
    return out


@pytest.fixture(params=["memory", "redis", "redis_cluster"])
async def store(request: pytest.FixtureRequest, key_prefix: str) -> AsyncIterator[IndexStore]:
    if request.param == "memory":
        yield MemoryStore()
        return
    if request.param == "redis_cluster":
        url = request.getfixturevalue("redis_cluster").url
    else:
        url = request.getfixturevalue("redis_url")
    s = RedisStore.from_url(url, KeySchema(key_prefix, stream_shards=4))
    assert s.cluster == (request.param == "redis_cluster")
    try:
        yield s
    finally:
        await s.close()


async def _publish(store: IndexStore, name: str, ranks: tuple[int, ...] = (0,)) -> StoreWriter:
    info = ReplicaInfo(name, url=f"http://{name}", model="m", dp_ranks=ranks)
    await store.register(info, owner=f"pub-{name}", lease_ttl_s=30)
    writer = StoreWriter(store, info.replica_keys())
    await writer.flush()  # initial reset
    return writer


async def _torn_and_other(store: IndexStore) -> tuple[StoreWriter, StoreWriter]:
    """Writers of replica "torn", blocks 1-3 stored, and of replica "o" (nothing yet)."""
    w = await _publish(store, "torn")
    other = await _publish(store, "o")
    w.add(ReplicaKey("torn"), [BlocksStored((1, 2, 3))])
    await w.flush()
    return w, other


async def test_two_routers_converge_and_a_restarted_router_recovers(store: IndexStore) -> None:
    rng = random.Random(1)
    chains = {f"c{i}": chain(rng, 40) for i in range(6)}
    w1 = await _publish(store, "r1", ranks=(0, 1))
    w2 = await _publish(store, "r2")
    # Content written before any router starts (bootstrap path).
    w1.add(ReplicaKey("r1"), [BlocksStored(tuple(chains["c0"]))])
    w2.add(ReplicaKey("r2"), [BlocksStored(tuple(chains["c1"][:20]), Tier.CPU)])
    await w1.flush()
    await w2.flush()
    a, b = PrefixIndex(), PrefixIndex()
    async with IndexSync(store, a, **FAST), IndexSync(store, b, **FAST):
        # Content written while they follow (stream path), incl. removals, state, clears.
        w1.add(ReplicaKey("r1", 1), [BlocksStored(tuple(chains["c2"]))])
        w1.add(ReplicaKey("r1", 1), [BlocksRemoved(tuple(chains["c2"][30:]))])
        w2.add(ReplicaKey("r2"), [BlocksStored(tuple(chains["c3"]))])
        w2.add(
            ReplicaKey("r2"), [BlocksStored((chains["c3"][9], chains["c3"][39]), kind=Kind.STATE)]
        )
        await w1.flush()
        await w2.flush()
        w1.add(ReplicaKey("r1"), [AllCleared(), BlocksStored(tuple(chains["c4"][:10]))])
        await w1.flush()
        expected = {
            "c0": [],
            "c1": [("r2", (20, 0, 20, 20))],
            "c2": [("r1#dp1", (30, 30, 30, 30))],
            "c3": [("r2", (40, 40, 40, 40))],
            "c4": [("r1", (10, 10, 10, 10))],
        }

        def settled(index: PrefixIndex) -> bool:
            got = content(index, chains)
            return all(
                [
                    (k, (m.kv_blocks, m.gpu_blocks, m.host_blocks, m.usable_blocks))
                    for k, m in got[c]
                ]
                == v
                for c, v in expected.items()
            )

        await eventually(lambda: settled(a) and settled(b))
        assert content(a, chains) == content(b, chains)
        assert a.match(chains["c3"], hybrid=True).get(ReplicaKey("r2")).usable_blocks == 40
        assert a.match(chains["c3"][:25], hybrid=True).get(ReplicaKey("r2")).usable_blocks == 10
        # c1 was stored on CPU only: kv but no GPU blocks.
        m = a.match(chains["c1"]).get(ReplicaKey("r2"))
        assert (m.kv_blocks, m.gpu_blocks) == (20, 0)
    # A router started later (restarted) recovers the same index from the store.
    c = PrefixIndex()
    async with IndexSync(store, c, **FAST):
        assert content(c, chains) == content(a, chains)


async def test_lease_expiry_purges_and_load_reaches_the_tracker(store: IndexStore) -> None:
    info = ReplicaInfo("short", model="m")
    # a lease that outlasts the setup however loaded the machine; the heartbeat below
    # shortens it to 0.4 s (it once lapsed before that heartbeat: False, in a CI run)
    await store.register(info, owner="p", lease_ttl_s=30)
    writer = StoreWriter(store, info.replica_keys())
    writer.add(ReplicaKey("short"), [BlocksStored((1, 2, 3))])
    await writer.flush()
    index, tracker = PrefixIndex(), LoadTracker()
    async with IndexSync(store, index, listener=LoadTrackerListener(tracker), **FAST):
        assert ReplicaKey("short") in index
        await store.publish_load(ReplicaKey("short"), LoadSample(3, 4, 0.25, time.time()))
        await eventually(lambda: tracker.view(ReplicaKey("short"), 0.0).engine is not None)
        assert tracker.view(ReplicaKey("short"), 0.0).waiting(1e9) == 4
        assert await store.heartbeat("short", "p", 0.4)
        await eventually(lambda: ReplicaKey("short") not in index, timeout=3)
        assert ReplicaKey("short") not in tracker.replicas()
        assert not await store.heartbeat("short", "p", 0.4)
        # The expired replica's keys are reaped from the store, not left to leak.
        for _ in range(100):
            if not await store.list_replicas():
                break
            await asyncio.sleep(0.02)
        assert await store.list_replicas() == []
        assert await store.read_replicas([ReplicaKey("short")]) == [None]
        assert not await store.reap("short")


async def test_writes_are_fenced_by_the_writers_lease(store: IndexStore) -> None:
    """A writer with an owner writes only while the lease is its own, checked in the same
    atomic step as the write: after another owner registered, or once its lease is gone,
    nothing of a flush, a reset or a load sample lands (not the buckets, not the seq)."""
    info = ReplicaInfo("fenced", model="m")
    key = ReplicaKey("fenced")
    await store.register(info, owner="first", lease_ttl_s=30)
    first = StoreWriter(store, [key], owner="first")
    first.add(key, [BlocksStored((1, 2))])
    await first.flush()  # the reset, events included
    await store.register(info, owner="second", lease_ttl_s=0.3)
    second = StoreWriter(store, [key], owner="second")
    second.states[key].seq = first.states[key].seq  # (as a publisher's resume_seq)
    await second.flush()
    first.add(key, [BlocksStored((3,))])
    with pytest.raises(LeaseTaken) as taken:
        await first.flush()
    assert taken.value.holder == "second" and first.needs_reset
    with pytest.raises(LeaseTaken):
        await first.flush()  # its reset
    with pytest.raises(LeaseTaken):
        await store.publish_load(key, LoadSample(9, 9, 0.9, 1.0), owner="first")
    (snap,) = await store.read_replicas([key])
    assert snap is not None and snap.entries == 0 and snap.seq == second.states[key].seq
    # the second owner's lease runs out (a stalled writer): its own writes are refused too
    await eventually(lambda: _lease_gone(store, "fenced"))
    second.add(key, [BlocksStored((4,))])
    with pytest.raises(LeaseLost):
        await second.flush()
    with pytest.raises(LeaseLost):
        await store.publish_load(key, LoadSample(1, 1, 0.1, 1.0), owner="second")
    assert await store.stored_seq(key) == second.states[key].seq - 1
    await store.register(info, owner="second", lease_ttl_s=30, take_over=False)
    await second.flush()  # the reset it owes
    (snap,) = await store.read_replicas([key])
    assert snap is not None and snap.entries == 1 and snap.seq == second.states[key].seq


async def _lease_gone(store: IndexStore, replica: str) -> bool:
    return not (await store.leases([replica]))[replica]


async def test_the_last_registration_owns_the_lease(store: IndexStore) -> None:
    """One writer per replica: a second owner's registration takes the lease; the first
    owner's heartbeat then raises and its deregister leaves the replica in place."""
    info = ReplicaInfo("twice", model="m")
    await store.register(info, owner="first", lease_ttl_s=30)
    assert await store.heartbeat("twice", "first", 30)
    await store.register(info, owner="second", lease_ttl_s=30)
    with pytest.raises(LeaseTaken) as taken:
        await store.heartbeat("twice", "first", 30)
    assert taken.value.holder == "second"
    # registering again without taking over leaves the successor's lease alone
    with pytest.raises(LeaseTaken):
        await store.register(info, owner="first", lease_ttl_s=30, take_over=False)
    assert not await store.deregister("twice", owner="first")
    assert [i.replica for i in await store.list_replicas()] == ["twice"]
    assert await store.heartbeat("twice", "second", 30)
    assert await store.deregister("twice", owner="second")
    assert await store.list_replicas() == []
    # a lease that is gone may be cleaned up by any owner
    await store.register(info, owner="second", lease_ttl_s=0.05)
    await eventually(lambda: _lease_gone(store, "twice"))
    assert await store.deregister("twice", owner="first")


async def _lease_gone(store: IndexStore, replica: str) -> bool:
    return not (await store.leases([replica]))[replica]


async def test_deregister_removes_replica_everywhere(store: IndexStore) -> None:
    w = await _publish(store, "gone")
    w.add(ReplicaKey("gone"), [BlocksStored((10, 11))])
    await w.flush()
    index = PrefixIndex()
    async with IndexSync(store, index, **FAST):
        assert index.match([10, 11]).get(ReplicaKey("gone")).kv_blocks == 2
        await store.deregister("gone")
        await eventually(lambda: ReplicaKey("gone") not in index)
    assert [i.replica for i in await store.list_replicas()] == []


def _after_the_delete_script(store: RedisStore, then: Callable[[], Awaitable[None]]) -> Any:
    """Run ``then`` right after the first script of ``store`` that deleted a replica (returned
    1): a publisher registering the replica between that script and what follows it."""
    real = store.redis.eval
    fired = False

    async def eval_then(*args: Any) -> Any:
        nonlocal fired
        got = await real(*args)
        if got == 1 and not fired:
            fired = True
            await then()
        return got

    store.redis.eval = eval_then  # type: ignore[method-assign]
    return real


@pytest.mark.parametrize("how", ["reap", "deregister"])
async def test_a_registration_racing_a_reap_or_deregister_stays(
    store: IndexStore, how: str
) -> None:
    """A publisher registers the replica right after the delete script ran: routers keep the
    new registration (no Down purges it) and the registry still lists it."""
    if not isinstance(store, RedisStore):
        pytest.skip("MemoryStore deletes and announces in one step: nothing can come between")
    name, key = "phoenix", ReplicaKey("phoenix")
    info = ReplicaInfo(name, url="http://phoenix", model="m")
    await store.register(info, owner="old", lease_ttl_s=0.3 if how == "reap" else 30)
    old = StoreWriter(store, info.replica_keys())
    old.add(key, [BlocksStored((1, 2))])
    await old.flush()
    index = PrefixIndex()
    async with IndexSync(store, index, reap_expired=False, **FAST):
        assert index.match([1, 2]).get(key).kv_blocks == 2
        if how == "reap":
            await eventually(lambda: _lease_gone(store, name))

        async def register_new() -> None:
            await store.register(info, owner="new", lease_ttl_s=30)

        real = _after_the_delete_script(store, register_new)
        try:
            if how == "reap":
                assert await store.reap(name)
            else:
                assert await store.deregister(name, owner="old")
        finally:
            store.redis.eval = real  # type: ignore[method-assign]
        new = StoreWriter(store, info.replica_keys())
        await new.flush()  # the new publisher's start-up reset
        new.add(key, [BlocksStored((5, 6, 7))])
        await new.flush()
        await eventually(lambda: index.match([5, 6, 7]).get(key).kv_blocks == 3, timeout=5)
        assert [i.replica for i in await store.list_replicas()] == [name]
        assert await store.heartbeat(name, "new", 30)


async def _append_down(store: IndexStore, replica: str) -> None:
    if isinstance(store, MemoryStore):
        store._append(ReplicaDown(replica))
        return
    assert isinstance(store, RedisStore)
    async with store.redis.pipeline(transaction=False) as pipe:
        store._xadd(pipe, replica, ReplicaDown(replica))
        await pipe.execute()


async def test_a_down_entry_for_a_replica_with_a_live_lease_is_ignored(store: IndexStore) -> None:
    """A Down that reaches routers after the replica registered again (its deleter and the
    new registration raced) does not purge it: the lease says it is alive."""
    w = await _publish(store, "alive")
    key = ReplicaKey("alive")
    w.add(key, [BlocksStored((3, 4))])
    await w.flush()
    index = PrefixIndex()
    async with IndexSync(store, index, **FAST) as sync:
        await _append_down(store, "alive")
        w.add(key, [BlocksStored((3, 4, 5))])
        await w.flush()  # after the Down in the same stream shard
        await eventually(lambda: index.match([3, 4, 5]).get(key).kv_blocks == 3, timeout=5)
        assert sync.stats.purges == 0  # never dropped, not even for a moment
        assert sync.stats.downs_ignored == 1


async def _leftover_keys(store: RedisStore, replica: str) -> list[str]:
    """Which of the replica's keys exist (dp ranks 0..7)."""
    s = store.schema
    keys = [s.meta(replica), s.lease(replica), s.load(replica)]
    keys += [k for d in range(8) for k in (s.kv(replica, d), s.state(replica, d))]
    async with store.redis.pipeline(transaction=False) as pipe:
        for k in keys:
            pipe.exists(k)
        found = await pipe.execute()
    return [k for k, n in zip(keys, found, strict=True) if n]


async def test_dp_ranks_dropped_by_a_registration_leave_nothing_behind(store: IndexStore) -> None:
    """Re-registered with fewer DP ranks, the others' state goes; what a superseded writer
    still wrote for a dropped rank goes with the deregistration; registered with the ranks
    again, no router reads stale state or seqs of them."""
    name = "shrink"
    w = await _publish(store, name, ranks=(0, 1, 2, 3))
    for d in range(4):
        w.add(ReplicaKey(name, d), [BlocksStored((100 + d, 200 + d))])
    await w.flush()
    two = ReplicaInfo(name, url="http://shrink", model="m", dp_ranks=(0, 1))
    await store.register(two, owner="pub-shrink-2", lease_ttl_s=30)
    dropped = [ReplicaKey(name, 2), ReplicaKey(name, 3)]
    assert await store.stored_seqs(dropped) == [None, None]
    assert [s.entries if s else 0 for s in await store.read_replicas(dropped)] == [0, 0]
    kept = [ReplicaKey(name, 0), ReplicaKey(name, 1)]
    assert [s.entries if s else 0 for s in await store.read_replicas(kept)] == [2, 2]
    if isinstance(store, RedisStore):
        s = store.schema
        assert not {s.kv(name, 2), s.kv(name, 3)} & set(await _leftover_keys(store, name))
        assert sorted(await store.redis.hkeys(s.meta(name))) == [b"info", b"seq:0", b"seq:1"]
    # the superseded 4-rank writer flushes once more before it notices (and finds out)
    w.add(ReplicaKey(name, 2), [BlocksStored((7,))])
    with pytest.raises(SeqMismatch):
        await w.flush()
    assert await store.deregister(name, owner="pub-shrink-2")
    if isinstance(store, RedisStore):
        assert await _leftover_keys(store, name) == []
    four = ReplicaInfo(name, url="http://shrink", model="m", dp_ranks=(0, 1, 2, 3))
    await store.register(four, owner="pub-shrink-3", lease_ttl_s=30)
    keys = four.replica_keys()
    assert await store.stored_seqs(keys) == [None] * 4
    assert [s.entries if s else 0 for s in await store.read_replicas(keys)] == [0] * 4


async def test_a_change_of_a_dp_rank_not_registered_adds_no_index_key(
    store: IndexStore,
) -> None:
    """A batch or reset entry of a DP rank the replica's registration does not list (written
    before a re-registration dropped the rank and read after the router adopted it: its
    audit reads the registry ahead of a lagging stream) must not create that key in the
    index: nothing would ever remove it (a purge removes the registered ranks), so it stayed
    after the replica left, its blocks still matched."""
    name = "ranks"
    w = await _publish(store, name, ranks=(0, 1))
    index = PrefixIndex()
    async with IndexSync(store, index, **FAST) as sync:
        assert ReplicaKey(name, 1) in index
        one = ReplicaInfo(name, url=f"http://{name}", model="m", dp_ranks=(0,))
        await store.register(one, owner=f"pub-{name}", lease_ttl_s=30)
        await eventually(lambda: ReplicaKey(name, 1) not in index)
        # the old writer's last entries for rank 1 (unfenced, as one in flight)
        w.add(ReplicaKey(name, 1), [BlocksStored((11, 12))])
        with pytest.raises(SeqMismatch):
            await w.flush()
        await w.reset()
        w.add(ReplicaKey(name, 0), [BlocksStored((21,))])
        await w.flush()  # (a rank-0 batch after them: once applied, they were handled)
        await eventually(lambda: index.match([21]).get(ReplicaKey(name, 0)) is not None)
        assert index.replicas() == [ReplicaKey(name, 0)]
        assert not index.match([11, 12])
        assert await store.deregister(name)
        await eventually(lambda: sync.stats.purges >= 1)
        await eventually(lambda: index.replicas() == [])


@pytest.mark.parametrize("how", ["reap", "deregister"])
async def test_an_unreadable_registration_leaks_no_dp_rank(store: IndexStore, how: str) -> None:
    if not isinstance(store, RedisStore):
        pytest.skip("MemoryStore keeps no JSON")
    name = "garbled"
    info = ReplicaInfo(name, model="m", dp_ranks=(0, 1, 2))
    await store.register(info, owner="p", lease_ttl_s=0.2 if how == "reap" else 30)
    w = StoreWriter(store, info.replica_keys())
    for d in range(3):
        w.add(ReplicaKey(name, d), [BlocksStored((d + 1,))])
    await w.flush()
    await store.redis.hset(store.schema.meta(name), "info", "{not json")
    if how == "reap":
        await eventually(lambda: _lease_gone(store, name))
        assert await store.reap(name)
    else:
        assert await store.deregister(name, owner="p")
    assert await _leftover_keys(store, name) == []


async def test_state_written_after_a_reap_is_swept(store: IndexStore) -> None:
    """A publisher stalled past its lease flushes once more after the replica was reaped,
    then dies: its state has no lease and no registration; the routers' sweep deletes it
    (and leaves a live replica and one that registers again alone)."""
    name = "stalled"
    info = ReplicaInfo(name, model="m", dp_ranks=(0, 1))
    await store.register(info, owner="p", lease_ttl_s=0.2)
    w = StoreWriter(store, info.replica_keys())
    w.add(ReplicaKey(name, 0), [BlocksStored((1, 2))])
    await w.flush()
    live = await _publish(store, "live")
    live.add(ReplicaKey("live"), [BlocksStored((5,))])
    await live.flush()
    await eventually(lambda: _lease_gone(store, name))
    assert await store.reap(name)
    assert await store.orphans() == []
    # the stalled writer's last flush and load sample land after the reap
    w.add(ReplicaKey(name, 1), [BlocksStored((3,))])
    with pytest.raises(SeqMismatch):  # (what makes it republish, were it alive)
        await w.flush()
    await store.publish_load(ReplicaKey(name, 1), LoadSample(1, 0, 0.1, 0.0))
    assert await store.orphans() == [name]
    index = PrefixIndex()
    sync = IndexSync(store, index, **FAST)
    async with sync:
        await eventually(lambda: sync.stats.orphans_reaped == 1)
        assert ReplicaKey("live") in index
    assert await store.orphans() == []
    assert await store.read_replicas([ReplicaKey(name, 1)]) == [None]
    if isinstance(store, RedisStore):
        assert await _leftover_keys(store, name) == []
        assert await _leftover_keys(store, "live") != []
    # a replica that registers again in the meantime is not an orphan
    w.add(ReplicaKey(name, 0), [BlocksStored((4,))])
    await w.flush()
    await store.register(info, owner="p2", lease_ttl_s=30)
    assert await store.orphans() == []


async def test_a_replica_that_died_unseen_is_reaped(store: IndexStore) -> None:
    """A publisher that dies while no router follows the store (every router restarting)
    leaves its registration and state behind with its lease gone. A router that starts
    afterwards never knew the replica, so its lease expiry is no purge of a known one: the
    audit must still reap it, or its keys stay in Redis for good (and a live replica
    registered beside it is kept)."""
    name = "died-unseen"
    info = ReplicaInfo(name, model="m", dp_ranks=(0, 1))
    await store.register(info, owner="p", lease_ttl_s=0.2)
    w = StoreWriter(store, info.replica_keys())
    w.add(ReplicaKey(name, 1), [BlocksStored((1, 2, 3))])
    await w.flush()
    await _publish(store, "live")
    await eventually(lambda: _lease_gone(store, name))
    index = PrefixIndex()
    async with IndexSync(store, index, **FAST):
        assert ReplicaKey(name, 1) not in index  # (skipped at bootstrap: its lease is gone)

        async def reaped() -> bool:
            return [i.replica for i in await store.list_replicas()] == ["live"]

        await eventually(reaped)
        assert ReplicaKey("live") in index
    assert await store.read_replicas([ReplicaKey(name, 1)]) == [None]
    assert await store.orphans() == []
    if isinstance(store, RedisStore):
        assert await _leftover_keys(store, name) == []


@pytest.mark.parametrize("router", ["knew_it", "started_after"])
async def test_a_replica_lost_with_its_keys_leaves_no_registry_entry(
    redis_url: str, key_prefix: str, router: str
) -> None:
    """A cluster node restarted empty takes a replica's keys (lease, meta, state) while the
    registry set lives on another node, and its publisher died too: nothing of it is left
    to delete, so the reap refused and its name stayed in ``<p>:replicas`` for good (read by
    every audit). So did a dead replica whose registration does not parse. Both leave it,
    whether the router knew them or started afterwards (the sweep)."""
    schema = KeySchema(key_prefix, stream_shards=1)
    store = RedisStore.from_url(redis_url, schema)
    try:
        await _publish(store, "live")
        lost = await _publish(store, "lost")
        lost.add(ReplicaKey("lost"), [BlocksStored((1, 2))])
        await lost.flush()
        await store.register(ReplicaInfo("garbled", model="m"), owner="g", lease_ttl_s=30)
        await store.redis.hset(schema.meta("garbled"), "info", b"{not json")
        await store.redis.delete(schema.lease("garbled"))

        async def lose() -> None:
            await store.redis.delete(
                schema.lease("lost"),
                schema.meta("lost"),
                schema.kv("lost", 0),
                schema.state("lost", 0),
            )

        if router == "started_after":
            await lose()
        index = PrefixIndex()
        async with IndexSync(store, index, lost_store_grace_s=0.2, **FAST):
            if router == "knew_it":
                assert ReplicaKey("lost") in index
                await lose()
            await eventually(lambda: ReplicaKey("lost") not in index)
            await eventually(_registry_is(store, {b"live"}))
            assert ReplicaKey("live") in index
        assert await _leftover_keys(store, "garbled") == []
    finally:
        await store.close()


def _registry_is(store: RedisStore, names: set[bytes]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return set(await store.redis.smembers(store.schema.registry)) == names

    return check


async def test_the_pods_load_exchange_is_no_orphaned_replica(
    redis_url: str, key_prefix: str
) -> None:
    """The router pods' load stream (``<p>:{pods}:load``) has a replica's key shape: the
    sweep leaves it alone, and no replica may take that name."""
    from router.core.errors import ConfigError
    from router.service.pod_exchange import ExchangeSettings

    store = RedisStore.from_url(redis_url, KeySchema(key_prefix, stream_shards=1))
    try:
        stream = ExchangeSettings("stream", key_prefix, "a", 0.1, 1.0).stream_key
        await store.redis.xadd(stream, {"m": "{}"})
        assert await store.orphans() == []
        assert await store.redis.exists(stream)
        with pytest.raises(ConfigError, match="reserved"):
            ReplicaInfo("pods", model="m")
    finally:
        await store.redis.delete(stream)
        await store.close()


async def test_lost_stream_entry_is_a_gap_and_resyncs(redis_url: str, key_prefix: str) -> None:
    store = RedisStore.from_url(redis_url, KeySchema(key_prefix, stream_shards=2))
    try:
        w = await _publish(store, "g")
        index = PrefixIndex()
        async with IndexSync(store, index, **FAST) as sync:
            key = ReplicaKey("g")
            w.add(key, [BlocksStored((1, 2, 3))])
            # Commit a batch without its stream entry: followers will see seq jump.
            st = w.states[key]
            st.seq += 1
            st.apply([BlocksStored((1, 2, 3, 4))])
            w._pending.clear()
            await store._commit([st], full=False)
            w.add(key, [BlocksStored((5,))])
            await w.flush()
            await eventually(lambda: index.match([1, 2, 3, 4, 5]).get(key).kv_blocks == 5)
            assert sync.stats.gaps >= 1
    finally:
        await store.close()


def _commit_without_entry(w: StoreWriter, key: ReplicaKey, events: list[Any]) -> Any:
    """Commit a batch to the replica's stored state without its stream entry (as if the
    stream had been trimmed past a router that lagged): routers see no change for it."""
    st = w.states[key]
    st.seq += 1
    st.apply(events)
    w._pending.clear()
    return st


async def test_a_backlog_of_resets_is_one_snapshot_read(redis_url: str, key_prefix: str) -> None:
    """A router that lagged reads several reset entries of one key in one go (a publisher
    that republished again and again: failed writes, seq mismatches): the first resync reads
    the key's state as it is now, which holds every later reset of that read; reading the
    whole state again for each of them multiplied a lag into full reads."""
    parked, gate = asyncio.Event(), asyncio.Event()
    gate.set()

    class Gated(RedisStore):
        async def read_changes(self, cursor: object, block_s: float, count: int) -> Any:
            if not gate.is_set():
                parked.set()
                await gate.wait()
            return await super().read_changes(cursor, block_s, count)

    schema = KeySchema(key_prefix, stream_shards=1)
    store = RedisStore.from_url(redis_url, schema)
    router = Gated(RedisStore.from_url(redis_url).redis, schema)
    try:
        w = await _publish(store, "flappy")
        key = ReplicaKey("flappy")
        index = PrefixIndex()
        async with IndexSync(router, index, **FAST) as sync:
            gate.clear()
            await parked.wait()
            before = sync.stats.resyncs
            for block in range(5):
                w.add(key, [BlocksStored((block,))])
                await w.reset()
            gate.set()
            await eventually(lambda: index.last_seq(key) == w.states[key].seq)
            assert index.match([0, 1, 2, 3, 4]).get(key).kv_blocks == 5
            assert sync.stats.resyncs == before + 1
    finally:
        await store.close()
        await router.close()


async def test_a_replicas_last_batch_lost_to_the_stream_is_found_by_the_audit(
    redis_url: str, key_prefix: str
) -> None:
    """No later batch shows the gap (the replica went idle): the audit sees the index behind
    a store that stood still for an interval, and resyncs that key."""
    store = RedisStore.from_url(redis_url, KeySchema(key_prefix, stream_shards=2))
    try:
        w = await _publish(store, "idle")
        key = ReplicaKey("idle")
        index = PrefixIndex()
        async with IndexSync(store, index, **FAST) as sync:
            w.add(key, [BlocksStored((1, 2, 3, 4, 5, 6))])
            await w.flush()
            await eventually(lambda: index.match([1, 2, 3, 4, 5, 6]).get(key).kv_blocks == 6)
            st = _commit_without_entry(w, key, [BlocksRemoved((4, 5, 6))])
            await store._commit([st], full=False)
            await eventually(lambda: index.match([1, 2, 3, 4, 5, 6]).get(key).kv_blocks == 3)
            assert index.last_seq(key) == st.seq and sync.stats.stale >= 1
            assert sync.stats.gaps == 0
    finally:
        await store.close()


async def test_a_key_read_blank_is_resynced_once_the_store_holds_it_again(
    redis_url: str, key_prefix: str
) -> None:
    """A resync that reads a replica key while its registration is missing (between a
    publisher's deregistration and its successor's registration) leaves the key empty and
    with no seq. The successor's reset entry lost to the trim (the router lagged), the
    audit's seq check skipped a key without a seq, and the next batch was applied on the
    empty key as if it followed: the router missed the replica's blocks for good."""
    store = RedisStore.from_url(redis_url, KeySchema(key_prefix, stream_shards=1))
    try:
        w = await _publish(store, "blank")
        key = ReplicaKey("blank")
        w.add(key, [BlocksStored((1, 2, 3))])
        await w.flush()
        index = PrefixIndex()
        async with IndexSync(store, index, **FAST) as sync:
            assert index.match([1, 2, 3]).get(key).kv_blocks == 3
            await store.redis.hdel(store.schema.meta("blank"), "info")
            st = _commit_without_entry(w, key, [BlocksStored((4,))])
            await store._commit([st], full=False)
            w.add(key, [BlocksStored((5,))])
            await w.flush()  # a gap: its resync finds the key unregistered
            await eventually(lambda: sync.stats.gaps >= 1 and index.last_seq(key) is None)
            # registered again (the Up is read: same info), its full reset's entry trimmed
            await store.register(ReplicaInfo("blank", url="http://blank", model="m"), "p2", 30)
            st = _commit_without_entry(w, key, [BlocksStored((6,))])
            await store._commit([st], full=True)
            await eventually(lambda: index.match([1, 2, 3, 4, 5, 6]).get(key).kv_blocks == 6)
            w.add(key, [BlocksStored((7,))])
            await w.flush()
            await eventually(lambda: index.match([1, 2, 3, 4, 5, 6, 7]).get(key).kv_blocks == 7)
    finally:
        await store.close()


async def test_a_registration_whose_up_entry_was_lost_reaches_the_router(
    redis_url: str, key_prefix: str
) -> None:
    """A re-registration with fewer DP ranks whose ReplicaUp the router never read (the
    stream trimmed past it while it lagged): the store dropped the rank's state, so the
    audit must bring the router's view of the replica in line, not keep the rank's blocks."""
    store = RedisStore.from_url(redis_url, KeySchema(key_prefix, stream_shards=2))
    try:
        w = await _publish(store, "shrunk", ranks=(0, 1))
        gone = ReplicaKey("shrunk", 1)
        w.add(gone, [BlocksStored((1, 2, 3))])
        await w.flush()
        index = PrefixIndex()
        async with IndexSync(store, index, **FAST) as sync:
            assert index.match([1, 2, 3]).get(gone).kv_blocks == 3
            xadd = store._xadd
            store._xadd = lambda pipe, r, change: (  # type: ignore[method-assign]
                None if isinstance(change, ReplicaUp) else xadd(pipe, r, change)
            )
            one = ReplicaInfo("shrunk", url="http://shrunk", model="m", dp_ranks=(0,))
            await store.register(one, owner="pub-shrunk", lease_ttl_s=30)
            store._xadd = xadd  # type: ignore[method-assign]
            assert await store.stored_seqs([gone]) == [None]  # its state went
            await eventually(lambda: gone not in index)
            assert sync.infos["shrunk"].dp_ranks == (0,)
    finally:
        await store.close()


class _FlakyReads:
    """A store whose next ``fail`` snapshot reads raise, as a Redis blip would."""

    def __init__(self, inner: RedisStore) -> None:
        self.inner = inner
        self.fail = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def read_replicas(self, keys: Any) -> Any:
        if self.fail:
            self.fail -= 1
            raise ConnectionError("a blip")
        return await self.inner.read_replicas(keys)


@pytest.mark.parametrize("fails", [1, 10**9], ids=["once", "for_a_while"])
async def test_a_failing_resync_is_retried_and_the_other_replicas_are_read(
    redis_url: str, key_prefix: str, fails: int
) -> None:
    """A gap's resync that fails (a Redis blip; a snapshot on a Cluster slot mid-migration
    for a while) stays owed and is retried every turn until it succeeds; the read it came
    with is not skipped, and the follower reads every other replica's changes meanwhile,
    rather than retry that one read before any other (the whole index frozen)."""
    store = RedisStore.from_url(redis_url, KeySchema(key_prefix, stream_shards=1))
    flaky = _FlakyReads(store)
    try:
        w = await _publish(store, "g")
        other = await _publish(store, "o")
        key, okey = ReplicaKey("g"), ReplicaKey("o")
        index = PrefixIndex()
        async with IndexSync(flaky, index, **FAST) as sync:  # type: ignore[arg-type]
            w.add(key, [BlocksStored((1, 2, 3))])
            await w.flush()
            await eventually(lambda: index.match([1, 2, 3]).get(key).kv_blocks == 3)
            st = _commit_without_entry(w, key, [BlocksStored((1, 2, 3, 4))])
            await store._commit([st], full=False)
            flaky.fail = fails
            w.add(key, [BlocksStored((5,))])
            await w.flush()  # a gap: seq jumps
            if fails > 1:
                await eventually(lambda: sync.stats.errors >= 2)  # retried, and failing
            other.add(okey, [BlocksStored((9, 10))])
            await other.flush()  # in the same stream, after the gap
            await eventually(lambda: index.match([9, 10]).get(okey).kv_blocks == 2)
            if fails > 1:
                assert key in sync._owed
                flaky.fail = 0  # the slot is back: the owed resync completes
            # (block 4 is asked for itself: a match bisects, a hole before the last block
            # asked for may not show)
            await eventually(lambda: index.match([1, 2, 3, 4]).get(key).kv_blocks == 4)
            assert sync.stats.gaps >= 1 and sync.stats.errors >= 1
    finally:
        await store.close()


@pytest.mark.parametrize("garble", ["torn", "misaligned", "state", "seq"])
async def test_a_registered_key_whose_state_does_not_parse_is_unreadable_not_absent(
    store: IndexStore, garble: str
) -> None:
    """A registered replica key whose stored state does not parse (a torn record, records
    that only line up when joined, a foreign seq) is told apart from one not registered:
    None would make a follower drop the replica's blocks. Its other keys read as usual."""
    if not isinstance(store, RedisStore):
        pytest.skip("MemoryStore keeps no bytes")
    name = "garbled-state"
    w = await _publish(store, name, ranks=(0, 1))
    key, other = ReplicaKey(name, 0), ReplicaKey(name, 1)
    w.add(key, [BlocksStored((1, 2, 3))])
    w.add(other, [BlocksStored((4,))])
    await w.flush()
    s = store.schema
    if garble == "torn":
        await store.redis.hset(s.kv(name, 0), "foreign", b"\x01\x02\x03")
    elif garble == "misaligned":  # 4 + 5 bytes: a multiple of a record only when joined
        await store.redis.hset(s.kv(name, 0), mapping={"f1": b"\x00" * 4, "f2": b"\x00" * 5})
    elif garble == "state":
        await store.redis.hset(s.state(name, 0), "foreign", b"\x01")
    else:
        await store.redis.hset(s.meta(name), s.seq_field(0), "nope")
    snap, fine = await store.read_replicas([key, other])
    assert snap is not None and not isinstance(snap, ReplicaSnapshot)
    assert isinstance(snap, UnreadableSnapshot) and snap.key == key
    assert isinstance(fine, ReplicaSnapshot) and fine.entries == 1


@pytest.mark.parametrize("when", ["bootstrap", "gap"])
async def test_a_snapshot_that_does_not_parse_keeps_the_replica_and_is_read_again(
    redis_url: str, key_prefix: str, when: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A resync whose snapshot does not parse (a torn record in the replica's kv hash) is
    not a replica gone: the index keeps what it knew of the key, the read is counted and
    logged once, and the resync stays owed, retried (with a backoff) while the follower
    reads every other change, until the state parses again."""
    caplog.set_level(logging.WARNING, logger="router.store.sync")
    store = RedisStore.from_url(redis_url, KeySchema(key_prefix, stream_shards=1))
    try:
        w, other = await _torn_and_other(store)
        key, okey = ReplicaKey("torn"), ReplicaKey("o")
        kv = store.schema.kv("torn", 0)
        if when == "bootstrap":
            await store.redis.hset(kv, "foreign", b"\x01\x02\x03")
        index = PrefixIndex()
        async with IndexSync(store, index, unreadable_retry_s=0.01, **FAST) as sync:
            if when == "gap":
                assert index.match([1, 2, 3]).get(key).kv_blocks == 3
                await store.redis.hset(kv, "foreign", b"\x01\x02\x03")
                st = _commit_without_entry(w, key, [BlocksStored((1, 2, 3, 4))])
                await store._commit([st], full=False)
                w.add(key, [BlocksStored((5,))])
                await w.flush()  # a gap: seq jumps, the resync reads the torn record
            other.add(okey, [BlocksStored((9, 10))])
            await other.flush()  # in the same stream, after the gap
            await eventually(lambda: index.match([9, 10]).get(okey).kv_blocks == 2)
            assert key in index.replicas() and "torn" in sync.infos
            if when == "gap":  # what it knew, and the gap batch, kept
                assert index.match([1, 2, 3]).get(key).kv_blocks == 3
                assert index.match([5]).get(key).kv_blocks == 1
            assert key in sync._owed
            await eventually(lambda: sync.stats.unreadable >= 3)  # retried
            registry = CollectorRegistry()
            registry.register(_IndexSyncCollector(sync))
            page = generate_latest(registry).decode()
            family = "kvrouter_index_sync_unreadable_snapshots_total"
            counted = re.search(rf"^{family} (\S+)$", page, re.M)
            assert counted and float(counted[1]) >= 3, page
            said = [r for r in caplog.records if "torn" in r.getMessage()]
            assert len(said) == 1 and said[0].levelno == logging.WARNING, said
            # the record goes (the publisher rewrote the bucket): the owed resync completes
            await store.redis.hdel(kv, "foreign")
            await eventually(lambda: key not in sync._owed)
            blocks = [1, 2, 3, 4] if when == "gap" else [1, 2, 3]
            assert index.match(blocks).get(key).kv_blocks == len(blocks)
            if when == "gap":
                assert index.match([5]).get(key).kv_blocks == 1
    finally:
        await store.close()


async def test_an_unreadable_snapshot_is_read_again_after_a_wait_not_each_turn(
    redis_url: str, key_prefix: str
) -> None:
    """Such a read succeeds with the key's whole stored state: retried each turn (a turn
    after every read of the change streams), it re-read megabytes from Redis many times a
    second for as long as the key stayed unreadable. It waits ``unreadable_retry_s``,
    doubling, between reads. The audit's seq check (the key has no seq in the index) waits
    too."""
    audits = 0

    class Counted(RedisStore):
        async def stored_seqs(self, keys: Sequence[ReplicaKey]) -> list[int | None]:
            nonlocal audits
            audits += 1
            return await super().stored_seqs(keys)

    store = Counted(RedisStore.from_url(redis_url).redis, KeySchema(key_prefix, stream_shards=1))
    try:
        _, other = await _torn_and_other(store)
        key, okey = ReplicaKey("torn"), ReplicaKey("o")
        await store.redis.hset(store.schema.kv("torn", 0), "foreign", b"\x01\x02\x03")
        index = PrefixIndex()
        async with IndexSync(store, index, unreadable_retry_s=60.0, **FAST) as sync:
            assert sync.stats.unreadable == 1
            for block in range(10, 20):  # turns: each batch read and applied
                other.add(okey, [BlocksStored((block,))])
                await other.flush()
                await eventually(lambda b=block: index.match([b]).get(okey) is not None)
            await eventually(lambda: audits >= 4)
            assert sync.stats.unreadable == 1
            assert key in sync._owed and key in index.replicas()
    finally:
        await store.close()


async def test_a_seq_that_does_not_parse_fails_no_audit(redis_url: str, key_prefix: str) -> None:
    """A ``seq:<dp>`` that is not an integer (a foreign write) is no stored seq. The audit's
    seq check raised on it, so every audit failed, each counted as the store unreachable:
    ``up`` flapped to 0, the outage grace was armed again each time, and a replica whose
    lease lapsed meanwhile was never purged."""
    schema = KeySchema(key_prefix, stream_shards=1)
    store = RedisStore.from_url(redis_url, schema)
    try:
        await _publish(store, "live")
        await store.redis.hset(schema.meta("live"), schema.seq_field(0), "nope")
        assert await store.stored_seqs([ReplicaKey("live")]) == [None]
        assert await store.stored_seq(ReplicaKey("live")) is None
        dead = ReplicaInfo("dead", model="m")
        await store.register(dead, owner="p", lease_ttl_s=1.0)
        index = PrefixIndex()
        async with IndexSync(store, index, lost_store_grace_s=30, **FAST) as sync:
            assert ReplicaKey("dead") in index
            await eventually(lambda: ReplicaKey("dead") not in index)  # its lease lapsed
            assert sync.stats.errors == 0 and sync.up
    finally:
        await store.close()


async def test_a_write_over_a_seq_that_does_not_parse_is_a_seq_mismatch(
    redis_url: str, key_prefix: str
) -> None:
    """A publisher's write over a foreign ``seq:<dp>`` raised ValueError after its
    transaction landed: the batch's change-stream entry was never appended. It is a seq
    mismatch (the writer sends its full state), with the entry appended."""
    schema = KeySchema(key_prefix, stream_shards=1)
    store = RedisStore.from_url(redis_url, schema)
    try:
        w = await _publish(store, "live")
        await store.redis.hset(schema.meta("live"), schema.seq_field(0), "nope")
        before = await store.redis.xlen(schema.stream(0))
        w.add(ReplicaKey("live"), [BlocksStored((5, 6))])
        with pytest.raises(SeqMismatch):
            await w.flush()
        assert await store.redis.xlen(schema.stream(0)) == before + 1
        assert await store.stored_seq(ReplicaKey("live")) is not None
    finally:
        await store.close()


async def test_malformed_stream_entries_do_no_harm(redis_url: str, key_prefix: str) -> None:
    store = RedisStore.from_url(redis_url, KeySchema(key_prefix, stream_shards=1))
    try:
        w = await _publish(store, "m")
        index = PrefixIndex()
        async with IndexSync(store, index, **FAST) as sync:
            stream = store.schema.stream(0)
            for junk in (
                {b"x": b"y"},
                {b"t": b"B", b"r": b"m", b"d": b"0", b"s": b"2", b"e": b"\xff\xfe"},
                {b"t": b"B", b"r": b"m", b"d": b"0", b"s": b"nope", b"e": b"\x90"},
            ):
                await store.redis.xadd(stream, junk)  # type: ignore[arg-type]
            w.add(ReplicaKey("m"), [BlocksStored((7, 8))])
            await w.flush()
            await eventually(lambda: index.match([7, 8]).get(ReplicaKey("m")).kv_blocks == 2)
            assert sync.stats.malformed == 3
    finally:
        await store.close()


async def test_redis_flush_and_restart_publishers_republish_routers_resync(
    private_redis: LocalRedis,
) -> None:
    store = RedisStore.from_url(private_redis.url, KeySchema("kvr", stream_shards=2))
    router_store = RedisStore.from_url(private_redis.url, KeySchema("kvr", stream_shards=2))
    try:
        info = ReplicaInfo("f1", model="m")
        await store.register(info, owner="p", lease_ttl_s=30)
        w = StoreWriter(store, info.replica_keys())
        w.add(ReplicaKey("f1"), [BlocksStored((1, 2, 3))])
        await w.flush()
        index = PrefixIndex()
        async with IndexSync(router_store, index, **FAST) as sync:
            assert index.match([1, 2, 3]).get(ReplicaKey("f1")).kv_blocks == 3
            await store.redis.flushall()
            # The router re-bootstraps and keeps f1 (the engine's cache did not change) for
            # its publisher to register again.
            await eventually(lambda: sync.stats.kept_on_data_loss == 1)
            assert index.match([1, 2, 3]).get(ReplicaKey("f1")).kv_blocks == 3
            # The publisher notices on its heartbeat and republishes everything.
            assert not await store.heartbeat("f1", "p", 30)
            await store.register(info, owner="p", lease_ttl_s=30)
            await w.reset()
            await eventually(lambda: index.match([1, 2, 3]).get(ReplicaKey("f1")).kv_blocks == 3)
            # an audit saw its lease again: the data loss's grace is over (else the next loss
            # finds f1 still in it, kept but not counted again)
            await eventually(lambda: "f1" not in sync._grace)
            # Restart: the server comes back empty on the same port.
            private_redis.restart()
            # (the server's restart and the follower's reconnect backoff, up to 2 s: on a
            # loaded machine seconds more)
            await eventually(lambda: sync.stats.kept_on_data_loss == 2, timeout=30)
            assert ReplicaKey("f1") in index
            w.add(ReplicaKey("f1"), [BlocksStored((4,))])
            try:
                await w.flush()
            except Exception:  # the first use of the dead connection failed
                assert w.needs_reset  # so the writer republishes everything next time
            else:
                # redis-py reconnected on its own and the delta landed on the empty server:
                # the lost lease is what tells a publisher to republish (its heartbeat).
                lease = await store.heartbeat("f1", "p", 30)
                assert not lease
                w.needs_reset = True
            for _ in range(50):
                try:
                    await store.register(info, owner="p", lease_ttl_s=30)
                    await w.flush()
                    break
                except Exception:
                    await asyncio.sleep(0.1)
            await eventually(lambda: index.match([1, 2, 3, 4]).get(ReplicaKey("f1")).kv_blocks == 4)
            assert sync.stats.bootstraps >= 2
    finally:
        await store.close()
        await router_store.close()


async def test_a_full_redis_does_not_stop_the_audit(private_redis: LocalRedis) -> None:
    """Redis at ``maxmemory`` (noeviction) refuses every command that may allocate, a
    ``SET NX`` of a key that exists too. The audit began with one (the instance token), so
    it failed every turn for as long as Redis stayed full: a replica whose publisher died
    stayed routable, its blocks in every router's index."""
    schema = KeySchema("kvr", stream_shards=1)
    store = RedisStore.from_url(private_redis.url, schema)
    try:
        await _publish(store, "live")
        dead = await _publish(store, "dead")
        dead.add(ReplicaKey("dead"), [BlocksStored((1, 2))])
        await dead.flush()
        index = PrefixIndex()
        async with IndexSync(store, index, **FAST) as sync:
            assert index.match([1, 2]).get(ReplicaKey("dead")).kv_blocks == 2
            await store.redis.config_set("maxmemory", 1)
            try:
                await store.redis.delete(schema.lease("dead"))  # its publisher died
                await eventually(lambda: ReplicaKey("dead") not in index)
                assert ReplicaKey("live") in index and sync.stats.purges == 1
            finally:
                await store.redis.config_set("maxmemory", 0)
    finally:
        await store.close()


async def test_a_reap_that_fails_does_not_hold_the_audit(private_redis: LocalRedis) -> None:
    """A full Redis deletes a dead replica's keys but refuses the ReplicaDown entry the reap
    appends: that error ended the whole audit as a store outage, so the next dead replica
    was not purged, and the outage's grace kept every lapsed lease routable for
    ``lost_store_grace_s`` more. A reap is best effort: the next audit tries again."""
    schema = KeySchema("kvr", stream_shards=1)
    store = RedisStore.from_url(private_redis.url, schema)
    try:
        await _publish(store, "live")
        for name in ("dead1", "dead2"):
            dead = await _publish(store, name)
            dead.add(ReplicaKey(name), [BlocksStored((1, 2))])
            await dead.flush()
        index = PrefixIndex()
        async with IndexSync(store, index, lost_store_grace_s=30.0, **FAST) as sync:
            assert ReplicaKey("dead1") in index and ReplicaKey("dead2") in index
            await store.redis.config_set("maxmemory", 1)
            try:
                await store.redis.delete(schema.lease("dead1"), schema.lease("dead2"))
                await eventually(
                    lambda: ReplicaKey("dead1") not in index and ReplicaKey("dead2") not in index
                )
                assert ReplicaKey("live") in index and sync.stats.purges == 2
                assert sync.up and sync.stats.errors == 0
            finally:
                await store.redis.config_set("maxmemory", 0)

            # Redis has room again: the registry entries the failed reaps left go
            async def only_live_listed() -> bool:
                return [i.replica for i in await store.list_replicas()] == ["live"]

            await eventually(only_live_listed)
    finally:
        await store.close()


async def test_a_replica_lost_with_the_store_stays_until_its_grace_ends(
    private_redis: LocalRedis,
) -> None:
    """Redis comes back empty: a replica whose publisher registers again within the grace
    is never dropped (no request sees it missing); one that does not is purged after it."""
    schema = KeySchema("kvr", stream_shards=2)
    store = RedisStore.from_url(private_redis.url, schema)
    router_store = RedisStore.from_url(private_redis.url, schema)
    downs: list[str] = []

    class Downs(NullListener):
        def replica_down(self, replica: str, keys: Sequence[ReplicaKey]) -> None:
            downs.append(replica)

    try:
        writers = {}
        for name in ("back", "dead"):
            info = ReplicaInfo(name, model="m")
            await store.register(info, owner="p", lease_ttl_s=30)
            writers[name] = StoreWriter(store, info.replica_keys())
            writers[name].add(ReplicaKey(name), [BlocksStored((1, 2))])
            await writers[name].flush()
        index = PrefixIndex()
        sync = IndexSync(router_store, index, listener=Downs(), lost_store_grace_s=1.5, **FAST)
        async with sync:
            await store.redis.flushall()
            await eventually(lambda: sync.stats.kept_on_data_loss == 2)
            assert not await store.heartbeat("back", "p", 30)
            await store.register(ReplicaInfo("back", model="m"), owner="p", lease_ttl_s=30)
            await writers["back"].reset()
            await eventually(lambda: "dead" in downs, timeout=5)
            assert downs == ["dead"]
            assert index.match([1, 2]).get(ReplicaKey("back")).kv_blocks == 2
            assert ReplicaKey("dead") not in index
    finally:
        await store.close()
        await router_store.close()


class _Unreachable:
    """A store the router cannot reach while ``down`` (every call fails); counts the
    registry reads it answers (one per audit, after its lease check)."""

    def __init__(self, inner: RedisStore) -> None:
        self.inner = inner
        self.down = False
        self.listed = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr
        if self.down:

            async def fail(*args: Any, **kw: Any) -> Any:
                raise ConnectionError("Redis unreachable")

            return fail
        if name == "list_replicas":
            self.listed += 1
        return attr


async def test_leases_that_lapsed_while_redis_was_unreachable_get_the_grace(
    redis_url: str, key_prefix: str
) -> None:
    """Redis unreachable (down, paused, partitioned) for longer than the lease TTL and back
    with its data (persistence: the same instance token): the leases lapsed only because no
    publisher could renew them either. The router's first audit must not purge the whole
    fleet at once: a replica whose publisher registers again within the grace stays, one
    that does not is purged after it."""
    schema = KeySchema(key_prefix, stream_shards=2)
    store = RedisStore.from_url(redis_url, schema)
    router = _Unreachable(RedisStore.from_url(redis_url, schema))
    downs: list[str] = []

    class Downs(NullListener):
        def replica_down(self, replica: str, keys: Sequence[ReplicaKey]) -> None:
            downs.append(replica)

    try:
        writers = {}
        for name in ("back", "dead"):
            info = ReplicaInfo(name, model="m")
            await store.register(info, owner="p", lease_ttl_s=30)
            writers[name] = StoreWriter(store, info.replica_keys())
            writers[name].add(ReplicaKey(name), [BlocksStored((1, 2))])
            await writers[name].flush()
        index = PrefixIndex()
        grace = {"lost_store_grace_s": 1.5}
        sync = IndexSync(router, index, listener=Downs(), **grace, **FAST)  # type: ignore[arg-type]
        async with sync:
            router.down = True
            await eventually(lambda: sync.stats.errors >= 1 and not sync.up)
            # the leases run out meanwhile (nobody can renew them)
            await store.redis.delete(schema.lease("back"), schema.lease("dead"))
            router.down, router.listed = False, 0
            await eventually(lambda: router.listed >= 2)  # (audits ran since)
            assert downs == []
            assert index.match([1, 2]).get(ReplicaKey("dead")).kv_blocks == 2
            assert not await store.heartbeat("back", "p", 30)
            await store.register(ReplicaInfo("back", model="m"), owner="p", lease_ttl_s=30)
            await writers["back"].reset()
            await eventually(lambda: "dead" in downs, timeout=5)
            assert set(downs) == {"dead"}  # (its reap's Down entry may tell it again)
            assert index.match([1, 2]).get(ReplicaKey("back")).kv_blocks == 2
            assert ReplicaKey("dead") not in index
    finally:
        await store.close()
        await router.inner.close()


async def test_an_up_entry_read_after_its_lease_lapsed_adds_no_replica(
    redis_url: str, key_prefix: str
) -> None:
    """A router that could not read the stream for a while reads a registration whose
    publisher died meanwhile (its lease gone): adopting it would make a dead address
    routable (for the grace after the outage, too). It is skipped, as ``_learn`` skips a
    batch of a replica whose lease is gone; a live one read the same way is adopted."""
    schema = KeySchema(key_prefix, stream_shards=2)
    store = RedisStore.from_url(redis_url, schema)
    router = _Unreachable(RedisStore.from_url(redis_url, schema))
    ups: list[str] = []

    class Ups(NullListener):
        def replica_up(self, info: ReplicaInfo) -> None:
            ups.append(info.replica)

    try:
        index = PrefixIndex()
        async with IndexSync(router, index, listener=Ups(), **FAST) as sync:  # type: ignore[arg-type]
            router.down = True
            await eventually(lambda: sync.stats.errors >= 1 and not sync.up)
            await store.register(ReplicaInfo("gone", model="m"), owner="p", lease_ttl_s=0.05)
            await store.register(ReplicaInfo("live", model="m"), owner="p", lease_ttl_s=30)
            await eventually(lambda: _lease_gone(store, "gone"))
            router.down = False
            await eventually(lambda: ReplicaKey("live") in index)
            router.listed = 0
            await eventually(lambda: router.listed >= 2)  # (audits ran since)
            assert ups.count("gone") == 0
            assert ReplicaKey("gone") not in index
    finally:
        await store.close()
        await router.inner.close()


async def test_a_rebootstrap_after_data_loss_that_fails_midway_keeps_the_grace(
    private_redis: LocalRedis,
) -> None:
    """Redis comes back empty and the router's re-bootstrap fails after reading the new
    instance token (Redis still loading, a timeout): the retry is still a re-bootstrap after
    a data loss, so the replicas the empty store lacks keep their grace instead of being
    purged at once."""
    schema = KeySchema("kvr", stream_shards=2)
    store = RedisStore.from_url(private_redis.url, schema)
    downs: list[str] = []

    class Downs(NullListener):
        def replica_down(self, replica: str, keys: Sequence[ReplicaKey]) -> None:
            downs.append(replica)

    class Flaky(RedisStore):
        """A real store whose stream cursor (read by bootstraps alone) fails once when
        ``fail`` is set."""

        fail = False

        async def cursor(self) -> object:
            if self.fail:
                self.fail = False
                raise ConnectionError("cursor read failed once")
            return await super().cursor()

    router_store = Flaky.from_url(private_redis.url, schema)
    assert isinstance(router_store, Flaky)
    try:
        info = ReplicaInfo("r", model="m")
        await store.register(info, owner="p", lease_ttl_s=30)
        w = StoreWriter(store, info.replica_keys())
        w.add(ReplicaKey("r"), [BlocksStored((1, 2))])
        await w.flush()
        index = PrefixIndex()
        sync = IndexSync(router_store, index, listener=Downs(), lost_store_grace_s=30, **FAST)
        async with sync:
            router_store.fail = True
            await store.redis.flushall()
            await eventually(lambda: sync.stats.kept_on_data_loss == 1)
            assert not router_store.fail  # the failing bootstrap ran first
            assert downs == [] and index.match([1, 2]).get(ReplicaKey("r")).kv_blocks == 2
    finally:
        await store.close()
        await router_store.close()


async def test_auth_urls(tmp_path: Any) -> None:
    with LocalRedis(tmp_path / "auth", password="s3cret") as server:
        ok = RedisStore.from_url(server.url)
        try:
            assert await ok.instance_token()
        finally:
            await ok.close()
        bad = RedisStore.from_url(server.url.replace("s3cret", "wrong"))
        try:
            with pytest.raises(Exception, match=r"(?i)auth|password"):
                await bad.instance_token()
        finally:
            await bad.close()
    tls = RedisStore.from_url("rediss://user:pw@example.invalid:6380/2")
    pool = tls.redis.connection_pool
    assert pool.connection_class.__name__ == "SSLConnection"
    assert pool.connection_kwargs["password"] == "pw" and pool.connection_kwargs["db"] == 2
    await tls.close()


async def test_a_silent_redis_fails_calls_instead_of_hanging(private_redis: LocalRedis) -> None:
    """A Redis that stops answering (SIGSTOP: the socket stays open, nothing comes back) must
    not hang the follower: its reads time out, it keeps retrying, and it catches up when the
    server answers again. The event loop stays free all along."""
    import os
    import signal

    from router.store.redis_store import connect

    schema = KeySchema("silent", stream_shards=2)
    writer_store = RedisStore(connect(private_redis.url, socket_timeout=1.0), schema)
    router_store = RedisStore(connect(private_redis.url, socket_timeout=1.0), schema)
    assert private_redis.process is not None
    pid = private_redis.process.pid
    try:
        w = await _publish(writer_store, "s")
        key = ReplicaKey("s")
        index = PrefixIndex()
        async with IndexSync(router_store, index, **FAST) as sync:
            w.add(key, [BlocksStored((1, 2))])
            await w.flush()
            await eventually(lambda: index.match([1, 2]).get(key).kv_blocks == 2)
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.05)

            tick_task = asyncio.create_task(ticker())
            os.kill(pid, signal.SIGSTOP)
            try:
                # reads time out instead of waiting for ever...
                waited = await eventually(lambda: sync.stats.errors >= 1)
                assert ticks >= waited / 0.05 / 2  # ...and the loop keeps running meanwhile
            finally:
                os.kill(pid, signal.SIGCONT)
                tick_task.cancel()
            w.add(key, [BlocksStored((1, 2, 3))])
            await w.flush()
            await eventually(lambda: index.match([1, 2, 3]).get(key).kv_blocks == 3)
    finally:
        await writer_store.close()
        await router_store.close()


async def test_a_rank_dropped_and_named_again_numbers_above_what_it_wrote() -> None:
    """A publisher's registration drops a DP rank and later names it again (``--zmq auto``
    following the engine): the rank's batches must number above those it wrote before, or a
    router that lagged past both registrations takes them for batches it applied and drops
    them (the index then misses what the rank stores)."""
    store = MemoryStore()
    k0, k1 = ReplicaKey("r"), ReplicaKey("r", 1)
    clock = iter(range(1_000, 10**9, 1_000))
    writer = StoreWriter(store, [k0, k1], seq_floor=lambda: next(clock))
    await writer.flush()
    index = PrefixIndex()  # a router that applied everything rank 1 wrote
    for h in range(1, 6):
        writer.add(k1, [BlocksStored((h,))])
        await writer.flush()
        assert index.apply(EventBatch(k1, (BlocksStored((h,)),), writer.states[k1].seq))
    before = writer.states[k1].seq
    writer.set_keys([k0])
    writer.set_keys([k0, k1])
    writer.add(k1, [BlocksStored((99,))])
    await writer.flush()  # the reset the key change asks for, then the batch
    writer.add(k1, [BlocksStored((100,))])
    await writer.flush()
    after = writer.states[k1].seq
    assert after > before
    outcome = index.apply(EventBatch(k1, (BlocksStored((100,)),), after))
    assert outcome is not ApplyOutcome.DUPLICATE


async def test_a_dead_replicas_backlog_reads_the_registry_once_a_read() -> None:
    """Entries of a replica the registry does not hold alive (it died with its batches
    still in the stream): the follower asks the registry once a read, not once an entry
    (every ask lists the whole registry: a backlog of thousands would stall the follower
    for every replica of the fleet)."""
    store = MemoryStore()
    ghost = ReplicaKey("ghost")
    lists = 0
    listing = store.list_replicas

    async def counted() -> list[ReplicaInfo]:
        nonlocal lists
        lists += 1
        return await listing()

    store.list_replicas = counted  # type: ignore[method-assign]
    index = PrefixIndex()
    sync = IndexSync(store, index, audit_interval_s=3600.0, read_count=1000, block_s=0.5)
    async with sync:
        await sync.ready.wait()
        before = lists
        writer = StoreWriter(store, [ghost])
        # 200 entries of a replica never registered (MemoryStore writes without suspending:
        # all are in the stream before the follower's next read)
        for h in range(1, 201):
            writer.add(ghost, [BlocksStored((h,))])
            await writer.flush()
        # every entry read and handled
        await eventually(lambda: int(sync._cursor or 0) >= store._appended and not sync._backlog)
        assert ghost not in index
        # once a read: the entries came in a few reads, not 200 asks
        assert lists - before <= 3, lists - before


async def test_a_busy_replica_numbering_below_the_index_is_resynced(
    redis_url: str, key_prefix: str
) -> None:
    """A publisher restarted on a host whose clock is behind the old one's numbers its
    batches below what routers applied from its predecessor; a router that missed its reset
    entry (trimmed while it lagged) took every later batch for a duplicate, and while the
    replica kept writing its stored seq never stood still for an audit: the index kept the
    old publisher's blocks for as long as the replica was busy. The index cannot be ahead of
    the store (a state is committed before its entry is appended): the audit resyncs it."""
    store = RedisStore.from_url(redis_url, KeySchema(key_prefix, stream_shards=1))
    key = ReplicaKey("skewed")
    try:
        w = await _publish(store, "skewed")
        w.states[key].seq = 1_000_000  # the old publisher's clock
        w.add(key, [BlocksStored((1, 2, 3))])
        await w.reset()
        index = PrefixIndex()
        stop = asyncio.Event()

        async def busy() -> None:  # the new publisher, from a reset the router never read
            st = w.states[key]
            st.seq = 10
            st.apply([AllCleared(), BlocksStored((7,))])
            await store._commit([st], full=True)
            while not stop.is_set():
                w.add(key, [BlocksStored((8,))])
                await w.flush()

        async with IndexSync(store, index, **FAST) as sync:
            assert index.match([1, 2, 3]).get(key).kv_blocks == 3
            task = asyncio.create_task(busy())
            try:
                await eventually(lambda: sync.stats.duplicates > 10)
                await eventually(
                    lambda: index.match([1, 2, 3]).get(key).kv_blocks == 0,
                    message="the index kept the old publisher's blocks",
                )
                assert index.match([7]).get(key).kv_blocks == 1
            finally:
                stop.set()
                await task
    finally:
        await store.close()


async def test_a_replayed_load_sample_is_not_taken_as_current(store: IndexStore) -> None:
    """Load entries read late (a backlog after an outage, a lagging router) or appended
    again (a signature proves who wrote an entry, not when) carry an old sample. One older
    than the sample the router holds for that key is ignored; one past ``load_max_age_s``
    by the router's wall clock is not applied at all; the others are stamped with their
    age, so the policies' report_max_age_s and the housekeeping judge them as old as they
    are, not as taken now. Rank 1's fresh sample, written after, shows that the entries
    before it were handled."""
    info = ReplicaInfo("ld", model="m", dp_ranks=(0, 1))
    await store.register(info, owner="p", lease_ttl_s=30)
    r0, r1 = ReplicaKey("ld", 0), ReplicaKey("ld", 1)
    clock = [10_000.0]  # the router's wall clock
    tracker = LoadTracker()
    sync = IndexSync(
        store,
        PrefixIndex(),
        lambda: 500.0,
        LoadTrackerListener(tracker),
        wall_clock=lambda: clock[0],
        load_max_age_s=10.0,
        **FAST,
    )

    async def marker(running: int) -> None:
        await store.publish_load(r1, LoadSample(running, 0, 0.0, clock[0]))
        await eventually(lambda: (e := tracker.view(r1, 500.0).engine) and e.running == running)

    async with sync:
        await eventually(lambda: r0 in tracker.replicas())
        # a sample a minute old: not the replica's load now
        await store.publish_load(r0, LoadSample(9, 9, 0.95, clock[0] - 60))
        await marker(1)
        assert tracker.view(r0, 500.0).engine is None
        wall = clock[0]
        await store.publish_load(r0, LoadSample(1, 1, 0.1, wall))  # fresh
        await marker(2)
        report = tracker.view(r0, 500.0).engine
        assert report is not None and report.running == 1 and report.at == 500.0
        clock[0] = wall + 3
        # the newest sample, then an older one of the same key read after it, both late
        await store.publish_load(r0, LoadSample(5, 5, 0.5, wall + 2))
        await store.publish_load(r0, LoadSample(8, 8, 0.8, wall + 1))
        await marker(3)
        report = tracker.view(r0, 500.0).engine
        assert report is not None and report.running == 5
        assert report.at == 499.0  # one second later than its publisher's usual
        # older than the one held: ignored
        await store.publish_load(r0, LoadSample(7, 7, 0.7, wall + 1.5))
        await marker(4)
        report = tracker.view(r0, 500.0).engine
        assert report is not None and report.running == 5
    # (the sample read after a newer one in the same read is dropped uncounted)
    assert sync.stats.loads_stale >= 2
