"""The live backlog of a subscriber is bounded in bytes (router/events/backlog.py), real ZMQ
on loopback: ZMQ bounds its queue by message count only, and an engine's batches can be
megabytes each. A handler that falls behind (here: its lock held, as a long history load
holds it) keeps at most the budget buffered; what it dropped is refilled from the replay
socket, or counted lost without one. Nothing is lost silently."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from router.events.backlog import MESSAGE_OVERHEAD
from router.events.subscriber import ZmqEventSubscriber
from router.events.zmq_pub import KVEventPublisher
from tests.ports import free_port
from tests.waiting import eventually

BUDGET = 1 << 20
BATCH = 100_000  # bytes of one payload: 50 of them are five budgets
STALLED = 50


def _payload(seq: int, size: int = BATCH) -> bytes:
    return seq.to_bytes(8, "big") * (size // 8)


@pytest.fixture(params=[True, False], ids=["replay", "no-replay"])
async def pub(request: pytest.FixtureRequest) -> AsyncIterator[KVEventPublisher]:
    replay = f"tcp://127.0.0.1:{free_port()}" if request.param else None
    p = KVEventPublisher(f"tcp://127.0.0.1:{free_port()}", replay)
    p.start()
    yield p
    await p.close()


class Record:
    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.payloads: dict[int, bytes] = {}
        self.lost = 0

    def payload(self, seq: int, payload: bytes) -> None:
        self.seqs.append(seq)
        self.payloads[seq] = payload

    def on_lost(self, n: int) -> None:
        self.lost += n


async def _joined(pub: KVEventPublisher, sub: ZmqEventSubscriber, rec: Record) -> None:
    """Publish small batches until one arrives live (ZMQ's slow joiner)."""

    async def live() -> bool:
        await pub.publish_raw(_payload(pub.seq + 1, 64))
        return bool(rec.seqs)

    await eventually(live)
    await eventually(lambda: sub.last_seq == pub.seq)


def _subscriber(pub: KVEventPublisher, rec: Record) -> ZmqEventSubscriber:
    """A subscriber of ``pub`` (and its replay socket, if any) recording into ``rec``, with a
    backlog budget of ``BUDGET``."""
    return ZmqEventSubscriber(
        pub.endpoint,
        rec.payload,
        replay_endpoint=pub.replay_endpoint,
        on_lost=rec.on_lost,
        max_backlog_bytes=BUDGET,
    )


async def test_a_stalled_handler_buffers_at_most_the_budget_and_loses_nothing_silently(
    pub: KVEventPublisher,
) -> None:
    rec = Record()
    sub = _subscriber(pub, rec)
    task = asyncio.create_task(sub.run())
    try:
        await _joined(pub, sub, rec)
        before = sub.stats.received
        first = pub.seq + 1
        async with sub._lock:  # the handler is busy (a history load holds the lock)
            for _ in range(STALLED):
                await pub.publish_raw(_payload(pub.seq + 1))
            # every batch reached the subscriber: queued within the budget, or dropped
            await eventually(lambda: sub.stats.received - before >= STALLED)
            assert sub.backlog_bytes <= BUDGET
            # (the handler may hold one, taken before the lock)
            assert sub.stats.dropped >= STALLED - BUDGET // (BATCH + MESSAGE_OVERHEAD) - 1
        await eventually(lambda: sub.last_seq == pub.seq)
        assert sub.stats.max_backlog_bytes <= BUDGET
        stalled = [s for s in rec.seqs if s >= first]
        if pub.replay_endpoint:  # the drops came back from the replay socket, in order
            assert stalled == list(range(first, pub.seq + 1))
            assert all(rec.payloads[s] == _payload(s) for s in stalled)
            assert rec.lost == sub.stats.lost == 0
        else:  # every batch applied or counted lost
            assert stalled == sorted(stalled)
            assert len(stalled) + rec.lost == STALLED
            assert rec.lost == sub.stats.lost == sub.stats.dropped > 0
        # the next batch follows the refilled (or lost) ones: no gap again, nothing more lost
        lost, gaps = rec.lost, sub.stats.gaps
        after = await pub.publish_raw(_payload(pub.seq + 1, 64))
        await eventually(lambda: sub.last_seq == after)
        assert rec.seqs[-1] == after
        assert (rec.lost, sub.stats.gaps) == (lost, gaps)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_batch_larger_than_the_budget_alone_is_still_delivered_live(
    pub: KVEventPublisher,
) -> None:
    rec = Record()
    sub = ZmqEventSubscriber(
        pub.endpoint, rec.payload, replay_endpoint=pub.replay_endpoint, max_backlog_bytes=BUDGET
    )
    task = asyncio.create_task(sub.run())
    try:
        await _joined(pub, sub, rec)
        replayed = sub.stats.replayed
        big = await pub.publish_raw(_payload(pub.seq + 1, 2 * BUDGET))
        await eventually(lambda: sub.last_seq == big)
        assert rec.payloads[big] == _payload(big, 2 * BUDGET)
        assert sub.stats.dropped == 0
        assert sub.stats.replayed == replayed
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_the_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_backlog_bytes"):
        ZmqEventSubscriber("tcp://127.0.0.1:1", lambda s, p: None, max_backlog_bytes=0)


def test_the_budget_is_read_once_and_checked_at_the_edge() -> None:
    """``server.max_event_backlog_mb`` and ``kvrouter publish --max-event-backlog-mb``: a
    budget that cannot work stops the start with the setting's name."""
    from router.cli import build_parser
    from router.core.errors import ConfigError
    from router.publisher.cli import check_timing
    from router.service.config import build_settings

    assert build_settings({}).server.max_event_backlog_mb == 64.0
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=r"server\.max_event_backlog_mb"):
            build_settings({"server": {"max_event_backlog_mb": bad}})
    argv = ["publish", "--replica", "r", "--model", "m", "--zmq", "tcp://127.0.0.1:1"]
    args = build_parser("publish").parse_args(argv)
    assert args.max_event_backlog_mb == 64.0
    check_timing(args)
    args = build_parser("publish").parse_args([*argv, "--max-event-backlog-mb", "0"])
    with pytest.raises(ValueError, match="--max-event-backlog-mb"):
        check_timing(args)


