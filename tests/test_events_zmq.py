"""Real ZMQ: engine publisher (vLLM wire format) -> subscriber with replay -> index."""

from __future__ import annotations

import asyncio
import random

import pytest
import zmq.asyncio

from router.core.hashing import hash_prompt, root_hash
from router.core.index import PrefixIndex
from router.core.types import ReplicaKey
from router.events.direct import DirectEvents
from router.events.ingest import EndpointSpec
from router.events.model import EngineBlockStored
from router.events.subscriber import ZmqEventSubscriber
from router.events.zmq_pub import KVEventPublisher
from tests.ports import free_port
from tests.waiting import eventually

B = 32
KEY = ReplicaKey("eng")


class Engine:
    """Produces BlockStored events for token sequences, 16-token engine blocks."""

    def __init__(self, be: int = 16) -> None:
        self.be = be
        self.rng = random.Random(0)

    def prompt(self, n_blocks: int) -> list[int]:
        return [self.rng.randrange(30_000) for _ in range(n_blocks * self.be)]

    def stored(self, tokens: list[int], first: int, last: int) -> EngineBlockStored:
        """Blocks [first, last) of ``tokens`` (engine hashes: the token prefix's Python hash)."""
        be = self.be
        hashes = tuple(
            hash(tuple(tokens[: (i + 1) * be])) & (2**63 - 1) for i in range(first, last)
        )
        parent = hash(tuple(tokens[: first * be])) & (2**63 - 1) if first else None
        return EngineBlockStored(hashes, parent, tuple(tokens[first * be : last * be]), be)


def canonical(tokens: list[int]) -> list[int]:
    return hash_prompt(tokens, B, root_hash("m")).hashes


@pytest.fixture
async def pub() -> KVEventPublisher:
    p = KVEventPublisher(
        f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", buffer_steps=8
    )
    p.start()
    yield p
    await p.close()


async def _follow(pub: KVEventPublisher, index: PrefixIndex) -> DirectEvents:
    direct = DirectEvents(index)
    direct.add_replica("eng", "m", B, [EndpointSpec(pub.endpoint, pub.replay_endpoint)])
    await direct.start()
    await asyncio.sleep(0.2)  # ZMQ slow joiner: let the SUB connect before publishing
    return direct


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_dropped_message_is_recovered_through_replay(
    pub: KVEventPublisher, encoding: str
) -> None:
    pub.encoding = encoding  # type: ignore[assignment]
    eng, index = Engine(), PrefixIndex()
    direct = await _follow(pub, index)
    try:
        tokens = eng.prompt(12)
        await pub.publish([eng.stored(tokens, 0, 4)])
        pub.drop_next = 2  # two batches never reach the PUB socket
        await pub.publish([eng.stored(tokens, 4, 6)])
        await pub.publish([eng.stored(tokens, 6, 8)])
        await pub.publish([eng.stored(tokens, 8, 12)])
        want = canonical(tokens)
        await eventually(lambda: index.match(want).get(KEY).kv_blocks == len(want))
        sub = direct._groups[0].subscribers[0]
        assert sub.stats.gaps == 1 and sub.stats.replayed == 2 and sub.stats.lost == 0
    finally:
        await direct.stop()


async def test_gap_beyond_the_replay_buffer_clears_the_replica(pub: KVEventPublisher) -> None:
    eng, index = Engine(), PrefixIndex()
    direct = await _follow(pub, index)
    try:
        a = eng.prompt(4)
        await pub.publish([eng.stored(a, 0, 4)])
        await eventually(lambda: index.match(canonical(a)).get(KEY).kv_blocks == 2)
        pub.drop_next = 10  # more than the 8-batch buffer keeps
        for _ in range(10):
            await pub.publish([])
        b = eng.prompt(4)
        await pub.publish([eng.stored(b, 0, 4)])
        await eventually(lambda: index.match(canonical(b)).get(KEY).kv_blocks == 2)
        # What came before the loss may be stale: it was dropped.
        assert index.match(canonical(a)).get(KEY).kv_blocks == 0
        assert direct.ingests["eng"].stats.lost_batches == 3  # seqs 1-3 left the buffer
    finally:
        await direct.stop()


