"""router.compile.stale: an extension older than its source is reported (the edit would not
run), a newer one is not. Real files in a temporary tree shaped like the repository."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from router import compile as build


def _tree(root: Path) -> Path:
    for source in build.sources():
        path = root / source
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# source\n")
    return root / "router" / "service" / "proxy.py"


def test_a_source_edited_after_the_build_is_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = _tree(tmp_path)
    shim = proxy.with_name("proxy.cpython-311-x86_64-linux-gnu.so")
    shim.write_bytes(b"ELF")
    lib = tmp_path / "router" / "hot_core__mypyc.cpython-311-x86_64-linux-gnu.so"
    lib.write_bytes(b"ELF")
    monkeypatch.setattr(build, "ROOT", tmp_path)
    for path in tmp_path.rglob("*.py"):
        os.utime(path, (1_000_000, 1_000_000))
    os.utime(lib, (2_000_000, 2_000_000))
    os.utime(proxy, (3_000_000, 3_000_000))  # edited after the build
    assert build.stale() == ["router/service/proxy.py"]
    os.utime(lib, (4_000_000, 4_000_000))  # compiled again
    # the module's shim may stay older than its source (setuptools copies it unchanged
    # from an earlier build): the shared library, which holds the code, says when it was built
    os.utime(shim, (1_000_000, 1_000_000))
    assert build.stale() == []


def test_nothing_compiled_is_never_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tree(tmp_path)
    monkeypatch.setattr(build, "ROOT", tmp_path)
    assert build.stale() == []


def test_the_compiled_pass_names_test_files_that_exist() -> None:
    """``make test-compiled`` runs router.compile.TESTS (files, or ``file::test`` node ids): a
    renamed or removed file or test must not silently drop out of CI's run against the
    compiled build."""
    root = Path(build.__file__).resolve().parent.parent
    missing = []
    for entry in build.TESTS:
        path, _, name = entry.partition("::")
        file = root / path
        if not file.is_file() or (name and f"def {name}(" not in file.read_text()):
            missing.append(entry)
    assert not missing, missing
    assert len(set(build.TESTS)) == len(build.TESTS)
