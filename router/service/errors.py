"""OpenAI-style error responses, and the one place where core errors become HTTP statuses.

Body: ``{"error": {"message", "type", "param", "code"}}``. BadRequest -> 400,
UnknownModel -> 404, body too large -> 413, NoReplicaAvailable -> 503 with ``Retry-After``
(429 when every replica is over its busy threshold), anything unexpected -> 500.
"""

from __future__ import annotations

import json

from aiohttp import web

from router.core.errors import BadRequest, KVRouterError, NoReplicaAvailable, UnknownModel

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "error"),
            "param": param,
            "code": code,
        }
    }
    return web.Response(
        status=status,
        body=json.dumps(body).encode(),
        content_type="application/json",
        headers=headers,
    )


def from_exception(exc: KVRouterError, retry_after_s: int = 1) -> web.Response:
    """The HTTP answer for a core error raised while handling a request."""
    if isinstance(exc, UnknownModel):
        return error_response(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, NoReplicaAvailable):
        status = 429 if exc.busy else 503
        return error_response(
            status,
            str(exc),
            code="replicas_busy" if exc.busy else "no_replica_available",
            headers={"Retry-After": str(retry_after_s)},
        )
    if isinstance(exc, BadRequest):
        return error_response(400, str(exc), code="invalid_request")
    return error_response(500, str(exc), code="internal_error")
