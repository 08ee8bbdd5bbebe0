"""The router's HTTP/1.1 server: a raw asyncio protocol with the ``httptools`` (llhttp)
parser, serving every path of the public port (and, with several workers, each worker's
control socket) through one ``handler(request, sink)`` coroutine: on the public port
router.service.handling.handle, the front door.

* The server parses and frames; it decides nothing about routes or limits but sizes: a
  body over ``max_body`` is answered 413 by the handler (``HttpRequest.too_large``; the body
  is discarded as it arrives, never buffered); a request line and headers over
  :data:`MAX_HEAD_BYTES` (or of more than :data:`MAX_HEADERS` fields) 431 and an unparsable
  request 400, and the connection is closed. Framing a proxy in front could read otherwise
  is refused the same way (RFC 9112 6.1): a ``Transfer-Encoding`` in an HTTP/1.0 request
  400, a transfer coding other than ``chunked`` 501 (llhttp refuses ``Content-Length`` with
  ``Transfer-Encoding``, repeated lengths, bare LF, obs-fold and bad chunk framing: 400).
  Such a close ends the stream after the answer and reads (and drops) what the client still
  sends, until it closes or for :data:`LINGER_S`: a close with its bytes unread would be a
  reset, which destroys the answer before the client reads it.
* Connection limits (:class:`ConnLimits`, from ``server.*``): a request's line and headers
  must arrive within ``header_timeout_s`` of its first byte and its body may pause at most
  ``body_timeout_s`` (else 408 and the connection closes); a connection idle between
  requests closes after ``keep_alive_timeout_s``; one whose client takes no byte of the
  answer waiting for it for ``send_timeout_s`` (writes paused, nothing more acknowledged:
  any progress starts the wait again) is aborted, its request cancelled. At
  ``max_connections`` open connections a new one first closes the longest-idle connection;
  with none idle it is answered 503 (with ``Retry-After``) and closed, logged at most every
  10 s: the process keeps file descriptors for its replicas and its logs.
* HTTP/1.0: a streamed answer goes out unframed and the connection closes at its end (no
  chunked encoding, which 1.0 does not know); a kept connection is confirmed with
  ``Connection: keep-alive``.
* Keep-alive and pipelining: requests on one connection are answered in order; reading
  pauses while more than a few requests wait. A protocol error (400, 431) in a pipelined
  request is answered after the requests before it, then the connection closes.
  ``Expect: 100-continue`` is honoured (its ``100`` also waits for the answers before it;
  an HTTP/1.0 request's is ignored, RFC 9110 10.1.1);
  with a ``Content-Length`` over ``max_body`` the answer is 413 at once, without the body,
  and the connection closes. ``HEAD`` gets the head of the GET answer. A request asking to
  switch protocols (``Upgrade: h2c``) is answered in HTTP/1.1 as if it had not asked;
  ``CONNECT`` is 400. A chunked body's trailer fields are dropped, never taken for headers.
  An absolute-form target (``http://host/path``) is served as its path.
* A client that disconnects cancels its request's task, which aborts the upstream request
  (the replica sees the connection close). Writes wait while the client's socket buffer is
  full (backpressure reaches the replica through the upstream client's pause).
* An exception the handler lets out is logged (with its traceback; a replica that broke off
  a stream as a warning) and answered 500 when no answer had started, else the connection is
  aborted, so a client never takes a half answer for a whole one.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import http
import logging
import math
import resource
import socket
import sys
import termios
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httptools

from router.service.errors import error_body, messages_path
from router.service.http_types import HttpRequest
from router.service.upstream_errors import UpstreamError
from router.service.wire import Sink

_log = logging.getLogger(__name__)
_STATUS_LINES: dict[int, bytes] = {}
_PIPELINE_MAX = 8
# what the parser keeps of one request's line and headers, whatever server.max_header_kb says
# (the front door's limit, answered with an OpenAI-style 431), and what is read of a head or
# of a chunked body's trailer section (one that never ends its line included): past it the
# connection closes
MAX_HEAD_BYTES = 1 << 20
# header fields per request: each costs two bytes objects and a tuple (~20x the wire size of
# a tiny one), so MAX_HEAD_BYTES of them would hold ~20 MB per connection
MAX_HEADERS = 1000
_LAST_CHUNK = b"0\r\n\r\n"
# answers that never have a body, so neither framing header (RFC 9110 6.4.1, 8.6: a 204
# must not carry Content-Length; a 304's would give another answer's size)
_BODILESS = frozenset({204, 304})
_PIECE = 4096  # body pieces below this size are gathered (see _Connection.on_body)
# how long a connection closed by a protocol error's answer goes on reading (and dropping)
# what its client still sends, so that its close is no reset that destroys the answer
LINGER_S = 5.0
BACKLOG = 2048  # connections the kernel queues on a listening socket before one is accepted


@dataclass(slots=True, frozen=True)
class ConnLimits:
    """Connection-level limits (see the module docstring); 0 turns one off."""

    header_timeout_s: float = 0.0
    body_timeout_s: float = 0.0
    keep_alive_timeout_s: float = 0.0
    max_connections: int = 0
    send_timeout_s: float = 0.0

    @classmethod
    def from_server(cls, s: Any) -> ConnLimits:
        """``server.*`` (router.service.settings.ServerSettings); ``max_connections`` 0 there
        means 80% of the process's file-descriptor limit."""
        cap = s.max_connections
        if cap <= 0:
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            cap = max(int(soft * 0.8), 64) if soft != resource.RLIM_INFINITY else 0
        return cls(
            s.header_timeout_s, s.body_timeout_s, s.keep_alive_timeout_s, cap, s.send_timeout_s
        )


