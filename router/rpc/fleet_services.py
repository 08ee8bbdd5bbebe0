"""The gRPC services of the fleet's side: Index (``kvrouter.v1.Index``) takes engines' KV
cache events into the router's index; Admin (``kvrouter.v1.Admin``) reads and steers the
replicas.

* Index ``Publish``: a stream of per-replica event batches (:func:`decode_batch`), each
  applied to the index and acked APPLIED, DUPLICATE or GAP (router/core/index_updates.py).
  A batch that does not decode ends the stream INVALID_ARGUMENT, one of a replica the
  router does not know (configured or registered) NOT_FOUND; with several worker processes
  the stream is refused FAILED_PRECONDITION, as it would feed one worker's index only.
* Admin ``ListReplicas`` / ``Stats``: the replicas with their load (this worker's own
  requests, as ``GET /admin/replicas`` counts them) and index size, and the process's
  totals; a ``model`` filter naming no configured model is NOT_FOUND. ``Drain`` /
  ``Undrain``: one rank or all ranks of a replica, forwarded to every other worker process
  as the HTTP admin endpoints forward it; a worker missed fails the call UNAVAILABLE.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc

from router.core.errors import BadRequest
from router.core.types import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    IndexEvent,
    Kind,
    ReplicaKey,
    Tier,
)
from router.rpc.calls import abort_error
from router.rpc.decisions import DecisionBook
from router.rpc.gen import admin_pb2, admin_pb2_grpc, index_pb2, index_pb2_grpc
from router.service.state import RouterState
from router.service.workers import Workers, forward_to_peers

Clock = Callable[[], float]

MAX_EVENTS_PER_BATCH = 100_000


_TIERS = {index_pb2.GPU: Tier.GPU, index_pb2.CPU: Tier.CPU, index_pb2.DISK: Tier.DISK}
_KINDS = {index_pb2.KV: Kind.KV, index_pb2.STATE: Kind.STATE}
_OUTCOMES = {
    "applied": index_pb2.PublishAck.APPLIED,
    "duplicate": index_pb2.PublishAck.DUPLICATE,
    "gap": index_pb2.PublishAck.GAP,
}


def decode_batch(msg: index_pb2.IndexEventBatch) -> EventBatch:
    """Protobuf batch -> core EventBatch; BadRequest says what is wrong."""
    if not msg.replica:
        raise BadRequest("replica is required")
    if len(msg.events) > MAX_EVENTS_PER_BATCH:
        raise BadRequest(f"at most {MAX_EVENTS_PER_BATCH} events per batch")
    events: list[IndexEvent] = []
    for i, ev in enumerate(msg.events):
        tier = _TIERS.get(ev.tier)
        kind = _KINDS.get(ev.kind)
        if tier is None or kind is None:
            raise BadRequest(f"events[{i}]: unknown tier or kind")
        if ev.type == index_pb2.IndexEvent.STORED:
            events.append(BlocksStored(tuple(ev.hashes), tier, kind))
        elif ev.type == index_pb2.IndexEvent.REMOVED:
            events.append(BlocksRemoved(tuple(ev.hashes), tier, kind))
        elif ev.type == index_pb2.IndexEvent.ALL_CLEARED:
            events.append(AllCleared())
        else:
            raise BadRequest(f"events[{i}]: unknown event type {ev.type}")
    return EventBatch(ReplicaKey(msg.replica, msg.dp_rank), tuple(events), msg.seq or None)


class IndexServicer(index_pb2_grpc.IndexServicer):
    """``workers``: the worker processes of a ``kvrouter serve --workers N`` (None for one
    process). A Publish stream lands on one of them and only its index would take the
    events, so with several it is refused rather than leave the others cache-blind."""

    def __init__(self, state: RouterState, workers: Workers | None = None) -> None:
        self.state = state
        self.workers = workers

    async def Publish(
        self,
        request_iterator: AsyncIterator[index_pb2.IndexEventBatch],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[index_pb2.PublishAck]:
        if self.workers is not None and self.workers.count > 1:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"index publishing reaches one of the router's {self.workers.count} worker "
                "processes only (each keeps its own index): publish through Redis "
                "(kvrouter publish) or the engines' ZMQ events, or run server.workers = 1",
            )
            return
        async for msg in request_iterator:
            try:
                batch = decode_batch(msg)
            except BadRequest as exc:
                await abort_error(context, exc)
                return
            if self.state.registry.endpoint(batch.replica) is None:
                # an unknown name would grow the index with entries nothing routes to
                await context.abort(
                    grpc.StatusCode.NOT_FOUND,
                    f"no replica {msg.replica!r} (rank {msg.dp_rank}): configure it "
                    "([[replicas]]) or register it before publishing its events",
                )
                return
            outcome = self.state.index.apply(batch)
            yield index_pb2.PublishAck(
                replica=msg.replica,
                dp_rank=msg.dp_rank,
                seq=msg.seq,
                outcome=_OUTCOMES[outcome.value],
            )


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """``workers``: the worker processes of a ``kvrouter serve --workers N`` (None for one
    process); a Drain / Undrain applied here is forwarded to every other worker, as the HTTP
    admin endpoints do (router/service/workers.py)."""

    def __init__(
        self,
        state: RouterState,
        clock: Clock,
        book: DecisionBook,
        workers: Workers | None = None,
    ) -> None:
        self.state = state
        self.clock = clock
        self.book = book
        self.workers = workers

    async def ListReplicas(
        self, request: admin_pb2.ListReplicasRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListReplicasResponse:
        if request.model and request.model not in self.state.processors:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"The model '{request.model}' does not exist"
            )
        now = self.clock()
        out = []
        for ep in self.state.registry.endpoints():
            if request.model and ep.model != request.model:
                continue
            view = self.state.load.view(ep.key, now)
            # this worker's own requests, as GET /admin/replicas counts them: not the other
            # workers' reports nor a failing replica's phantom penalty (routing cost only)
            own = self.state.load.own(ep.key)
            kv, st = self.state.index.replica_size(ep.key)
            info = admin_pb2.ReplicaInfo(
                replica=ep.key.replica,
                dp_rank=ep.key.dp_rank,
                endpoint=ep.base_url,
                model=ep.model,
                rack=ep.rack or "",
                region=ep.region or "",
                healthy=view.healthy,
                draining=view.draining,
                in_flight=own.prefilling + own.decoding,
                queued_prefill_tokens=own.queued_prefill_tokens,
                kv_entries=kv,
                state_entries=st,
            )
            if view.engine is not None:
                info.engine_running = view.engine.running
                info.engine_waiting = view.engine.waiting
                info.engine_kv_usage = view.engine.kv_usage
            out.append(info)
        return admin_pb2.ListReplicasResponse(replicas=out)

    async def _drain(
        self, request: admin_pb2.DrainRequest, context: grpc.aio.ServicerContext, on: bool
    ) -> admin_pb2.DrainResponse:
        if not request.replica:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "replica is required")
        keys = self.state.registry.find(request.replica)
        if not request.all_ranks:
            keys = [k for k in keys if k.dp_rank == request.dp_rank]
        if not keys:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no replica {request.replica!r} (rank {request.dp_rank})",
            )
        now = self.clock()
        changed = 0
        for key in keys:
            if self.state.load.view(key, now).draining != on:
                changed += 1
        if request.all_ranks and self.state.registry.get(request.replica) is not None:
            self.state.fleet.set_replica_draining(request.replica, on)  # later ranks too
        else:
            for key in keys:
                self.state.fleet.set_draining(key, on)
        # every other worker process; ``name#dpN`` names one rank (a bare name is all ranks)
        name = request.replica if request.all_ranks else f"{request.replica}#dp{request.dp_rank}"
        fan = await forward_to_peers(self.workers, name, on, self.state.settings.server.admin_token)
        if fan.failed:
            # DrainResponse has no field for it: the call fails, naming the workers missed
            await context.abort(grpc.StatusCode.UNAVAILABLE, fan.message(name, on))
        return admin_pb2.DrainResponse(changed=changed)

    async def Drain(
        self, request: admin_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.DrainResponse:
        return await self._drain(request, context, True)

    async def Undrain(
        self, request: admin_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.DrainResponse:
        return await self._drain(request, context, False)

    async def Stats(
        self, request: admin_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.StatsResponse:
        s = self.state.index.stats()
        return admin_pb2.StatsResponse(
            replicas=len(self.state.registry.endpoints()),
            kv_entries=s.kv_entries,
            state_entries=s.state_entries,
            speculative_entries=s.speculative_entries,
            unique_kv_blocks=s.unique_kv_blocks,
            in_flight=self.state.load.in_flight(),
            decisions=len(self.book),
        )
