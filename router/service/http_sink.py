"""Writing the router's HTTP/1.1 answers to a client connection
(router.service.http_connection ``Connection``): :class:`ConnectionSink`, the
:class:`~router.service.wire.Sink` the handler writes through, framing each answer (chunked,
or unframed for HTTP/1.0; no body for ``HEAD``, 204 and 304) and waiting while the client
takes the bytes written."""

from __future__ import annotations

import http
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.service.http_connection import Connection

_STATUS_LINES: dict[int, bytes] = {}
_LAST_CHUNK = b"0\r\n\r\n"
# answers that never have a body, so neither framing header (RFC 9110 6.4.1, 8.6: a 204
# must not carry Content-Length; a 304's would give another answer's size)
_BODILESS = frozenset({204, 304})


def _chunk(data: bytes) -> bytes:
    """``data`` framed as one HTTP/1.1 chunk."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = http.HTTPStatus(status).phrase
        except ValueError:
            phrase = "Unknown"
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {phrase}\r\n".encode()
    return line


class ConnectionSink:
    """:class:`~router.service.wire.Sink` writing HTTP/1.1 to the client connection."""

    __slots__ = ("conn", "head_only", "http10", "keep_alive", "started")

    def __init__(
        self, conn: Connection, keep_alive: bool, head_only: bool = False, http10: bool = False
    ) -> None:
        # (the wire.Sink protocol's methods, over the connection)
        self.conn = conn
        self.keep_alive = keep_alive
        self.head_only = head_only
        self.http10 = http10  # streams go out unframed, then the connection closes
        self.started = False  # a status line went out

    def _head(self, status: int, headers: list[tuple[bytes, bytes]], framing: bytes) -> bytes:
        parts = [status_line(status)]
        for k, v in headers:
            parts += (k, b": ", v, b"\r\n")
        parts.append(framing)
        if not self.keep_alive:
            parts.append(b"Connection: close\r\n")
        elif self.http10:  # a 1.0 client keeps the connection only when told
            parts.append(b"Connection: keep-alive\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        conn = self.conn
        if conn.closed:
            raise ConnectionResetError("client went away")
        bodiless = status in _BODILESS
        framing = b"" if bodiless else b"Content-Length: %d\r\n" % len(body)
        head = self._head(status, headers, framing)
        self.started = True
        if self.head_only or bodiless or not body:
            conn.transport.write(head)
        elif len(body) < 65536:
            conn.transport.write(head + body)
        else:
            conn.transport.write(head)
            conn.transport.write(body)
        if conn.paused:
            await conn.drain()

    async def start(
        self, status: int, headers: list[tuple[bytes, bytes]], data: bytes = b"", end: bool = False
    ) -> None:
        conn = self.conn
        if conn.closed:
            raise ConnectionResetError("client went away")
        self.started = True
        if status in _BODILESS:  # the head alone: no framing, nothing written after it
            self.head_only = True
            conn.transport.write(self._head(status, headers, b""))
            if conn.paused:
                await conn.drain()
            return
        if self.http10:
            self.keep_alive = False
            out = self._head(status, headers, b"")
            if not self.head_only:
                out += data
            conn.transport.write(out)
            if conn.paused:
                await conn.drain()
            return
        out = self._head(status, headers, b"Transfer-Encoding: chunked\r\n")
        if not self.head_only:
            if data:
                out += _chunk(data)
            if end:
                out += _LAST_CHUNK
        conn.transport.write(out)
        if conn.paused:
            await conn.drain()

    async def write(self, data: bytes) -> None:
        conn = self.conn
        if conn.closed:
            raise ConnectionResetError("client went away")
        if data and not self.head_only:
            conn.transport.write(data if self.http10 else _chunk(data))
        if conn.paused:
            await conn.drain()

    async def end(self, data: bytes = b"") -> None:
        conn = self.conn
        if conn.closed:
            raise ConnectionResetError("client went away")
        if self.http10:
            if data and not self.head_only:
                conn.transport.write(data)
        elif not self.head_only:
            conn.transport.write(_chunk(data) + _LAST_CHUNK if data else _LAST_CHUNK)
        if conn.paused:  # the answer is complete only once a slow client has taken it
            await conn.drain()
