"""``kvrouter serve`` on a port it cannot listen on exits with the error, on both HTTP
engines, even with a Redis index sync already started (which used to keep the fast engine's
process alive and silent: it never answered and never exited)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.procs import Fleet


@pytest.mark.parametrize("engine", ["fast", "aiohttp"])
def test_a_taken_port_is_an_error_exit(
    engine: str, redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    with socket.socket() as taken, Fleet(tmp_path) as fleet:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = {"http_engine": engine, "redis_url": redis_url, "redis_key_prefix": key_prefix}
        router = fleet.router("router", [], port=port, server=server, wait=False)
        code = router.wait(60)
    assert code == 2, router.log()[-2000:]
    assert "address already in use" in router.log()
