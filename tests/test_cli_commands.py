"""The ``kvrouter`` command line: a command imports only the module that adds it (every
``serve``, ``mock-replica`` and ``publish`` process would otherwise import all benchmarks),
and the whole command line still lists every command."""

from __future__ import annotations

import subprocess
import sys

from router.cli import _MODULE_OF, build_parser

PROBE = """
import sys
from router.cli import build_parser
build_parser("serve")
print(sorted(m for m in sys.modules if m.startswith(("router.bench", "sim.cli", "router.demo"))))
"""


def test_a_named_command_imports_only_its_module() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_whole_command_line_has_every_command() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == set(_MODULE_OF)  # type: ignore[arg-type]
    for command in _MODULE_OF:  # and each command parses on its own parser
        only = build_parser(command)
        assert set(next(a for a in only._actions if a.dest == "command").choices) >= {command}  # type: ignore[arg-type]
