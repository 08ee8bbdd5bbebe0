"""The gRPC server of the router process: Router, Index and Admin services plus the
standard health service and reflection, on grpc.aio beside the HTTP server.

Authentication (:class:`AuthInterceptor`): Router calls carry ``authorization: Bearer X``
where X is ``token`` (``server.grpc_token``) or a client API key, which the HTTP front
door's gate checks and whose per-key limit a Pick holds as an HTTP request does; Index calls
need ``token``; Admin calls need ``admin_token`` (and are refused when none is configured).
Secrets are compared in constant time. Before the credentials, a call's metadata is held to
``server.max_header_kb`` as an HTTP request's header block is (RESOURCE_EXHAUSTED with the
431's message). TLS is on when a certificate and key are given.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import pathlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol, TypeAlias, cast
from urllib.parse import unquote

import grpc
from aiohttp import web
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router.rpc.calls import (
    CALLER,
    DELIVERY,
    Delivery,
    abort_reply,
    metadata_bytes,
    metadata_headers,
)
from router.rpc.decisions import DecisionBook
from router.rpc.fleet_services import AdminServicer, IndexServicer
from router.rpc.gen import (
    admin_pb2,
    admin_pb2_grpc,
    index_pb2,
    index_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from router.rpc.router_service import RouterServicer
from router.rpc.settings import GrpcSettings
from router.service.ejection import Ejections
from router.service.errors import ErrorReply
from router.service.gate import Gate, header_refusal, presented_key
from router.service.http_connection import MAX_HEAD_BYTES, MAX_HEADERS
from router.service.keys import (
    FORWARDER,
    GATE,
    GRPC_PORT,
    GRPC_SERVER,
    REPORT_RELAY,
    SETTINGS,
    STATE,
    STOPPING,
    WORKERS,
)
from router.service.public import is_ready
from router.service.report_relay import ReportRelay
from router.service.state import RouterState
from router.service.stopping import Stopping
from router.service.workers import Workers

__all__ = [
    "GRPC_PORT",
    "GRPC_SERVER",
    "BuiltServer",
    "build_server",
    "grpc_cleanup_ctx",
    "serve_grpc",
]
_log = logging.getLogger("kvrouter.service")
SWEEP_S = 1.0  # how often decisions past their TTL are ended without a Pick to do it
READY_S = 0.5  # how often the health service's statuses are brought in line with /ready
STOP_GRACE_S = 5.0  # RPCs in flight when the server stops: at most this, within the deadline
ADMIN_SERVICE = "/kvrouter.v1.Admin/"
ROUTER_SERVICE = "/kvrouter.v1.Router/"
# unary methods whose handler must learn whether its reply reached the caller (:data:`DELIVERY`)
DELIVERED = frozenset({f"{ROUTER_SERVICE}Pick"})
KVROUTER_SERVICES = "/kvrouter."  # every other service (health, reflection) is open


Metadata: TypeAlias = tuple[tuple[str, str | bytes], ...] | None


def _bearer(metadata: Metadata) -> str:
    for key, value in metadata or ():
        if key.lower() == "authorization":
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            if text[:7].lower() == "bearer ":
                return text[7:].strip()
    return ""


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def client_address(peer: str | None) -> str:
    """The client's address in a grpc peer string (``ipv4:10.0.0.1:5555``,
    ``ipv6:%5B::1%5D:5555``), as the HTTP server names a client (the host without the port),
    so a client without keys is one identity to the gate whichever port it calls."""
    text = unquote(peer or "")
    kind, _, rest = text.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0].strip("[]")
    return text


# grpc ships no types (grpc.aio.ServicerContext and the rest are Any to mypy); what this module
# reads of a method handler (grpc.RpcMethodHandler), with the aio server's async behaviours:
Context: TypeAlias = grpc.aio.ServicerContext
Requests: TypeAlias = AsyncIterator[Message]


class MethodHandler(Protocol):
    request_streaming: bool
    response_streaming: bool
    request_deserializer: Callable[[bytes], Message] | None
    response_serializer: Callable[[Message], bytes] | None
    unary_unary: Callable[[Message, Context], Awaitable[Message]] | None
    stream_stream: Callable[[Requests, Context], AsyncIterator[Message]] | None


def _unauthenticated(why: str) -> ErrorReply:
    return ErrorReply(401, why)


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc: untyped
    """The credentials of each service, checked before a handler runs (and before its
    request is parsed). Health and reflection stay open so load balancers and grpcurl can see
    the server. Secrets are compared in constant time (client keys by the gate, as HTTP).

    * Admin: ``admin_token`` only; refused to everyone without one.
    * Router (Pick, Report): ``token`` (``server.grpc_token``, a trusted gateway's: not held
      to per-key limits), or a client key, checked by ``gate`` (router/service/gate.py, the
      object the HTTP front door checks with), whose per-key limit a Pick then holds
      (router/rpc/router_service.py). With neither token nor client keys configured the service
      is open, and a caller is its address (the gate's per-address limit, as on HTTP).
    * Index (Publish) and any other kvrouter service: ``token`` only. Without a token it is
      open when no client keys are configured, refused when they are: a client key never
      authorises index writes.

    Every kvrouter call is first held to ``max_header_bytes`` (``server.max_header_kb``; 0:
    unlimited): metadata larger, counted as an HTTP header block (router/rpc/calls.py
    ``metadata_bytes``), is refused RESOURCE_EXHAUSTED with the message of HTTP's 431, before
    any credential is read (as the HTTP gate checks the size first).

    The caller a Router call was admitted as is :data:`CALLER` while its handler runs.
    """

    def __init__(
        self,
        token: str | None,
        admin_token: str | None,
        gate: Gate | None = None,
        max_header_bytes: int = 0,
    ) -> None:
        self.token = token
        self.admin_token = admin_token
        self.gate = gate
        self.max_header_bytes = max_header_bytes

    def check(self, method: str, metadata: Metadata, peer: str) -> tuple[ErrorReply | None, object]:
        """(the refusal, None to go on; the caller for :data:`CALLER`: a client identity of
        the gate, None for one not held to per-key limits)."""
        too_large = header_refusal(metadata_bytes(metadata), self.max_header_bytes)
        if too_large is not None:
            return too_large, None
        given = _bearer(metadata)
        if method.startswith(ADMIN_SERVICE):
            if not self.admin_token:
                return _unauthenticated("admin API disabled: no admin token configured"), None
            if _same(given, self.admin_token):
                return None, None
            return _unauthenticated("missing or wrong admin token"), None
        if self.token and _same(given, self.token):
            return None, None  # the gateway's / publisher's token, on Router and Index
        gate = self.gate
        keyed = gate is not None and gate.keyed()
        if method.startswith(ROUTER_SERVICE):
            if gate is not None and (keyed or not self.token):
                # the client's key read as HTTP reads it (Authorization: Bearer, or api-key);
                # 401 when missing or wrong
                return gate.caller(presented_key(metadata_headers(metadata)), peer)
            if self.token:
                return _unauthenticated("missing or wrong bearer token"), None
            return None, None
        if self.token:
            return _unauthenticated("missing or wrong bearer token"), None
        if keyed:
            return _unauthenticated(
                "index publishing disabled: no server.grpc_token configured (client API keys "
                "do not authorise it)"
            ), None
        return None, None

    async def admit(self, method: str, context: Context) -> object:
        """The caller of this call; ends it (UNAUTHENTICATED; RESOURCE_EXHAUSTED for
        metadata over the limit) when refused."""
        refused, caller = self.check(
            method, context.invocation_metadata(), client_address(context.peer())
        )
        if refused is not None:
            await abort_reply(context, refused)
        return caller

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[MethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> MethodHandler | None:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or not method.startswith(KVROUTER_SERVICES):
            return handler  # health, reflection (open), or no such method
        return _guarded(handler, partial(self.admit, method), method in DELIVERED)


def _guarded(
    handler: MethodHandler,
    admit: Callable[[Context], Awaitable[object]],
    delivered: bool = False,
) -> MethodHandler:
    """``handler`` behind ``admit`` (the credentials; the caller it returns is
    :data:`CALLER` during the call), with request parsing moved into the handler, so a
    message that is not valid protobuf is answered INVALID_ARGUMENT with the parser's reason
    (grpc-python's own deserialization failure is an UNKNOWN status and an error-level
    traceback in the log), and nothing is parsed for a caller that is refused.

    ``delivered``: a unary method whose handler learns whether its reply was written to the
    caller's stream (:data:`DELIVERY`). It is served as a server-streaming handler that
    yields its one reply (the same messages on the wire: a unary client reads one message
    and the status), so the write is awaited here and fails for a call its client cancelled
    or whose deadline passed; grpc.aio answers a unary handler's reply after the handler,
    where nothing tells it failed."""
    parse = handler.request_deserializer

    async def parsed(raw: bytes, context: Context) -> Message:
        if parse is None:
            return cast(Message, raw)
        try:
            return parse(raw)
        except Exception as exc:  # DecodeError, or anything the parser raises
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {exc}"
            )
            raise AssertionError("context.abort returned") from None

    call, streams = handler.unary_unary, handler.stream_stream
    if delivered and not handler.request_streaming and not handler.response_streaming:
        assert call is not None

        async def tracked(raw: bytes, context: Context) -> AsyncIterator[Message]:
            delivery = Delivery()
            caller, box = CALLER.set(await admit(context)), DELIVERY.set(delivery)
            try:
                reply = await call(await parsed(raw, context), context)
            finally:
                DELIVERY.reset(box)
                CALLER.reset(caller)
            yield reply  # grpc writes it, and asks for the next one once it was written
            delivery.sent = True

        tracking: MethodHandler = grpc.unary_stream_rpc_method_handler(
            tracked, response_serializer=handler.response_serializer
        )
        return tracking
    if not handler.request_streaming and not handler.response_streaming and call is not None:

        async def unary(raw: bytes, context: Context) -> Message:
            caller = CALLER.set(await admit(context))
            try:
                return await call(await parsed(raw, context), context)
            finally:
                CALLER.reset(caller)

        new: MethodHandler = grpc.unary_unary_rpc_method_handler(
            unary, response_serializer=handler.response_serializer
        )
        return new
    if handler.request_streaming and handler.response_streaming and streams is not None:

        async def stream(raw_iter: AsyncIterator[bytes], context: Context) -> Requests:
            await admit(context)  # (no streaming method reads CALLER)

            async def requests() -> Requests:
                async for raw in raw_iter:
                    yield await parsed(raw, context)

            async for reply in streams(requests(), context):
                yield reply

        new = grpc.stream_stream_rpc_method_handler(
            stream, response_serializer=handler.response_serializer
        )
        return new
    # no kvrouter method has another shape; one added must be guarded here, not served open
    raise NotImplementedError("kvrouter gRPC methods are unary or bidirectional streams")


@dataclass(frozen=True, slots=True)
class BuiltServer:
    """A created, not yet started, server: its bound port, its health service, the names of
    the services it serves (the health service reports each) and its Router service (whose
    decisions :func:`serve_grpc` sweeps)."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    router: RouterServicer


def build_server(
    state: RouterState,
    settings: GrpcSettings,
    clock: Callable[[], float],
    workers: Workers | None = None,
    ejections: Ejections | None = None,
    relay: ReportRelay | None = None,
    gate: Gate | None = None,
) -> BuiltServer:
    """Create (not start) the server. ``workers``: the worker processes Admin Drain /
    Undrain reach (``kvrouter serve --workers N``); ``ejections``: the HTTP forwarder's
    outlier ejection, which Report feeds; ``gate``: the HTTP front door's (client keys and
    per-key limits, which Router calls are held to; None: no client keys, nothing counted)."""
    limit = int(settings.max_message_mb * 2**20)
    header_limit = int(settings.max_header_kb * 1024)
    # grpc's own metadata limits (8 KiB soft: refused at random above it; 16 KiB hard) must
    # not refuse what server.max_header_kb lets through: they are raised above it (grpc counts
    # 32 bytes a field where HTTP counts 4) so the interceptor refuses with HTTP's message; 0
    # (unlimited) keeps the HTTP front door's own ceiling (http_connection.MAX_HEAD_BYTES)
    metadata_ceiling = (header_limit or MAX_HEAD_BYTES) + 32 * MAX_HEADERS
    server = grpc.aio.server(
        interceptors=[AuthInterceptor(settings.token, settings.admin_token, gate, header_limit)],
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.max_metadata_size", metadata_ceiling),
            ("grpc.absolute_max_metadata_size", metadata_ceiling),
            # grpc binds with SO_REUSEPORT unless told not to: a second router on this port
            # would silently share its calls; only the workers of one router share it (their
            # parent checked that nobody else holds it: router/service/supervisor.py)
            ("grpc.so_reuseport", int(workers is not None)),
        ],
    )
    book = DecisionBook(settings.max_pending_decisions, settings.decision_ttl_s)
    router = RouterServicer(state, clock, book, ejections, workers, gate)
    if relay is not None:  # other workers' control sockets hand it Reports (report_relay.py)
        relay.apply = router.apply_report
    router_pb2_grpc.add_RouterServicer_to_server(router, server)
    index_pb2_grpc.add_IndexServicer_to_server(IndexServicer(state, workers), server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(state, clock, book, workers), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [
        router_pb2.DESCRIPTOR.services_by_name["Router"].full_name,
        index_pb2.DESCRIPTOR.services_by_name["Index"].full_name,
        admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
    ]
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    address = f"{settings.host}:{settings.port or 0}"
    if settings.tls_cert and settings.tls_key:
        creds = grpc.ssl_server_credentials(
            [
                (
                    pathlib.Path(settings.tls_key).read_bytes(),
                    pathlib.Path(settings.tls_cert).read_bytes(),
                )
            ]
        )
    else:
        creds = None
    try:
        if creds is not None:
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc's "Failed to bind to address ..."
        raise OSError(
            errno.EADDRINUSE,
            f"server.grpc_port: cannot listen on {address} (taken, or no address of this host)",
        ) from exc
    return BuiltServer(server, port, health_servicer, tuple(names), router)


async def serve_grpc(
    state: RouterState,
    settings: GrpcSettings,
    clock: Callable[[], float],
    workers: Workers | None = None,
    ejections: Ejections | None = None,
    relay: ReportRelay | None = None,
    gate: Gate | None = None,
    stopping: Stopping | None = None,
) -> AsyncGenerator[tuple[grpc.aio.Server, int], None]:
    """Async generator for aiohttp ``cleanup_ctx``-style lifetimes: start, yield the server
    and its port, stop. While it serves, decisions past their TTL are ended every
    :data:`SWEEP_S`, whether or not Picks come, and the health service follows ``/ready``
    (:func:`_follow_readiness`). ``stopping``: the process's stop, from whose start every
    service reports NOT_SERVING and whose deadline bounds the grace of the RPCs in flight."""
    built = build_server(state, settings, clock, workers, ejections, relay, gate)
    await built.server.start()
    for name in built.service_names[1:]:  # Index, Admin: while the process serves
        await built.health.set(name, health_pb2.HealthCheckResponse.SERVING)
    stopping = stopping or Stopping()
    built.router.stopping = stopping
    await _set_ready(built, is_ready(state, loop_clock()))
    sweeper = asyncio.create_task(_sweep(built.router))
    follower = asyncio.create_task(_follow_readiness(built, state, stopping))
    try:
        yield built.server, built.port
    finally:
        sweeper.cancel()
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await built.health.enter_graceful_shutdown()
        grace = STOP_GRACE_S
        if stopping.started:  # (the HTTP drain may have used the time up)
            grace = min(grace, stopping.left(loop_clock()))
        await built.server.stop(grace=grace)


async def _set_ready(built: BuiltServer, ready: bool) -> None:
    """The server as a whole (service "") and the Router service: SERVING when ``/ready``
    would answer 200, else NOT_SERVING (a Pick would find no replica)."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if ready
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", built.service_names[0]):
        await built.health.set(name, status)


async def _follow_readiness(built: BuiltServer, state: RouterState, stopping: Stopping) -> None:
    """Every :data:`READY_S`, the health statuses of :func:`_set_ready`; once the process
    stops, NOT_SERVING for every service at once (graceful shutdown)."""
    shown = is_ready(state, loop_clock())
    while not stopping.started:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.event.wait(), READY_S)
        if stopping.started:
            break
        ready = is_ready(state, loop_clock())
        if ready != shown:
            await _set_ready(built, ready)
            shown = ready
    await built.health.enter_graceful_shutdown()


async def _sweep(router: RouterServicer) -> None:
    """End ``router``'s expired decisions every :data:`SWEEP_S` (until cancelled)."""
    while True:
        await asyncio.sleep(SWEEP_S)
        try:
            router.sweep()
        except Exception:  # one bad decision must not end the sweeping
            _log.exception("sweeping expired gRPC decisions failed")


def loop_clock() -> float:
    return asyncio.get_running_loop().time()


async def grpc_cleanup_ctx(app: web.Application) -> AsyncIterator[None]:
    """aiohttp ``cleanup_ctx`` entry: serve gRPC beside HTTP for the app's RouterState."""
    s = app[SETTINGS].server
    settings = GrpcSettings(
        host=s.grpc_host or s.host,
        port=s.grpc_port,
        token=s.grpc_token,
        admin_token=s.admin_token,
        tls_cert=s.grpc_tls_cert,
        tls_key=s.grpc_tls_key,
        max_message_mb=s.grpc_max_message_mb,
        max_header_kb=s.max_header_kb,
    )
    # with several worker processes (control.join_workers ran before the app started)
    workers = app.get(WORKERS)
    forwarder = app.get(FORWARDER)  # (router/service/background.py upstream_session)
    ejections = forwarder.ejections if forwarder is not None else None
    relay = app.get(REPORT_RELAY)
    # the public port's gate: one check of client keys and one count per key for both ports
    async for server, port in serve_grpc(
        app[STATE], settings, loop_clock, workers, ejections, relay, app[GATE], app[STOPPING]
    ):
        app[GRPC_PORT] = port
        app[GRPC_SERVER] = server
        yield
