"""A worker's control socket (``server.workers > 1``): ``<dir>/worker-<pid>.sock``, served by
the router's HTTP server (router.service.fast_server) with a route table of its own.

It answers the other workers only: their forwarded drains / undrains, and their requests
for this worker's replica rows, routing decisions, drained replicas (for a worker replacing
one that died),
metrics page (router/service/worker_metrics.py), load
(router/service/load_share.py) and the holder of a stored response it recorded
(router/service/response_share.py). It never serves the public routes, so there is no "already
forwarded" header a client could forge on the public port. Its trust boundary is the file
system (only the router's user can enter the directory, the socket is 0600); the admin token
travels with a forwarded drain and is checked again, so a control socket reached some other
way (a loosened directory mode, root tools) still needs it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator
from functools import partial

from aiohttp import web

from router.core.errors import BadRequest
from router.core.types import ReplicaKey
from router.service.admin import (
    DECISIONS_PATH,
    apply_drain,
    authorised,
    decisions_limit,
    own_decisions,
    replica_rows,
)
from router.service.errors import ErrorReply
from router.service.fast_server import FastServer
from router.service.http_types import HttpRequest, Reply
from router.service.keys import FORWARDER, REPORT_RELAY, STATE, WORKER_INDEX, WORKERS
from router.service.load_share import load_sharing_ctx, own_load
from router.service.peers import peer_call
from router.service.report_relay import PATH as REPORT_PATH
from router.service.report_relay import Reported, ReportRelay
from router.service.response_share import PATH_PREFIX, holder_json, siblings_ctx
from router.service.routes import Handler, Routes, error
from router.service.wire import Sink
from router.service.worker_metrics import INDEX_HEADER
from router.service.workers import Workers, ask_peers, parent_watch

_MAX_BODY = 1 << 16  # control calls carry no body
DRAINED_PATH = "/internal/drained"
_log = logging.getLogger(__name__)


def control_routes(app: web.Application, index: int) -> Routes:
    routes = Routes()
    group = app[WORKERS]

    def drain(draining: bool) -> Handler:
        async def handler(req: HttpRequest, name: str) -> Reply:
            state = app[STATE]
            denied = authorised(req, state.settings.server.admin_token)
            if denied is not None:
                return denied
            return apply_drain(state, name, draining, group)

        return handler

    async def own_metrics(req: HttpRequest, _: str) -> Reply:
        # the control socket's file permissions are the boundary, as for /metrics
        return Reply.text(
            await app[STATE].metrics.page(),
            b"text/plain; version=0.0.4",
            (INDEX_HEADER.encode(), str(index).encode()),
        )

    async def own_replicas(req: HttpRequest, _: str) -> Reply:
        state = app[STATE]
        denied = authorised(req, state.settings.server.admin_token)
        if denied is not None:
            return denied
        forwarder = app.get(FORWARDER)
        ejections = forwarder.ejections if forwarder is not None else None
        return Reply.json({"replicas": replica_rows(state, ejections)})

    async def decisions(req: HttpRequest, _: str) -> Reply:
        # this worker's own, for GET /admin/decisions?workers=all on another worker
        state = app[STATE]
        denied = authorised(req, state.settings.server.admin_token)
        if denied is not None:
            return denied
        limit = decisions_limit(req)
        if isinstance(limit, Reply):
            return limit
        return Reply.json({"decisions": own_decisions(state, limit)})

    async def drained(req: HttpRequest, _: str) -> Reply:
        # what this worker holds drained, discovered replicas away included, for a worker
        # that replaces one that died (inherit_drains)
        state = app[STATE]
        denied = authorised(req, state.settings.server.admin_token)
        if denied is not None:
            return denied
        fleet = state.fleet
        return Reply.json(
            {
                "drained": sorted(str(k) for k in fleet.drained),
                # drained whole: the ranks a discovered replica registers later are too
                "drained_replicas": sorted(fleet.drained_replicas),
            }
        )

    async def own_load_of_worker(req: HttpRequest, _: str) -> Reply:
        # what this worker has in flight, for the others' load sharing (load_share.py)
        return Reply.json(own_load(app[STATE].load))

    async def report(req: HttpRequest, decision_id: str) -> Reply:
        # a gRPC Report another worker received for a decision of this one (report_relay.py)
        relay = app.get(REPORT_RELAY)
        if relay is None or relay.apply is None:
            return error(ErrorReply(404, "no gRPC server in this worker", "not_found"))
        try:
            got = Reported.parse(decision_id, req.query())
        except BadRequest as exc:
            return error(ErrorReply(400, str(exc)))
        if not relay.apply(got):
            return error(ErrorReply(404, f"no decision {decision_id!r} here", "not_found"))
        return Reply.json({"accepted": True})

    async def stored_response(req: HttpRequest, response_id: str) -> Reply:
        # this worker's own record only (never asks further: the asker does)
        holder = app[STATE].response_ids.get(response_id)
        if holder is None:
            return error(ErrorReply(404, "no such stored response here", "not_found"))
        return Reply.json(holder_json(holder))

    routes.get("/internal/metrics", own_metrics)
    routes.get("/internal/replicas", own_replicas)
    routes.get("/internal/load", own_load_of_worker)
    routes.get(DECISIONS_PATH, decisions)
    routes.get(DRAINED_PATH, drained)
    routes.get(PATH_PREFIX + "{id}", stored_response)
    routes.post("/internal/replicas/{name}/drain", drain(True))
    routes.post("/internal/replicas/{name}/undrain", drain(False))
    routes.post(REPORT_PATH, report)
    return routes


async def _answer(routes: Routes, req: HttpRequest, sink: Sink) -> None:
    reply = await routes.answer(req)
    await sink.respond(reply.status, list(reply.headers), reply.body)


async def inherit_drains(app: web.Application, group: Workers) -> None:
    """Drain in ``app`` (a worker replacing one that died, not listening yet) every replica
    key some other worker of ``group`` holds drained, and every replica one holds drained
    whole (its later ranks too): drains live in each worker's memory. A worker that does
    not answer is logged and passed over."""
    state = app[STATE]
    auth = f"Bearer {state.settings.server.admin_token or ''}"

    async def ask(pid: int) -> tuple[list[str], list[str]] | str:
        got = await peer_call(group.socket(pid), "GET", DRAINED_PATH, auth=auth)
        if isinstance(got, str):
            return got
        if got.status != 200:
            return got.why_not()
        try:
            answer = json.loads(got.body)
            return [str(k) for k in answer["drained"]], [str(n) for n in answer["drained_replicas"]]
        except (ValueError, KeyError, TypeError):
            return "a malformed answer"

    answers, failed = await ask_peers(group, ask)
    for f in failed:
        _log.warning("drains not taken from worker %s: %s", f["pid"] or "?", f["reason"])
    fleet = state.fleet
    for name in sorted({n for _, whole in answers for n in whole}):
        if state.registry.get(name) is not None:
            fleet.set_replica_draining(name, True)
        else:  # (a discovered replica away: drained whole when it comes back)
            fleet.drained_replicas.add(name)
    for name in sorted({k for keys, _ in answers for k in keys}):
        key = ReplicaKey.parse(name)
        if state.registry.endpoint(key) is not None:
            fleet.set_draining(key, True)
        else:  # (a discovered replica away: drained when it comes back)
            fleet.drained.add(key)
    if fleet.drained:
        _log.info("drained as the other workers: %s", ", ".join(sorted(map(str, fleet.drained))))


def join_workers(
    app: web.Application,
    group: Workers,
    index: int = 0,
    parent: int | None = None,
    *,
    replacing: bool = False,
) -> None:
    """Make ``app`` (not started yet) worker ``index`` of ``group``: its drains reach every
    worker, and while it runs it answers the other workers on its control socket; it takes
    their load every ``server.load_share_interval_s`` and asks them for the stored responses
    it does not know. ``parent``: the pid of the process that forked it, whose end stops
    this worker (:func:`~router.service.workers.parent_watch`). ``replacing``: it replaces
    a worker that died, and takes the others' drains before it listens (HTTP and gRPC)."""
    app[WORKERS] = group
    app[WORKER_INDEX] = index
    app[REPORT_RELAY] = ReportRelay()
    if parent is not None:
        app.cleanup_ctx.append(parent_watch(parent))
    if replacing:

        async def drains(app: web.Application) -> AsyncIterator[None]:
            await inherit_drains(app, group)
            yield

        # first: before any context that serves (the gRPC port, bound in create_app's
        # contexts, would answer Picks meanwhile); an away replica's drain waits in the fleet
        app.cleanup_ctx.insert(0, drains)

    async def control(app: web.Application) -> AsyncIterator[None]:
        server = FastServer(partial(_answer, control_routes(app, index)), _MAX_BODY)
        path = group.socket(os.getpid())
        await server.start_unix(path)
        os.chmod(path, 0o600)
        try:
            yield
        finally:
            await server.close()
            with contextlib.suppress(OSError):
                os.unlink(path)

    app.cleanup_ctx.append(control)
    if group.count <= 1:
        return
    # (the pid list the sockets were read from, the sockets)
    known: list[tuple[tuple[int, int, int] | None, list[str]]] = [(None, [])]

    def sockets() -> list[str]:
        # peers() (a file read) again only when the parent wrote another pid list (it
        # replaced a worker that died) or some worker was not known yet
        listing = group.listing()
        if listing is not None and listing == known[0][0]:
            return known[0][1]
        pids, unknown = group.peers()
        current = [group.socket(pid) for pid in pids]
        known[0] = (listing if not unknown else None, current)
        return current

    state = app[STATE]
    app.cleanup_ctx.append(siblings_ctx(state.response_share, sockets, state.metrics.registry))
    interval = state.settings.server.load_share_interval_s
    if interval > 0:
        app.cleanup_ctx.append(load_sharing_ctx(app, sockets, interval))
