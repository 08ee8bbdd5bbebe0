"""``StoreWriter`` (router/store/writer.py) against a real redis-server: what is asked of
it while a write of its is in flight."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from router.core.types import AllCleared, BlocksStored, ReplicaKey
from router.store.base import ReplicaInfo, ReplicaSnapshot, ReplicaState
from router.store.redis_store import RedisStore
from router.store.schema import KeySchema
from router.store.writer import StoreWriter

OWNER = "pub-r"


class HeldResets(RedisStore):
    """A ``RedisStore`` whose ``reset`` lands its write, then waits for ``release``: the
    writer's reset is in flight (its round trip not yet answered) until the test says."""

    landed: asyncio.Event
    release: asyncio.Event

    async def reset(self, states: Sequence[ReplicaState], owner: str | None = None) -> None:
        await super().reset(states, owner)
        self.landed.set()
        await self.release.wait()


@pytest.fixture
async def store(redis_url: str, key_prefix: str) -> AsyncIterator[HeldResets]:
    s = HeldResets.from_url(redis_url, KeySchema(key_prefix, stream_shards=2))
    s.landed, s.release = asyncio.Event(), asyncio.Event()
    await s.register(ReplicaInfo("r", url="http://r", model="m"), OWNER, 30)
    try:
        yield s
    finally:
        await s.close()


async def _in_flight(store: HeldResets, writer: StoreWriter) -> asyncio.Task[int]:
    """The writer's reset, started and landed, its answer held back."""
    task = asyncio.create_task(writer.flush())
    await store.landed.wait()
    return task


async def test_a_reset_asked_for_while_one_is_in_flight_is_not_forgotten(
    store: HeldResets,
) -> None:
    """The publisher's heartbeat finds the lease gone (it expired, or Redis lost its data)
    while the flush loop's reset is in flight, and asks for another one (``needs_reset``).
    Before, the reset in flight cleared that when it returned: the publisher did not register
    again until a later heartbeat found the lease gone once more."""
    k0 = ReplicaKey("r", 0)
    writer = StoreWriter(store, [k0], OWNER)
    task = await _in_flight(store, writer)
    writer.needs_reset = True  # what ``Publisher._heartbeat_loop`` does on a lost lease
    store.release.set()
    await task
    assert writer.needs_reset


async def test_ranks_changed_while_a_reset_is_in_flight_are_written(
    store: HeldResets,
) -> None:
    """``Publisher.follow_endpoints`` (``--zmq auto``: the engine came back with other DP
    ranks) clears the old ranks and hands the writer the new ones while the flush loop's
    reset is in flight. Before, that reset cleared the reset the new ranks asked for, and
    every flush after it failed on the old rank's pending clear (``KeyError``): the
    publisher wrote nothing more while its heartbeat kept the replica registered with the
    old engine's blocks."""
    k0, k1 = ReplicaKey("r", 0), ReplicaKey("r", 1)
    writer = StoreWriter(store, [k0], OWNER)
    writer.add(k0, [BlocksStored((1, 2))])
    task = await _in_flight(store, writer)
    writer.add(k0, [AllCleared()])  # ``EngineIngest.clear`` of the old ranks
    writer.set_keys([k1])
    store.release.set()
    await task
    writer.add(k1, [BlocksStored((7,))])
    await writer.flush()
    await writer.flush()
    assert await store.stored_seq(k1) == writer.states[k1].seq
    snap = (await store.read_replicas([k1]))[0]
    assert isinstance(snap, ReplicaSnapshot)
    assert {h for ev in snap.events() if isinstance(ev, BlocksStored) for h in ev.hashes} == {7}
