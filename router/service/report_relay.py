"""gRPC Reports between the worker processes of one ``kvrouter serve --workers N``.

A gateway Picks on one connection and may Report on another (it reconnected), which the
kernel's SO_REUSEPORT can hand to another worker. That worker has no such decision, so the
load the deciding worker counts for it would stay until the decision's TTL (an hour by
default) and skew that worker's routing. The receiving worker therefore hands a Report it
cannot apply to the other workers over their control sockets (router/service/control.py);
the one that made the decision applies it. The control socket's file permissions are the
boundary (only the router's user can reach it), as for the other internal routes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import quote

from router.core.errors import BadRequest
from router.service.peers import peer_call
from router.service.workers import Workers

PATH = "/internal/decisions/{name}/report"


@dataclass(slots=True, frozen=True)
class Reported:
    """One gRPC Report: ``phase`` is the proto's ``ReportRequest.Phase`` number; ``owner``
    the reporting caller as a decision records its owner (router/rpc/decisions.py
    ``owner_of``), carried along so the deciding worker applies it only to that caller's
    decision."""

    decision_id: str
    phase: int
    output_tokens: int = 0
    cached_tokens: int | None = None
    owner: str | None = None
    http_status: int | None = None  # the replica's answer status, when the caller gave it

    def target(self) -> str:
        """The control-socket path and query that carry this report."""
        query = f"phase={self.phase}&out={self.output_tokens}"
        if self.cached_tokens is not None:
            query += f"&cached={self.cached_tokens}"
        if self.owner is not None:
            query += f"&owner={quote(self.owner, safe='')}"
        if self.http_status is not None:
            query += f"&status={self.http_status}"
        return PATH.replace("{name}", quote(self.decision_id, safe="")) + "?" + query

    @classmethod
    def parse(cls, decision_id: str, query: Mapping[str, str]) -> Reported:
        """The report :meth:`target` encoded (``decision_id`` already percent-decoded,
        ``query`` its parameters); BadRequest for a malformed query."""
        try:
            phase = int(query["phase"])
            out = int(query.get("out", "0"))
            cached = int(query["cached"]) if "cached" in query else None
            status = int(query["status"]) if "status" in query else None
        except (KeyError, ValueError):
            raise BadRequest(f"malformed report query {dict(query)!r}") from None
        return cls(decision_id, phase, out, cached, query.get("owner"), status)


class ReportRelay:
    """Set by the gRPC server of this worker (``apply``: its Router service's
    ``apply_report``); read by the control socket's report route. ``apply`` is None while
    this worker serves no gRPC."""

    __slots__ = ("apply",)

    def __init__(self) -> None:
        self.apply: Callable[[Reported], bool] | None = None


async def report_to_peers(group: Workers, report: Reported) -> bool:
    """Hand ``report`` to every other worker of ``group`` at once; True as soon as one
    applied it (only the deciding worker can: the others' calls are then dropped, so a
    hung worker holds up no Report it does not own), False when none did."""
    target = report.target()
    peers, _ = group.peers()
    calls = [asyncio.ensure_future(peer_call(group.socket(pid), "POST", target)) for pid in peers]
    try:
        for answered in asyncio.as_completed(calls):
            got = await answered
            if not isinstance(got, str) and got.status == 200:
                return True
        return False
    finally:
        for call in calls:
            call.cancel()
