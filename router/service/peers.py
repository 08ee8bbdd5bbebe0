"""Calls to another worker process's control socket (``server.workers > 1``).

Every worker-to-worker call goes through :class:`PeerClient` (the pooled HTTP/1.1 client of
router/service/upstream.py over unix sockets): the drains / undrains a worker forwards
(router/service/workers.py), the replica views of ``GET /admin/replicas?workers=all``, the
pages of an all-worker ``/metrics`` (router/service/worker_metrics.py) and the load exchange
(router/service/load_share.py). A peer that is gone, hangs or answers garbage is one failure
path: a reason string, never an exception.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.service.upstream import Client, Timeouts
from router.service.upstream_errors import UpstreamError

PEER_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class PeerAnswer:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    def header(self, name: str) -> str | None:
        low = name.lower().encode("latin-1")
        for k, v in self.headers:
            if k.lower() == low:
                return v.decode("latin-1")
        return None

    def why_not(self) -> str:
        """The answer as the reason a call failed (status and the start of the body)."""
        return f"HTTP {self.status}: {self.body[:200].decode(errors='replace')}"


class PeerClient:
    """Keep-alive connections to the other workers' control sockets; every wait (connect,
    answer, whole call) is bounded by ``timeout_s``."""

    def __init__(self, timeout_s: float = PEER_TIMEOUT_S) -> None:
        self._client = Client(Timeouts(timeout_s, timeout_s, timeout_s), pool_size=4)

    async def call(
        self, socket_path: str, method: str, path: str, *, auth: str | None = None
    ) -> PeerAnswer | str:
        """``method path`` on the worker listening at ``socket_path``: its answer, or why
        there was none (connection refused, timeout, broken answer)."""
        head = f"{method} {path} HTTP/1.1\r\nHost: worker\r\nContent-Length: 0\r\n".encode()
        if auth is not None:
            head += b"Authorization: " + auth.encode("latin-1") + b"\r\n"
        try:
            ex = await self._client.unix_pool(socket_path).send(head + b"\r\n")
            try:
                body = ex.body()
                if body is None:
                    body = await ex.read_all()
                return PeerAnswer(ex.status, tuple(ex.headers), body)
            except BaseException:
                ex.abort()
                raise
            finally:
                ex.release()
        except (OSError, UpstreamError) as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

    def close(self) -> None:
        self._client.close()


async def peer_call(
    socket_path: str,
    method: str,
    path: str,
    *,
    auth: str | None = None,
    timeout_s: float = PEER_TIMEOUT_S,
) -> PeerAnswer | str:
    """One call on a connection of its own (see :meth:`PeerClient.call`)."""
    client = PeerClient(timeout_s)
    try:
        return await client.call(socket_path, method, path, auth=auth)
    finally:
        client.close()
