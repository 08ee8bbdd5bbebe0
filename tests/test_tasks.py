"""Stopping background tasks: a task that swallows its cancellation still stops."""

from __future__ import annotations

import asyncio

import pytest

from router import tasks


async def _stubborn(swallow: int, swallowed: list[int]) -> None:
    """Sleeps; swallows its first ``swallow`` cancellations (as a client library's own
    error handling would), noting each cancellation in ``swallowed``."""
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.append(1)
            if len(swallowed) > swallow:
                raise


async def test_stop_cancels_again_a_task_that_swallowed_its_cancellation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    swallowed: list[int] = []
    monkeypatch.setattr(tasks, "RECANCEL_S", 0.05)
    task = asyncio.create_task(_stubborn(1, swallowed))
    await asyncio.sleep(0)
    await tasks.stop(task)
    assert task.cancelled() and len(swallowed) == 2


async def test_running_stops_its_task_on_exit() -> None:
    started = asyncio.Event()

    async def loop() -> None:
        started.set()
        await asyncio.sleep(3600)

    async with tasks.running(loop(), name="t"):
        await started.wait()
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "t"]


async def test_stop_all_leaves_nothing_running_when_its_caller_is_cancelled_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pods exchange's two loops: its own task is stopped (cancelled, then cancelled
    again) while it waits for a loop that swallowed its cancellation."""
    swallowed: list[int] = []
    monkeypatch.setattr(tasks, "RECANCEL_S", 0.05)
    loops = [asyncio.create_task(_stubborn(2, swallowed)), asyncio.create_task(asyncio.sleep(3600))]

    async def owner() -> None:
        try:
            await asyncio.gather(*loops)
        finally:
            await tasks.stop_all(loops)

    task = asyncio.create_task(owner())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0.01)
    task.cancel()  # cancelled again while stop_all waits
    with pytest.raises(asyncio.CancelledError):
        await task
    assert all(t.done() for t in loops) and len(swallowed) == 3
