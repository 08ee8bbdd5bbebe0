"""The parent process of ``kvrouter serve --workers N``: it forks the workers, replaces the
ones that die, and stops them all when it is asked to stop (docs/service.md, "Worker
processes").

:func:`supervise` creates the group's private control directory (mode 0700), forks one
worker per index and writes the workers' pids to ``<dir>/workers`` (index order) whenever it
has started one. A worker says that it listens by writing a byte to a pipe the parent
holds. A worker that exits or is killed when no stop was asked is logged with its exit
status or signal and replaced, with the same index, after :func:`restart_delay`; the
replacements are counted in ``<dir>/restarts`` (``kvrouter_worker_restarts_total``). A
worker of the first start that dies before it listened (its port taken, a bad file) stops
the router with its status instead: a replacement would fail the same way. SIGTERM / SIGINT
stop every worker and then the parent, also while workers start; nothing is replaced from
then on. A second one is passed on as SIGQUIT, which ends the workers' drain at once (a
worker may get a SIGTERM of its own beside the parent's: a service manager that signals the
whole group; that is one stop).

A worker that listens keeps its pipe and writes a byte to it every ``hang_s / 4`` (at most
every second) from its event loop (:func:`heartbeat`): one that writes none for ``hang_s``
(its loop stuck in a call, the process stopped) is hung. It answers nothing, while the
kernel still hands it its share of new connections, so the parent kills it (SIGKILL) and
replaces it as one that died, as gunicorn's arbiter does with workers that miss its
timeout. ``hang_s`` 0: not watched (the pipe is closed after its first byte).

``server.listener = "shared"``: the parent binds the port once (:func:`shared_socket`)
before forking and keeps the socket open while it runs, so every worker, replacements
included, accepts from one kernel queue: a worker that dies or does not run leaves the
connections queued there to the others. :func:`supervise` closes the parent's copy once a
stop is asked, so the port closes when the last worker stopped accepting (new connections
are refused, not queued for no one).

SO_REUSEPORT lets any process of the same user bind a port its holders bound so: a second
router started on a running one's port would silently take a share of its connections (two
configurations, two index views, one port). So before the workers bind it, the parent
checks that nobody holds the port (:func:`check_port_free`) and refuses to start if it is
taken, as a single process does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.service.fast_server import BACKLOG
from router.service.workers import PIDS_FILE, RESTARTS_FILE, Workers, restart_delay

_log = logging.getLogger("kvrouter.service")


@dataclass(slots=True)
class _Child:
    """A worker process as its parent sees it."""

    index: int
    ready: int | None  # the read end of its pipe while open (closed: it died, or no watch)
    serving_since: float | None = None  # monotonic time it said it listens
    beat_at: float = 0.0  # monotonic time of the last byte read from its pipe
    killed: bool = False  # killed as hung: reaped next


def heartbeat(loop: asyncio.AbstractEventLoop, fd: int, every_s: float) -> None:
    """In a worker that listens: write a byte to ``fd`` (its pipe to the parent) every
    ``every_s`` from ``loop``, for as long as the parent reads it. A byte that does not fit
    (the parent reads later) is skipped: the parent needs one, not each."""
    os.set_blocking(fd, False)

    def beat() -> None:
        try:
            os.write(fd, b".")
        except BlockingIOError:
            pass
        except OSError:  # the parent is gone
            return
        loop.call_later(every_s, beat)

    loop.call_later(every_s, beat)


def heartbeat_interval(hang_s: float) -> float:
    """How often a worker writes its heartbeat when the parent calls ``hang_s`` hung."""
    return min(hang_s / 4, 1.0)


def exit_status(wait_status: int) -> int:
    """A worker's exit as a shell reports it: its exit code, or 128 + the signal that
    killed it (a worker the kernel's OOM killer took is a failure, not a clean exit)."""
    code = os.waitstatus_to_exitcode(wait_status)
    return code if code >= 0 else 128 - code


def _how(wait_status: int) -> str:
    code = os.waitstatus_to_exitcode(wait_status)
    if code >= 0:
        return f"exited with status {code}"
    return f"was killed by signal {signal.Signals(-code).name} ({-code})"


def _write(directory: str, name: str, text: str) -> None:
    path = os.path.join(directory, name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _ignore(_signum: int, _frame: Any) -> None:
    """SIGCHLD's handler: nothing, but a handled signal wakes the loop (``set_wakeup_fd``)."""


def shared_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` for every worker to accept from, bound as
    the workers' own servers bind (``SO_REUSEADDR``; IPv6 only for an IPv6 address). OSError
    when ``host`` names more than one address (``localhost``: IPv4 and IPv6; one socket
    serves one) or the port is taken."""
    infos = {
        (family, addr)
        for family, _, _, _, addr in socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        if family in (socket.AF_INET, socket.AF_INET6)
    }
    if len(infos) != 1:
        raise OSError(
            f"server.listener = 'shared' listens on one address; host {host!r} names "
            f"{len(infos)}: give an IP address"
        )
    ((family, addr),) = infos
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def check_port_free(host: str, port: int, what: str) -> None:
    """OSError naming ``what`` (``server.port``, ``server.grpc_port``) when a process
    listens on ``host:port`` (any of the addresses ``host`` names). The probe binds without
    SO_REUSEPORT, which every holder's SO_REUSEPORT bind cannot share, and closes at once:
    the workers then bind it with SO_REUSEPORT among themselves. Port 0: nothing to check."""
    if port == 0:
        return
    for family, _, _, _, addr in socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    ):
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is free
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(addr)
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"{what} {port} on {addr[0]}: {str(exc.strerror).lower()}; a router "
                    "running there would silently share it with these workers (SO_REUSEPORT)",
                ) from None


def supervise(
    count: int,
    port: int,
    work: Callable[[Workers, int, int, bool], None],
    hang_s: float = 0.0,
    listening: socket.socket | None = None,
) -> int:
    """Run ``count`` workers until SIGTERM / SIGINT; the exit status: that of the first
    worker (in index order of their ends) that failed while they stopped or before the
    first start completed, 0 when all stopped cleanly. ``work(group, index, ready_fd,
    replacing)`` runs in each forked worker and never returns (``os._exit``); the worker
    writes a byte to ``ready_fd`` once it listens, then (``hang_s`` > 0) its
    :func:`heartbeat`; ``replacing``: it replaces one that died. A worker whose last byte
    is older than ``hang_s`` is killed and replaced (0: never). ``listening``: the socket
    the workers share (:func:`shared_socket`), kept open for replacements until a stop is
    asked, then closed (the workers hold their copies until they stop accepting)."""
    children: dict[int, _Child] = {}
    stopping: list[int] = []  # the signals that asked the router to stop

    def forward(signum: int, _frame: Any) -> None:
        stopping.append(signum)
        passed = signal.SIGTERM if len(stopping) == 1 else signal.SIGQUIT  # (second: cut)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, passed)

    # the parent only supervises: SIGTERM / SIGINT stop every worker, then the parent; set
    # before anything is made, so that a stop asked for while the workers start stops them
    # all too and leaves no control directory
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    held = {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD}
    wake_r, wake_w = os.pipe()  # every handled signal writes a byte: the loop wakes
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, _ignore)
    control = tempfile.mkdtemp(prefix="kvrouter-workers-")  # mode 0700
    group = Workers(control, count)
    _log.info(
        "%d workers on port %d (%s); worker control sockets in %s",
        count,
        port,
        "one listening socket, shared" if listening is not None else "SO_REUSEPORT",
        control,
    )
    pids = [0] * count  # by index, the last started
    delays: list[float | None] = [None] * count  # the last delay before a replacement
    served = [False] * count  # whether a worker of that index ever listened
    due: dict[int, float] = {}  # index -> when its replacement starts (monotonic)
    restarts = 0
    status = 0

    def spawn(index: int, replacing: bool = False) -> int:
        """Fork worker ``index``; its pid, or 0 when a stop was asked meanwhile."""
        # held over the fork: the parent's handlers run once the pid is listed, and a
        # worker never runs them (it gets its own first)
        signal.pthread_sigmask(signal.SIG_BLOCK, held)
        if stopping:  # (asked since the caller looked: the new worker would not hear it)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
            return 0
        ready_r, ready_w = os.pipe()
        try:
            pid = os.fork()
        except BaseException:  # (out of processes or memory)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
            os.close(ready_r)
            os.close(ready_w)
            raise
        if pid == 0:  # child
            signal.set_wakeup_fd(-1)
            for fd in (ready_r, wake_r, wake_w, *(c.ready for c in children.values())):
                if fd is not None:
                    os.close(fd)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (the app sets its own)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            # the parent's "cut the drain", sent after a SIGTERM: nothing until the app
            # handles it (a SIGTERM ends a worker still starting; SIGQUIT goes first)
            signal.signal(signal.SIGQUIT, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
            try:
                work(group, index, ready_w, replacing)
            finally:
                os._exit(1)  # (work never returns)
        os.close(ready_w)
        children[pid] = _Child(index, ready_r)
        pids[index] = pid
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
        if stopping:
            # a signal whose C handler ran before the block above runs its Python handler
            # (``forward``) at any later bytecode, also between the check above and the
            # fork: it then stopped the workers listed before this one
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if all(pids):  # (until then the workers find each other by their sockets)
            _write(control, PIDS_FILE, "".join(f"{p}\n" for p in pids))
        return pid

    def ended(pid: int, wait_status: int) -> None:
        nonlocal status
        child = children.pop(pid, None)
        if child is None:
            return
        if child.ready is not None:
            # its byte, if it said it listens before it died, is still in the pipe (reaped
            # before the loop read it)
            os.set_blocking(child.ready, False)
            with contextlib.suppress(BlockingIOError):
                if os.read(child.ready, 1) and child.serving_since is None:
                    child.serving_since = time.monotonic()
                    served[child.index] = True
            os.close(child.ready)
        with contextlib.suppress(OSError):  # (a killed worker leaves its socket behind)
            os.unlink(group.socket(pid))
        index = child.index
        if stopping:
            if os.WIFSIGNALED(wait_status) and os.WTERMSIG(wait_status) == signal.SIGTERM:
                return  # stopped as asked before it could handle the signal itself
            status = status or exit_status(wait_status)
            return
        if not served[index]:  # the first start failed: a replacement would fail alike
            _log.error(
                "worker %d (pid %d) %s before it listened: the router stops",
                index,
                pid,
                _how(wait_status),
            )
            status = exit_status(wait_status) or 1
            forward(signal.SIGTERM, None)
            return
        now = time.monotonic()
        up = now - child.serving_since if child.serving_since is not None else None
        delay = restart_delay(delays[index], up)
        delays[index] = delay
        due[index] = now + delay
        _log.warning(
            "worker %d (pid %d) %s; a replacement starts in %.1f s",
            index,
            pid,
            _how(wait_status),
            delay,
        )

    def beating(child: _Child) -> bool:
        """Whether ``child`` is watched: it listens, its pipe is open, not killed as hung."""
        return child.serving_since is not None and child.ready is not None and not child.killed

    def reap() -> None:
        while children:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            ended(pid, wait_status)

    try:
        for index in range(count):
            if stopping:
                break
            spawn(index)
        while children or (due and not stopping):
            reap()
            if stopping:
                due.clear()
                if listening is not None:  # no replacement will accept from it
                    listening.close()
                if not children:
                    break
            now = time.monotonic()
            for index in [i for i, at in sorted(due.items()) if at <= now]:
                del due[index]
                restarts += 1  # (written first: counted before the replacement serves)
                _write(control, RESTARTS_FILE, f"{restarts}\n")
                pid = spawn(index, replacing=True)
                if pid:
                    _log.info("worker %d replaced: pid %d (%d so far)", index, pid, restarts)
            deadlines = list(due.values())
            if hang_s > 0:
                deadlines += [c.beat_at + hang_s for c in children.values() if beating(c)]
            timeout = max(min(deadlines) - time.monotonic(), 0.0) if deadlines else None
            fds = [wake_r] + [c.ready for c in children.values() if c.ready is not None]
            readable, _, _ = select.select(fds, [], [], timeout)
            for fd in readable:
                if fd == wake_r:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(wake_r, 512):
                            pass
                    continue
                for child in children.values():
                    if child.ready == fd:
                        said = os.read(fd, 4096)
                        now = time.monotonic()
                        if said and child.serving_since is None:  # it listens
                            child.serving_since = now
                            served[child.index] = True
                        child.beat_at = now
                        if not said or hang_s <= 0:  # (no byte: it died, reaped next)
                            os.close(fd)
                            child.ready = None
                        break
            # after the reads: a parent that was stopped itself reads its workers' bytes of
            # meanwhile first, and finds none of them hung
            if hang_s > 0:
                now = time.monotonic()
                for pid, child in children.items():
                    if beating(child) and now - child.beat_at > hang_s:
                        _log.error(
                            "worker %d (pid %d) sent no heartbeat for %.1f s (hung): killed",
                            child.index,
                            pid,
                            now - child.beat_at,
                        )
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                        child.killed = True
        return status
    finally:
        if children:  # (an error of the parent itself): leave no worker behind
            forward(signal.SIGTERM, None)
            for pid in list(children):
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
        if listening is not None:
            listening.close()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(wake_r)
        os.close(wake_w)
        shutil.rmtree(control, ignore_errors=True)
