"""The worker processes of one ``kvrouter serve --workers N`` (``server.workers > 1``,
:func:`router.service.cli._serve_workers`), as each worker sees the group.

Each worker has its own state. Before forking, the parent creates a private control
directory (mode 0700); each worker listens on ``<dir>/worker-<pid>.sock`` (its control
socket, router/service/control.py) and the parent writes the workers' pids to
``<dir>/workers`` once all are forked, and again whenever it replaces one that died
(router/service/supervisor.py). A drain / undrain is applied by the worker that
received it and then by every other worker through its control socket
(:func:`forward_to_peers`, used by the HTTP admin endpoints and the gRPC Admin service).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

from router.service.peers import peer_call

T = TypeVar("T")
PIDS_FILE = "workers"  # the parent's list of worker pids, one a line, in the control directory
RESTARTS_FILE = "restarts"  # how many workers the parent replaced, in the control directory
PARENT_CHECK_S = 0.5  # how often a worker checks that the parent that forked it still runs
RESTART_FIRST_S = 0.5  # a worker that died is replaced after this long ...
RESTART_MAX_S = 30.0  # ... doubled for each death of its replacements, up to this ...
RESTART_RESET_S = 60.0  # ... unless the one that died had served this long
_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Workers:
    """The worker processes of one ``kvrouter serve``: the control directory and how many."""

    directory: str
    count: int

    def socket(self, pid: int) -> str:
        return os.path.join(self.directory, f"worker-{pid}.sock")

    def peers(self) -> tuple[list[int], int]:
        """(pids of the other workers, how many others are not known by pid). The parent
        writes the pid list once every worker is forked; before that (or if it could not)
        the control sockets present name the peers and the rest are unknown."""
        me = os.getpid()
        try:
            with open(os.path.join(self.directory, PIDS_FILE)) as f:
                pids = [int(line) for line in f if line.strip()]
        except (OSError, ValueError):
            pids = []
        if len(pids) != self.count:
            pids = []
            for entry in os.listdir(self.directory):
                if entry.startswith("worker-") and entry.endswith(".sock"):
                    try:
                        pids.append(int(entry[7:-5]))
                    except ValueError:
                        continue
            if me not in pids:
                pids.append(me)
        others = sorted(p for p in pids if p != me)
        return others, max(self.count - 1 - len(others), 0)

    def listing(self) -> tuple[int, int, int] | None:
        """Which pid list the parent wrote last (it writes a new file whenever it starts a
        worker, replacements included), to tell whether :meth:`peers` may have changed;
        None before the first."""
        try:
            st = os.stat(os.path.join(self.directory, PIDS_FILE))
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def restarts(self) -> int:
        """How many workers the parent started to replace ones that died."""
        try:
            with open(os.path.join(self.directory, RESTARTS_FILE)) as f:
                return int(f.read().strip() or 0)
        except (OSError, ValueError):
            return 0


def restart_delay(previous: float | None, served_s: float | None) -> float:
    """How long after a worker's death its replacement starts: ``RESTART_FIRST_S``, doubled
    from ``previous`` (the delay before the one that died, None if none) while replacements
    keep dying, up to ``RESTART_MAX_S``; back to the first once one served
    ``RESTART_RESET_S`` (``served_s``: how long the one that died served, None if it died
    before it listened)."""
    if previous is None or (served_s is not None and served_s >= RESTART_RESET_S):
        return RESTART_FIRST_S
    return min(previous * 2, RESTART_MAX_S)


def worker_info(group: Workers | None) -> dict[str, int]:
    """This worker's pid and the group's size (1 without a group), for admin answers."""
    return {"worker_pid": os.getpid(), "workers": group.count if group is not None else 1}


async def ask_peers(
    group: Workers, ask: Callable[[int], Awaitable[T | str]]
) -> tuple[list[T], list[dict[str, Any]]]:
    """``ask(pid)`` of every other worker of ``group`` at once: the answers, and the workers
    that gave none as ``{"pid", "reason"}`` (an answer that is a string is the reason; pid
    None for a worker not known by pid)."""
    peers, unknown = group.peers()
    got = await asyncio.gather(*(ask(pid) for pid in peers))
    answers = [g for g in got if not isinstance(g, str)]
    failed: list[dict[str, Any]] = [
        {"pid": pid, "reason": g} for pid, g in zip(peers, got, strict=True) if isinstance(g, str)
    ]
    failed += [{"pid": None, "reason": "not started or not known"} for _ in range(unknown)]
    return answers, failed


@dataclass(frozen=True, slots=True)
class FanOut:
    """What forwarding a drain / undrain to the other workers gave: ``workers`` in all
    (this one included, which applied it before forwarding), ``failed`` the ones that did not
    apply it (``{"pid", "reason"}``, pid None for a worker not known by pid)."""

    workers: int
    failed: list[dict[str, Any]]

    @property
    def applied(self) -> int:
        return self.workers - len(self.failed)

    def message(self, name: str, draining: bool) -> str:
        action = "drain" if draining else "undrain"
        missed = "; ".join(
            f"worker {f['pid'] if f['pid'] is not None else '?'} ({f['reason']})"
            for f in self.failed
        )
        return (
            f"{action} of {name!r} applied on {self.applied} of {self.workers} "
            f"workers; not reached: {missed}. Retry it: draining is idempotent"
        )


async def _forward(group: Workers, pid: int, name: str, draining: bool, auth: str) -> bool | str:
    """Send the drain / undrain to worker ``pid``; True when it applied it, else why not."""
    action = "drain" if draining else "undrain"
    path = f"/internal/replicas/{quote(name, safe='')}/{action}"
    got = await peer_call(group.socket(pid), "POST", path, auth=auth)
    if isinstance(got, str):
        return got
    return True if got.status == 200 else got.why_not()


async def forward_to_peers(
    group: Workers | None, name: str, draining: bool, admin_token: str | None
) -> FanOut:
    """Send a drain / undrain of ``name`` (a replica name or ``name#dpN``), already applied
    in this worker, to every other worker of ``group`` through their control sockets; the
    admin token goes along (checked again there). With no group (one process) there is
    nothing to forward."""
    if group is None or group.count <= 1:
        return FanOut(1, [])
    auth = f"Bearer {admin_token or ''}"
    _, failed = await ask_peers(group, lambda pid: _forward(group, pid, name, draining, auth))
    return FanOut(group.count, failed)


def parent_watch(parent: int) -> Callable[[object], AsyncIterator[None]]:
    """A ``cleanup_ctx`` for a worker forked by process ``parent``: when that parent is gone
    (killed without stopping its workers: SIGKILL, the OOM killer) the worker stops as on
    SIGTERM (requests in flight finish), rather than serve the port unsupervised beside the
    workers of a router started again."""

    async def ctx(_app: object) -> AsyncIterator[None]:
        async def watch() -> None:
            while os.getppid() == parent:
                await asyncio.sleep(PARENT_CHECK_S)
            _log.warning("the parent process %d is gone: this worker stops", parent)
            os.kill(os.getpid(), signal.SIGTERM)

        task = asyncio.ensure_future(watch())
        try:
            yield
        finally:
            task.cancel()

    return ctx
