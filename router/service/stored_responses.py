"""``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: sent to the replica
holding the stored response (router/service/response_ids.py; an id this process did not
record is looked up in the other workers and pods: router/service/response_share.py), whose
answer is relayed as it sent it. An id nobody knows (never seen, or forgotten) is a 404 with
vLLM's body (``response_not_found_body``); a holder that cannot be reached, a 503. A JSON
answer is read whole, then relayed; a retrieve with ``stream=true`` (a background response
still running) is relayed event by event as the holder sends them
(router/service/pass_through.py)."""

from __future__ import annotations

from urllib.parse import unquote

from router.service.errors import response_not_found_body
from router.service.http_types import HttpRequest
from router.service.pass_through import relay_once
from router.service.proxy import Forwarder
from router.service.state import RouterState
from router.service.wire import Sink, send_error

JSON = (b"Content-Type", b"application/json")
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
    holder = await state.response_share.find(found)  # (asks elsewhere only if not known here)
    keys = state.registry.find(holder.replica) if holder is not None else []
    bases = [ep.base_url for k in keys if (ep := state.registry.endpoint(k)) is not None]
    if not bases:
        await sink.respond(404, [JSON], response_not_found_body(found))
        return
    failed = await relay_once(
        state, forwarder, sink, bases[0], req.target, req.headers, req.body, rid, req.method
    )
    if failed is not None:
        s = state.settings.server
        await send_error(
            sink,
            503,
            f"replica {holder.replica if holder else ''} holding response {found!r} did "
            f"not answer ({failed})",
            headers=[(b"Retry-After", str(s.retry_after_s).encode())],
        )
