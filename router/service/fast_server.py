"""The router's HTTP/1.1 server: a raw asyncio protocol with the ``httptools`` (llhttp)
parser, serving every path of the public port (and, with several workers, each worker's
control socket) through one ``handler(request, sink)`` coroutine: on the public port
router.service.handling.handle, the front door. This module listens, admits connections,
times them out and runs the handler; each connection's parsing, framing and answer writing
are router.service.http_connection's.

* Connection limits (:class:`ConnLimits`, from ``server.*``): a request's line and headers
  must arrive within ``header_timeout_s`` of its first byte and its body may pause at most
  ``body_timeout_s`` (else 408 and the connection closes); a connection idle between
  requests closes after ``keep_alive_timeout_s``; one whose client takes no byte of the
  answer waiting for it for ``send_timeout_s`` (writes paused, nothing more acknowledged:
  any progress starts the wait again) is aborted, its request cancelled. At
  ``max_connections`` open connections a new one first closes the longest-idle connection;
  with none idle it is answered 503 (with ``Retry-After``) and closed, logged at most every
  10 s: the process keeps file descriptors for its replicas and its logs.
* An exception the handler lets out is logged (with its traceback; a replica that broke off
  a stream as a warning) and answered 500 when no answer had started, else the connection is
  aborted, so a client never takes a half answer for a whole one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import resource
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from router.service.errors import error_body, messages_path
from router.service.http_connection import Aborted, Connection
from router.service.http_sink import ConnectionSink
from router.service.http_types import HttpRequest
from router.service.upstream_errors import UpstreamError
from router.service.wire import Sink

_log = logging.getLogger(__name__)
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


Handler = Callable[[HttpRequest, Sink], Awaitable[None]]


class FastServer:
    """One listening socket served by ``handler`` (see the module docstring)."""

    def __init__(
        self,
        handler: Handler,
        max_body: int,
        limits: ConnLimits | None = None,
        refuses_body: Callable[[bytes, list[tuple[bytes, bytes]]], bool] | None = None,
    ) -> None:
        self.handler = handler
        self.max_body = max_body
        # (path, headers) -> whether the handler will refuse the request whatever its body
        # (a wrong API key: Gate.refuses_key): its body is read and dropped, never kept, and
        # an ``Expect: 100-continue`` gets no 100 (the handler's answer needs no body)
        self.refuses_body = refuses_body
        self.limits = limits or ConnLimits()
        self.connections: set[Connection] = set()
        # connections between requests, longest idle first (dict order)
        self.idle: dict[Connection, None] = {}
        self.loop = asyncio.get_running_loop()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.refused = 0  # the cap's actions since its last log line
        self._logged_at = -1e9
        # closing (:meth:`close`): no connection is kept for another request
        self.draining = False
        self.drain_until = math.inf  # loop time the drain ends (:meth:`close`, :meth:`cut`)

    def admit(self, conn: Connection) -> None:
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

    def rest(self, conn: Connection) -> None:
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
                    conn.fatal(408, "the request did not arrive in time")
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
                lambda: Connection(self), sock=sock, backlog=BACKLOG
            )
        else:
            self._server = await self.loop.create_server(
                lambda: Connection(self),
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
        self._server = await self.loop.create_unix_server(lambda: Connection(self), path)
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
            conn.transport.close()  # (lingering ones too: see Connection.fatal)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    def cut(self) -> None:
        """End :meth:`close`'s wait now: what is still in flight is closed as at its end."""
        self.drain_until = self.loop.time()

    async def serve(self, conn: Connection, req: HttpRequest, http10: bool = False) -> bool:
        """Answer ``req``; returns whether the connection stays open for another request."""
        keep = req.keep_alive and not self.draining
        sink = ConnectionSink(conn, keep, head_only=req.method == b"HEAD", http10=http10)
        try:
            await self.handler(req, sink)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except UpstreamError as exc:  # (proxy.py answers those it can; this one broke a stream)
            _log.warning("%s %s: %s; connection aborted", *_what(req), exc)
            raise Aborted() from exc
        except Exception as exc:
            _log.exception("unexpected error on %s %s", *_what(req))
            if sink.started:
                raise Aborted() from exc
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
