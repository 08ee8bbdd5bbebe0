"""``kvrouter`` test processes forked from one interpreter that imported the router already.

A fresh interpreter spends about half a second of CPU importing what ``kvrouter serve`` or
``kvrouter mock-replica`` needs (aiohttp, numpy, the router), and the suite starts about a
hundred of them on two cores. So each test worker keeps one *zygote*: a child that imports
those modules once, then forks a process per :func:`spawn`. The forked process is what
``subprocess.Popen([kvrouter, ...])`` would have started, less the imports: a session of its
own, its output into its log file, the environment and working directory of the caller, and
``router.cli.main`` run at the top level of its interpreter (so ``atexit`` and threads end as
in a fresh one). It is the zygote's child, not the test's: :class:`Forked` asks the zygote
for its exit status and waits on a pidfd, with the subset of ``Popen`` that tests/procs.py
uses. ``KVROUTER_TEST_FORK=0`` turns it off (every process a fresh interpreter).

The zygote runs no thread when it forks (checked), takes one request at a time over a socket
pair, reaps its children and keeps their statuses; when the test worker goes (its end of the
socket closes) it kills the children still running and exits.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ENABLED = os.environ.get("KVROUTER_TEST_FORK", "1") != "0" and hasattr(os, "pidfd_open")
# what `serve`, `mock-replica` and `publish` import (a module imported here is shared)
PRELOAD = (
    "router.service.app",
    "router.service.cli",
    "router.mock.server",
    "router.mock.cli",
    "router.publisher.cli",
    "router.publisher.publisher",
)
_ROOT = str(Path(__file__).resolve().parent.parent)


class Forked:
    """A process the zygote forked: ``pid``, ``returncode`` and Popen's ``poll``, ``wait``,
    ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd: int | None = os.pidfd_open(pid)

    def __del__(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.status(self.pid)
            if self.returncode is not None and self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status, once the process ended (``subprocess.TimeoutExpired`` after
        ``timeout`` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            fd = self._pidfd
            if fd is not None:
                # readable once the process exited; the zygote reaps it right after
                ready, _, _ = select.select([fd], [], [], left)
                if ready:
                    self.zygote.reaped(self.pid, left)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)  # (never a reused pid)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The test worker's end of its zygote (one request at a time, under a lock)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        code = f"import tests.forkserver as f; f.child_main({theirs.fileno()})"
        path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        self.process = subprocess.Popen(
            [sys.executable, "-c", code],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=env,
        )
        theirs.close()
        self.sock = ours
        self.reader = ours.makefile("rb")
        self.lock = threading.Lock()

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.sock.sendall(json.dumps(request).encode() + b"\n")
            line = self.reader.readline()
        if not line:
            raise RuntimeError("the test zygote exited")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def spawn(self, args: Sequence[str], log_path: Path, env: dict[str, str]) -> Forked:
        answer = self.ask(
            {"argv": list(args), "log": str(log_path), "env": env, "cwd": os.getcwd()}
        )
        return Forked(self, int(answer["pid"]))

    def status(self, pid: int) -> int | None:
        code = self.ask({"status": pid})["code"]
        return None if code is None else int(code)

    def reaped(self, pid: int, timeout: float | None) -> None:
        """Wait (at most ``timeout``) until the zygote reaped ``pid``, which exited."""
        self.ask({"reap": pid, "timeout": timeout})


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def spawn(args: Sequence[str], log_path: Path, env: dict[str, str]) -> Forked:
    """``args`` (``[kvrouter, command, ...]``) as a process forked from this worker's
    zygote (started on first use), its stdout and stderr appended to ``log_path``."""
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.process.poll() is not None:
            _zygote = Zygote()
        zygote = _zygote
    return zygote.spawn(args, log_path, env)


# ---------------------------------------------------------------------- the zygote's side


def child_main(fd: int) -> None:
    """The zygote: import, then serve requests until the test worker goes. Returns only in
    a forked child, which then runs ``kvrouter`` as its interpreter's main program."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    argv = _serve(socket.socket(fileno=fd))
    from router.cli import main

    sys.exit(main(argv[1:]))


def _serve(sock: socket.socket) -> list[str]:
    codes: dict[int, int] = {}
    running: set[int] = set()
    reader = sock.makefile("rb")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)

    def reap() -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(wake_r, 4096):  # (a full pipe would warn on every signal)
                pass
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            running.discard(pid)
            codes[pid] = os.waitstatus_to_exitcode(status)

    while True:
        line = reader.readline()
        if not line:  # the test worker went: nothing of its may outlive it
            for pid in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            os._exit(0)
        request = json.loads(line)
        reap()
        if "status" in request:
            answer: dict[str, Any] = {"code": codes.get(request["status"])}
        elif "reap" in request:
            pid, timeout = request["reap"], request["timeout"]
            deadline = None if timeout is None else time.monotonic() + timeout
            while pid in running and (deadline is None or time.monotonic() < deadline):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                select.select([wake_r], [], [], left)
                reap()
            answer = {}
        else:
            if threading.active_count() > 1:  # a fork would copy a thread's locks half-held
                answer = {"error": f"zygote runs threads: {threading.enumerate()}"}
            else:
                pid = os.fork()
                if pid == 0:
                    return _become(request, sock, reader, wake_r, wake_w)
                running.add(pid)
                answer = {"pid": pid}
        sock.sendall(json.dumps(answer).encode() + b"\n")


def _become(
    request: dict[str, Any], sock: socket.socket, reader: Any, wake_r: int, wake_w: int
) -> list[str]:
    """In the forked child: what a fresh ``Popen(argv, stdout=log, stderr=STDOUT, env=env,
    cwd=cwd, start_new_session=True)`` of ``kvrouter`` would have been."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    reader.close()
    sock.close()
    os.close(wake_r)
    os.close(wake_w)
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    # PYTHONUNBUFFERED's streams: every write reaches the log at once
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace"
    )
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv: list[str] = request["argv"]
    sys.argv = list(argv)
    return argv