async def test_malformed_payloads_and_frames_do_no_harm(pub: KVEventPublisher) -> None:
    eng, index = Engine(), PrefixIndex()
    direct = await _follow(pub, index)
    try:
        await pub.publish_raw(b"\xc1garbage")
        await pub.publish_raw(b"\x93\x01")
        # A frame with the wrong shape straight on the PUB socket.
        await pub.pub.send_multipart([b"", b"short"])
        tokens = eng.prompt(8)
        await pub.publish([eng.stored(tokens, 0, 8)])
        await eventually(lambda: index.match(canonical(tokens)).get(KEY).kv_blocks == 4)
        stats = direct.ingests["eng"].stats
        assert stats.malformed_payloads == 2
        assert direct._groups[0].subscribers[0].stats.malformed_frames == 1
    finally:
        await direct.stop()


async def test_subscriber_started_late_gets_history_from_replay(pub: KVEventPublisher) -> None:
    eng, index = Engine(), PrefixIndex()
    tokens = eng.prompt(8)
    await pub.publish([eng.stored(tokens, 0, 4)])  # nobody listens yet
    direct = await _follow(pub, index)
    try:
        await pub.publish([eng.stored(tokens, 4, 8)])
        await eventually(lambda: index.match(canonical(tokens)).get(KEY).kv_blocks == 4)
    finally:
        await direct.stop()


@pytest.mark.parametrize("published_before", [0, 3, 20])
async def test_engine_restart_clears_state(published_before: int) -> None:
    """However few batches the old engine published: a restarted one counts from 0 again,
    and its first batches must not pass for repeats of the old one's."""
    port, rport = free_port(), free_port()
    ctx = zmq.asyncio.Context.instance()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", context=ctx)
    pub.start()
    eng, index = Engine(), PrefixIndex()
    direct = await _follow(pub, index)
    try:
        a = eng.prompt(4)
        for _ in range(published_before):
            await pub.publish([])
        await pub.publish([eng.stored(a, 0, 4)])
        await eventually(lambda: index.match(canonical(a)).get(KEY).kv_blocks == 2)
        pub = await _reopened(pub, ctx)
        await asyncio.sleep(0.3)
        b = eng.prompt(4)
        await pub.publish([eng.stored(b, 0, 4)])
        await eventually(lambda: index.match(canonical(b)).get(KEY).kv_blocks == 2)
        assert index.match(canonical(a)).get(KEY).kv_blocks == 0
        assert direct.ingests["eng"].stats.restarts == 1
    finally:
        await direct.stop()
        await pub.close()


async def test_an_endpoint_it_cannot_subscribe_to_fails_the_start() -> None:
    """An endpoint ZMQ refuses is an error at start-up, never a start that waits forever
    (a well-formed one: malformed ones are configuration errors, test_engine_replay)."""
    direct = DirectEvents(PrefixIndex())
    direct.add_replica("eng", "m", B, [EndpointSpec("ipc:///tmp/" + "x" * 300)])
    with pytest.raises(zmq.ZMQError):
        await asyncio.wait_for(direct.start(), 10)
    await direct.stop()


async def test_a_failed_subscriber_restarts_and_replays_what_it_missed() -> None:
    pub = KVEventPublisher(
        f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", buffer_steps=10_000
    )
    pub.start()
    eng, index = Engine(), PrefixIndex()
    direct = await _follow(pub, index)
    try:
        group = direct._groups[0]
        group.RESTART_BACKOFF_S = (0.01, 0.05)
        sub = group.subscribers[0]
        tokens = eng.prompt(8)
        await pub.publish([eng.stored(tokens, 0, 4)])
        await eventually(lambda: index.match(canonical(tokens)).get(KEY).kv_blocks == 2)
        handle = sub._handle

        async def fail_once(frames: list[bytes]) -> None:
            sub._handle = handle  # type: ignore[method-assign]
            raise RuntimeError("injected")

        sub._handle = fail_once  # type: ignore[method-assign]
        await pub.publish([eng.stored(tokens, 4, 8)])  # taken by the failing subscriber
        await eventually(lambda: group.restarts == 1)

        async def caught_up() -> bool:
            await pub.publish([])  # a later batch shows the restarted subscriber the gap
            return index.match(canonical(tokens)).get(KEY).kv_blocks == 4

        await eventually(caught_up, interval=0.05)
        assert sub.stats.replayed >= 1 and sub.stats.lost == 0
        assert direct.ingests["eng"].stats.lost_batches == 0
    finally:
        await direct.stop()
        await pub.close()


