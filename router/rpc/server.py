"""The gRPC server of the router process: Router, Index and Admin services plus the
standard health service and reflection, on grpc.aio beside the HTTP server.

Authentication: with ``token`` set, every call must carry ``authorization: Bearer TOKEN``;
Admin calls need ``admin_token`` (and are refused when none is configured). Tokens are
compared in constant time. TLS is on when a certificate and key are given.
"""

from __future__ import annotations

import asyncio
import hmac
import pathlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import grpc
from aiohttp import web
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router.rpc.gen import (
    admin_pb2,
    admin_pb2_grpc,
    index_pb2,
    index_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from router.rpc.servicers import AdminServicer, DecisionBook, IndexServicer, RouterServicer
from router.rpc.settings import GrpcSettings
from router.service.ejection import Ejections
from router.service.keys import (
    FORWARDER,
    GRPC_PORT,
    GRPC_SERVER,
    REPORT_RELAY,
    SETTINGS,
    STATE,
    WORKERS,
)
from router.service.report_relay import ReportRelay
from router.service.state import RouterState
from router.service.workers import Workers

__all__ = [
    "GRPC_PORT",
    "GRPC_SERVER",
    "BuiltServer",
    "build_server",
    "grpc_cleanup_ctx",
    "serve_grpc",
]
ADMIN_SERVICE = "/kvrouter.v1.Admin/"
HEALTH_SERVICE = "/grpc.health.v1.Health/"
REFLECTION_SERVICE = "/grpc.reflection."


def _bearer(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str:
    for key, value in metadata or ():
        if key.lower() == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            if text.lower().startswith("bearer "):
                return text[7:].strip()
    return ""


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


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


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc: untyped
    """Bearer-token checks before any handler runs. Health and reflection stay open so
    load balancers and grpcurl can see the server."""

    def __init__(self, token: str | None, admin_token: str | None) -> None:
        self.token = token
        self.admin_token = admin_token

    def _denied(self, method: str, given: str) -> str | None:
        if method.startswith((HEALTH_SERVICE, REFLECTION_SERVICE)):
            return None
        if method.startswith(ADMIN_SERVICE):
            if not self.admin_token:
                return "admin API disabled: no admin token configured"
            return None if _same(given, self.admin_token) else "missing or wrong admin token"
        if self.token and not _same(given, self.token):
            return "missing or wrong bearer token"
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[MethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> MethodHandler | None:
        why = self._denied(details.method, _bearer(details.invocation_metadata))
        if why is None:
            handler = await continuation(details)
            if details.method.startswith(KVROUTER_SERVICES):
                return _parse_in_handler(handler)
            return handler
        handler = await continuation(details)
        if handler is None:
            return None

        async def deny(request: Message, context: Context) -> Message:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
            raise AssertionError("context.abort returned")

        async def deny_stream(requests: Requests, context: Context) -> AsyncIterator[Message]:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
            raise AssertionError("context.abort returned")
            yield  # pragma: no cover  (an async generator, as streaming handlers are)

        denied: MethodHandler
        if handler.request_streaming and handler.response_streaming:
            denied = grpc.stream_stream_rpc_method_handler(
                deny_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        else:
            denied = grpc.unary_unary_rpc_method_handler(
                deny,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return denied


KVROUTER_SERVICES = "/kvrouter."


def _parse_in_handler(handler: MethodHandler | None) -> MethodHandler | None:
    """Move request parsing into the handler, so a message that is not valid protobuf is
    answered INVALID_ARGUMENT with the parser's reason (grpc-python's own deserialization
    failure is an UNKNOWN status and an error-level traceback in the log)."""
    if handler is None or handler.request_deserializer is None:
        return handler
    parse = handler.request_deserializer

    async def parsed(raw: bytes, context: Context) -> Message:
        try:
            return parse(raw)
        except Exception as exc:  # DecodeError, or anything the parser raises
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {exc}"
            )
            raise AssertionError("context.abort returned") from None

    call, streams = handler.unary_unary, handler.stream_stream
    if not handler.request_streaming and not handler.response_streaming and call is not None:

        async def unary(raw: bytes, context: Context) -> Message:
            return await call(await parsed(raw, context), context)

        new: MethodHandler = grpc.unary_unary_rpc_method_handler(
            unary, response_serializer=handler.response_serializer
        )
        return new
    if handler.request_streaming and handler.response_streaming and streams is not None:

        async def stream(raw_iter: AsyncIterator[bytes], context: Context) -> Requests:
            async def requests() -> Requests:
                async for raw in raw_iter:
                    yield await parsed(raw, context)

            async for reply in streams(requests(), context):
                yield reply

        new = grpc.stream_stream_rpc_method_handler(
            stream, response_serializer=handler.response_serializer
        )
        return new
    return handler


@dataclass(frozen=True, slots=True)
class BuiltServer:
    """A created, not yet started, server: its bound port, its health service and the
    names of the services it serves (the health service reports each)."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]


def build_server(
    state: RouterState,
    settings: GrpcSettings,
    clock: Callable[[], float],
    workers: Workers | None = None,
    ejections: Ejections | None = None,
    relay: ReportRelay | None = None,
) -> BuiltServer:
    """Create (not start) the server. ``workers``: the worker processes Admin Drain /
    Undrain reach (``kvrouter serve --workers N``); ``ejections``: the HTTP forwarder's
    outlier ejection, which Report feeds."""
    limit = int(settings.max_message_mb * 2**20)
    server = grpc.aio.server(
        interceptors=[AuthInterceptor(settings.token, settings.admin_token)],
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ],
    )
    book = DecisionBook(settings.max_pending_decisions, settings.decision_ttl_s)
    router = RouterServicer(state, clock, book, ejections, workers)
    if relay is not None:  # other workers' control sockets hand it Reports (report_relay.py)
        relay.apply = router.apply_report
    router_pb2_grpc.add_RouterServicer_to_server(router, server)
    index_pb2_grpc.add_IndexServicer_to_server(IndexServicer(state), server)
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
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    return BuiltServer(server, port, health_servicer, tuple(names))


async def serve_grpc(
    state: RouterState,
    settings: GrpcSettings,
    clock: Callable[[], float],
    workers: Workers | None = None,
    ejections: Ejections | None = None,
    relay: ReportRelay | None = None,
) -> AsyncGenerator[tuple[grpc.aio.Server, int], None]:
    """Async generator for aiohttp ``cleanup_ctx``-style lifetimes: start, yield the server
    and its port, stop."""
    built = build_server(state, settings, clock, workers, ejections, relay)
    await built.server.start()
    for name in ["", *built.service_names]:
        await built.health.set(name, health_pb2.HealthCheckResponse.SERVING)
    try:
        yield built.server, built.port
    finally:
        await built.health.enter_graceful_shutdown()
        await built.server.stop(grace=5.0)


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
    )
    # with several worker processes (control.join_workers ran before the app started)
    workers = app.get(WORKERS)
    forwarder = app.get(FORWARDER)  # (router/service/background.py upstream_session)
    ejections = forwarder.ejections if forwarder is not None else None
    relay = app.get(REPORT_RELAY)
    async for server, port in serve_grpc(
        app[STATE], settings, loop_clock, workers, ejections, relay
    ):
        app[GRPC_PORT] = port
        app[GRPC_SERVER] = server
        yield
