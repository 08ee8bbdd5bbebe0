"""What the gRPC servicers and the server share about a call: who made it, what it carries
and how a refusal ends it.

* :data:`CALLER`: the client a Router call was admitted as (router/rpc/server.py
  ``AuthInterceptor`` sets it for the handler's run).
* :data:`DELIVERY`: whether a Pick's reply reached its caller's stream (set for the
  handler's run; its ``sent`` turns true once grpc wrote the reply).
* :func:`metadata_headers`: the call's metadata as the HTTP server's header pairs, for the
  readers of HTTP headers; :func:`metadata_bytes`: its size as an HTTP header block's, which
  ``server.max_header_kb`` bounds.
* :func:`status_of` / :func:`abort_error`: errors of the core (router/core/errors.py) map
  to gRPC status codes here and only here, with the HTTP answer's ``Retry-After`` as the
  trailers ``retry-after`` and ``grpc-retry-pushback-ms``; :func:`abort_reply` does the
  same for a refusal of the HTTP front door's gate (401, 429, 431).

Both aborts raise (as ``context.abort`` does): they never return.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import NoReturn

import grpc

from router.core.errors import (
    BadRequest,
    KVRouterError,
    NoReplicaAvailable,
    Overloaded,
    UnknownModel,
)
from router.service.errors import ErrorReply, reply_for

# The client a Router call was admitted as (router/rpc/server.py AuthInterceptor): its
# identity to the HTTP front door's gate (router/service/gate.py ``Gate.caller``), or None
# for a caller not held to per-key limits (``server.grpc_token``, or no gate).
CALLER: ContextVar[object] = ContextVar("kvrouter_grpc_caller", default=None)


@dataclass(slots=True)
class Delivery:
    """Whether a call's reply was written to its stream (router/rpc/server.py sets
    ``sent`` once grpc's write of it completed). A call its client cancelled, or whose
    deadline passed, before that never gets it: the write fails. grpc.aio's own
    ``context.cancelled()`` cannot tell: it reads the status the server set, and stays
    False for a call the client cancelled."""

    sent: bool = False


# The Delivery of the call whose handler runs (None: a call served without one, whose
# delivery is unknown)
DELIVERY: ContextVar[Delivery | None] = ContextVar("kvrouter_grpc_delivery", default=None)


def status_of(exc: KVRouterError) -> grpc.StatusCode:
    """The status a core error ends an RPC with: BadRequest -> INVALID_ARGUMENT,
    UnknownModel -> NOT_FOUND, Overloaded (SLO-aware admission) -> RESOURCE_EXHAUSTED,
    NoReplicaAvailable -> UNAVAILABLE, any other -> INTERNAL."""
    if isinstance(exc, BadRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, UnknownModel):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, NoReplicaAvailable):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def _trailers(reply: ErrorReply) -> tuple[tuple[str, str], ...]:
    """The HTTP answer's ``Retry-After`` as gRPC trailers: ``retry-after`` (seconds) and
    ``grpc-retry-pushback-ms``, which a client's retry policy honours."""
    trailers: list[tuple[str, str]] = []
    for name, value in reply.headers:
        if name.lower() == "retry-after":
            trailers += [("retry-after", value), ("grpc-retry-pushback-ms", f"{int(value) * 1000}")]
    return tuple(trailers)


async def abort_error(
    context: grpc.aio.ServicerContext, exc: KVRouterError, retry_after_s: int = 1
) -> NoReturn:
    """End the RPC with the status mapped from ``exc`` (``context.abort`` raises). When the
    HTTP answer to ``exc`` carries ``Retry-After`` (an overloaded router, no replica free),
    so do the trailers (:func:`_trailers`)."""
    await context.abort(status_of(exc), str(exc), _trailers(reply_for(exc, retry_after_s)))
    raise AssertionError("context.abort returned")


_GATE_STATUS = {
    401: grpc.StatusCode.UNAUTHENTICATED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    # the header block over server.max_header_kb: grpc's own answer to metadata over its limit
    431: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


async def abort_reply(context: grpc.aio.ServicerContext, reply: ErrorReply) -> NoReturn:
    """End the RPC with a refusal of the gate (or of the gRPC credentials): 401 ->
    UNAUTHENTICATED, 429 (the per-key limit) -> RESOURCE_EXHAUSTED with the retry-after
    trailers, 431 (metadata over ``server.max_header_kb``) -> RESOURCE_EXHAUSTED; the reply's
    message is the details."""
    code = _GATE_STATUS.get(reply.status, grpc.StatusCode.INTERNAL)
    await context.abort(code, reply.message, _trailers(reply))
    raise AssertionError("context.abort returned")


def metadata_headers(
    metadata: tuple[tuple[str, str | bytes], ...] | None,
) -> list[tuple[bytes, bytes]]:
    """Call metadata as the HTTP server's header pairs, for the readers of HTTP headers
    (router/service/gate.py ``presented_key``, admission's class and tenant)."""
    return [
        (
            k.encode("latin-1", "replace"),
            v if isinstance(v, bytes) else v.encode("latin-1", "replace"),
        )
        for k, v in metadata or ()
    ]


def metadata_bytes(metadata: tuple[tuple[str, str | bytes], ...] | None) -> int:
    """The size of a call's metadata counted as the HTTP server counts a header block's
    (router/service/http_connection.py: name, value and 4 bytes of ``: `` and CRLF per field),
    so ``server.max_header_kb`` bounds both alike. Values are counted as they arrived
    (``-bin`` values decoded, others as text)."""
    total = 0
    for k, v in metadata or ():
        total += len(k) + (len(v) if isinstance(v, bytes) else len(v.encode("utf-8"))) + 4
    return total
