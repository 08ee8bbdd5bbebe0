"""Stopping background tasks: a task that swallows its cancellation still stops."""

from __future__ import annotations

import asyncio

import pytest

from router.service import tasks


async def test_stop_cancels_again_a_task_that_swallowed_its_cancellation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:  # as a client library's own error would be caught
                swallowed += 1
                if swallowed > 1:
                    raise

    monkeypatch.setattr(tasks, "RECANCEL_S", 0.05)
    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await tasks.stop(task)
    assert task.cancelled() and swallowed == 2


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
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed > 2:
                    raise

    monkeypatch.setattr(tasks, "RECANCEL_S", 0.05)
    loops = [asyncio.create_task(stubborn()), asyncio.create_task(asyncio.sleep(3600))]

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
    assert all(t.done() for t in loops) and swallowed == 3
