"""The life cycle of an engine's KV-event feed against the engines' own publishers
(tests/engines, real ZMQ on loopback): a long history or backlog shares the event loop, a
restart is found whenever the subscriber comes back."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest
import zmq

from router.events.subscriber import YIELD_EVERY, ZmqEventSubscriber
from tests.engines.harness import RefEngine, free_port_run
from tests.waiting import eventually, wait_until

ENGINE = "vllm-0.33.0"  # byte-identical to vLLM 0.34.0's kv_events.py (tests/engines)


class Turns:
    """An ``on_payload`` that records how many batches were delivered in a row without the
    event loop getting a turn (a callback scheduled at the first of them runs at the next)."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.run = 0
        self.longest = 0
        self._pending = False

    def _turn(self) -> None:
        self._pending = False

    def __call__(self, seq: int, payload: bytes) -> None:
        self.seqs.append(seq)
        if self._pending:
            self.run += 1
        else:
            self.run = 1
            self._pending = True
            asyncio.get_running_loop().call_soon(self._turn)
        self.longest = max(self.longest, self.run)


@pytest.fixture
def engine() -> Iterator[RefEngine]:
    p = free_port_run(2)
    eng = RefEngine(ENGINE, p, p + 1)
    yield eng
    eng.close()


def _subscriber(eng: RefEngine, on_payload: Turns) -> ZmqEventSubscriber:
    port = int(eng.pub._endpoint.rpartition(":")[2])
    replay = int(str(eng.pub._replay_endpoint).rpartition(":")[2])
    return ZmqEventSubscriber(
        f"tcp://127.0.0.1:{port}", on_payload, replay_endpoint=f"tcp://127.0.0.1:{replay}"
    )


