"""Many concurrent streams through one router to many mock replicas (real processes):
no errors, the router stays up, memory does not run away. The default run is short;
``pytest -m soak tests/test_load_streams.py`` runs the issue's 1,000 streams / 16 replicas /
60 s (the same code as ``kvrouter bench reliability``, which prints the latency figures).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from router.bench import reliability_bench
from tests.ports import free_port


@pytest.fixture(autouse=True)
def _test_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's processes listen on the tests' ports (tests/ports.py): a port the kernel
    picks from its ephemeral range can be taken by an outgoing connection, or by another
    xdist worker, before the mock replica binds it (seen once: "address already in use")."""
    monkeypatch.setattr(reliability_bench, "_free_port", free_port)


def _bench(capsys: Any, **kw: Any) -> dict[str, Any]:
    args = argparse.Namespace(
        replicas=4,
        concurrency=100,
        duration=1.0,
        direct_duration=0.0,
        prompt_tokens=128,
        max_tokens=8,
        policy="ours",
    )
    for k, v in kw.items():
        setattr(args, k, v)
    code = reliability_bench.run(args)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    print(json.dumps(out))
    assert code == 0, out
    return out


def test_concurrent_streams_without_errors(capsys: Any) -> None:
    out = _bench(capsys)
    assert out["router"]["errors"] == {}
    assert out["router"]["requests"] > 100
    assert out["router_alive"]
    assert out["rss_max_mb"] < 1024


@pytest.mark.soak
def test_soak_1000_streams_16_replicas_60s(capsys: Any) -> None:
    out = _bench(
        capsys,
        replicas=16,
        concurrency=1000,
        duration=1.0,
        direct_duration=20.0,
        prompt_tokens=256,
        max_tokens=16,
        policy="round_robin",
    )
    assert out["router"]["errors"] == {}
    assert out["rss_last_mb"] - out["rss_first_mb"] < 100
