"""Loopback ports for the servers tests start as processes: :func:`free_port` is the
benchmarks' (router/bench/ports.py: below the kernel's ephemeral range, a slice for each
pytest-xdist worker, never one twice); :class:`RefusedPort` holds one no server listens on."""

from __future__ import annotations

import socket

from router.bench.ports import free_port as free_port


class RefusedPort:
    """A loopback port bound and never listened on, held while the context is open: a
    connection to it is refused, and no other server (another test, another xdist worker)
    can take the port meanwhile, as one freed by a stopped server could be."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def __enter__(self) -> RefusedPort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()