async def test_a_repeated_batch_is_dropped_and_a_new_one_under_an_old_seq_is_a_restart() -> None:
    ctx = zmq.asyncio.Context.instance()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    got: list[tuple[int, bytes]] = []
    restarts: list[int] = []
    sub = ZmqEventSubscriber(
        endpoint,
        lambda seq, payload: got.append((seq, payload)),
        on_restart=lambda: restarts.append(len(got)),
        replay_history=False,
        context=ctx,
    )
    task = asyncio.create_task(sub.run())
    try:
        await sub.connected.wait()

        async def send(seq: int, payload: bytes) -> None:
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

        # ZMQ's slow joiner: repeat the first batch until one gets through (the repeats
        # are duplicates, which is what this test is about anyway)
        async def first_through() -> bool:
            await send(0, b"a0")
            return bool(got)

        await eventually(first_through)
        await send(1, b"a1")
        await send(1, b"a1")  # the same batch again: dropped
        await send(0, b"a0")  # an older one again: dropped
        await send(2, b"a2")
        await eventually(lambda: got[-1] == (2, b"a2"))
        assert got == [(0, b"a0"), (1, b"a1"), (2, b"a2")]
        assert restarts == []
        await send(0, b"b0")  # seq 0 with another payload: the engine restarted
        await send(1, b"b1")
        await eventually(lambda: got[-1] == (1, b"b1"))
        assert got[3:] == [(0, b"b0"), (1, b"b1")]
        assert restarts == [3]
        assert sub.stats.restarts == 1
        assert sub.stats.duplicates >= 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close(0)


def _replaying_pair() -> tuple[KVEventPublisher, ZmqEventSubscriber, list[int], list[int]]:
    """A started publisher with a replay socket, and a subscriber of it (not running) that
    records the seqs delivered and the counts reported lost."""
    ctx = zmq.asyncio.Context.instance()
    pub = KVEventPublisher(
        f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", context=ctx
    )
    pub.start()
    got: list[int] = []
    lost: list[int] = []
    sub = ZmqEventSubscriber(
        pub.endpoint,
        lambda seq, _: got.append(seq),
        replay_endpoint=pub.replay_endpoint,
        on_lost=lost.append,
        context=ctx,
    )
    return pub, sub, got, lost


async def test_history_longer_than_the_replay_sockets_queue_arrives_whole() -> None:
    """The engine's ROUTER drops replies past its high-water mark (1,000), the end marker
    with them: the subscriber asks again from where a reply stopped, and misses nothing."""
    pub, sub, got, lost = _replaying_pair()
    task: asyncio.Task[None] | None = None
    try:
        for _ in range(3000):  # nobody listens yet
            await pub.publish([])
        task = asyncio.create_task(sub.run())
        await eventually(lambda: len(got) >= 3000)
        assert got == list(range(pub.seq - 2999, pub.seq + 1))
        assert lost == [] and sub.stats.lost == 0
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await pub.close()


async def test_replies_dropped_mid_burst_are_asked_again() -> None:
    """The ROUTER drops replies past its high-water mark anywhere in the burst, and later
    ones (the end marker too) still arrive: a history and a gap's replay with a hole in the
    middle are asked again from the hole, and nothing is lost (before, the hole was)."""
    pub, sub, got, lost = _replaying_pair()
    task: asyncio.Task[None] | None = None
    try:
        for _ in range(50):  # nobody listens yet
            await pub.publish([])
        pub.drop_replay = set(range(10, 20))
        task = asyncio.create_task(sub.run())
        await eventually(lambda: len(got) >= 50)
        assert got == list(range(50)) and sub.stats.replayed == 50

        async def live() -> bool:
            await pub.publish([])
            return len(got) > 50

        await eventually(live)
        start = pub.seq + 1
        pub.drop_next = 30  # a gap of 30 the subscriber replays, 5 of them dropped in it
        for _ in range(30):
            await pub.publish([])
        pub.drop_replay = set(range(start + 12, start + 17))
        await pub.publish([])
        await eventually(lambda: got[-1] == pub.seq)
        assert got == list(range(pub.seq + 1))
        assert lost == [] and sub.stats.lost == 0 and sub.stats.gaps == 1
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await pub.close()