class Gate:
    """A TCP forwarder on loopback that holds the connections made to it until ``open``:
    a subscriber's SUB socket behind it connects (to the gate) but completes no handshake
    with the engine until then."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.opened = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.opened.wait()
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        finally:
            dst.close()

    async def close(self) -> None:
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_long_history_is_delivered_in_turns_with_the_event_loop(
    engine: RefEngine,
) -> None:
    """A warm engine's 10,000-batch history took seconds to apply, every batch delivered
    without the event loop getting a turn (requests, probes and other engines' events
    waited): now it gets one at least every YIELD_EVERY batches."""
    for _ in range(10 * YIELD_EVERY):
        engine.publish(engine.stored(engine.prompt(2)))
    engine.wait_sent()
    turns = Turns()
    task = asyncio.create_task(_subscriber(engine, turns).run())
    try:
        await eventually(lambda: len(turns.seqs) == 10 * YIELD_EVERY)
        assert turns.seqs == list(range(10 * YIELD_EVERY))
        assert turns.longest <= YIELD_EVERY
    finally:
        await _stop(task)


async def test_a_backlog_of_live_batches_is_delivered_in_turns_with_the_event_loop(
    engine: RefEngine,
) -> None:
    """Live batches queued on the SUB socket (the router was busy) came out of pyzmq
    without a yield: all of them were applied before anything else ran."""
    turns = Turns()
    sub = _subscriber(engine, turns)
    task = asyncio.create_task(sub.run())
    try:

        async def live() -> bool:
            engine.publish()
            return bool(turns.seqs)

        await eventually(live)
        await eventually(lambda: turns.seqs[-1] == engine.published - 1)
        # a SUB of the test's own, fed by the same engine, tells when the backlog is there
        watch = zmq.Context.instance().socket(zmq.SUB)
        watch.setsockopt(zmq.LINGER, 0)
        watch.setsockopt(zmq.SUBSCRIBE, b"")
        watch.connect(sub.endpoint)
        try:

            async def joined() -> bool:
                engine.publish()
                return bool(watch.poll(0))

            await eventually(joined)
            await eventually(lambda: turns.seqs[-1] == engine.published - 1)
            while watch.poll(0):
                watch.recv_multipart()
            first, backlog = engine.published, 10 * YIELD_EVERY
            # the event loop is held here (a busy router) while the engine publishes
            for _ in range(backlog):
                engine.publish(engine.stored(engine.prompt(2)))
            engine.wait_sent()
            seen = 0
            while seen < backlog and watch.poll(10_000):
                seen += watch.recv_multipart()[1] >= first.to_bytes(8, "big")
            assert seen == backlog
        finally:
            watch.close(0)
        await eventually(lambda: turns.seqs[-1] == first + backlog - 1)
        assert turns.seqs[-backlog:] == list(range(first, first + backlog))
        assert turns.longest <= YIELD_EVERY
    finally:
        await _stop(task)


def _restart(eng: RefEngine) -> RefEngine:
    """``eng`` shut down and a new engine on its ports."""
    port = int(eng.pub._endpoint.rpartition(":")[2])
    replay = int(str(eng.pub._replay_endpoint).rpartition(":")[2])
    eng.close()
    return _back(port, replay)


def _back(port: int, replay: int) -> RefEngine:
    """A new engine on ``port`` with replay on ``replay`` (an old engine's ports are
    released asynchronously by ZMQ's I/O thread: bound once they are free)."""
    made: list[RefEngine] = []

    def bound() -> bool:
        try:
            made.append(RefEngine(ENGINE, port, replay, seed=1))
        except zmq.ZMQError:
            return False
        return True

    wait_until(bound)
    return made[0]


async def test_a_restarted_engine_is_forgotten_before_its_first_batch() -> None:
    """vLLM restarts on the same ports and stays idle: the subscriber's SUB reconnects, it
    asks the replay socket from its last seq, the new engine holds nothing, and the old
    engine's state is forgotten at once (``on_restart``), not at the new one's first
    batch; that batch then comes as seq 0 of the new engine, no second restart."""
    p = free_port_run(2)
    engine = RefEngine(ENGINE, p, p + 1)
    turns = Turns()
    sub = _subscriber(engine, turns)
    restarts: list[int] = []
    sub.on_restart = lambda: restarts.append(len(turns.seqs))
    task = asyncio.create_task(sub.run())
    new: RefEngine | None = None
    try:
        for _ in range(3):
            engine.publish(engine.stored(engine.prompt(2)))
        await eventually(lambda: turns.seqs == [0, 1, 2])
        new = _restart(engine)
        await eventually(lambda: restarts == [3])

        async def live() -> bool:
            assert new is not None
            new.publish(new.stored(new.prompt(2)))
            return len(turns.seqs) > 3

        await eventually(live)
        assert turns.seqs[3] == 0 and restarts == [3] and sub.stats.restarts == 1
    finally:
        await _stop(task)
        (engine if new is None else new).close()


async def test_a_subscriber_back_while_its_engine_is_down_catches_up_when_it_returns() -> None:
    """The subscriber fails and its supervisor runs it again while the engine is down: its
    catch-up from the last seq gets no answer. The engine then comes back restarted and
    stays idle. The SUB socket's first handshake is the engine's return: the subscriber
    catches up then and forgets the old engine. Before, the monitor skipped every socket's
    first handshake (the one ``run`` had caught up for), so the old engine's blocks stayed
    until the new engine's first batch."""
    p = free_port_run(2)
    engine = RefEngine(ENGINE, p, p + 1)
    turns = Turns()
    sub = _subscriber(engine, turns)
    sub.replay_timeout_s = 0.2
    restarts: list[int] = []
    sub.on_restart = lambda: restarts.append(len(turns.seqs))
    task = asyncio.create_task(sub.run())
    new: RefEngine | None = None
    try:
        for _ in range(3):
            engine.publish(engine.stored(engine.prompt(2)))
        await eventually(lambda: turns.seqs == [0, 1, 2])
        await _stop(task)  # the subscriber fails ...
        engine.close()  # ... and the engine goes down
        task = asyncio.create_task(sub.run())  # its supervisor runs it again
        # its catch-up asked the replay socket, unanswered (held under the lock until then)
        await eventually(lambda: sub._sub is not None and not sub._lock.locked())
        assert restarts == [] and sub.last_seq == 2
        new = _back(p, p + 1)  # restarted, idle
        await eventually(lambda: restarts == [3])
        assert sub.last_seq is None and sub.stats.restarts == 1
    finally:
        await _stop(task)
        (engine if new is None else new).close()


async def test_a_subscriber_started_before_its_engine_loads_the_history_when_it_comes() -> None:
    """The subscriber starts while its engine is down (its history fetch unanswered); the
    engine comes, publishes a few batches that do not reach the SUB socket and goes idle.
    Its first handshake loads the history: they are delivered. Before, they waited for the
    engine's next batch."""
    p = free_port_run(2)
    engine = RefEngine(ENGINE, p, p + 1)
    turns = Turns()
    sub = _subscriber(engine, turns)
    engine.close()
    sub.replay_timeout_s = 0.2
    task = asyncio.create_task(sub.run())
    new: RefEngine | None = None
    try:
        await eventually(lambda: sub._sub is not None and not sub._lock.locked())
        new = _back(p, p + 1)
        # published before the event loop runs again: the handshake's fetch comes after
        new.wire.drop = 3
        for _ in range(3):
            new.publish(new.stored(new.prompt(2)))
        new.wait_sent()
        await eventually(lambda: turns.seqs == [0, 1, 2])
        assert sub.stats.replayed == 3
    finally:
        await _stop(task)
        (engine if new is None else new).close()


async def test_batches_published_before_the_subscription_joined_are_loaded() -> None:
    """The history fetch is answered (the engine's buffer is empty) before the SUB socket
    has joined the engine's PUB (ZMQ connects asynchronously: here a gate holds the
    connection); the engine publishes a few batches meanwhile, which its PUB drops for
    want of a subscriber, then goes idle. The first handshake catches up: they are
    delivered. Before, the first handshake was skipped and they waited for the engine's
    next batch."""
    p = free_port_run(2)
    engine = RefEngine(ENGINE, p, p + 1)
    gate = Gate(p)
    await gate.start()
    turns = Turns()
    sub = ZmqEventSubscriber(
        f"tcp://127.0.0.1:{gate.port}", turns, replay_endpoint=f"tcp://127.0.0.1:{p + 1}"
    )
    task = asyncio.create_task(sub.run())
    try:
        await eventually(lambda: sub._sub is not None and not sub._lock.locked())
        assert sub.stats.replayed == 0 and sub.last_seq is None  # answered: nothing yet
        for _ in range(3):
            engine.publish(engine.stored(engine.prompt(2)))
        engine.wait_sent()
        gate.opened.set()
        await eventually(lambda: turns.seqs == [0, 1, 2])
        assert sub.stats.replayed == 3
    finally:
        await _stop(task)
        await gate.close()
        engine.close()


async def test_a_backlog_of_the_old_engine_is_not_taken_for_the_restarted_ones() -> None:
    """The subscriber is busy while its engine publishes a backlog of batches, then
    restarts on the same ports: the SUB socket reconnects and the subscriber finds the
    restart by its replay socket while the old engine's batches are still queued on the
    SUB. Those are the old engine's: none of them is delivered after the restart (the SUB
    socket is made anew; the new engine's batches come by replay and live). Before, they
    followed the new engine's history as its own (their seqs went on from it): the old
    engine's blocks were indexed as the restarted one's until its next batch."""
    p = free_port_run(2)
    engine = RefEngine(ENGINE, p, p + 1)
    got: list[bytes] = []
    restarts: list[int] = []
    sub = _subscriber(engine, lambda _, payload: got.append(payload))  # type: ignore[arg-type]
    sub.on_restart = lambda: restarts.append(len(got))
    task = asyncio.create_task(sub.run())
    new: RefEngine | None = None
    watch = zmq.Context.instance().socket(zmq.SUB)
    watch.setsockopt(zmq.LINGER, 0)
    watch.setsockopt(zmq.SUBSCRIBE, b"")
    watch.connect(sub.endpoint)
    try:

        async def live() -> bool:
            engine.publish()
            return bool(got) and bool(watch.poll(0))

        await eventually(live)
        await eventually(lambda: len(got) == engine.published)
        while watch.poll(0):
            watch.recv_multipart()
        async with sub._lock:  # the subscriber is busy (delivering a batch)
            backlog = 10 * YIELD_EVERY
            for _ in range(backlog):
                engine.publish(engine.stored(engine.prompt(2)))
            engine.wait_sent()
            seen = 0
            while seen < backlog and watch.poll(10_000):
                watch.recv_multipart()
                seen += 1
            assert seen == backlog  # the test's own SUB has them: so has the subscriber's
            new = _restart(engine)
            # waiting for the subscriber: its receiving loop (a batch of the backlog in
            # hand) and its reconnection watch (the new engine's handshake)
            await eventually(lambda: len(sub._lock._waiters or ()) == 2)

        def latest_delivered() -> bool:
            assert new is not None
            if restarts and got[-1] == new.pub._buffer[-1][1]:
                return True
            new.publish(new.stored(new.prompt(2)))  # until one arrives after the rest
            new.wait_sent()
            return False

        await eventually(latest_delivered, interval=0.1)
        old = {payload for _, payload in engine.pub._buffer}
        after = got[restarts[0] :]
        assert sum(payload in old for payload in after) == 0
        assert after == [payload for _, payload in new.pub._buffer]
        assert len(restarts) == 1 and sub.stats.restarts == 1
    finally:
        watch.close(0)
        await _stop(task)
        (engine if new is None else new).close()


async def test_engine_restarts_leave_no_sockets_or_tasks_behind() -> None:
    """The engine restarts on the same ports again and again, each time found by the
    subscriber (its SUB socket made anew, replay sockets opened and closed): the open file
    descriptors and tasks stay as many as after the first restart."""
    p = free_port_run(2)
    engine = RefEngine(ENGINE, p, p + 1)
    got: list[bytes] = []
    restarts: list[int] = []
    sub = _subscriber(engine, lambda _, payload: got.append(payload))  # type: ignore[arg-type]
    sub.on_restart = lambda: restarts.append(len(got))
    task = asyncio.create_task(sub.run())
    held: tuple[int, int] | None = None

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    try:
        for i in range(6):

            def delivered(eng: RefEngine = engine) -> bool:
                if eng.pub._buffer and got and got[-1] == eng.pub._buffer[-1][1]:
                    return True
                eng.publish(eng.stored(eng.prompt(2)))  # until one arrives (slow joiner)
                return False

            await eventually(delivered, interval=0.1)
            if held is None and i == 1:
                held = (fds(), len(asyncio.all_tasks()))
            elif held is not None:
                most_fds, most_tasks = held
                await eventually(lambda n=most_fds: fds() <= n)  # ZMQ closes sockets by and by
                assert len(asyncio.all_tasks()) <= most_tasks
            engine = _restart(engine)
            await eventually(lambda i=i: len(restarts) == i + 1)
    finally:
        await _stop(task)
        engine.close()
