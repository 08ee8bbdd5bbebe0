"""The HTTP wire of forwarding (router/service/proxy.py and the routes that pass a request
on): the :class:`Sink` a front end writes an answer through, the upstream request head the
router sends (hop-by-hop headers dropped, ``X-Request-Id`` and the data-parallel rank set),
the response headers it relays, and the errors it writes itself (OpenAI's shape, the
Messages API's with ``anthropic``), whole or as a stream's last event."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from router.service.errors import error_body

Headers = list[tuple[bytes, bytes]]

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",  # (HTTP/1.0 proxies' Connection, RFC 9110 7.6.1)
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"expect",
    }
)


# accept-encoding: the router reads what replicas answer (usage, a stream's closing event,
# error bodies), so it asks for identity whatever the client accepts (``identity`` said
# outright: a request without the field accepts any coding, RFC 9110 12.5.3)
_NOT_FORWARDED = HOP_BY_HOP | {b"x-request-id", b"x-data-parallel-rank", b"accept-encoding"}


def _hop_by_hop(headers: Iterable[tuple[bytes, bytes]], base: frozenset[bytes]) -> frozenset[bytes]:
    """``base`` and the headers that a ``Connection`` header of ``headers`` names: those are
    for this hop only too (RFC 9110, 7.6.1), and a proxy does not pass them on."""
    named: set[bytes] | None = None
    for k, v in headers:
        if len(k) == 10 and k.lower() == b"connection":
            for token in v.split(b","):
                token = token.strip().lower()
                if token and token not in base:
                    named = named or set()
                    named.add(token)
    return base if named is None else base | named


_JSON = [(b"Content-Type", b"application/json")]


class Sink(Protocol):
    """Where the answer to the client goes. ``write`` raises ConnectionResetError when the
    client has gone away."""

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        """A whole answer (Content-Length framing)."""

    async def start(
        self, status: int, headers: Headers, data: bytes = b"", end: bool = False
    ) -> None:
        """Begin a streamed answer, with its first ``data`` when that is already at hand (and
        its end too when ``end``): what is available goes out in one write."""

    async def write(self, data: bytes) -> None: ...

    async def end(self, data: bytes = b"") -> None:
        """End a streamed answer, after a last piece of ``data``."""


async def send_error(
    sink: Sink,
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: Headers | None = None,
    anthropic: bool = False,
) -> None:
    """Answer an error the router makes (``anthropic``: in the Messages API's shape)."""
    body = error_body(status, message, param=param, code=code, anthropic=anthropic)
    await sink.respond(status, [*_JSON, *(headers or [])], body)


def stream_error_event(status: int, message: str, code: str, anthropic: bool) -> bytes:
    """The SSE event that tells a client its stream broke off: OpenAI's ``data:`` error, or
    the Messages API's ``event: error``."""
    if anthropic:
        return b"event: error\ndata: " + error_body(status, message, anthropic=True) + b"\n\n"
    return b"data: " + error_body(status, message, code=code) + b"\n\n"


def request_head(
    path: bytes,
    host: bytes,
    client_headers: Iterable[tuple[bytes, bytes]],
    rid: bytes,
    dp_rank: int | None,
    length: int,
    method: bytes = b"POST",
) -> bytes:
    """The upstream request head (``method``, POST by default): the client's headers minus
    hop-by-hop ones (and those its ``Connection`` header names), plus
    ``X-Request-Id``, ``X-data-parallel-rank``, ``Accept-Encoding: identity`` and
    ``Content-Length``."""
    parts = [method, b" ", path, b" HTTP/1.1\r\nHost: ", host, b"\r\n"]
    client_headers = list(client_headers)
    dropped = _hop_by_hop(client_headers, _NOT_FORWARDED)
    for k, v in client_headers:
        if k.lower() not in dropped:
            parts += (k, b": ", v, b"\r\n")
    parts += (b"X-Request-Id: ", rid, b"\r\n")
    if dp_rank is not None:
        parts += (b"X-data-parallel-rank: ", str(dp_rank).encode(), b"\r\n")
    parts += (b"Accept-Encoding: identity\r\nContent-Length: ", str(length).encode(), b"\r\n\r\n")
    return b"".join(parts)


def other_coding(value: bytes) -> bytes:
    """The first transfer coding of a ``Transfer-Encoding`` field ``value`` that is not
    ``chunked`` (the one llhttp undoes; any other would be taken for the payload), b''
    when none."""
    for coding in value.split(b","):
        coding = coding.strip().lower()
        if coding and coding != b"chunked":
            return coding
    return b""


def is_event_stream(content_type: bytes) -> bool:
    """Whether a ``Content-Type`` value names an SSE stream: media types are
    case-insensitive (RFC 9110 8.3.1), parameters (``; charset=utf-8``) may follow."""
    return content_type.lstrip()[:17].lower() == b"text/event-stream"


def response_headers(upstream: Headers) -> tuple[Headers, bool, bool]:
    """(headers to pass on, is it an SSE stream, has an X-Request-Id)."""
    out: Headers = []
    sse = has_rid = False
    dropped = _hop_by_hop(upstream, HOP_BY_HOP)
    for k, v in upstream:
        low = k.lower()
        if low in dropped:
            continue
        if low == b"content-type" and is_event_stream(v):
            sse = True
        elif low == b"x-request-id":
            has_rid = True
        out.append((k, v))
    return out, sse, has_rid