async def test_replayed_history_and_refills_are_held_at_most_a_budget_at_a_time() -> None:
    """A history load and a gap refill of many large batches (five budgets each) are
    delivered in chunks of at most the budget as they are read (``stats.max_replay_bytes``:
    the most replayed bytes held, read and not yet delivered), in order, nothing lost."""
    pub = KVEventPublisher(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    pub.start()
    rec = Record()
    sub = _subscriber(pub, rec)
    task: asyncio.Task[None] | None = None
    try:
        for _ in range(STALLED):  # the history: published before the subscriber starts
            await pub.publish_raw(_payload(pub.seq + 1))
        history = list(range(pub.seq - STALLED + 1, pub.seq + 1))
        task = asyncio.create_task(sub.run())
        await eventually(lambda: sub.last_seq == pub.seq)
        assert rec.seqs[:STALLED] == history
        assert 0 < sub.stats.max_replay_bytes <= BUDGET
        await _joined(pub, sub, rec)
        pub.drop_next = STALLED  # a gap of five budgets, refilled from the replay socket
        first = pub.seq + 1
        for _ in range(STALLED):
            await pub.publish_raw(_payload(pub.seq + 1))
        after = await pub.publish_raw(_payload(pub.seq + 1, 64))
        await eventually(lambda: sub.last_seq == after)
        refilled = [s for s in rec.seqs if s >= first]
        assert refilled == list(range(first, after + 1))
        assert all(rec.payloads[s] == _payload(s) for s in refilled[:-1])
        assert sub.stats.gaps == 1
        assert rec.lost == sub.stats.lost == 0
        assert sub.stats.max_replay_bytes <= BUDGET
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await pub.close()
