"""The loopback ports benchmarks, the demo and the tests start servers on
(router/bench/ports.py): never one the kernel may give an outgoing connection meanwhile."""

from __future__ import annotations

import socket
import subprocess
import sys

from router.bench import ports
from router.bench.ports import free_port


def test_ports_are_below_the_ephemeral_range_and_never_given_twice() -> None:
    """A port from the kernel's ephemeral range (``bind(0)``, which every bench's own copy
    used) can be taken by any process's connect() between the pick and the server's bind:
    ``kvrouter serve`` then exits 2 and the bench fails, which under a loaded test run
    happened (tests/test_bench_faults.py)."""
    low = ports._ephemeral_low()
    given = [free_port() for _ in range(200)]
    assert len(set(given)) == len(given)
    if low >= ports.BASE + ports.SPAN:
        assert all(ports.BASE <= p < ports.BASE + ports.SPAN for p in given), given
    for port in given[:5]:  # free now: a server can listen there
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_benchmarks_take_their_ports_from_the_one_picker() -> None:
    """Every module that starts servers on picked ports uses :func:`free_port` (one rule,
    not a copy of ``bind(0)`` per benchmark)."""
    code = (
        "import importlib, sys\n"
        "from router.bench.ports import free_port\n"
        "for name in sys.argv[1:]:\n"
        "    mod = importlib.import_module(name)\n"
        "    got = getattr(mod, '_free_port', None) or getattr(mod, 'free_port', None)\n"
        "    assert got is free_port, name\n"
    )
    modules = [
        "router.bench.reliability_bench", "router.bench.proxy_bench",
        "router.bench.redis_server", "router.bench.faults_bench", "router.bench.stall_bench",
        "router.bench.scrape_bench", "router.bench.longctx_bench",
        "router.bench.listener_bench", "router.bench.instructions_bench", "router.demo.fleet",
    ]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
