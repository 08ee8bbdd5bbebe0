"""Worker processes share their in-flight load (``server.workers > 1``).

Each worker routes with its own :class:`~router.core.load.LoadTracker`, which knows only the
requests that worker sent, so N workers pile onto the replica each of them thinks is idle
(what that costs in TTFT and ITL: docs/service.md, "Worker processes"). Every
``server.load_share_interval_s`` each worker asks the others for their own load (``GET
/internal/load`` on their control sockets, with the peer client of router/service/peers.py)
and hands the sum to its tracker (``set_peer_load``), which folds it into the counts the
policy reads: nothing is added per request.

The sum goes to the app's :class:`~router.service.peer_sum.PeerSum` as the ``workers``
source (other pods' load is another source: router/service/pod_exchange.py).

A round waits at most ``server.load_share_interval_s`` for the answers: a peer slower than
that (a worker whose event loop is held up) is not asked again while its call is under way,
and its answer counts in the round it arrives in, so it holds up no other peer's figures. A
peer that does not answer keeps its last answer for ``STALE_AFTER_S``, then counts as idle
(a worker that died has no requests in flight). The answer lists only replicas with
requests in flight: ``{"load": [[replica, dp_rank, prefilling, queued_prefill_tokens,
decoding, decode_context_tokens, in_flight_prompt_tokens, decode_weight], ...]}`` (the
:class:`~router.core.load.PeerLoad` fields in order; all integers but ``decode_weight``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from router.core.load import NO_PEER_LOAD, LoadTracker, PeerLoad
from router.core.types import ReplicaKey
from router.service.peer_sum import PEER_SUM, PeerSum, peer_sum, summed
from router.service.peers import PeerClient
from router.tasks import running

_log = logging.getLogger(__name__)
SOURCE = "workers"
STALE_AFTER_S = 1.0
_FIELDS = len(PeerLoad._fields)


def own_load(load: LoadTracker) -> dict[str, Any]:
    """This worker's own requests in flight, per replica (the ``/internal/load`` body)."""
    rows = []
    for key in load.replicas():
        mine = load.own(key)
        if mine != NO_PEER_LOAD:
            rows.append([key.replica, key.dp_rank, *mine])
    return {"load": rows}


def parse_load(body: bytes) -> dict[ReplicaKey, PeerLoad]:
    """A peer's ``/internal/load`` answer; raises ValueError for anything else."""
    data = json.loads(body)
    rows = data.get("load") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ValueError("expected {'load': [...]}")
    out: dict[ReplicaKey, PeerLoad] = {}
    for row in rows:
        if (
            not isinstance(row, list)
            or len(row) != 2 + _FIELDS
            or not isinstance(row[0], str)
            or type(row[1]) is not int
            or not all(_count(v) for v in row[2:-1])
            or not _weight(row[-1])
        ):
            raise ValueError(f"bad load row {row!r}")
        key = ReplicaKey(row[0], row[1])
        if key in out:
            raise ValueError(f"replica {key} has two load rows")
        out[key] = PeerLoad(*row[2:])
    return out


_MAX_COUNT = 1 << 53  # beyond any real count; exact as a float (the mirror table's type)


def _count(v: object) -> bool:
    """A count of requests or tokens: a negative one would cancel other peers' load out in
    their sum, a huge one overflow the tracker's float table."""
    return type(v) is int and 0 <= v < _MAX_COUNT


def _weight(v: object) -> bool:
    """A decode weight: bounded as a count is, so that the members' sum stays finite (an
    infinite one taken off again would leave NaN in the tracker's sums)."""
    return (
        isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
        and 0 <= v < _MAX_COUNT
    )


@dataclass(slots=True)
class LoadSharing:
    """The exchange of one worker (see the module docstring): ``peers`` sums into this
    worker's tracker, ``last`` is each peer's last answer (by control socket) and when it
    came."""

    peers: PeerSum
    client: PeerClient
    last: dict[str, tuple[float, dict[ReplicaKey, PeerLoad]]] = field(default_factory=dict)
    # calls under way (by control socket) and when each was made
    asking: dict[str, tuple[float, asyncio.Task[dict[ReplicaKey, PeerLoad] | None]]] = field(
        default_factory=dict
    )

    async def _ask(self, socket: str) -> dict[ReplicaKey, PeerLoad] | None:
        got = await self.client.call(socket, "GET", "/internal/load")
        if isinstance(got, str) or got.status != 200:
            why = got if isinstance(got, str) else got.why_not()
            _log.debug("no load from %s: %s", socket, why)
            return None
        try:
            return parse_load(got.body)
        except ValueError as exc:
            _log.debug("no load from %s: %s", socket, exc)
            return None

    async def exchange(self, sockets: list[str], now: float, wait_s: float | None = None) -> None:
        """One round: ask every peer not still answering an earlier call, wait for the calls
        under way up to ``wait_s`` (None: until all end), keep the fresh answers (as of when
        each was asked), apply their sum. A call still under way goes on into the next
        rounds."""
        live = set(sockets)
        for socket in sockets:
            if socket not in self.asking:
                self.asking[socket] = (now, asyncio.ensure_future(self._ask(socket)))
        if self.asking:
            await asyncio.wait([task for _, task in self.asking.values()], timeout=wait_s)
        for socket, (asked_at, task) in list(self.asking.items()):
            if not task.done():
                if socket not in live:
                    task.cancel()
                    del self.asking[socket]
                continue
            del self.asking[socket]
            answer = None if task.cancelled() or task.exception() else task.result()
            if answer is not None:
                self.last[socket] = (asked_at, answer)
        for socket in list(self.last):
            if socket not in live or now - self.last[socket][0] > STALE_AFTER_S:
                del self.last[socket]
        self.apply(summed(answer for _, answer in self.last.values()))

    def stop(self) -> None:
        """Cancel the calls under way."""
        for _, task in self.asking.values():
            task.cancel()
        self.asking.clear()

    def apply(self, peers: dict[ReplicaKey, PeerLoad]) -> None:
        self.peers.update(SOURCE, peers)


def load_sharing_ctx(
    app: web.Application, sockets: Callable[[], list[str]], interval_s: float
) -> Callable[[web.Application], AsyncIterator[None]]:
    """A ``cleanup_ctx`` for ``app`` (not started yet) running the exchange every
    ``interval_s`` while it runs; ``sockets()`` gives the other workers' control sockets at
    each round."""
    peer_sum(app)

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        timeout = max(interval_s * 20, 0.5)
        client = PeerClient(timeout)
        sharing = LoadSharing(app[PEER_SUM], client)
        loop = asyncio.get_running_loop()

        async def run() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await sharing.exchange(sockets(), loop.time(), wait_s=interval_s)
                except Exception:  # never let one bad round stop the exchange
                    _log.exception("load exchange with the other workers failed")

        try:
            async with running(run(), name=f"load-sharing-{os.getpid()}"):
                yield
        finally:
            sharing.stop()
            client.close()

    return ctx
