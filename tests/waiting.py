"""Waiting for a condition, the one way tests synchronise with servers, processes and tasks
(never a fixed sleep).

``await eventually(pred)`` polls ``pred`` (a plain function or a coroutine function) until
it returns something true and returns how long that took; after ``timeout`` seconds it fails
with an ``AssertionError`` that carries the last value ``pred`` returned (or ``message``).
``wait_until`` is the same for code outside an event loop (threads, process helpers).

Timeouts bound a failure, they are not the test's subject: give generous ones (the machine
may be loaded), and assert a duration only in ``-m soak`` tests or print it.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

POLL_S = 0.02


async def eventually(
    pred: Callable[[], Any] | Callable[[], Awaitable[Any]],
    timeout: float = 10.0,
    *,
    interval: float = POLL_S,
    message: str = "",
) -> float:
    """Wait until ``pred()`` (awaited if it returns an awaitable) is true; return the
    seconds waited. Fails after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        value = pred()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return loop.time() - start
        if loop.time() - start > timeout:
            raise AssertionError(
                f"condition not reached in {timeout} s: {message or _describe(pred, value)}"
            )
        await asyncio.sleep(interval)


def wait_until(
    pred: Callable[[], Any], timeout: float = 10.0, *, interval: float = POLL_S, message: str = ""
) -> float:
    """``eventually`` for code that runs outside an event loop."""
    start = time.monotonic()
    while True:
        value = pred()
        if value:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(
                f"condition not reached in {timeout} s: {message or _describe(pred, value)}"
            )
        time.sleep(interval)


def _describe(pred: Callable[..., Any], value: Any) -> str:
    name = getattr(pred, "__qualname__", repr(pred))
    return f"{name} returned {value!r}"[:2000]
