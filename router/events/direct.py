"""Single-router mode without Redis: the router subscribes to its engines' ZMQ endpoints
itself and applies canonical events straight to its ``PrefixIndex``.

``DirectEvents(index)`` with ``add_replica(...)`` per engine, then ``start()``/``stop()``
(or ``async with``); the service can run it in ``cleanup_ctx``. It runs in the router's event
loop, so index mutations never race with lookups.

``event_lag`` (the service passes ``RouterState.event_lag_s``, exported as
``kvrouter_index_event_lag_seconds``): for each replica key, set when a batch is applied to
``wall_clock()`` minus the engine's batch timestamp (``KVEventBatch.ts``), at least 0.
``max_backlog_bytes``: each subscription's live backlog budget (router/events/backlog.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, MutableMapping, Sequence

from router.core.index import PrefixIndex
from router.core.types import EventBatch, IndexEvent, ReplicaKey
from router.events.endpoints import EndpointSpec
from router.events.ingest import EngineFacts, EngineIngest, SubscriberGroup
from router.events.subscriber import DEFAULT_MAX_BACKLOG_BYTES


class DirectEvents:
    def __init__(
        self,
        index: PrefixIndex,
        *,
        event_lag: MutableMapping[str, float] | None = None,
        wall_clock: Callable[[], float] = time.time,
        max_backlog_bytes: int = DEFAULT_MAX_BACKLOG_BYTES,
    ) -> None:
        self.index = index
        self.event_lag = event_lag
        self.wall_clock = wall_clock
        self.max_backlog_bytes = max_backlog_bytes
        self.ingests: dict[str, EngineIngest] = {}
        self._groups: list[SubscriberGroup] = []
        self._started = False

    def _sink(self, key: ReplicaKey, events: list[IndexEvent]) -> None:
        self.index.apply(EventBatch(key, tuple(events)))

    def _applied(self, key: ReplicaKey, ts: float) -> None:
        if self.event_lag is not None:
            self.event_lag[str(key)] = max(0.0, self.wall_clock() - ts)

    def add_replica(
        self,
        replica: str,
        model: str,
        block_size: int,
        endpoints: Sequence[EndpointSpec],
        on_checkpoint: Callable[[int], None] | None = None,
        on_facts: Callable[[EngineFacts], None] | None = None,
        adapter: bool = False,
    ) -> EngineIngest:
        """Follow ``endpoints`` of ``replica``; call before ``start`` (after it:
        :meth:`follow`). ``on_checkpoint``, ``on_facts``, ``adapter``: see ``EngineIngest``."""
        if self._started:
            raise RuntimeError("add replicas before start(), or follow() them")
        return self._add(replica, model, block_size, endpoints, on_checkpoint, on_facts, adapter)

    async def follow(
        self,
        replica: str,
        model: str,
        block_size: int,
        endpoints: Sequence[EndpointSpec],
        on_checkpoint: Callable[[int], None] | None = None,
        on_facts: Callable[[EngineFacts], None] | None = None,
        adapter: bool = False,
    ) -> EngineIngest:
        """:meth:`add_replica` once running (endpoints learned later, e.g. asked of the
        replica: router.events.discovery); its subscribers start now."""
        if not self._started:
            raise RuntimeError("follow() is for a running DirectEvents; add_replica() before")
        if replica in self.ingests:
            raise ValueError(f"replica {replica!r} is followed already")
        ingest = self._add(replica, model, block_size, endpoints, on_checkpoint, on_facts, adapter)
        await self._groups[-1].start()
        return ingest

    async def unfollow(self, replica: str) -> None:
        """Stop following ``replica`` and forget what its events said: its subscribers
        stop, and every key they fed (the endpoints' ranks, and the ranks their payloads
        named) is cleared in the index (kept: the replica is still routed to). Then
        :meth:`follow` it elsewhere (it restarted publishing on other endpoints)."""
        ingest = self.ingests.pop(replica, None)
        if ingest is None:
            return
        ranks: set[int] = set()
        cancelled = False
        for group in [g for g in self._groups if g.ingest is ingest]:
            self._groups.remove(group)
            ranks.update(spec.dp_rank for spec in group.specs)
            try:
                await group.stop()
            except asyncio.CancelledError:  # the router stopping: raised once all are
                cancelled = True
        ingest.clear(ranks)
        if cancelled:
            raise asyncio.CancelledError

    def _add(
        self,
        replica: str,
        model: str,
        block_size: int,
        endpoints: Sequence[EndpointSpec],
        on_checkpoint: Callable[[int], None] | None,
        on_facts: Callable[[EngineFacts], None] | None,
        adapter: bool,
    ) -> EngineIngest:
        ingest = EngineIngest(
            replica,
            model,
            block_size,
            self._sink,
            self._applied,
            on_checkpoint=on_checkpoint,
            on_facts=on_facts,
            adapter=adapter,
            max_backlog_bytes=self.max_backlog_bytes,
        )
        self.ingests[replica] = ingest
        for spec in endpoints:
            self.index.add_replica(ReplicaKey(replica, spec.dp_rank))
        self._groups.append(SubscriberGroup(ingest, endpoints))
        return ingest

    async def start(self) -> None:
        for group in self._groups:
            await group.start()
        self._started = True

    async def stop(self) -> None:
        for group in self._groups:
            await group.stop()
        self._started = False

    async def __aenter__(self) -> DirectEvents:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
