"""Warm the bytecode caches before ``make test`` starts its xdist workers.

On a fresh checkout nothing is compiled: each of the workers then compiles the sources and
rewrites the asserts of every test module itself, all at once, and the first router and
replica processes the tests start compile the sources again (~40 s of CPU on 2 cores, where
the whole suite takes ~200). Done once here, in two processes, it costs a few seconds; on a
warm checkout it finds nothing to do. Run as ``python -m tests.bytecode`` from the project
root; it never fails the run (a module that does not compile is the suite's to report)."""

from __future__ import annotations

import compileall
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("router", "sim", "tests")
# pytest's name for a test module's assert-rewritten code (_pytest.assertion.rewrite)
PYTEST_TAIL = f".{sys.implementation.cache_tag}-pytest-{pytest.__version__}.pyc"


def unrewritten(tests: Path) -> list[Path]:
    """The test modules (and conftest) whose assert-rewritten bytecode is missing or older
    than their source."""
    out = []
    for source in sorted([*tests.glob("test_*.py"), tests / "conftest.py"]):
        pyc = tests / "__pycache__" / (source.stem + PYTEST_TAIL)
        if not pyc.exists() or pyc.stat().st_mtime < source.stat().st_mtime:
            out.append(source)
    return out


def main() -> int:
    for package in PACKAGES:
        compileall.compile_dir(ROOT / package, quiet=2)
    stale = unrewritten(ROOT / "tests")
    if stale:
        # collecting a module rewrites and caches it; two halves, one per core
        halves = [stale[0::2], stale[1::2]]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly"]
                + [str(p) for p in half],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for half in halves
            if half
        ]
        for proc in procs:
            proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
