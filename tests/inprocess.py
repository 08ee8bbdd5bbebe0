"""The ``kvrouter`` command run in the test's own process: the console entry point's ``main``
with its arguments, its output captured and its exit status returned as a subprocess would
give them. For offline commands (``kvrouter sim ...``) whose process boundary tests nothing:
a fresh interpreter costs a second of CPU a call (the imports), most of these tests' time.
Commands that serve or that a test signals run as real subprocesses (tests/procs.py).

The simulator's default ``--jobs`` is 1 here: its worker pool forks, and a fork of a test
worker (execnet's and the tokenizer pool's threads running) once left a child that never
exited. A test of the pool itself runs the command as a process of its own."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import unittest.mock
from pathlib import Path

import sim.runner
from router.cli import main


def kvrouter(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``kvrouter ARGS...``: (returncode, stdout, stderr) as ``subprocess.run`` reports them;
    ``cwd`` is the working directory during the call."""
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            unittest.mock.patch.object(sim.runner, "default_jobs", lambda: 1),
        ):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse's usage errors, SystemExit("message")
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if exc.code is not None and not isinstance(exc.code, int):
                    print(exc.code, file=err)  # as the interpreter does on the way out
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["kvrouter", *args], code, out.getvalue(), err.getvalue())
