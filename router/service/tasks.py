"""Background tasks tied to a lifetime: :func:`running` starts one for the duration of an
``async with`` block (a ``cleanup_ctx``, typically) and cancels and awaits it on exit, so no
task outlives the app that started it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any


@contextlib.asynccontextmanager
async def running(coro: Coroutine[Any, Any, None], name: str | None = None) -> AsyncIterator[None]:
    task = asyncio.create_task(coro, name=name)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
