"""The router process: its parts wired together, and the one HTTP server of its port.

``create_app(settings)`` builds the application object (``web.Application``: the typed keys
of router.service.keys and the start / stop contexts of router.service.background; it serves
no HTTP itself) and the public port's route table. :func:`start` runs the contexts and opens
the port with the router's HTTP server (router.service.fast_server), every request of which
goes through the front door, router.service.handling.handle: ``POST /v1/chat/completions``,
``POST /v1/completions``, the Anthropic Messages API's ``POST /v1/messages`` and
``/v1/messages/count_tokens``, the OpenAI Responses API's ``POST /v1/responses`` (and ``GET`` /
``cancel`` of a stored response), ``GET /v1/models``, ``/health``, ``/ready``, ``/metrics`` and the
admin routes of router.service.admin. :func:`run` does that until SIGTERM / SIGINT
(``kvrouter serve``). Errors are OpenAI-style JSON (router.service.errors).

Hooks for parts built elsewhere: the app keys, and ``Settings.background`` context factories
run under ``cleanup_ctx``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from aiohttp import web

from router.service import admin, background, public
from router.service.admission import Admission
from router.service.banner import log_startup
from router.service.fast_server import ConnLimits, FastServer
from router.service.gate import Gate
from router.service.handling import CHAT_PATH, COMPLETIONS_PATH, FrontDoor, handle
from router.service.keys import (
    FORWARDER,
    GATE,
    INDEX,
    INDEX_SYNC,
    ROUTES,
    SESSION,
    SETTINGS,
    STATE,
    STOPPING,
)
from router.service.pass_through import MESSAGES_PATH, PATHS, RESPONSES_PATH
from router.service.response_share import redis_ctx
from router.service.routes import Routes
from router.service.saturation import loop_lag
from router.service.security import Limits, check_admin_token, check_grpc_token
from router.service.settings import Settings
from router.service.state import RouterState
from router.service.stopping import Stopping

__all__ = [
    "FORWARDER",
    "INDEX",
    "INDEX_SYNC",
    "SESSION",
    "SETTINGS",
    "STATE",
    "Running",
    "create_app",
    "run",
    "start",
]

_log = logging.getLogger("kvrouter.service")


def create_app(settings: Settings, state: RouterState | None = None) -> web.Application:
    """The router's application object. ``state`` may be passed in (tests, embedding); else
    built here."""
    state = state or RouterState(settings)
    if state.admission is None:
        state.admission = Admission(state)
    # a bad limit fails here, before anything starts
    limits = Limits.from_server(settings.server)
    check_grpc_token(settings.server, limits)
    check_admin_token(settings.server, limits)
    app = web.Application()
    app[SETTINGS] = settings
    app[GATE] = Gate(limits)  # one per process: HTTP and gRPC hold their callers to it
    app[STATE] = state
    app[INDEX] = state.index
    app[STOPPING] = Stopping()
    app.cleanup_ctx.append(background.upstream_session)
    app.cleanup_ctx.append(loop_lag)  # the saturation gauge (router/service/saturation.py)
    for factory in settings.background:
        app.cleanup_ctx.append(factory)
    if state.disagg:  # (after the upstream client: ends before it closes)
        from router.service.pd_serve import releases

        app.cleanup_ctx.append(releases)
    if settings.server.redis_url:
        app.cleanup_ctx.append(background.redis_index)
        if settings.server.pods_exchange != "off":
            from router.service.pod_exchange_app import pod_exchange_ctx

            app.cleanup_ctx.append(pod_exchange_ctx(app))
        if settings.server.response_ids_ttl_s > 0:  # (router/service/response_share.py)
            share = state.response_share
            app.cleanup_ctx.append(redis_ctx(share, settings.server, state.metrics.registry))
    if settings.server.record_path:
        app.cleanup_ctx.append(background.recording)
    if any(rep.zmq for rep in settings.replicas):
        app.cleanup_ctx.append(background.direct_events)
    if any(rep.metrics_url for rep in settings.replicas):
        app.cleanup_ctx.append(background.engine_metrics)
    if settings.server.grpc_port is not None:
        from router.rpc.server import grpc_cleanup_ctx

        app.cleanup_ctx.append(grpc_cleanup_ctx)
    routes = Routes()
    routes.served_elsewhere("POST", CHAT_PATH.decode())
    routes.served_elsewhere("POST", COMPLETIONS_PATH.decode())
    routes.served_elsewhere("POST", MESSAGES_PATH.decode())
    routes.served_elsewhere("POST", RESPONSES_PATH.decode())
    for path in PATHS:
        routes.served_elsewhere("POST", path.decode())
    public.add_routes(routes, app)
    admin.add_routes(routes, app)
    app[ROUTES] = routes
    return app


@dataclass(slots=True)
class Running:
    """A started router: its application object, port and server."""

    app: web.Application
    port: int
    server: FastServer
    runner: web.AppRunner

    async def cleanup(self, timeout: float = 0.0) -> None:
        """Stop accepting (``/ready`` and the gRPC health service say so from now on), answer
        the requests admission holds (router.service.admission ``Admission.stop``), let
        requests in flight finish for up to ``timeout`` seconds, close the rest, then stop
        the contexts."""
        now = asyncio.get_running_loop().time()
        self.app[STOPPING].begin(now + timeout)
        admission = self.app[STATE].admission
        if admission is not None:
            admission.stop(now)
        await self.server.close(timeout)
        await self.runner.cleanup()

    def cut(self) -> None:
        """End the drain of :meth:`cleanup` now (a second SIGTERM / SIGINT): requests still
        in flight are closed as at its deadline (streams cut, never ended cleanly), the
        gRPC server stops without grace, then the contexts stop."""
        self.app[STOPPING].cut(asyncio.get_running_loop().time())
        self.server.cut()


async def start(
    app: web.Application,
    host: str,
    port: int,
    *,
    reuse_port: bool = False,
    sock: socket.socket | None = None,
) -> Running:
    """Run the app's contexts, then serve its port (0: a free one), or accept from
    ``sock``, a socket listening on it already (the parent's, with several workers)."""
    runner = web.AppRunner(app, handle_signals=False)
    try:
        # the cleanup_ctx entries start (no aiohttp site: no HTTP here); one that fails
        # (the gRPC port taken) leaves those started before it to the cleanup below
        await runner.setup()
        state = app[STATE]
        door = FrontDoor(state, app[FORWARDER], app[GATE], app[ROUTES])
        s = state.settings.server
        server = FastServer(
            partial(handle, door),
            int(s.max_body_mb * 2**20),
            ConnLimits.from_server(s),
            refuses_body=door.gate.refuses_key,
        )
        bound = await server.start(host, port, reuse_port=reuse_port, sock=sock)
        log_startup(state, host, bound, server.limits.max_connections)
    except BaseException:
        await runner.cleanup()
        raise
    return Running(app, bound, server, runner)


def run(
    app: web.Application,
    host: str,
    port: int,
    *,
    reuse_port: bool = False,
    sock: socket.socket | None = None,
    shutdown_timeout: float = 30.0,
    on_started: Callable[[], None] | None = None,
    cut_signal: int | None = None,
) -> None:
    """Serve ``app`` until SIGTERM / SIGINT (``kvrouter serve``). Shutdown: stop accepting,
    let requests in flight finish for up to ``shutdown_timeout`` seconds (a second SIGTERM /
    SIGINT ends that wait at once: :meth:`Running.cut`), then stop the contexts.
    ``on_started`` is called once the port listens (``sock``: see :func:`start`).
    ``cut_signal``: the signal that ends the wait instead (a worker: SIGQUIT from its
    parent, which may pass on a SIGTERM the worker got itself too); SIGTERM / SIGINT then
    only begin the stop."""
    import signal

    async def main() -> None:
        running = await start(app, host, port, reuse_port=reuse_port, sock=sock)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def cut() -> None:
            _log.warning("stop now: requests still in flight are cut")
            stop.set()
            running.cut()

        def begin() -> None:
            if stop.is_set() and cut_signal is None:  # a second SIGTERM / SIGINT
                cut()
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, begin)
        if cut_signal is not None:
            loop.add_signal_handler(cut_signal, cut)
        if on_started is not None:
            on_started()
        await stop.wait()
        await running.cleanup(shutdown_timeout)

    asyncio.run(main())
