"""What the package ships: the router's dependencies carry no plotting stack (matplotlib is
the ``sim`` extra, and the simulator's report says so when it is missing), lint tools are the
``dev`` extra, and shipped code holds no developer's paths."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from router import cli
from router.bench.proxy_bench import VLLM_ROUTER_MISSING, _vllm_router_bin

ROOT = Path(__file__).resolve().parent.parent


def _project() -> dict[str, Any]:
    project: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_plots_and_lint_tools_are_extras_not_dependencies() -> None:
    project = _project()
    runtime = _names(project["dependencies"])
    extras = project["optional-dependencies"]
    assert "matplotlib" not in runtime and "matplotlib" in _names(extras["sim"])
    assert not {"ruff", "mypy", "pytest"} & runtime
    assert {"ruff", "mypy"} <= _names(extras["dev"])
    assert "kvrouter" in _names(extras["test"])  # kvrouter[sim]: the tests draw the plots


def test_a_report_without_matplotlib_is_a_clear_error_before_the_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kw: Any) -> Any:
        return None if name.split(".")[0] == "matplotlib" else real(name, *args, **kw)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    trace = ROOT / "sim" / "traces" / "mooncake_synthetic_trace.jsonl"
    code = cli.main(["sim", "replay", str(trace), "--report", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "pip install 'kvrouter[sim]'" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_shipped_code_names_no_developer_paths() -> None:
    pattern = re.compile(r"/tmp/scratch|/work/|/home/\w|/root/")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for package in ("router", "sim")
        for path in (ROOT / package).rglob("*.py")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found


def test_the_proxy_bench_finds_vllm_router_by_flag_or_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"--vllm-router .*: not an executable file"):
        _vllm_router_bin(str(tmp_path / "vllm-router"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert _vllm_router_bin(None) is None  # the bench reports VLLM_ROUTER_MISSING
    assert "--vllm-router PATH" in VLLM_ROUTER_MISSING
    binary = tmp_path / "vllm-router"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert _vllm_router_bin(None) == str(binary)
    assert _vllm_router_bin(str(binary)) == str(binary)
