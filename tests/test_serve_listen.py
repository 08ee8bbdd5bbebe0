"""``kvrouter serve`` on a port it cannot listen on exits with the error, on both HTTP
engines, even with a Redis index sync already started (which used to keep the fast engine's
process alive and silent: it never answered and never exited), and with several worker
processes (whose failure used to be silent, and the router's exit status 0)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.procs import Fleet


@pytest.mark.parametrize(("engine", "workers"), [("fast", 1), ("aiohttp", 1), ("fast", 2)])
def test_a_taken_port_is_an_error_exit(
    engine: str, workers: int, redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    with socket.socket() as taken, Fleet(tmp_path) as fleet:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = {
            "http_engine": engine,
            "workers": workers,
            "redis_url": redis_url,
            "redis_key_prefix": key_prefix,
        }
        router = fleet.router("router", [], port=port, server=server, wait=False)
        code = router.wait(60)
    assert code == 2, router.log()[-2000:]
    assert "address already in use" in router.log()
