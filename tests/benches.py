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


def bench_refused(*args: str, timeout: float = 120) -> str:
    """``kvrouter bench ARGS...`` that must refuse its arguments: its message (a usage error,
    exit status 2, not a traceback)."""
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return done.stderr.strip()
