"""The fast HTTP/1.1 front end (``server.http_engine = "fast"``): a raw asyncio protocol with
the ``httptools`` (llhttp) parser for the two hot endpoints, everything else relayed to the
aiohttp app.

* ``POST /v1/chat/completions`` and ``POST /v1/completions`` run :func:`handling.handle`
  here, the same code the aiohttp handlers run (validation, error bodies, request ids, debug
  header, routing, proxying, retries, metrics), answering through :class:`_Sink`.
* Every other request (admin, metrics, models, health, ready, unknown paths, other methods)
  is relayed unchanged to the aiohttp app, which listens on a private unix socket, with the
  pooled client of :mod:`router.service.upstream`; the answer comes back byte for byte. The
  hot endpoints take the same detour when the request needs what only the aiohttp app does
  (client API keys or per-key concurrency limits configured, or a header block over
  ``max_header_kb``, which the app refuses with 431).
* Limits: a body over ``max_body_mb`` is answered 413 (the body is discarded as it arrives,
  never buffered); an unparsable request 400 and the connection is closed.
* Keep-alive and pipelining: requests on one connection are answered in order; reading
  pauses while more than a few requests wait. ``Expect: 100-continue`` is honoured.
* A client that disconnects cancels its request's task, which aborts the upstream request
  (the replica sees the connection close). Writes wait while the client's socket buffer is
  full (backpressure reaches the replica through the upstream client's pause).
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import socket
from collections import deque
from dataclasses import dataclass
from typing import Any

import httptools
from aiohttp import web

from router.service.errors import error_body
from router.service.handling import KINDS, handle, too_large
from router.service.proxy import HOP_BY_HOP, Forwarder, response_headers
from router.service.security import Limits
from router.service.state import RouterState
from router.service.upstream import Pool
from router.service.upstream_errors import UpstreamError

_log = logging.getLogger(__name__)
_STATUS_LINES: dict[int, bytes] = {}
_PIPELINE_MAX = 8
_LAST_CHUNK = b"0\r\n\r\n"


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


@dataclass(slots=True)
class _Request:
    method: bytes
    url: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    keep_alive: bool
    too_large: bool
    header_bytes: int


class _Sink:
    """:class:`~router.service.proxy.Sink` writing HTTP/1.1 to the client connection."""

    __slots__ = ("conn", "head_only", "keep_alive", "started")

    def __init__(self, conn: _Connection, keep_alive: bool, head_only: bool = False) -> None:
        self.conn = conn
        self.keep_alive = keep_alive
        self.head_only = head_only
        self.started = False  # a status line went out

    def _head(self, status: int, headers: list[tuple[bytes, bytes]], framing: bytes) -> bytes:
        parts = [_status_line(status)]
        for k, v in headers:
            parts += (k, b": ", v, b"\r\n")
        parts.append(framing)
        if not self.keep_alive:
            parts.append(b"Connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        conn = self.conn
        if conn.closed:
            raise ConnectionResetError("client went away")
        head = self._head(status, headers, b"Content-Length: %d\r\n" % len(body))
        self.started = True
        if self.head_only or not body:
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
            conn.transport.write(_chunk(data))
        if conn.paused:
            await conn.drain()

    async def end(self, data: bytes = b"") -> None:
        conn = self.conn
        if conn.closed:
            raise ConnectionResetError("client went away")
        if not self.head_only:
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
        self._drain: asyncio.Future[None] | None = None
        self.queue: deque[_Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self.reading_paused = False
        self._new_message()

    def _new_message(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.header_bytes = 0
        self.body: list[bytes] = []
        self.body_size = 0
        self.too_large = False

    # ---------------------------------------------------------------- asyncio protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fatal(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._fatal(400, f"malformed HTTP request: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self.queue.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self._wake_drain(ConnectionResetError("client went away"))

    def pause_writing(self) -> None:
        self.paused = True

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

    def _fatal(self, status: int, message: str) -> None:
        if self.closed:
            return
        body = error_body(status, message, code=f"http_{status}")
        self.transport.write(
            _status_line(status)
            + b"Content-Type: application/json\r\nConnection: close\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body
        )
        self.transport.close()
        self.closed = True

    # ---------------------------------------------------------------- httptools callbacks

    def on_message_begin(self) -> None:
        self._new_message()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        self.header_bytes += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
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
        if expect and not self.too_large:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self.too_large:
            return
        self.body_size += len(body)
        if self.body_size > self.server.max_body:
            self.too_large = True
            self.body = []
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.queue.append(
            _Request(
                self.parser.get_method(),
                self.url,
                self.headers,
                body,
                self.parser.should_keep_alive(),
                self.too_large,
                self.header_bytes,
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
                req = self.queue.popleft()
                if self.reading_paused and len(self.queue) <= _PIPELINE_MAX // 2:
                    self.reading_paused = False
                    self.transport.resume_reading()
                await self.server.serve(self, req)
                if not req.keep_alive and not self.closed:
                    self.transport.close()
                    self.closed = True
        except asyncio.CancelledError:
            pass
        except Exception:  # a bug or a broken upstream mid-stream: never leave a half answer
            if not self.closed:
                self.transport.abort()
                self.closed = True
        finally:
            self.task = None


class FastServer:
    """The fast front end of one app (see the module docstring). ``delegate`` is the unix
    socket the aiohttp app listens on."""

    def __init__(self, app: web.Application, delegate: str) -> None:
        from router.service.app import FORWARDER, STATE

        self.app = app
        self.state: RouterState = app[STATE]
        self.forwarder: Forwarder = app[FORWARDER]
        s = self.state.settings.server
        self.max_body = int(s.max_body_mb * 2**20)
        limits = Limits.from_server(s)
        self.max_header = limits.max_header_bytes
        # what only the aiohttp app's middleware does: send hot requests there too
        self.hot_native = not limits.api_keys and not limits.max_concurrent_per_key
        self.delegate: Pool = self.forwarder.client.unix_pool(delegate)
        self.connections: set[_Connection] = set()
        self.loop = asyncio.get_running_loop()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> int:
        """Listen on ``host:port`` (0: any free port); returns the port."""
        self._server = await self.loop.create_server(
            lambda: _Connection(self), host, port, reuse_port=reuse_port or None, backlog=2048
        )
        # read untyped: uvloop's is a list where typeshed says tuple, which compiled code
        # (make compile) would check
        sockets: Any = getattr(self._server, "sockets")  # noqa: B009
        return int(sockets[0].getsockname()[1])

    async def close(self, timeout: float = 0.0) -> None:
        """Stop accepting; wait up to ``timeout`` s for requests in flight; close the rest."""
        if self._server is not None:
            self._server.close()
        deadline = self.loop.time() + timeout
        while self.loop.time() < deadline and any(c.task for c in self.connections):
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            if not conn.closed:
                conn.transport.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    async def serve(self, conn: _Connection, req: _Request) -> None:
        path = req.url.split(b"?", 1)[0]
        sink = _Sink(conn, req.keep_alive, head_only=req.method == b"HEAD")
        if (
            req.method == b"POST"
            and path in KINDS
            and self.hot_native
            and (not self.max_header or req.header_bytes <= self.max_header)
        ):
            if req.too_large:
                reply = too_large(self.state)
                await sink.respond(
                    reply.status, [(b"Content-Type", b"application/json")], reply.body()
                )
                return
            try:
                await handle(self.state, self.forwarder, sink, path, req.body, req.headers)
            except (asyncio.CancelledError, ConnectionResetError, UpstreamError):
                raise
            except Exception:
                if sink.started:
                    raise  # the answer began: abort the connection (see _Connection._run)
                _log.exception("unexpected error on %s", path.decode("latin-1"))
                body = error_body(500, "internal error in the router", code="internal_error")
                await sink.respond(500, [(b"Content-Type", b"application/json")], body)
            return
        await self._relay(sink, req)

    async def _relay(self, sink: _Sink, req: _Request) -> None:
        """Hand the request to the aiohttp app and its answer back."""
        if req.too_large:
            reply = too_large(self.state)
            await sink.respond(reply.status, [(b"Content-Type", b"application/json")], reply.body())
            return
        method = b"GET" if req.method == b"HEAD" else req.method
        parts = [method, b" ", req.url, b" HTTP/1.1\r\nHost: kvrouter\r\n"]
        for k, v in req.headers:
            if k.lower() not in HOP_BY_HOP:
                parts += (k, b": ", v, b"\r\n")
        parts.append(b"Content-Length: %d\r\n\r\n" % len(req.body))
        try:
            ex = await self.delegate.send(b"".join(parts), req.body)
        except UpstreamError as exc:
            body = error_body(500, f"internal app unavailable: {exc}", code="internal_error")
            await sink.respond(500, [(b"Content-Type", b"application/json")], body)
            return
        try:
            headers, _, _ = response_headers(ex.headers)
            chunked = any(k.lower() == b"transfer-encoding" for k, _ in ex.headers)
            if not chunked:
                await sink.respond(ex.status, headers, await ex.read_all())
                return
            await sink.start(ex.status, headers)
            while (data := await ex.read()) is not None:
                await sink.write(data)
            await sink.end()
        except BaseException:
            ex.abort()
            raise
        finally:
            ex.release()


async def start_fast(
    app: web.Application, host: str, port: int, *, reuse_port: bool = False, socket_dir: str
) -> tuple[web.AppRunner, FastServer, int]:
    """Set up the aiohttp app on a unix socket in ``socket_dir`` and the fast server on
    ``host:port`` in front of it; returns (runner, fast server, port).

    If either cannot listen (``host:port`` taken, ...), the app is cleaned up before the
    error propagates, as ``web.run_app`` does: its background tasks (the Redis index sync,
    ...) stop, so the process exits with the error instead of waiting on them."""
    import os

    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        path = os.path.join(socket_dir, f"kvrouter-{os.getpid()}-{id(app):x}.sock")
        site = web.UnixSite(runner, path)
        await site.start()
        fast = FastServer(app, path)
        bound = await fast.start(host, port, reuse_port=reuse_port)
    except BaseException:
        await runner.cleanup()
        raise
    return runner, fast, bound


def run_fast(
    app: web.Application,
    host: str,
    port: int,
    *,
    reuse_port: bool = False,
    shutdown_timeout: float = 30.0,
) -> None:
    """Serve ``app`` with the fast front end until SIGTERM / SIGINT (``kvrouter serve``).

    Shutdown: stop accepting, let requests in flight finish for up to ``shutdown_timeout``
    seconds, then run the app's cleanup."""
    import shutil
    import signal
    import tempfile

    async def main() -> None:
        tmp = tempfile.mkdtemp(prefix="kvrouter-")
        try:
            runner, fast, _ = await start_fast(
                app, host, port, reuse_port=reuse_port, socket_dir=tmp
            )
            if not fast.hot_native:
                _log.warning(
                    "http_engine=fast: API keys / per-key limits are configured, so the hot "
                    "endpoints are relayed to the aiohttp app (no speed-up)"
                )
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            await fast.close(shutdown_timeout)
            await runner.cleanup()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    asyncio.run(main())
