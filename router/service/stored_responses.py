"""``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: sent to the replica
holding the stored response (router/service/response_ids.py), whose answer is relayed as it
sent it. An id the router does not know (never seen by this process, or forgotten) is a 404
in OpenAI's shape, vLLM's words; a holder that cannot be reached, a 503. The answer is read
whole before it is relayed (a retrieve with ``stream=true``, of a background response
still running, arrives in one piece at its end)."""

from __future__ import annotations

import asyncio
from urllib.parse import unquote

from router.service.http_types import HttpRequest
from router.service.proxy import Forwarder
from router.service.replica_url import ReplicaUrl
from router.service.state import RouterState
from router.service.upstream_errors import UpstreamError
from router.service.wire import Sink, request_head, response_headers, send_error

PREFIX = b"/v1/responses/"
CANCEL = b"/cancel"


def response_id(req: HttpRequest) -> str | None:
    """The id a ``GET /v1/responses/{id}`` or ``POST /v1/responses/{id}/cancel`` names; None
    for any other request."""
    path = req.path
    if not path.startswith(PREFIX):
        return None
    rest = path[len(PREFIX) :]
    if req.method == b"POST" and rest.endswith(CANCEL):
        rest = rest[: -len(CANCEL)]
    elif req.method != b"GET":
        return None
    if not rest or b"/" in rest:
        return None
    return unquote(rest.decode("latin-1"))


async def serve(
    state: RouterState, forwarder: Forwarder, sink: Sink, req: HttpRequest, rid: str
) -> None:
    """Answer a stored-response request (module docstring); ``rid``: the request id."""
    found = response_id(req)
    assert found is not None
    holder = state.response_ids.get(found)
    keys = state.registry.find(holder.replica) if holder is not None else []
    bases = [ep.base_url for k in keys if (ep := state.registry.endpoint(k)) is not None]
    if not bases:
        await send_error(sink, 404, f"Response with id '{found}' not found.", param="response_id")
        return
    base = bases[0]
    head = request_head(
        req.target,
        ReplicaUrl.parse(base).netloc.encode(),
        req.headers,
        rid.encode("latin-1"),
        None,
        len(req.body),
        method=req.method,
    )
    s = state.settings.server
    upstream = None
    try:
        async with asyncio.timeout(s.first_byte_timeout_s):
            upstream = await forwarder.client.pool(base).send(head, req.body)
            payload = await upstream.read_all()
    except (UpstreamError, TimeoutError) as exc:
        if upstream is not None:
            upstream.abort()
        await send_error(
            sink,
            503,
            f"replica {holder.replica if holder else ''} holding response {found!r} did "
            f"not answer ({str(exc) or type(exc).__name__})",
            headers=[(b"Retry-After", str(s.retry_after_s).encode())],
        )
        return
    except BaseException:  # the client left: the replica's request goes too
        if upstream is not None:
            upstream.abort()
        raise
    headers, _, _ = response_headers(upstream.headers)
    upstream.release()
    await sink.respond(upstream.status, headers, payload)
