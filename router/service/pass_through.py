"""Requests the router passes to a replica without routing them: they leave nothing in the
engine's cache worth following (vLLM's ``/tokenize`` and ``/detokenize``, the Anthropic
``/v1/messages/count_tokens``) or are a pooling model's work (``/v1/embeddings``,
``/pooling``, ``/classify``, ``/score``, ``/rerank``, ...). The body is checked as a hot
endpoint's (a JSON object naming a model the router routes, or none for the one model) and
sent, as the client sent it, to the model's healthy replica with the fewest such requests
in flight from this process, in turn among equals (one that cannot be reached or does not
answer in time: the next, at most :data:`MAX_ATTEMPTS`); the answer, whatever its status,
is relayed as the replica sent it. 503 when none answers. Pooling work is not routed on
cache (it leaves none worth following), but a replica busy with a long batch is passed by.

The Anthropic Messages API itself (``POST /v1/messages``) is a hot endpoint
(router.service.handling, kind ``messages``); on its paths the router's own errors are
Anthropic-shaped (router.service.errors ``anthropic_error_body``).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable

from router.service.answers import closers_of, closes_stream, stream_end
from router.service.errors import MESSAGES_PATH as MESSAGES_PATH  # (the routes use it here)
from router.service.proxy import Forwarder
from router.service.render import render_targets
from router.service.replica_url import ReplicaUrl
from router.service.state import RouterState
from router.service.stream_usage import UsageFilter
from router.service.upstream import Exchange
from router.service.upstream_errors import UpstreamBroken, UpstreamError
from router.service.wire import (
    Headers,
    Sink,
    request_head,
    response_headers,
    send_error,
    stream_error_event,
)

COUNT_TOKENS_PATH = b"/v1/messages/count_tokens"
RESPONSES_PATH = b"/v1/responses"
# path -> whether its errors are Anthropic-shaped
PATHS: dict[bytes, bool] = {
    COUNT_TOKENS_PATH: True,
    **dict.fromkeys(
        (
            b"/tokenize",
            b"/detokenize",
            b"/v1/embeddings",
            b"/v2/embed",
            b"/pooling",
            b"/classify",
            b"/score",
            b"/v1/score",
            b"/rerank",
            b"/v1/rerank",
            b"/v2/rerank",
        ),
        False,
    ),
}
MAX_ATTEMPTS = 2

_turns = itertools.count()


async def relay_once(
    state: RouterState,
    forwarder: Forwarder,
    sink: Sink,
    base: str,
    target: bytes,
    client_headers: Iterable[tuple[bytes, bytes]],
    body: bytes,
    request_id: str,
    method: bytes = b"POST",
) -> str | None:
    """Send one request to the replica at ``base`` and relay its answer, whatever its
    status; the reason it could not (no answer in ``first_byte_timeout_s``, a broken
    connection) is returned instead, nothing written. A client that leaves aborts it.

    An answer is read whole, then relayed, except an event stream that is still coming
    after its first data (``GET /v1/responses/{id}?stream=true`` of a background response
    runs as long as the response): that is relayed as it comes (:func:`_relay_stream`).
    A stream the replica delimits by closing the connection is whole only with its closing
    event, as on the hot endpoints (router/service/proxy.py)."""
    head = request_head(
        target,
        ReplicaUrl.parse(base).netloc.encode(),
        client_headers,
        request_id.encode("latin-1"),
        None,
        len(body),
        method=method,
    )
    upstream = None
    try:
        async with asyncio.timeout(state.settings.server.first_byte_timeout_s):
            upstream = await forwarder.client.pool(base).send(head, body)
            headers, sse, _ = response_headers(upstream.headers)
            if sse:  # its first data (or its end) in time; the rest as it comes
                await upstream.ready(whole=False)
                payload = upstream.body()
                if payload is not None and _cut(upstream, payload, target):
                    raise UpstreamBroken("the connection closed before the stream's end")
            else:
                payload = await upstream.read_all()
    except (UpstreamError, TimeoutError) as exc:
        if upstream is not None:
            upstream.abort()
        return f"{base}: {str(exc) or type(exc).__name__}"
    except BaseException:  # the client left: the replica's request goes too
        if upstream is not None:
            upstream.abort()
        raise
    if payload is None:
        await _relay_stream(sink, upstream, headers, target)
        return None
    upstream.release()
    await sink.respond(upstream.status, headers, payload)
    return None


def _cut(upstream: Exchange, end: bytes, target: bytes) -> bool:
    """Whether a stream to ``target`` that ended with ``end`` was cut: delimited by the
    connection's end (a clean close looks the same whether the replica finished or died)
    and without its closing event."""
    return upstream.until_close and not closes_stream(end, closers_of(target))


async def _relay_stream(sink: Sink, upstream: Exchange, headers: Headers, target: bytes) -> None:
    """Relay an event stream to ``target`` as its pieces arrive (each wait for more bounded
    by the upstream's read timeout; an event cut by a read waits for its end, as the hot
    endpoints' relay does); a replica that breaks off ends it with an error event, never
    glued to half of one."""
    started = False
    end = b""  # the stream's last bytes
    whole = UsageFilter(drop_usage=False)  # holds an event cut by a read
    try:
        while (data := await upstream.read()) is not None:
            end = stream_end(end, data)
            out = whole.feed(data)
            if started:
                await sink.write(out)
            else:
                started = True
                await sink.start(upstream.status, headers, out)
        if _cut(upstream, end, target):
            raise UpstreamBroken("the connection closed before the stream's end")
    except UpstreamError as exc:
        upstream.abort()
        why = f"the replica broke off its answer ({str(exc) or type(exc).__name__})"
        event = whole.pending() + stream_error_event(502, why, "upstream_error", anthropic=False)
        if started:
            await sink.end(event)
        else:
            await sink.start(upstream.status, headers, event, end=True)
        return
    except BaseException:  # the client left: the replica's request goes too
        upstream.abort()
        raise
    upstream.release()
    if started:
        await sink.end(whole.flush())
    else:
        await sink.start(upstream.status, headers, whole.flush(), end=True)


async def pass_through(
    state: RouterState,
    forwarder: Forwarder,
    sink: Sink,
    model: str,
    target: bytes,
    client_headers: Iterable[tuple[bytes, bytes]],
    body: bytes,
    request_id: str,
    *,
    anthropic: bool = False,
) -> None:
    """Send ``body`` (a checked request for ``model``) to ``target`` on a healthy replica of
    the model, and relay its answer (module docstring); 503 when none answers."""
    urls = render_targets(state, model)
    start = next(_turns)
    busy = state.passed_in_flight
    # the least busy first; among equals, in turn (the sort is stable)
    rotated = [urls[(start + i) % len(urls)] for i in range(len(urls))]
    order = sorted(rotated, key=lambda url: busy.get(url, 0))[:MAX_ATTEMPTS]
    s = state.settings.server
    client_headers = list(client_headers)
    last = "no replica to ask"
    for base in order:
        busy[base] = busy.get(base, 0) + 1
        try:
            failed = await relay_once(
                state, forwarder, sink, base, target, client_headers, body, request_id
            )
        finally:
            left = busy[base] - 1
            if left:
                busy[base] = left
            else:
                del busy[base]
        if failed is None:
            return
        last = failed
    await send_error(
        sink,
        503,
        f"no replica of model {model!r} answered ({last})",
        headers=[(b"Retry-After", str(s.retry_after_s).encode())],
        anthropic=anthropic,
    )
