"""Running a ``kvrouter bench ...`` command the way an operator does, for the benches' smoke
tests (figures are not asserted: performance is measured, not tested)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def bench_json(*args: str, timeout: float = 120) -> dict[str, Any]:
    """``kvrouter bench ARGS...`` in a fresh process: the one JSON object it prints last."""
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def bench_refused(*args: str) -> str:
    """``kvrouter bench ARGS...`` that must refuse its arguments: its message (a usage error,
    exit status 2, not a traceback). Run in the test's process (tests/inprocess.py): a fresh
    interpreter costs a second of imports, and an exception other than the refusal's
    propagates out of the call and fails the test as a traceback would."""
    from tests.inprocess import kvrouter

    done = kvrouter("bench", *args)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return done.stderr.strip()