def _chunk(data: bytes) -> bytes:
    """``data`` framed as one HTTP/1.1 chunk."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = http.HTTPStatus(status).phrase
        except ValueError:
            phrase = "Unknown"
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {phrase}\r\n".encode()
    return line


def _origin_form(target: bytes) -> bytes:
    """An absolute-form request target as its origin-form (``http://host/p?q`` -> ``/p?q``,
    RFC 9112 3.2.2: a server must accept it); any other (``*``, ``host:port``) as it is."""
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return target
    slash, query = rest.find(b"/"), rest.find(b"?")
    if query >= 0 and (slash < 0 or query < slash):
        return b"/" + rest[query:]
    return rest[slash:] if slash >= 0 else b"/"


class _Aborted(Exception):
    """The handler failed after its answer began (logged already): abort the connection."""


class _Sink:
    """:class:`~router.service.wire.Sink` writing HTTP/1.1 to the client connection."""

    __slots__ = ("conn", "head_only", "http10", "keep_alive", "started")

    def __init__(
        self, conn: _Connection, keep_alive: bool, head_only: bool = False, http10: bool = False
    ) -> None:
        # (the wire.Sink protocol's methods, over the connection)
        self.conn = conn
        self.keep_alive = keep_alive
        self.head_only = head_only
        self.http10 = http10  # streams go out unframed, then the connection closes
        self.started = False  # a status line went out

    def _head(self, status: int, headers: list[tuple[bytes, bytes]], framing: bytes) -> bytes:
        parts = [_status_line(status)]
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


class _Connection(asyncio.Protocol):
    """One client connection (see the module docstring)."""

    def __init__(self, server: FastServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.paused = False
        # while paused: when the unacknowledged answer bytes last shrank, and how many then
        self.stalled_at = 0.0
        self.unsent = 0
        self._drain: asyncio.Future[None] | None = None
        self.queue: deque[tuple[HttpRequest, bool]] = deque()  # (request, HTTP/1.0)
        self.peer = ""
        self.fd = -1  # the socket's descriptor (TCP only), for what its kernel queue holds
        self.task: asyncio.Task[None] | None = None
        self.reading_paused = False
        self.deadline = 0.0  # loop time at which the connection is closed; 0: none
        self.in_message = False  # a request is being received
        self.over_cap = False  # accepted over max_connections: answered 503
        # a protocol error's answer (status, message, code, extra headers) that waits for
        # the answers of the requests before it; nothing more is read meanwhile
        self.failed: tuple[int, str, str, bytes] | None = None
        self.want_continue = False  # "100 Continue" is owed once the answers before it went
        self._new_message()

    def _new_message(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.header_bytes = 0
        # bytes read since the request began or since its last body bytes, and whether body
        # bytes came in the piece being read (see data_received)
        self.head_read = 0
        self.got_body = False
        self.head_done = False  # the head is parsed: header fields now are trailer fields
        # the body's pieces; small ones after the first are gathered in a bytearray (one
        # object per tiny chunk of a chunked body would cost ~27x the body's size)
        self.body: list[bytes | bytearray] = []
        self.body_size = 0
        self.too_large = False

    # ---------------------------------------------------------------- asyncio protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer: Any = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.peer = str(peer[0])
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            self.fd = sock.fileno()
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.admit(self)

    def data_received(self, data: bytes) -> None:
        if self.closed or self.failed is not None:
            return  # (closed: lingering after a protocol error's answer, see _fatal)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._no_upgrade(data[exc.args[0] :])
        except httptools.HttpParserError as exc:
            self._fatal(400, f"malformed HTTP request: {exc}")
        else:
            if self.in_message:
                # httptools gathers a header (or trailer) line's name and value until the
                # line ends (on_url and on_header count only what ended): the bytes read
                # since the request began, or since its last body bytes, bound what it
                # holds of an unended line. (Counted by whole pieces read: from the start of
                # the piece the request began in, a request before it there included.)
                if self.got_body:
                    self.got_body = False
                    self.head_read = 0
                else:
                    self.head_read += len(data)
                    if self.head_read > MAX_HEAD_BYTES:
                        what = "chunk framing or trailer" if self.head_done else "head"
                        self._fatal(431, f"request {what} over {MAX_HEAD_BYTES} bytes")

    def _no_upgrade(self, rest: bytes) -> None:
        """The request just parsed asked for another protocol (``Upgrade``, as curl's
        ``--http2`` asks ``h2c``): llhttp stopped there, before its body. The router speaks
        HTTP/1.1 only and answers as if not asked (RFC 9110, 7.8): the request is parsed
        again without its ``Upgrade`` field, with what followed it (``rest``), on a fresh
        parser. ``CONNECT`` (a tunnel) is answered 400."""
        queue = self.queue
        if not queue or queue[-1][0].headers is not self.headers:
            return  # not queued: answered already (over the connection cap)
        req, http10 = queue.pop()
        self.parser = httptools.HttpRequestParser(self)
        if req.method == b"CONNECT":
            self._fatal(400, "CONNECT is not supported")
            return
        head = [req.method, b" ", req.target, b" HTTP/1.0\r\n" if http10 else b" HTTP/1.1\r\n"]
        for k, v in req.headers:
            if k.lower() != b"upgrade":
                head += (k, b": ", v, b"\r\n")
        head.append(b"\r\n")
        self.data_received(b"".join(head) + rest)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self.server.idle.pop(self, None)
        self.queue.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self._wake_drain(ConnectionResetError("client went away"))

    def pause_writing(self) -> None:
        self.paused = True
        self.stalled_at = self.loop.time()
        self.unsent = self._unsent()

    def _unsent(self) -> int:
        """Answer bytes the client has not acknowledged: the transport's buffer and the
        kernel's send queue (which takes megabytes and is refilled in large steps, so the
        transport's buffer alone would show a slow reader no progress for seconds)."""
        queued = 0
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                raw = fcntl.ioctl(self.fd, termios.TIOCOUTQ, b"\0\0\0\0")
                queued = int.from_bytes(raw, sys.byteorder, signed=True)
        return self.transport.get_write_buffer_size() + queued

    def stalled(self, now: float, timeout: float) -> bool:
        """Whether the client has taken no byte of what waits for it for ``timeout`` s
        (any progress, however slow, starts the wait again)."""
        if not self.paused or self.closed:
            return False
        unsent = self._unsent()
        if unsent < self.unsent:
            self.unsent, self.stalled_at = unsent, now
            return False
        return now - self.stalled_at > timeout

    def resume_writing(self) -> None:
        self.paused = False
        self._wake_drain(None)

    async def drain(self) -> None:
        if not self.paused:
            return
        if self.closed:
            raise ConnectionResetError("client went away")
        self._drain = self.loop.create_future()
        await self._drain

    def _wake_drain(self, exc: Exception | None) -> None:
        w = self._drain
        self._drain = None
        if w is not None and not w.done():
            if exc is None:
                w.set_result(None)
            else:
                w.set_exception(exc)

    def _fatal(self, status: int, message: str, extra: bytes = b"", code: str = "") -> None:
        """Answer ``status`` and close, once the requests before this one are answered
        (pipelining: answers go out in order); the parser takes nothing more."""
        if self.closed or self.failed is not None:
            return
        code = code or f"http_{status}"
        if self.task is not None or self.queue:
            self.failed = (status, message, code, extra)
            if not self.reading_paused:
                self.reading_paused = True
                self.transport.pause_reading()
            return
        # (the Messages API's shape on its paths, once the request line is known whole)
        anthropic = self.head_done and messages_path(_origin_form(self.url).split(b"?")[0])
        body = error_body(status, message, code=code, anthropic=anthropic)
        transport = self.transport
        transport.write(
            _status_line(status)
            + b"Content-Type: application/json\r\nConnection: close\r\n"
            + extra
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body
        )
        self.closed = True
        # a close with unread bytes (the rest of a refused body or head, pipelined requests)
        # is a TCP reset, which destroys the answer at the client before it is read: the
        # answer is followed by the end of the stream, then what the client still sends is
        # read and dropped until it closes, for at most LINGER_S (RFC 9112 9.6)
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        if self.reading_paused:
            self.reading_paused = False
            transport.resume_reading()
        self.loop.call_later(LINGER_S, transport.close)

    # ---------------------------------------------------------------- httptools callbacks

    def on_message_begin(self) -> None:
        self._new_message()
        self.in_message = True
        self.server.idle.pop(self, None)
        limits = self.server.limits
        if limits.header_timeout_s > 0:
            self.deadline = self.loop.time() + limits.header_timeout_s

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > MAX_HEAD_BYTES:
            self._fatal(431, f"request head over {MAX_HEAD_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        # (after the head: a chunked body's trailer fields, not headers, RFC 9110 6.5.1;
        # the body is passed on whole, so they are dropped)
        if self.closed or self.failed is not None or self.head_done:
            return
        headers = self.headers
        headers.append((name, value))
        self.header_bytes += len(name) + len(value) + 4
        if self.header_bytes + len(self.url) > MAX_HEAD_BYTES:
            self._fatal(431, f"request head over {MAX_HEAD_BYTES} bytes")
        elif len(headers) > MAX_HEADERS:
            self._fatal(431, f"request head of more than {MAX_HEADERS} header fields")

    def on_headers_complete(self) -> None:
        self.head_done = True
        if self.closed or self.failed is not None:
            return
        body_timeout = self.server.limits.body_timeout_s
        self.deadline = self.loop.time() + body_timeout if body_timeout > 0 else 0.0
        limit = self.server.max_body
        expect = False
        for k, v in self.headers:
            if len(k) == 14 and k.lower() == b"content-length":
                try:  # (not contextlib.suppress: this runs per request, try costs nothing)
                    if int(v) > limit:
                        self.too_large = True
                except ValueError:
                    pass
            elif len(k) == 6 and k.lower() == b"expect" and v.lower() == b"100-continue":
                expect = True
            elif len(k) == 17 and k.lower() == b"transfer-encoding" and self._bad_coding(v):
                return
        if not expect or self.parser.get_http_version() == "1.0":  # (1.0 has no 100)
            return
        if self.too_large:  # the client waits for "100 Continue": answer without the body
            self._fatal(
                413,
                f"request body exceeds the {limit / 2**20:g} MB limit (server.max_body_mb)",
                code="request_too_large",
            )
        elif self.task is not None or self.queue:  # after the answers before this request
            self.want_continue = True
        else:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _bad_coding(self, value: bytes) -> bool:
        """Whether a ``Transfer-Encoding`` field ``value`` makes the request one the router
        must refuse (answered, the connection closing): in an HTTP/1.0 request (1.0 has no
        transfer coding: a proxy in front may frame it otherwise, RFC 9112 6.1), 400; a
        coding but ``chunked`` (the one llhttp undoes), 501. llhttp refuses the others
        (``chunked`` not last, with ``Content-Length``)."""
        if self.parser.get_http_version() == "1.0":
            self._fatal(400, "Transfer-Encoding in an HTTP/1.0 request")
            return True
        for coding in value.split(b","):
            coding = coding.strip().lower()
            if coding and coding != b"chunked":
                self._fatal(
                    501,
                    f"transfer coding {coding.decode('latin-1')!r} is not supported (only chunked)",
                )
                return True
        return False

    def on_body(self, body: bytes) -> None:
        self.got_body = True
        if self.deadline:
            self.deadline = self.loop.time() + self.server.limits.body_timeout_s
        if self.too_large:
            return
        self.body_size += len(body)
        if self.body_size > self.server.max_body:
            self.too_large = True
            self.body = []
            return
        parts = self.body
        if not parts or len(body) >= _PIECE:
            parts.append(body)
        elif type(parts[-1]) is bytearray:
            parts[-1] += body
        else:
            parts.append(bytearray(body))

    def on_message_complete(self) -> None:
        self.in_message = False
        self.deadline = 0.0
        self.want_continue = False
        if self.closed or self.failed is not None:
            return
        if self.over_cap:
            self._fatal(
                503,
                "the router has too many open connections (server.max_connections); retry",
                b"Retry-After: 1\r\n",
            )
            return
        parts = self.body
        body = parts[0] if len(parts) == 1 and type(parts[0]) is bytes else b"".join(parts)
        url = self.url
        if not url.startswith(b"/"):
            url = _origin_form(url)
        self.queue.append(
            (
                HttpRequest(
                    self.parser.get_method(),
                    url,
                    url.split(b"?", 1)[0],
                    self.headers,
                    body,
                    self.peer,
                    self.header_bytes,
                    self.too_large,
                    self.parser.should_keep_alive(),
                ),
                self.parser.get_http_version() == "1.0",
            )
        )
        if len(self.queue) > _PIPELINE_MAX and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()
        if self.task is None:
            self.task = self.loop.create_task(self._run())

    # ---------------------------------------------------------------- serving

    async def _run(self) -> None:
        try:
            while self.queue and not self.closed:
                req, http10 = self.queue.popleft()
                if (
                    self.reading_paused
                    and self.failed is None
                    and len(self.queue) <= _PIPELINE_MAX // 2
                ):
                    self.reading_paused = False
                    self.transport.resume_reading()
                keep_alive = await self.server.serve(self, req, http10)
                if not keep_alive and not self.closed:
                    self.transport.close()
                    self.closed = True
                elif self.want_continue and not self.queue and not self.closed:
                    self.want_continue = False
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # never leave a half answer
            if not isinstance(exc, _Aborted):
                _log.exception("unexpected error in the HTTP server")
            if not self.closed:
                self.transport.abort()
                self.closed = True
        finally:
            self.task = None
            failed, self.failed = self.failed, None
            if failed is not None:
                status, message, code, extra = failed
                self._fatal(status, message, extra, code)
            elif not self.closed and not self.in_message:
                if self.server.draining:
                    self.transport.close()
                    self.closed = True
                else:
                    self.server.rest(self)


Handler = Callable[[HttpRequest, Sink], Awaitable[None]]


class FastServer:
    """One listening socket served by ``handler`` (see the module docstring)."""

    def __init__(self, handler: Handler, max_body: int, limits: ConnLimits | None = None) -> None:
        self.handler = handler
        self.max_body = max_body
        self.limits = limits or ConnLimits()
        self.connections: set[_Connection] = set()
        # connections between requests, longest idle first (dict order)
        self.idle: dict[_Connection, None] = {}
        self.loop = asyncio.get_running_loop()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.refused = 0  # the cap's actions since its last log line
        self._logged_at = -1e9
        # closing (:meth:`close`): no connection is kept for another request
        self.draining = False
        self.drain_until = math.inf  # loop time the drain ends (:meth:`close`, :meth:`cut`)

    def admit(self, conn: _Connection) -> None:
        """A new connection: under the cap, or over it after closing the longest-idle one,
        it is served; else it is answered 503 (see the module docstring)."""
        cap = self.limits.max_connections
        if cap and len(self.connections) >= cap:
            if self.idle:
                oldest = next(iter(self.idle))
                del self.idle[oldest]
                oldest.transport.close()
                oldest.closed = True
                self.connections.discard(oldest)
                self._report("closing the longest-idle connection for each new one")
            elif len(self.connections) >= cap + max(cap // 10, 16):
                # far over: keep the descriptors the process needs (replicas, logs)
                conn.transport.abort()
                conn.closed = True
                return
            else:
                conn.over_cap = True
                self._report("none idle: answering 503 to new ones")
                now = self.loop.time()
                timeout = self.limits.header_timeout_s or 5.0
                conn.deadline = now + min(timeout, 5.0)
        self.connections.add(conn)
        if not conn.over_cap:
            self.rest(conn)

    def _report(self, what: str) -> None:
        """Log the cap's action, at most every 10 s, with how often it acted since."""
        self.refused += 1
        now = self.loop.time()
        if now - self._logged_at >= 10.0:
            _log.warning(
                "%d open connections reach server.max_connections (%d): %s (%d since the "
                "last report)",
                len(self.connections),
                self.limits.max_connections,
                what,
                self.refused,
            )
            self._logged_at = now
            self.refused = 0

    def rest(self, conn: _Connection) -> None:
        """``conn`` waits for its next request (idle: keep-alive timeout, evictable)."""
        self.idle.pop(conn, None)
        self.idle[conn] = None
        t = self.limits.keep_alive_timeout_s
        conn.deadline = self.loop.time() + t if t > 0 else 0.0

    async def _sweep(self, every: float) -> None:
        """Close the connections past their deadline (timeouts of the module docstring);
        one whose request is being answered waits for the answer. Idle connections expire
        in the order they went idle: every 0.25 s the expired ones are taken from the front
        of :attr:`idle`; the others are scanned every ``every`` seconds."""
        tick = min(every, 0.25)
        scanned = self.loop.time()
        while True:
            await asyncio.sleep(tick)
            now = self.loop.time()
            idle = self.idle
            while idle:
                oldest = next(iter(idle))
                if not oldest.deadline or oldest.deadline >= now:
                    break
                del idle[oldest]
                if not oldest.closed:
                    oldest.transport.close()
                    oldest.closed = True
                self.connections.discard(oldest)
            if now - scanned < every:
                continue
            scanned = now
            send = self.limits.send_timeout_s
            if send > 0:
                for conn in [c for c in self.connections if c.stalled(now, send)]:
                    conn.transport.abort()  # (connection_lost cancels its request)
                    conn.closed = True
                    self.idle.pop(conn, None)
                    self.connections.discard(conn)
            for conn in [c for c in self.connections if c.deadline and c.deadline < now]:
                if conn.task is not None or conn.closed:
                    continue
                if conn.in_message:
                    conn._fatal(408, "the request did not arrive in time")
                else:
                    conn.transport.close()
                    conn.closed = True
                self.idle.pop(conn, None)
                self.connections.discard(conn)

    def _start_sweeper(self) -> None:
        lim = self.limits
        timeouts = [
            t
            for t in (
                lim.header_timeout_s,
                lim.body_timeout_s,
                lim.keep_alive_timeout_s,
                lim.send_timeout_s,
            )
            if t > 0
        ]
        if timeouts or lim.max_connections:
            every = min(max(min(timeouts, default=5.0) / 4, 0.05), 1.0)
            self._sweeper = self.loop.create_task(self._sweep(every))

    async def start(
        self,
        host: str,
        port: int,
        *,
        reuse_port: bool = False,
        sock: socket.socket | None = None,
    ) -> int:
        """Listen on ``host:port`` (0: any free port), or accept from ``sock``, a socket
        that listens already (bound by another process: ``host`` and ``port`` unused);
        returns the port."""
        if sock is not None:  # (the backlog: libuv listens again, with this one)
            self._server = await self.loop.create_server(
                lambda: _Connection(self), sock=sock, backlog=BACKLOG
            )
        else:
            self._server = await self.loop.create_server(
                lambda: _Connection(self),
                host,
                port,
                reuse_port=reuse_port or None,
                backlog=BACKLOG,
            )
        # read untyped: uvloop's is a list where typeshed says tuple, which compiled code
        # (make compile) would check
        sockets: Any = getattr(self._server, "sockets")  # noqa: B009
        self._start_sweeper()
        return int(sockets[0].getsockname()[1])

    async def start_unix(self, path: str) -> None:
        """Listen on the unix socket ``path``."""
        self._server = await self.loop.create_unix_server(lambda: _Connection(self), path)
        self._start_sweeper()

    async def close(self, timeout: float = 0.0) -> None:
        """Stop accepting; close the connections kept idle between requests (a load balancer
        sends new requests on those too); wait up to ``timeout`` s for the requests in flight
        (and those being received), each connection closing once its answer is out (answers
        begun from now on say ``Connection: close``); close the rest."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self.idle):
            if not conn.closed:
                conn.transport.close()
                conn.closed = True
            self.connections.discard(conn)
        self.idle.clear()
        self.drain_until = min(self.drain_until, self.loop.time() + timeout)
        while self.loop.time() < self.drain_until and any(
            c.task or c.in_message for c in self.connections
        ):
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.transport.close()  # (lingering ones too: see _Connection._fatal)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    def cut(self) -> None:
        """End :meth:`close`'s wait now: what is still in flight is closed as at its end."""
        self.drain_until = self.loop.time()

    async def serve(self, conn: _Connection, req: HttpRequest, http10: bool = False) -> bool:
        """Answer ``req``; returns whether the connection stays open for another request."""
        keep = req.keep_alive and not self.draining
        sink = _Sink(conn, keep, head_only=req.method == b"HEAD", http10=http10)
        try:
            await self.handler(req, sink)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except UpstreamError as exc:  # (proxy.py answers those it can; this one broke a stream)
            _log.warning("%s %s: %s; connection aborted", *_what(req), exc)
            raise _Aborted() from exc
        except Exception as exc:
            _log.exception("unexpected error on %s %s", *_what(req))
            if sink.started:
                raise _Aborted() from exc
            body = error_body(
                500,
                "internal error in the router",
                code="internal_error",
                anthropic=messages_path(req.path),
            )
            await sink.respond(500, [(b"Content-Type", b"application/json")], body)
        return sink.keep_alive and not self.draining  # (an answer begun before the drain)


def _what(req: HttpRequest) -> tuple[str, str]:
    return req.method.decode("latin-1"), req.path.decode("latin-1")
