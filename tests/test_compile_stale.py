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


def test_an_extension_older_than_its_source_is_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = _tree(tmp_path)
    ext = proxy.with_name("proxy.cpython-311-x86_64-linux-gnu.so")
    ext.write_bytes(b"ELF")
    monkeypatch.setattr(build, "ROOT", tmp_path)
    os.utime(ext, (1_000_000, 1_000_000))
    os.utime(proxy, (2_000_000, 2_000_000))
    assert build.stale() == ["router/service/proxy.py"]
    os.utime(ext, (3_000_000, 3_000_000))  # rebuilt after the edit
    assert build.stale() == []


def test_nothing_compiled_is_never_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tree(tmp_path)
    monkeypatch.setattr(build, "ROOT", tmp_path)
    assert build.stale() == []
