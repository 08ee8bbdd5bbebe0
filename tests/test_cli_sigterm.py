"""A command that starts processes of its own (a bench, the demo) stopped by SIGTERM stops
them too: killed by the signal's default action it ran none of its ``finally`` blocks and
left its replicas and router running, orphaned (a helper's ``timeout``-bounded runs had left
329 of them on one machine)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

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
