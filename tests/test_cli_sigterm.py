"""A command that starts processes of its own (a bench, the demo) stopped by SIGTERM stops
them too: killed by the signal's default action it ran none of its ``finally`` blocks and
left its replicas and router running, orphaned (a helper's ``timeout``-bounded runs had left
329 of them on one machine)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from router.bench.reliability_bench import Procs
from router.sigterm import held, stopped_by_sigterm
from tests.procs import KVROUTER
from tests.waiting import wait_until


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_bench_stopped_by_sigterm_stops_the_processes_it_started(tmp_path: Path) -> None:
    args = [KVROUTER, "bench", "scrape", "--entries", "2", "--models", "2", "--scrapes", "1000"]
    bench = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started: list[int] = []
    try:
        # its two replicas and its router
        wait_until(lambda: len(_children(bench.pid)) >= 3, timeout=60)
        started = _children(bench.pid)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        wait_until(lambda: not any(_alive(p) for p in started), timeout=30)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in started:  # (what the old code left behind)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _default_sigterm() -> None:
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        pytest.skip("this process handles SIGTERM itself: the command would keep its handler")


def test_a_sigterm_inside_held_is_raised_when_the_block_ends() -> None:
    _default_sigterm()
    done: list[str] = []
    with pytest.raises(SystemExit) as stopped, stopped_by_sigterm(True):
        with held():
            signal.raise_signal(signal.SIGTERM)
            done.append("recorded")
        done.append("after")  # never: the signal is raised as the block ends
    assert stopped.value.code == 128 + signal.SIGTERM
    assert done == ["recorded"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_sigterm_while_a_process_starts_leaves_it_recorded_for_stopping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bench above, SIGTERMed the moment its router's process appeared, once left that
    router running: the signal, raised inside ``Popen`` after the fork, ended ``spawn``
    before it recorded the process. Here the signal arrives at that moment every time."""
    _default_sigterm()
    popen = subprocess.Popen

    def interrupted(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = popen(*args, **kwargs)
        signal.raise_signal(signal.SIGTERM)  # the handler runs here, before Popen returns
        return proc

    procs = Procs(tmp_path)
    monkeypatch.setattr(subprocess, "Popen", interrupted)
    try:
        with pytest.raises(SystemExit), stopped_by_sigterm(True):
            procs.spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
    finally:
        monkeypatch.undo()
        procs.stop()
    assert len(procs.procs) == 1 and procs.procs[0].returncode is not None


def _open_writer(fifo: Path) -> int | None:
    """The FIFO's write end, once a reader has it open (else None)."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return None


def _pid_namespaces() -> bool:
    """Whether this machine lets a test start a process in a PID namespace of its own
    (``unshare`` installed, and not refused by the sandbox the tests run in)."""
    if shutil.which("unshare") is None:
        return False
    args = ["unshare", "--pid", "--fork", "--kill-child", "true"]
    if os.getuid() != 0:
        args[1:1] = ["--user", "--map-root-user"]
    try:
        return subprocess.run(args, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _pid_namespaces(), reason="no PID namespaces here (unshare)")
def test_serve_as_a_containers_pid_1_stops_on_a_sigterm_during_start_up(tmp_path: Path) -> None:
    """In a container the image's entrypoint (deploy/docker/Dockerfile: ``kvrouter``) is
    PID 1 of its PID namespace, and the kernel drops a signal sent to PID 1 that it has no
    handler for: before the router's event loop takes SIGTERM over, a pod deleted while
    it starts (loading tokenizers, reading Redis) ignored the kubelet's SIGTERM and ran
    on until the SIGKILL at the end of ``terminationGracePeriodSeconds``, serving
    meanwhile. docs/operations.md: such a SIGTERM ends it at once, status 143. Here
    ``serve`` runs as PID 1 of a new PID namespace and is held in start-up reading its
    config from a FIFO when the SIGTERM comes."""
    fifo = tmp_path / "router.toml"
    os.mkfifo(fifo)
    args = ["unshare", "--pid", "--fork", "--kill-child", KVROUTER, "serve", "--config", str(fifo)]
    if os.getuid() != 0:
        args[1:1] = ["--user", "--map-root-user"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    writer: list[int] = []
    try:

        def reading() -> bool:  # serve has the FIFO open: it reads its config
            fd = _open_writer(fifo)
            if fd is not None:
                writer.append(fd)
            return fd is not None

        wait_until(reading, timeout=60)
        router = _children(proc.pid)
        assert len(router) == 1
        status = (Path("/proc") / str(router[0]) / "status").read_text()
        assert re.search(r"^NSpid:\t\d+\t1$", status, flags=re.M), "not PID 1 of its namespace"
        os.kill(router[0], signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("serve, PID 1 of its namespace, ignored the SIGTERM during start-up")
        assert code == 128 + signal.SIGTERM, proc.stderr.read() if proc.stderr else b""
    finally:
        for fd in writer:
            os.close(fd)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not _pid_namespaces(), reason="no PID namespaces here (unshare)")
def test_publish_as_a_containers_pid_1_stops_on_a_sigterm_during_start_up(
    redis_url: str,
) -> None:
    """The publisher sidecar as PID 1 of its container (deploy/k8s: the image's entrypoint)
    with ``--zmq auto`` asks its engine where it publishes until the engine answers, which
    is while the engine loads its model (minutes); a SIGTERM then (the pod deleted) was
    dropped by the kernel and the sidecar ran on until the grace period's SIGKILL. It now
    ends it at once, status 143, with nothing registered."""
    from router.bench.ports import free_port

    engine = f"http://127.0.0.1:{free_port()}"  # nothing listens: the engine is not up yet
    args = [
        "unshare", "--pid", "--fork", "--kill-child", KVROUTER, "publish", "--replica", "r",
        "--model", "m", "--url", engine, "--zmq", "auto", "--redis", redis_url,
    ]  # fmt: skip
    if os.getuid() != 0:
        args[1:1] = ["--user", "--map-root-user"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        # it logs its first unanswered ask (start-up: no handler of its event loop's yet)
        line = proc.stderr.readline()
        assert "KV events not followed yet" in line, line
        (publisher,) = _children(proc.pid)
        status = (Path("/proc") / str(publisher) / "status").read_text()
        assert re.search(r"^NSpid:\t\d+\t1$", status, flags=re.M), "not PID 1 of its namespace"
        os.kill(publisher, signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("publish, PID 1 of its namespace, ignored the SIGTERM during start-up")
        assert code == 128 + signal.SIGTERM, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
