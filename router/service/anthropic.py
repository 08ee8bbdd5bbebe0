"""The Anthropic Messages API through the router: what is particular to its routes.

``POST /v1/messages`` is one of the front door's hot endpoints (router.service.handling:
kind ``messages``): the same gate, checks, routing and forwarding as a chat request, its
prompt the engine's ``/v1/messages/render`` answer (router.service.render) or the body's
chat conversion (router.tokenize.anthropic), its body forwarded as sent, its answer (JSON,
or vLLM's ``event: message_start`` ... ``message_stop`` stream) relayed as the replica sent
it, its usage read by router.service.proxy ``usage_tokens``. The errors the router makes on
these paths are Anthropic-shaped (router.service.errors ``anthropic_error_body``).

``POST /v1/messages/count_tokens`` (:func:`pass_through`) needs no routing: it renders the
prompt and counts it, on any healthy replica of the model, and leaves nothing behind. It
is sent to the model's healthy replicas in turn (a replica that cannot be reached or does
not answer in time: the next, at most :data:`MAX_ATTEMPTS`), and the answer, whatever its
status, is relayed as the replica sent it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable

from router.service.proxy import Forwarder, Sink, request_head, response_headers, send_error
from router.service.render import render_targets
from router.service.replica_url import ReplicaUrl
from router.service.state import RouterState
from router.service.upstream_errors import UpstreamError

MESSAGES_PATH = b"/v1/messages"
COUNT_TOKENS_PATH = b"/v1/messages/count_tokens"
MAX_ATTEMPTS = 2

_turns = itertools.count()


async def pass_through(
    state: RouterState,
    forwarder: Forwarder,
    sink: Sink,
    model: str,
    target: bytes,
    client_headers: Iterable[tuple[bytes, bytes]],
    body: bytes,
    request_id: str,
) -> None:
    """Send ``body`` (a checked request for ``model``) to ``target`` on a healthy replica of
    the model, and relay its answer (module docstring); 503 when none answers."""
    urls = render_targets(state, model)
    start = next(_turns)
    order = [urls[(start + i) % len(urls)] for i in range(len(urls))][:MAX_ATTEMPTS]
    s = state.settings.server
    client_headers = list(client_headers)
    last = "no replica to ask"
    for base in order:
        head = request_head(
            target,
            ReplicaUrl.parse(base).netloc.encode(),
            client_headers,
            request_id.encode("latin-1"),
            None,
            len(body),
        )
        upstream = None
        try:
            async with asyncio.timeout(s.first_byte_timeout_s):
                upstream = await forwarder.client.pool(base).send(head, body)
                payload = await upstream.read_all()
        except (UpstreamError, TimeoutError) as exc:
            if upstream is not None:
                upstream.abort()
            last = f"{base}: {str(exc) or type(exc).__name__}"
            continue
        except BaseException:  # the client left: the replica's request goes too
            if upstream is not None:
                upstream.abort()
            raise
        headers, _, _ = response_headers(upstream.headers)
        upstream.release()
        await sink.respond(upstream.status, headers, payload)
        return
    await send_error(
        sink,
        503,
        f"no replica of model {model!r} answered ({last})",
        headers=[(b"Retry-After", str(s.retry_after_s).encode())],
        anthropic=True,
    )
