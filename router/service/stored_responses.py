"""``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: sent to the replica
holding the stored response (router/service/response_ids.py; an id this process did not
record is looked up in the other workers and pods: router/service/response_share.py), whose
answer is relayed as it sent it. An id nobody knows (never seen, or forgotten) is a 404 with
vLLM's body (``response_not_found_body``); a holder that cannot be reached, a 503. A JSON
answer is read whole, then relayed; a retrieve with ``stream=true`` (a background response
still running) is relayed event by event as the holder sends them
(router/service/pass_through.py).

With client keys (``server.api_keys`` / ``api_keys_file``) a stored response is the key's
that asked for it (:func:`owner_of`), as OpenAI's are their project's: vLLM keeps them by id
alone, whoever asks, so the router answers another key's request naming it (a retrieve, a
cancel, a ``previous_response_id``) as one naming an id nobody holds."""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import unquote

from router.service.errors import response_not_found_body
from router.service.gate import tenant_of
from router.service.http_types import HttpRequest
from router.service.pass_through import relay_once
from router.service.proxy import Forwarder
from router.service.response_ids import Holder
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


def owner_of(state: RouterState, headers: Iterable[tuple[bytes, bytes]]) -> str:
    """Whose stored responses a request may name (module docstring): the digest of the API
    key it presents (gate.py ``tenant_of``) when the router checks client keys; "" when it
    runs open (any key passes, so none tells clients apart)."""
    server = state.settings.server
    return tenant_of(headers) if server.api_keys is not None or server.api_keys_file else ""


def held_for(holder: Holder | None, owner: str) -> Holder | None:
    """``holder`` when its response is ``owner``'s (:func:`owner_of`), else None: another
    key's response is as unknown to the request."""
    return holder if holder is not None and holder.owner == owner else None


async def serve(
    state: RouterState, forwarder: Forwarder, sink: Sink, req: HttpRequest, rid: str
) -> None:
    """Answer a stored-response request (module docstring); ``rid``: the request id."""
    found = response_id(req)
    assert found is not None
    # (asked elsewhere only if not known here)
    holder = held_for(await state.response_share.find(found), owner_of(state, req.headers))
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
