"""A command that starts processes of its own (a bench, the demo) stopped by SIGTERM stops
them too: killed by the signal's default action it ran none of its ``finally`` blocks and
left its replicas and router running, orphaned (a helper's ``timeout``-bounded runs had left
329 of them on one machine)."""

from __future__ import annotations

import os
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
