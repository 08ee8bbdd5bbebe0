"""A small pooled HTTP/1.1 client for the proxy path, over raw asyncio transports.

Why not aiohttp's client: on the router's hot path it cost more CPU per request than routing
itself. This client does only what the proxy needs:

* keep-alive pools per upstream (TCP ``host:port`` or a unix socket), most recently used
  connection first, at most ``pool_size`` idle connections kept per upstream;
* requests are written as given (the caller builds the head; the body is sent as is);
* responses are parsed with ``httptools`` (llhttp): status, raw header pairs, and the body
  as the bytes the upstream sent (``Content-Length``, chunked or until close; the chunked
  framing is removed, the payload bytes are untouched; trailer fields are dropped, never
  taken for headers);
* streaming: :meth:`Exchange.read` returns body data as it arrives; reading from the upstream
  pauses while more than ``HIGH_WATER`` bytes wait for a slow client;
* timeouts: connect (new connections only), first byte of the head, each wait for more body
  (``read_timeout``), and a total deadline; all raise :class:`UpstreamTimeout`. A
  ``first_byte_s`` bound (:meth:`Pool.send`) covers the head and the first body data of
  an answer, the head alone of an error answer (4xx / 5xx: its body may follow later);
* errors: :class:`ConnectFailed` when the upstream could not be reached or closed the
  connection before any response byte (a request is re-sent, on a fresh connection, only
  when its pooled connection was found closed before any of it went out: :meth:`Pool.send`;
  connections idle for more than :data:`MAX_IDLE_S` are not reused),
  :class:`UpstreamBroken` when the response broke off (a connection reset ends no body,
  not even one delimited by the connection's end; a response head or trailer section over
  the caps the server holds its clients to, ``MAX_HEAD_BYTES`` and ``MAX_HEADERS`` of
  router.service.http_connection, is broken too, and so is one with a transfer coding but
  ``chunked``: the router asks for none);
* :meth:`Exchange.abort` closes the connection at once (the upstream sees the client go
  away); :meth:`Exchange.release` returns a fully read keep-alive connection to its pool.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass

import httptools

from router.service.http_connection import MAX_HEAD_BYTES, MAX_HEADERS
from router.service.replica_url import ReplicaUrl
from router.service.upstream_errors import (
    ConnectFailed,
    TotalTimeout,
    UpstreamBroken,
    UpstreamError,
    UpstreamTimeout,
)
from router.service.wire import other_coding

HIGH_WATER = 1 << 20  # buffered body bytes above which reading from the upstream pauses
# a pooled connection idle longer is closed, not reused: under the 5 s keep-alive timeout of
# the engines' uvicorn servers (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, uvicorn's default), so
# a request is not written to a connection the replica is closing at that moment (a request
# caught in that race cannot be told from one the replica read and dropped)
MAX_IDLE_S = 4.0


@dataclass(slots=True, frozen=True)
class Timeouts:
    connect: float = 3.0
    read: float = 600.0  # first byte of the head, and each wait for more body
    total: float = 3600.0


@dataclass(slots=True, frozen=True)
class Target:
    """Where an upstream listens: ``host:port`` or a unix socket ``path``."""

    host: str = ""
    port: int = 0
    path: str | None = None

    @classmethod
    def from_url(cls, base_url: str) -> Target:
        """A replica's ``http://host[:port]`` (router/service/replica_url.py); ValueError
        for anything else."""
        url = ReplicaUrl.parse(base_url)
        return cls(url.host, url.port)


class _Conn(asyncio.Protocol):
    """One upstream connection; carries one exchange at a time."""

    __slots__ = (
        "buffered",
        "chunks",
        "closed",
        "complete",
        "error",
        "extra",
        "got_body",
        "got_bytes",
        "head_done",
        "headers",
        "idle_since",
        "keep_alive",
        "loop",
        "parser",
        "paused",
        "reused",
        "status",
        "transport",
        "unframed",
        "waiter",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False
        self.idle_since = 0.0  # (pooled: when it was handed back)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.head_done = False
        self.complete = False
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False
        self.keep_alive = True
        self.got_bytes = False
        # bytes read since the answer began or since its last body bytes (a head or trailer
        # line httptools gathers until it ends), and whether the piece read held body bytes
        self.unframed = 0
        self.got_body = False
        # bytes after the answer's end, which no request asked for (a balancer's unprompted
        # 408): never parsed into this answer; the connection is not reused
        self.extra = False

    # ---------------------------------------------------------------- asyncio protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.got_body = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamBroken(f"malformed HTTP response: {exc}"))
            self.abort()
        except httptools.HttpParserUpgrade:  # (not an HttpParserError: 101 to a request
            # that asked for no upgrade) a broken answer, not the protocol's fatal error
            self._fail(UpstreamBroken("the replica switched protocols (101) unasked"))
            self.abort()
        else:
            # (counted by whole pieces read, as the server counts its clients' heads)
            if self.got_body:
                self.unframed = 0
            elif not self.complete:
                self.unframed += len(data)
                if self.unframed > MAX_HEAD_BYTES:
                    what = "trailer section" if self.head_done else "head"
                    self._fail(UpstreamBroken(f"response {what} over {MAX_HEAD_BYTES} bytes"))
                    self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.complete:
            return
        if not self.got_bytes:
            self._fail(ConnectFailed("connection closed before any response byte", connected=True))
        elif exc is None and self.head_done and self.until_close():
            self.complete = True  # a body delimited by the end of the connection
            self.keep_alive = False
            self._wake()
        else:  # a reset ends a close-delimited body too early, not at its end
            self._fail(UpstreamBroken("connection lost in the middle of the response"))

    def until_close(self) -> bool:
        """The response body is delimited by the end of the connection (neither
        ``Content-Length`` nor ``Transfer-Encoding``): nothing in it marks its end."""
        return not any(
            k.lower() in (b"content-length", b"transfer-encoding") for k, _ in self.headers
        )

    # ---------------------------------------------------------------- httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request
            self.extra = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.head_done:  # (after it: a chunked body's trailer fields, dropped)
            self.headers.append((name, value))
            if len(self.headers) > MAX_HEADERS:
                self._fail(UpstreamBroken(f"response head of more than {MAX_HEADERS} fields"))
                raise ValueError("too many header fields")  # (ends the parse: broken)

    def on_headers_complete(self) -> None:
        if self.complete:
            return
        self.status = self.parser.get_status_code()
        if self.status < 200:  # 1xx: wait for the real answer
            self.headers = []
            return
        coded = False
        for k, v in self.headers:
            if len(k) == 17 and k.lower() == b"transfer-encoding":
                coded = True
                # the router asks for none (no TE): its body would be relayed still coded
                coding = other_coding(v)
                if coding:
                    why = f"transfer coding {coding.decode('latin-1')!r} (only chunked is read)"
                    self._fail(UpstreamBroken(why))
                    raise ValueError(why)  # (ends the parse: broken)
        self.head_done = True
        # an HTTP/1.0 answer with a transfer coding has faulty framing: the connection
        # closes after it (RFC 9112 6.1), whatever its keep-alive says
        self.keep_alive = self.parser.should_keep_alive() and not (
            coded and self.parser.get_http_version() == "1.0"
        )
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.got_body = True
        if self.complete:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.status < 200 or self.complete:
            return
        self.complete = True
        self._wake()

    # ---------------------------------------------------------------- helpers

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    async def wait(self, timeout: float) -> None:
        """Wait until woken (data, end, error) or ``timeout`` seconds pass."""
        self.waiter = w = self.loop.create_future()
        timer = self.loop.call_later(timeout, _expire, w)
        try:
            await w
        finally:
            timer.cancel()
            self.waiter = None


def _expire(w: asyncio.Future[None]) -> None:
    if not w.done():
        w.set_exception(UpstreamTimeout("upstream timed out"))


class Exchange:
    """One request/response on a pooled connection (see the module docstring)."""

    __slots__ = (
        "_conn",
        "_deadline",
        "_done",
        "_first_by",
        "_pool",
        "_read_timeout",
        "_total_bound",
        "headers",
        "status",
    )

    def __init__(
        self,
        pool: Pool,
        conn: _Conn,
        deadline: float,
        read_timeout: float,
        first_by: float = float("inf"),
    ) -> None:
        self._pool = pool
        self._conn = conn
        self._deadline = deadline
        self._read_timeout = read_timeout
        self._first_by = first_by  # the head and first data by then (until ``ready``)
        self._total_bound = False  # the last wait ended where the total deadline does
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._done = False

    def header(self, name: bytes) -> bytes | None:
        """First value of header ``name`` (lower-case bytes), if present."""
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def _timeout(self) -> float:
        now = self._conn.loop.time()
        left = self._deadline - now
        if left <= 0:
            raise TotalTimeout("upstream exceeded the request timeout")
        first = self._first_by - now
        if first <= 0:
            raise UpstreamTimeout("upstream sent no first byte in time")
        wait = min(first, self._read_timeout)
        self._total_bound = left <= wait
        return min(left, wait)

    async def _wait(self) -> None:
        """Wait for the connection's next news within :meth:`_timeout`; a wait that the
        total deadline ended raises :class:`TotalTimeout`."""
        try:
            await self._conn.wait(self._timeout())
        except UpstreamTimeout:
            if self._total_bound:
                raise TotalTimeout("upstream exceeded the request timeout") from None
            raise

    async def _head(self) -> None:
        c = self._conn
        while not c.head_done:
            if c.error is not None:
                raise c.error
            await self._wait()
        self.status = c.status
        self.headers = c.headers
        if c.status >= 400:
            # an error answer's first byte is its head: the engine has nothing to prefill
            # for it, so its body is read under the read and request timeouts alone
            self._first_by = float("inf")

    @property
    def until_close(self) -> bool:
        """The body ends only where the connection does (no length, not chunked): a clean
        close cannot be told from a replica that died mid-answer, so the caller checks the
        payload's own end (an SSE stream's ``data: [DONE]``)."""
        return self._conn.until_close()

    @property
    def data_ready(self) -> bool:
        """Body data has arrived and not been read yet (:meth:`read` will not wait)."""
        return bool(self._conn.chunks)

    @property
    def at_end(self) -> bool:
        """The whole body has arrived and been read (:meth:`read` returns None, at once)."""
        c = self._conn
        return c.complete and not c.chunks

    async def read(self) -> bytes | None:
        """The next body data as it arrived (several pieces joined), None at the end."""
        c = self._conn
        while True:
            if c.chunks:
                if len(c.chunks) == 1:
                    data = c.chunks.popleft()
                else:
                    data = b"".join(c.chunks)
                    c.chunks.clear()
                c.buffered = 0
                if c.paused and c.transport is not None and not c.closed:
                    c.paused = False
                    c.transport.resume_reading()
                return data
            if c.complete:
                self._done = True
                return None
            if c.error is not None:
                raise (
                    c.error if isinstance(c.error, UpstreamBroken) else UpstreamBroken(str(c.error))
                )
            await self._wait()

    def body(self) -> bytes | None:
        """The whole body if it has all arrived (then as :meth:`read_all`), else None: no
        coroutine for the common case of a short answer that came in one piece."""
        c = self._conn
        if not c.complete:
            return None
        self._done = True
        chunks = c.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        c.buffered = 0
        if c.paused and c.transport is not None and not c.closed:
            # the last data paused reading: the connection goes back to the pool reading,
            # or the next answer on it would never be read
            c.paused = False
            c.transport.resume_reading()
        return data

    async def ready(self, whole: bool) -> None:
        """Wait, reading nothing, until the first body data has arrived (``whole``: the
        whole body, however large: reading resumes when the buffer paused it, so that a
        body that breaks off does so here, before any of it went on) or the body ended;
        raises :class:`UpstreamBroken` / :class:`UpstreamTimeout` as :meth:`read` would."""
        c = self._conn
        while not (c.complete or (c.chunks and not whole)):
            if c.error is not None:
                raise (
                    c.error if isinstance(c.error, UpstreamBroken) else UpstreamBroken(str(c.error))
                )
            if c.paused and c.transport is not None and not c.closed:
                c.paused = False
                c.transport.resume_reading()
            await self._wait()
        self._first_by = float("inf")  # from here on, each wait has the read timeout

    async def read_all(self) -> bytes:
        """The whole body, however large: reading resumes when the buffer paused it (the
        caller asked for every byte, so ``HIGH_WATER`` cannot bound it here)."""
        c = self._conn
        while not c.complete:
            if c.error is not None:
                raise UpstreamBroken(str(c.error))
            if c.paused and c.transport is not None and not c.closed:
                c.paused = False
                c.transport.resume_reading()
            await self._wait()
        data = self.body()
        assert data is not None
        return data

    def abort(self) -> None:
        """Close the connection now (the upstream sees the request cancelled)."""
        self._done = True
        self._conn.abort()

    def release(self) -> None:
        """Hand the connection back: pooled if the response was read whole and keep-alive
        holds, closed otherwise. Idempotent."""
        c = self._conn
        if c.complete and c.keep_alive and not c.closed and c.error is None and not c.extra:
            self._pool._put(c)
        elif not c.closed:
            c.abort()


class Pool:
    """Keep-alive connections to one upstream."""

    def __init__(self, target: Target, timeouts: Timeouts, size: int = 256) -> None:
        self.target = target
        self.timeouts = timeouts
        self.size = size
        self._idle: list[_Conn] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False  # (closed: a connection handed back is closed, not kept)

    def _put(self, conn: _Conn) -> None:
        if self._closed or len(self._idle) >= self.size:
            conn.abort()
            return
        conn._reset()
        conn.reused = True
        conn.idle_since = conn.loop.time()
        self._idle.append(conn)

    async def _connect(self) -> _Conn:
        loop = self._loop or asyncio.get_running_loop()
        self._loop = loop
        t = self.target
        try:
            if t.path is not None:
                coro = loop.create_unix_connection(lambda: _Conn(loop), t.path)
            else:
                coro = loop.create_connection(lambda: _Conn(loop), t.host, t.port)
            # (asyncio.timeout, not wait_for: Python 3.11's wait_for may swallow a
            # cancellation that lands as the connection completes)
            async with asyncio.timeout(self.timeouts.connect):
                _, conn = await coro
        except TimeoutError:
            raise ConnectFailed(f"connect timed out after {self.timeouts.connect:g}s") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect: {exc.strerror or exc}") from None
        return conn

    def _take(self, now: float) -> _Conn | None:
        """An idle connection to reuse. One the replica spoke on while idle (a balancer's
        unprompted 408 as it times the connection out) is dropped: its bytes would be read
        as the next request's answer; so is one idle for more than :data:`MAX_IDLE_S`."""
        idle = self._idle
        while idle:
            conn = idle.pop()
            if conn.got_bytes or now - conn.idle_since > MAX_IDLE_S:
                conn.abort()
            elif not conn.closed:
                return conn
        return None

    @staticmethod
    def _write(conn: _Conn, data: bytes, body: bytes) -> bool:
        """Write the request; False when the connection was found closed as it was written
        (the write failed at once, or the loop had yet to deliver its end): none of the
        request reached the replica."""
        transport = conn.transport
        assert transport is not None
        if conn.closed or transport.is_closing():
            return False
        if body and len(body) < 65536:
            transport.write(data + body)
        else:
            transport.write(data)
            if body:
                transport.write(body)
        return not transport.is_closing()

    async def send(
        self,
        data: bytes,
        body: bytes = b"",
        first_byte_s: float | None = None,
        total_s: float | None = None,
        on_write: Callable[[], None] | None = None,
    ) -> Exchange:
        """Send one request (``data`` = head, ``body`` appended) and wait for the response
        head. It goes again, on a fresh connection, only when none of it reached the replica
        (its pooled connection was found closed as it was written): a request written whole
        and then met by the connection's end is :class:`ConnectFailed` (connected), as the
        replica may have read it and acted on it (a POST to an engine is not idempotent;
        RFC 9112 9.3.1; Go's ``net/http`` and aiohttp re-send only idempotent requests
        then); the forwarder's retries and outlier ejection judge it. ``first_byte_s``: the
        head (and, through :meth:`Exchange.ready`, the first body data) must come within
        this many seconds, whatever the read timeout.
        ``total_s``: the whole exchange's bound when shorter than the total timeout (what
        is left of a request that retried: :class:`TotalTimeout` past it). ``on_write``:
        called once the request is written (the replica may read it from then on)."""
        loop = self._loop or asyncio.get_running_loop()
        self._loop = loop
        now = loop.time()
        total = self.timeouts.total if total_s is None else min(total_s, self.timeouts.total)
        deadline = now + total
        first_by = now + first_byte_s if first_byte_s is not None else float("inf")
        conn = self._take(now)
        if conn is not None and not self._write(conn, data, body):
            conn.abort()  # closed by the replica before any of the request reached it
            conn = None
        if conn is None:
            conn = await self._connect()
            self._write(conn, data, body)  # (a failure shows as the connection's end)
        if on_write is not None:
            on_write()
        ex = Exchange(self, conn, deadline, self.timeouts.read, first_by)
        try:
            await ex._head()
        except BaseException:
            conn.abort()
            raise
        return ex

    def close(self) -> None:
        """Close the idle connections, and those in use as they are handed back."""
        self._closed = True
        for conn in self._idle:
            conn.abort()
        self._idle.clear()


class Client:
    """Pools by base URL (``http://host:port``) or unix socket path."""

    def __init__(self, timeouts: Timeouts, pool_size: int = 256) -> None:
        self.timeouts = timeouts
        self.pool_size = pool_size
        self._pools: dict[str, Pool] = {}

    def pool(self, base_url: str) -> Pool:
        p = self._pools.get(base_url)
        if p is None:
            p = self._pools[base_url] = Pool(
                Target.from_url(base_url), self.timeouts, self.pool_size
            )
        return p

    def unix_pool(self, path: str) -> Pool:
        key = "unix:" + path
        p = self._pools.get(key)
        if p is None:
            p = self._pools[key] = Pool(Target(path=path), self.timeouts, self.pool_size)
        return p

    def forget(self, keep: Container[str]) -> None:
        """Close and drop the pools of the base URLs not in ``keep`` (replicas that left:
        their addresses may never be asked again)."""
        for url in [u for u in self._pools if not u.startswith("unix:") and u not in keep]:
            self._pools.pop(url).close()

    def close(self) -> None:
        for p in self._pools.values():
            p.close()
        self._pools.clear()