async def test_a_history_hole_the_buffer_moved_past_is_reported_lost() -> None:
    """The history's first answer loses 10-19 on the way, and before it is asked again the
    engine's buffer forgets 0-14: 15-19 come back, 10-14 are lost, and said to be (the
    caller clears that engine: stale blocks are worse than missing ones)."""
    pub, sub, got, lost = _replaying_pair()
    task: asyncio.Task[None] | None = None
    try:
        for _ in range(50):
            await pub.publish([])
        pub.drop_replay = set(range(10, 20))
        pub.trim_after_replay = 15
        task = asyncio.create_task(sub.run())
        await eventually(lambda: len(got) >= 45)
        assert got == [*range(10), *range(15, 50)]
        assert lost == [5] and sub.stats.lost == 5
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await pub.close()


@pytest.mark.parametrize(("old_batches", "new_batches"), [(20, 5), (3, 7)])
async def test_a_restart_while_the_subscriber_was_away_is_found_and_replayed(
    old_batches: int, new_batches: int
) -> None:
    """The engine restarts while the subscriber is not connected and publishes its first
    batches unseen. Back, the subscriber sees a seq at or below its last (20, 5) or past
    it (3, 7): either way a restart, and the new engine's batches from 0 are delivered."""
    port, rport = free_port(), free_port()
    ctx = zmq.asyncio.Context.instance()
    endpoint, replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"
    got: list[bytes] = []
    restarts: list[int] = []
    sub = ZmqEventSubscriber(
        endpoint,
        lambda _, payload: got.append(payload),
        replay_endpoint=replay,
        on_restart=lambda: restarts.append(len(got)),
        context=ctx,
    )
    pub = KVEventPublisher(endpoint, replay, context=ctx)
    pub.start()
    task = asyncio.create_task(sub.run())
    try:
        old = [f"old-{i}".encode() for i in range(old_batches)]
        for payload in old:  # history or live, every one arrives
            await pub.publish_raw(payload)
        await eventually(lambda: got == old)
        task.cancel()  # the subscriber goes away (a publisher restart, a slow reconnect)
        await asyncio.gather(task, return_exceptions=True)
        pub = await _reopened(pub, ctx)
        new = [f"new-{i}".encode() for i in range(new_batches)]
        for payload in new:  # nobody listens
            await pub.publish_raw(payload)
        task = asyncio.create_task(sub.run())
        live: list[bytes] = []

        async def caught_up() -> bool:
            payload = f"live-{len(live)}".encode()  # until one gets past the slow joiner
            live.append(payload)
            await pub.publish_raw(payload)
            return any(p.startswith(b"live-") for p in got)

        await eventually(caught_up)
        assert len(restarts) == 1 and sub.stats.restarts == 1
        after = got[restarts[0] :]
        assert after[:new_batches] == new, after
        assert all(p.startswith(b"live-") for p in after[new_batches:])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await pub.close()


async def _reopened(pub: KVEventPublisher, ctx: zmq.asyncio.Context) -> KVEventPublisher:
    """A new engine on ``pub``'s endpoints (``pub`` closed first), started."""
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    await pub.close()
    for _ in range(100):  # the old sockets are closed asynchronously by ZMQ's I/O thread
        try:
            pub = KVEventPublisher(endpoint, replay, context=ctx)
            break
        except zmq.ZMQError:
            await asyncio.sleep(0.05)
    pub.start()
    return pub


