"""router/core must stay pure: no I/O libraries, no clock reads (docs/architecture.md)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

CORE = pathlib.Path(__file__).resolve().parents[1] / "router" / "core"
FORBIDDEN_MODULES = {
    "aiohttp",
    "redis",
    "grpc",
    "prometheus_client",
    "asyncio",
    "zmq",
    "socket",
    "requests",
    "httpx",
    "threading",
    "subprocess",
    "time",
    "datetime",
    "uvloop",
    "sim",
}
FORBIDDEN_CALLS = {
    ("time", "time"),
    ("time", "monotonic"),
    ("time", "perf_counter"),
    ("datetime", "now"),
    ("datetime", "utcnow"),
    ("os", "urandom"),
}


def _violations(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            names = []
        for name in names:
            if name.split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"{path.name}:{node.lineno} imports {name}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and (node.func.value.id, node.func.attr) in FORBIDDEN_CALLS
        ):
            found.append(f"{path.name}:{node.lineno} calls {node.func.value.id}.{node.func.attr}")
    return found


def test_core_sources_import_no_io_and_read_no_clock() -> None:
    files = sorted(CORE.rglob("*.py"))
    assert files, "router/core has no sources?"
    problems = [v for f in files for v in _violations(f)]
    assert problems == []


def test_checker_catches_a_violation(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import redis\nfrom aiohttp import web\nimport time\nt = time.monotonic()\n")
    assert len(_violations(bad)) == 4


def test_importing_core_loads_no_io_library() -> None:
    code = (
        "import sys, router.core.routing, router.core.policies, router.core.index, "
        "router.core.hashing\n"
        "bad = [m for m in ('aiohttp','redis','grpc','prometheus_client','asyncio','zmq')"
        " if m in sys.modules]\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


SERVING = ("core", "service", "store", "events", "publisher", "rpc", "tokenize", "bench")


def test_serving_code_never_imports_the_simulator() -> None:
    """Only command-line entry points (router/demo, router/mock's engine driver, router/cli)
    may reach into sim/; the serving path never does (one engine model, two clocks)."""
    root = CORE.parent
    offenders = []
    for pkg in SERVING:
        for path in sorted((root / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                if any(n == "sim" or n.startswith("sim.") for n in names):
                    offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert offenders == []
