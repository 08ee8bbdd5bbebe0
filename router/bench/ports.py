"""Loopback ports for the servers benchmarks, the demo and the tests start as processes
(routers, mock replicas, publishers' metrics, ZMQ endpoints, redis-server).

A port is picked here, released, and bound by a child process up to a second later (its
imports come first). Two things can take it in between, and a server that cannot listen
fails its run (``kvrouter serve`` refuses a port another process holds: exit 2):

* a port handed out twice (by this process, or by another pytest-xdist worker);
* an outgoing connection: the kernel gives connect() local ports from its ephemeral range
  (``net.ipv4.ip_local_port_range``), the range ``bind(port 0)`` picks from too.

So :func:`free_port` hands out ports *below* the ephemeral range, never the same one twice in
a process, from a slice of its own for each xdist worker (``gw0``, ``gw1``...; one slice
outside pytest), and checks that nothing listens on it now. Where the ephemeral range starts
too low for that, the kernel picks (ports are still never handed out twice by one process).
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

BASE = 10_000  # test ports: [BASE, BASE + SPAN), split between xdist workers
SPAN = 10_000

_given: set[int] = set()
_next: int | None = None


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _worker_slice() -> tuple[int, int]:
    """This process's ports: ``[lo, hi)``, one slice of the test range per xdist worker."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), 1)
    index = int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0
    width = SPAN // count
    lo = BASE + (index % count) * width
    return lo, lo + width


def _listening_possible(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _given:
            _given.add(port)
            return port


def free_port() -> int:
    """A loopback TCP port nothing listens on, not handed out before in this session."""
    global _next
    if _ephemeral_low() < BASE + SPAN:
        return _kernel_port()
    lo, hi = _worker_slice()
    if _next is None:
        _next = random.randrange(lo, hi)  # sessions running at once start apart
    for _ in range(hi - lo):
        port, _next = _next, lo + (_next + 1 - lo) % (hi - lo)
        if port not in _given and _listening_possible(port):
            _given.add(port)
            return port
    raise RuntimeError(f"no free test port left in [{lo}, {hi})")