@pytest.mark.parametrize(("old_batches", "new_batches"), [(20, 5), (3, 7), (3, 3), (5, 0)])
async def test_a_subscriber_back_from_a_failure_catches_up_with_an_idle_engine(
    old_batches: int, new_batches: int
) -> None:
    """The subscriber fails (its supervisor runs it again, keeping its last seq); meanwhile
    the engine publishes a few more batches, or restarts and publishes its first ones, and
    then stays idle. Back, the subscriber asks the replay socket from its last seq at once:
    it delivers what it missed, or finds the restart (a new batch under its last seq) and
    delivers the new engine's from 0. Before, it waited for the engine's next live batch,
    and one whose seq came right after its last (3, 3) passed for the old engine's."""
    ctx = zmq.asyncio.Context.instance()
    pub = KVEventPublisher(
        f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", context=ctx
    )
    pub.start()
    got: list[bytes] = []
    restarts: list[int] = []
    sub = ZmqEventSubscriber(
        pub.endpoint,
        lambda _, payload: got.append(payload),
        replay_endpoint=pub.replay_endpoint,
        on_restart=lambda: restarts.append(len(got)),
        context=ctx,
    )
    task = asyncio.create_task(sub.run())
    try:
        old = [f"old-{i}".encode() for i in range(old_batches)]
        for payload in old:
            await pub.publish_raw(payload)
        await eventually(lambda: got == old)
        task.cancel()  # the subscriber fails
        await asyncio.gather(task, return_exceptions=True)
        if new_batches:  # the engine restarts
            pub = await _reopened(pub, ctx)
            new = [f"new-{i}".encode() for i in range(new_batches)]
        else:  # the engine goes on
            new = [f"more-{i}".encode() for i in range(3)]
        for payload in new:  # nobody listens; then the engine stays idle
            await pub.publish_raw(payload)
        task = asyncio.create_task(sub.run())  # its supervisor runs it again
        await eventually(lambda: got[-len(new) :] == new)
        if new_batches:
            assert restarts == [old_batches] and sub.stats.restarts == 1
        else:
            assert restarts == [] and got == old + new and sub.stats.lost == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await pub.close()


async def test_an_engine_restart_is_found_when_the_subscriber_reconnects() -> None:
    """The engine restarts and then stays idle (no request reached it yet) while the
    subscriber stays up: the SUB socket reconnects by itself, and the subscriber asks the
    replay socket from its last seq then. The new engine holds no such batch: its state is
    cleared at once. Before, the old engine's blocks stayed indexed (and drew requests to
    the restarted engine) until the new engine's first batch arrived."""
    ctx = zmq.asyncio.Context.instance()
    pub = KVEventPublisher(
        f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", context=ctx
    )
    pub.start()
    eng, index = Engine(), PrefixIndex()
    direct = await _follow(pub, index)
    try:
        a = eng.prompt(4)
        await pub.publish([eng.stored(a, 0, 4)])
        await eventually(lambda: index.match(canonical(a)).get(KEY).kv_blocks == 2)
        pub = await _reopened(pub, ctx)  # publishes nothing
        await eventually(lambda: index.match(canonical(a)).get(KEY).kv_blocks == 0)
        assert direct.ingests["eng"].stats.restarts == 1
        b = eng.prompt(4)  # the new engine's batches follow
        await pub.publish([eng.stored(b, 0, 4)])

        async def b_indexed() -> bool:
            await pub.publish([])  # one past ZMQ's slow joiner shows a gap, if any
            return index.match(canonical(b)).get(KEY).kv_blocks == 2

        await eventually(b_indexed)
        assert direct.ingests["eng"].stats.restarts == 1
    finally:
        await direct.stop()
        await pub.close()


async def test_a_task_cancelled_while_it_unfollows_a_replica_ends_cancelled(
    pub: KVEventPublisher,
) -> None:
    """The router's discovery task (``zmq = "auto"``) unfollows a replica that moved its
    ports and follows it anew; the router stops it meanwhile (one cancel, then it waits
    for the task). The cancellation reaches the task while its subscribers stop: the task
    ends there, and the replica's blocks are cleared all the same. Before, stopping the
    subscribers swallowed the caller's cancellation too: the task went on following the
    replica and watching it, and the router's shutdown waited for it forever."""
    eng, index = Engine(), PrefixIndex()
    direct = await _follow(pub, index)
    went_on: list[str] = []
    try:
        tokens = eng.prompt(4)
        await pub.publish([eng.stored(tokens, 0, 4)])
        await eventually(lambda: index.match(canonical(tokens)).get(KEY).kv_blocks == 2)

        async def moved() -> None:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # delivered at its first wait: the subscribers' stopping
            await direct.unfollow("eng")
            went_on.append("followed again")

        task = asyncio.create_task(moved())
        await asyncio.wait({task}, timeout=10)
        assert task.cancelled() and went_on == []
        assert index.match(canonical(tokens)).get(KEY).kv_blocks == 0
    finally:
        await direct.stop()
