"""What the docs name as evidence or as the place of a thing exists: every repository path
(``router/...``, ``tests/...``, ``sim/...``, ...) names a file or directory of the tree, and
every test named (``test_file.py::test_name``, or a bare ``test_name``) is a test function of
that file, or of some test file. A renamed module or test fails here until the docs follow."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy/README.md"]
# placeholders the docs write for "a test file" / "the fuzz files"
PLACEHOLDER_PATHS = {"tests/test_x.py", "tests/test_fuzz_"}
_PATH = re.compile(r"(?<![\w/.-])((?:router|sim|tests|deploy|proto|docs)/[\w./-]*[\w/])")
_NODE = re.compile(r"(?<![\w.])(?:tests/)?(test_\w+\.py)::(test_\w+)")
_BARE = re.compile(r"(?<![\w/.:])(test_\w+)(?![\w.])")


def _tests() -> dict[str, set[str]]:
    """test function name -> the test files (base names) that define it."""
    out: dict[str, set[str]] = {}
    for path in (ROOT / "tests").rglob("*.py"):
        for name in re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), re.M):
            out.setdefault(name, set()).add(path.name)
    return out


def _docs() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), p.read_text()) for p in DOCS]


@pytest.mark.parametrize(("doc", "text"), _docs(), ids=lambda v: v if "\n" not in v else "")
def test_paths_the_docs_name_exist(doc: str, text: str) -> None:
    missing = sorted(
        {
            p
            for p in _PATH.findall(text)
            if p not in PLACEHOLDER_PATHS and not (ROOT / p.rstrip("/")).exists()
        }
    )
    assert missing == [], f"{doc} names paths the tree lacks"


@pytest.mark.parametrize(("doc", "text"), _docs(), ids=lambda v: v if "\n" not in v else "")
def test_tests_the_docs_name_exist(doc: str, text: str) -> None:
    tests = _tests()
    wrong = [
        f"{file}::{name}"
        for file, name in _NODE.findall(text)
        if file not in tests.get(name, set())
    ]
    wrong += [name for name in _BARE.findall(text) if name not in tests]
    assert wrong == [], f"{doc} names tests that do not exist there"


def test_architecture_lists_the_compiled_service_modules() -> None:
    """docs/architecture.md "Compiled hot path" names the service modules ``make compile``
    builds (``router.compile.SERVICE_MODULES``)."""
    from router.compile import SERVICE_MODULES

    text = (ROOT / "docs/architecture.md").read_text()
    found = re.search(r"runs through \(([^)]*): `router\.compile\.SERVICE_MODULES`\)", text, re.S)
    assert found, "the SERVICE_MODULES list is gone from docs/architecture.md"
    assert sorted(re.findall(r"`(\w+)`", found.group(1))) == sorted(SERVICE_MODULES)


def test_readme_names_every_benchmark_command() -> None:
    """README.md's ``kvrouter bench ...`` row names every ``kvrouter bench`` subcommand."""
    import argparse

    from router.cli import build_parser

    def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return dict(action.choices)

    benches = commands(commands(build_parser())["bench"])
    row = next(line for line in (ROOT / "README.md").read_text().splitlines()
               if line.startswith("| `kvrouter bench ...` |"))  # fmt: skip
    named = set(re.findall(r"`(\w+)`", row))
    assert sorted(set(benches) - named) == [], "bench commands README.md does not name"
