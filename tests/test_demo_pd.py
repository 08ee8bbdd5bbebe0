"""`kvrouter demo --pd` as a real process: prefill and decode mocks in two racks, the router
speaking vLLM's disaggregated protocol to them; no request fails."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.test_demo import SMALL

pytestmark = pytest.mark.xdist_group("demo_pd")


def test_demo_pd_always_serves_every_request() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "demo", "--replicas", "4", "--agentic", SMALL,
         "--speedup", "4", "--policies", "ours", "--pd", "always", "--max-output", "8"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("ours/pd=always"))
    ok = int(row.split()[1])
    assert ok > 0 and "FAILED" not in out.stderr
