"""``kvrouter serve`` on a port it cannot listen on exits with the error, on both HTTP
engines, even with a Redis index sync already started (which used to keep the fast engine's
process alive and silent: it never answered and never exited), and with several worker
processes (whose failure used to be silent, and the router's exit status 0)."""

from __future__ import annotations

import re
import signal
import socket
from pathlib import Path

import pytest

from tests.procs import Fleet
from tests.waiting import wait_until


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


@pytest.mark.parametrize(("workers", "which"), [(2, "port"), (1, "grpc_port"), (2, "grpc_port")])
def test_a_port_a_running_router_shares_is_an_error_exit(
    workers: int, which: str, tmp_path: Path
) -> None:
    """A port held with SO_REUSEPORT, as a running router's workers hold theirs (and grpc
    binds every port): a second router used to bind it too and silently take a share of the
    first one's connections (two configurations and index views behind one port). It now
    exits with the error, whichever port it is and however many workers it has."""
    with socket.socket() as taken, Fleet(tmp_path) as fleet:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server: dict[str, object] = {"workers": workers}
        router = fleet.router("router", [], server={**server, which: port}, wait=False)
        code = router.wait(60)
    assert code == 2, router.log()[-2000:]
    assert f"server.{which}" in router.log(), router.log()[-2000:]
    assert "Traceback" not in router.log(), router.log()[-4000:]


def test_a_stop_while_the_workers_start_stops_them_all_cleanly(tmp_path: Path) -> None:
    """SIGTERM to ``serve --workers 2`` as soon as it forks (the workers still building
    their apps): every worker stops, the control directory goes, and that is a clean stop
    (exit 0), though a worker may die of the signal before it could handle it."""
    with Fleet(tmp_path) as fleet:
        router = fleet.router("router", [], server={"workers": 2}, wait=False)
        wait_until(lambda: "worker control sockets in" in router.log(), timeout=30)
        found = re.search(r"worker control sockets in (\S+)", router.log())
        assert found, router.log()
        router.signal(signal.SIGTERM)
        code = router.wait(60)
        assert code == 0, router.log()[-2000:]
        assert not Path(found.group(1)).exists()
        config = str(fleet.workdir / "router.toml").encode()
        left = [
            p.name
            for p in Path("/proc").iterdir()
            if p.name.isdigit() and config in _cmdline(p)  # a worker shares the parent's
        ]
        assert left == [], left


def _cmdline(proc_dir: Path) -> bytes:
    try:
        return (proc_dir / "cmdline").read_bytes()
    except OSError:  # (it exited meanwhile)
        return b""
