"""The ``kvrouter`` command run in the test's own process: the console entry point's ``main``
with its arguments, its output captured and its exit status returned as a subprocess would
give them. For offline commands (``kvrouter sim ...``) whose process boundary tests nothing:
a fresh interpreter costs a second of CPU a call (the imports), most of these tests' time.
Commands that serve or that a test signals run as real subprocesses (tests/procs.py)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from pathlib import Path

from router.cli import main


def kvrouter(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``kvrouter ARGS...``: (returncode, stdout, stderr) as ``subprocess.run`` reports them;
    ``cwd`` is the working directory during the call."""
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["kvrouter", *args], code, out.getvalue(), err.getvalue())
