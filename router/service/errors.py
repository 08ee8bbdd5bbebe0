"""OpenAI-style error responses, and the one place where core errors become HTTP statuses.

Body: ``{"error": {"message", "type", "param", "code"}}``; on the Anthropic Messages routes
(``/v1/messages...``) Anthropic's ``{"type": "error", "error": {"type", "message"}}`` with
the type vLLM 0.34 gives the status (``translate_error_type``). BadRequest -> 400,
UnknownModel -> 404, body too large -> 413, NoReplicaAvailable -> 503 with ``Retry-After``
(429 when every replica is over its busy threshold; code ``router_stopping`` for
ShuttingDown), Overloaded (SLO-aware admission) -> 429
with ``Retry-After`` and code ``slo_<reason>``, anything unexpected -> 500.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from router.core.errors import (
    BadRequest,
    KVRouterError,
    NoReplicaAvailable,
    Overloaded,
    ShuttingDown,
    UnknownModel,
)

# the Messages API's paths (``/v1/messages`` and below): the router's errors there take
# Anthropic's shape (:func:`messages_path`)
MESSAGES_PATH = b"/v1/messages"


def messages_path(path: bytes) -> bool:
    """Whether a request's path (no query string) is one of the Messages API's, whose
    errors the router answers in Anthropic's shape."""
    n = len(MESSAGES_PATH)
    return path.startswith(MESSAGES_PATH) and (len(path) == n or path[n] == 0x2F)  # "/"


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    411: "invalid_request_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


# vLLM 0.34's vllm/entrypoints/anthropic/protocol.py ``_ANTHROPIC_ERROR_TYPE_BY_STATUS``
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    """Anthropic's ``error.type`` for an HTTP status, as vLLM translates it: the table
    above, else ``api_error`` from 500 on and ``invalid_request_error`` below."""
    found = _ANTHROPIC_TYPES.get(status)
    if found is not None:
        return found
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_body(status: int, message: str) -> bytes:
    """The JSON bytes of an Anthropic-style error (the Messages API's shape)."""
    error = {"type": anthropic_error_type(status), "message": message}
    return json.dumps({"type": "error", "error": error}).encode()


def error_body(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    anthropic: bool = False,
) -> bytes:
    """The JSON bytes of an OpenAI-style error (``anthropic``: of an Anthropic-style one,
    which has no ``param`` or ``code``)."""
    if anthropic:
        return anthropic_error_body(status, message)
    body = {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "error"),
            "param": param,
            "code": code,
        }
    }
    return json.dumps(body).encode()


def response_not_found_body(response_id: str) -> bytes:
    """vLLM 0.34's answer (status 404) for a stored response it does not hold, for a
    ``previous_response_id``, a retrieve and a cancel alike (``_make_not_found_error``:
    ``invalid_request_error``, the status as ``code``, not this module's 404 type)."""
    error = {
        "message": f"Response with id '{response_id}' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 404,
    }
    return json.dumps({"error": error}).encode()


class UnknownResponse(KVRouterError):
    """A request names a stored response its API key may not see (another key's:
    router/service/stored_responses.py): answered 404 with :func:`response_not_found_body`,
    as an id nobody holds is, so that it tells nothing of the response."""

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Response with id '{response_id}' not found.")
        self.response_id = response_id


@dataclass(slots=True, frozen=True)
class ErrorReply:
    """An error answer, engine-neutral: status, extra headers, OpenAI-style body."""

    status: int
    message: str
    code: str | None = None
    param: str | None = None
    headers: tuple[tuple[str, str], ...] = ()

    def body(self, anthropic: bool = False) -> bytes:
        """OpenAI-style, or Anthropic-style with ``anthropic``."""
        return error_body(
            self.status, self.message, param=self.param, code=self.code, anthropic=anthropic
        )


def reply_for(exc: KVRouterError, retry_after_s: int = 1) -> ErrorReply:
    """The answer for a core error raised while handling a request."""
    if isinstance(exc, UnknownModel):
        return ErrorReply(404, str(exc), "model_not_found", "model")
    if isinstance(exc, Overloaded):
        return ErrorReply(
            429,
            str(exc),
            f"slo_{exc.reason}",
            headers=(("Retry-After", str(max(int(exc.retry_after_s), 1))),),
        )
    if isinstance(exc, ShuttingDown):
        return ErrorReply(
            503, str(exc), "router_stopping", headers=(("Retry-After", str(retry_after_s)),)
        )
    if isinstance(exc, NoReplicaAvailable):
        status = 429 if exc.busy else 503
        return ErrorReply(
            status,
            str(exc),
            "replicas_busy" if exc.busy else "no_replica_available",
            headers=(("Retry-After", str(retry_after_s)),),
        )
    if isinstance(exc, BadRequest):
        return ErrorReply(400, str(exc), "invalid_request")
    return ErrorReply(500, str(exc), "internal_error")


def refused_load(exc: KVRouterError) -> bool:
    """A request the router could not serve for want of a replica (admission shed it, or
    none could take it: before routing, or a disaggregated request's decode leg): offered
    load, which a recorded trace keeps. A request the client got wrong (a 400, an unknown
    model) is none."""
    return isinstance(exc, (Overloaded, NoReplicaAvailable))
