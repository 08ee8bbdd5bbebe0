"""One call to another worker process's control socket (``server.workers > 1``).

The drains / undrains a worker forwards (router/service/admin.py), the replica views of
``GET /admin/replicas?workers=all`` and the pages of an all-worker ``/metrics``
(router/service/worker_metrics.py) all go through :func:`peer_call`, so a peer that is gone,
hangs or answers garbage is one failure path: a reason string, never an exception.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from multidict import CIMultiDictProxy

PEER_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class PeerAnswer:
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes

    def why_not(self) -> str:
        """The answer as the reason a call failed (status and the start of the body)."""
        return f"HTTP {self.status}: {self.body[:200].decode(errors='replace')}"


async def peer_call(
    socket_path: str,
    method: str,
    path: str,
    *,
    auth: str | None = None,
    timeout_s: float = PEER_TIMEOUT_S,
) -> PeerAnswer | str:
    """``method path`` on the worker listening at ``socket_path``: its answer, or why there
    was none (connection refused, timeout, broken answer)."""
    headers = {"Authorization": auth} if auth is not None else {}
    try:
        async with (
            aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=socket_path),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as session,
            session.request(method, f"http://worker{path}", headers=headers) as resp,
        ):
            return PeerAnswer(resp.status, resp.headers, await resp.read())
    except (OSError, TimeoutError, aiohttp.ClientError) as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
