"""One client connection of the router's HTTP/1.1 server (router.service.fast_server, which
listens, admits and times out connections and runs the handler): :class:`Connection`, the
asyncio protocol that parses its requests with ``httptools`` and answers them in order
through router.service.http_sink ``ConnectionSink``; the head checks beyond llhttp's are
router.service.http_head's.

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
* HTTP/1.0: a streamed answer goes out unframed and the connection closes at its end (no
  chunked encoding, which 1.0 does not know); a kept connection is confirmed with
  ``Connection: keep-alive``.
* Keep-alive and pipelining: requests on one connection are answered in order; reading
  pauses while more than a few requests wait. A request that ends the connection
  (``Connection: close``, HTTP/1.0 without keep-alive) is the last one served, and its
  answer is followed by a close as above, lingering (RFC 9112 9.6). A protocol error
  (400, 431) in a pipelined request is answered after the requests before it, then the
  connection closes.
  ``Expect: 100-continue`` is honoured (its ``100`` also waits for the answers before it;
  an HTTP/1.0 request's is ignored, RFC 9110 10.1.1);
  with a ``Content-Length`` over ``max_body`` the answer is 413 at once, without the body,
  and the connection closes. A request the handler will refuse whatever its body (a wrong
  API key: ``FastServer.refuses_body``, asked when the body is over 64 KiB, chunked or
  awaits a ``100``) has its body read and dropped, never kept: an unauthenticated client
  cannot make the router buffer ``max_body`` bytes; one that awaits a ``100`` gets no
  ``100`` but its answer at once, without its body (RFC 9110 10.1.1), and the connection
  closes (the client may send the body or not: what follows cannot be framed).
  ``HEAD`` gets the head of the GET answer. A request asking to
  switch protocols (``Upgrade: h2c``) is answered in HTTP/1.1 as if it had not asked;
  ``CONNECT`` is 400. A chunked body's trailer fields are dropped, never taken for headers.
  An absolute-form target (``http://host/path``) is served as its path. An HTTP/1.1
  request without a ``Host`` field, or any request with two, or one whose ``Host`` is no
  URI authority, is 400 (RFC 9112 3.2); so is a target with a fragment (``#``). A major
  version other than 1 (``HTTP/2.0``, ``HTTP/0.9``, which llhttp takes) is 505.
* A client that disconnects cancels its request's task, which aborts the upstream request
  (the replica sees the connection close). Writes wait while the client's socket buffer is
  full (backpressure reaches the replica through the upstream client's pause).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import socket
import sys
import termios
from collections import deque
from typing import TYPE_CHECKING, Any

import httptools

from router.service.errors import error_body, messages_path
from router.service.http_head import HASH, host_ok, origin_form, version_refusal
from router.service.http_sink import status_line
from router.service.http_types import HttpRequest
from router.service.wire import other_coding

if TYPE_CHECKING:
    from router.service.fast_server import FastServer

# logged under the server's name: a log line names the HTTP server, not which part of it
_log = logging.getLogger("router.service.fast_server")
_PIPELINE_MAX = 8
# what the parser keeps of one request's line and headers, whatever server.max_header_kb says
# (the front door's limit, answered with an OpenAI-style 431), and what is read of a head or
# of a chunked body's trailer section (one that never ends its line included): past it the
# connection closes
MAX_HEAD_BYTES = 1 << 20
# header fields per request: each costs two bytes objects and a tuple (~20x the wire size of
# a tiny one), so MAX_HEAD_BYTES of them would hold ~20 MB per connection
MAX_HEADERS = 1000
_PIECE = 4096  # body pieces below this size are gathered (see Connection.on_body)
# how long a connection closed by a protocol error's answer goes on reading (and dropping)
# what its client still sends, so that its close is no reset that destroys the answer
LINGER_S = 5.0


# a body this small is kept without asking FastServer.refuses_body first: a check for it
# would cost more than the bytes it saves
_KEEP_UNASKED = 64 * 1024


class Aborted(Exception):
    """The handler failed after its answer began (logged already): abort the connection."""


class _Answered(Exception):
    """Raised by a parser callback: the request is queued without its body, its answer
    ends the connection; nothing more is parsed."""


class Connection(asyncio.Protocol):
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
        # the request queued last ends the connection before its body (see
        # on_headers_complete): nothing more is parsed
        self.ended = False
        self.good_host = b""  # the last Host value found a URI authority (host_ok)
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
        self.dropping = False  # refused whatever its body (FastServer.refuses_body): not kept

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
        if self.closed or self.failed is not None or self.ended:
            return  # (closed: lingering after a protocol error's answer, see fatal)
        piece: bytes | memoryview = data
        while True:
            try:
                self.parser.feed_data(piece)
            except httptools.HttpParserUpgrade as exc:
                # (what followed the request goes on in this loop, not in a nested call: a
                # client may pipeline many such requests in one read)
                if self._no_upgrade():
                    piece = memoryview(piece)[exc.args[0] :]
                    continue
            except httptools.HttpParserError as exc:
                if not self.ended:
                    self.fatal(400, f"malformed HTTP request: {exc}")
            else:
                if self.in_message:
                    # httptools gathers a header (or trailer) line's name and value until
                    # the line ends (on_url and on_header count only what ended): the bytes
                    # read since the request began, or since its last body bytes, bound what
                    # it holds of an unended line. (Counted by whole pieces read: from the
                    # start of the piece the request began in, a request before it there
                    # included.)
                    if self.got_body:
                        self.got_body = False
                        self.head_read = 0
                    else:
                        self.head_read += len(piece)
                        if self.head_read > MAX_HEAD_BYTES:
                            what = "chunk framing or trailer" if self.head_done else "head"
                            self.fatal(431, f"request {what} over {MAX_HEAD_BYTES} bytes")
            return

    def _no_upgrade(self) -> bool:
        """The request just parsed asked for another protocol (``Upgrade``, as curl's
        ``--http2`` asks ``h2c``): llhttp stopped there, before its body. The router speaks
        HTTP/1.1 only and answers as if not asked (RFC 9110, 7.8): the request's head is
        parsed again without its ``Upgrade`` field, on a fresh parser, which then takes
        what followed it (returns whether it does). ``CONNECT`` (a tunnel) is answered 400."""
        queue = self.queue
        if not queue or queue[-1][0].headers is not self.headers:
            return False  # not queued: answered already (over the connection cap)
        req, http10 = queue.pop()
        self.parser = httptools.HttpRequestParser(self)
        if req.method == b"CONNECT":
            self.fatal(400, "CONNECT is not supported")
            return False
        head = [req.method, b" ", req.target, b" HTTP/1.0\r\n" if http10 else b" HTTP/1.1\r\n"]
        for k, v in req.headers:
            if k.lower() != b"upgrade":
                head += (k, b": ", v, b"\r\n")
        head.append(b"\r\n")
        try:
            self.parser.feed_data(b"".join(head))
        except httptools.HttpParserError as exc:
            self.fatal(400, f"malformed HTTP request: {exc}")
        return not self.closed and self.failed is None

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

    def fatal(self, status: int, message: str, extra: bytes = b"", code: str = "") -> None:
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
        anthropic = self.head_done and messages_path(origin_form(self.url).split(b"?")[0])
        body = error_body(status, message, code=code, anthropic=anthropic)
        self.transport.write(
            status_line(status)
            + b"Content-Type: application/json\r\nConnection: close\r\n"
            + extra
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body
        )
        self.close_after_answer()

    def close_after_answer(self) -> None:
        """Close the connection once the answer written last is out. A close with unread
        bytes (the rest of a refused body or head, requests pipelined after one that ends
        the connection) is a TCP reset, which destroys the answer at the client before it
        is read: the answer is followed by the end of the stream, then what the client
        still sends is read and dropped until it closes, for at most :data:`LINGER_S`
        (RFC 9112 9.6)."""
        self.closed = True
        transport = self.transport
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
            self.fatal(431, f"request head over {MAX_HEAD_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        # (after the head: a chunked body's trailer fields, not headers, RFC 9110 6.5.1;
        # the body is passed on whole, so they are dropped)
        if self.closed or self.failed is not None or self.head_done:
            return
        headers = self.headers
        headers.append((name, value))
        self.header_bytes += len(name) + len(value) + 4
        if self.header_bytes + len(self.url) > MAX_HEAD_BYTES:
            self.fatal(431, f"request head over {MAX_HEAD_BYTES} bytes")
        elif len(headers) > MAX_HEADERS:
            self.fatal(431, f"request head of more than {MAX_HEADERS} header fields")

    def on_headers_complete(self) -> None:
        self.head_done = True
        if self.closed or self.failed is not None:
            return
        body_timeout = self.server.limits.body_timeout_s
        self.deadline = self.loop.time() + body_timeout if body_timeout > 0 else 0.0
        limit = self.server.max_body
        expect = False
        length = 0  # the body's announced size (a chunked one's: unknown, counted as large)
        hosts = 0
        host = b""
        for k, v in self.headers:
            if len(k) == 4 and k.lower() == b"host":
                hosts += 1
                host = v
            elif len(k) == 14 and k.lower() == b"content-length":
                try:  # (not contextlib.suppress: this runs per request, try costs nothing)
                    length = int(v)
                    if length > limit:
                        self.too_large = True
                except ValueError:
                    pass
            elif len(k) == 6 and k.lower() == b"expect" and v.rstrip().lower() == b"100-continue":
                # (rstrip: llhttp keeps a value's trailing whitespace, RFC 9112 5.1 does not)
                expect = True
            elif len(k) == 17 and k.lower() == b"transfer-encoding":
                if self._bad_coding(v):
                    return
                length = limit
        version = self.parser.get_http_version()
        refused = version_refusal(version)
        if refused is not None:
            self.fatal(505, refused)
            return
        if hosts != 1 and (hosts or version != "1.0"):
            # RFC 9112 3.2: an HTTP/1.1 request without Host, or any with two, is a 400 (a
            # proxy in front may have read another Host than the router would)
            self.fatal(400, "an HTTP/1.1 request needs exactly one Host header")
            return
        if hosts and host != self.good_host:  # (a keep-alive client's: checked once)
            if not host_ok(host):
                self.fatal(400, "the Host header is no URI authority (RFC 9112 3.2)")
                return
            self.good_host = host
        if HASH in self.url:  # llhttp passes a fragment on; a client sends none
            self.fatal(400, "a request target has no fragment ('#', RFC 9112 3.2)")
            return
        refuses = self.server.refuses_body
        # asked only of a body worth not keeping (the handler checks every request anyway)
        if refuses is not None and (expect or length > _KEEP_UNASKED):
            url = self.url
            if not url.startswith(b"/"):
                url = origin_form(url)
            # its answer is a refusal whatever the body: read and dropped, no 100 Continue
            self.dropping = refuses(url.split(b"?", 1)[0], self.headers)
        if not expect or self.parser.get_http_version() == "1.0":
            return  # (1.0 has no 100)
        if self.dropping:
            if not length:
                return  # no body: it is answered as it is
            # its answer is known now: given at once, without the body (RFC 9110 10.1.1),
            # and the connection closes, as the client may send the body or not
            self._enqueue(b"", False)
            self.in_message = False
            self.deadline = 0.0
            self.ended = True
            raise _Answered()  # (stops the parser; what the client still sends is dropped)
        if self.too_large:  # the client waits for "100 Continue": answer without the body
            self.fatal(
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
            self.fatal(400, "Transfer-Encoding in an HTTP/1.0 request")
            return True
        coding = other_coding(value)
        if coding:
            self.fatal(
                501, f"transfer coding {coding.decode('latin-1')!r} is not supported (only chunked)"
            )
        return bool(coding)

    def on_body(self, body: bytes) -> None:
        self.got_body = True
        if self.deadline:
            self.deadline = self.loop.time() + self.server.limits.body_timeout_s
        if self.too_large or self.dropping:
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
            self.fatal(
                503,
                "the router has too many open connections (server.max_connections); retry",
                b"Retry-After: 1\r\n",
            )
            return
        parts = self.body
        body = parts[0] if len(parts) == 1 and type(parts[0]) is bytes else b"".join(parts)
        self._enqueue(body, self.parser.should_keep_alive())

    def _enqueue(self, body: bytes, keep_alive: bool) -> None:
        """Queue the request being parsed, with ``body``, to be answered in turn."""
        url = self.url
        if not url.startswith(b"/"):
            url = origin_form(url)
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
                    keep_alive,
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
                    self.close_after_answer()  # (pipelined requests after it: dropped)
                elif self.want_continue and not self.queue and not self.closed:
                    self.want_continue = False
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # never leave a half answer
            if not isinstance(exc, Aborted):
                _log.exception("unexpected error in the HTTP server")
            if not self.closed:
                self.transport.abort()
                self.closed = True
        finally:
            self.task = None
            failed, self.failed = self.failed, None
            if failed is not None:
                status, message, code, extra = failed
                self.fatal(status, message, extra, code)
            elif not self.closed and not self.in_message:
                if self.server.draining:
                    self.close_after_answer()
                else:
                    self.server.rest(self)
