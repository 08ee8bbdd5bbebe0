"""Background tasks tied to a lifetime: :func:`running` starts one for the duration of an
``async with`` block (a ``cleanup_ctx``, typically) and stops it on exit, so no task outlives
the app that started it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

_log = logging.getLogger("kvrouter.tasks")

# how long a cancelled task may take to end before it is cancelled again
RECANCEL_S = 1.0


async def stop(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has ended. A task that swallows its cancellation
    (a library that turns it into its own error and a loop that retries that) is cancelled
    again every ``RECANCEL_S``, so stopping never hangs on it."""
    task.cancel()
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=RECANCEL_S)
        if not done:
            _log.warning("task %s ignored its cancellation; cancelling it again", task.get_name())
            task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def stop_all(tasks: list[asyncio.Task[Any]]) -> None:
    """``stop`` for each of ``tasks``, ending only when all have ended: a cancellation of the
    caller meanwhile (its own stop, re-cancelling it) does not leave them running."""
    for task in tasks:
        task.cancel()
    while not all(task.done() for task in tasks):
        # the caller being stopped too: it ends once these have
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait(tasks, timeout=RECANCEL_S)
        for task in tasks:
            if not task.done():
                task.cancel()


@contextlib.asynccontextmanager
async def running(coro: Coroutine[Any, Any, None], name: str | None = None) -> AsyncIterator[None]:
    task = asyncio.create_task(coro, name=name)
    try:
        yield
    finally:
        await stop(task)
