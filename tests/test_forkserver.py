"""tests/forkserver.py: a forked ``kvrouter`` process reports what a fresh one would (its
exit status, its output in its log, its signals), in the caller's working directory."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests import forkserver
from tests.procs import KVROUTER, Fleet

pytestmark = pytest.mark.skipif(not forkserver.ENABLED, reason="KVROUTER_TEST_FORK=0")


def test_a_forked_command_exits_and_logs_as_a_fresh_one(tmp_path: Path) -> None:
    env = dict(os.environ)
    ok = forkserver.spawn([KVROUTER, "trace", "--help"], tmp_path / "ok.log", env)
    assert ok.wait(timeout=30) == 0
    assert "usage: kvrouter trace" in (tmp_path / "ok.log").read_text()
    bad = forkserver.spawn([KVROUTER, "trace", "--no-such-flag"], tmp_path / "bad.log", env)
    assert bad.wait(timeout=30) == 2  # argparse's usage error
    assert "kvrouter trace: error:" in (tmp_path / "bad.log").read_text()


def test_a_forked_server_is_signalled_waited_and_killed(tmp_path: Path) -> None:
    with Fleet(tmp_path) as fleet:
        mock = fleet.mock("m0")
        assert isinstance(mock.process, forkserver.Forked)
        assert os.getsid(mock.pid) == mock.pid  # a session of its own
        with pytest.raises(subprocess.TimeoutExpired):
            mock.process.wait(timeout=0.2)
        mock.signal(signal.SIGTERM)
        assert mock.wait(timeout=30) == 0
        other = fleet.mock("m1")
        other.kill()
        assert other.process is not None and other.process.returncode == -signal.SIGKILL
