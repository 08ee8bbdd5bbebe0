"""SIGTERM for the commands that start processes of their own (``bench``, ``demo``), and
for ``serve`` until its event loop takes SIGTERM over: as PID 1 of a container the kernel
drops a signal that has only its default action, so a router stopped while it starts would
run on (router/cli.py).

Python runs no ``finally`` block when a signal's default action ends it: a bench killed by
``timeout`` or a cancelled CI job left its replicas and router running, orphaned. While such
a command runs, SIGTERM is raised as ``SystemExit(128 + SIGTERM)`` instead, so the blocks that
stop its processes run. A SIGTERM that arrives while a process is being started and recorded
(:func:`held`) waits until it is recorded: raised inside ``subprocess.Popen``, after the fork
and before ``Popen`` returns, it would leave a child nobody knows of."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_held = 0  # depth of ``held`` blocks on the main thread
_pending: int | None = None  # the signal that arrived inside them


def _terminate(signum: int, _frame: FrameType | None) -> None:
    global _pending
    if _held:
        _pending = signum
        return
    raise SystemExit(128 + signum)


@contextmanager
def stopped_by_sigterm(on: bool) -> Iterator[None]:
    """While the block runs, SIGTERM raises ``SystemExit(128 + SIGTERM)``. Only where SIGTERM
    has its default action (a process embedding the command keeps its own handler), on the
    main thread, and when ``on``; the default action is restored after."""
    main_thread = threading.current_thread() is threading.main_thread()
    if not on or not main_thread or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def held() -> Iterator[None]:
    """Start a process and record it for stopping inside this block: a SIGTERM that arrives
    meanwhile is raised when the block ends (the process then in the caller's records).
    Elsewhere than on the main thread (where no signal handler runs) it does nothing."""
    global _held, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if not _held and _pending is not None:
            signum, _pending = _pending, None
            raise SystemExit(128 + signum)
