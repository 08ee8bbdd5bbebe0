"""The conftest's hang watchdog (tests/conftest.py): a test that pytest-timeout fails and whose
teardown then hangs ends its worker after the grace, with its stacks in the run's summary,
instead of hanging the run (CI once waited out its job limit on one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HANGING = """
import time
import pytest

@pytest.fixture
def stuck():
    yield
    time.sleep(600)  # the teardown hangs too

@pytest.mark.timeout(1)
def test_hangs(stuck):
    time.sleep(600)

def test_after():
    pass
"""


def test_a_hung_teardown_ends_its_worker_and_the_run_goes_on(tmp_path: Path) -> None:
    (tmp_path / "test_hanging.py").write_text(HANGING)
    env = {**os.environ, "KVROUTER_TEST_WATCHDOG_GRACE_S": "1", "PYTHONPATH": str(ROOT)}
    args = ["-p", "tests.conftest", "-p", "no:randomly", "-n", "1", "-q", "-o", "timeout=30"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "test_hanging.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    out = run.stdout
    assert run.returncode == 1, out + run.stderr
    assert "hung past timeout + 1 s: gw0.txt" in out, out
    assert "--- test_hanging.py::test_hangs" in out and "in stuck" in out, out
    assert "1 passed" in out, out  # test_after ran on the replacement worker
