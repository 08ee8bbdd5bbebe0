"""Pooled keep-alive connections that close before answering (router/service/upstream.py
``Pool.send``): a request is sent again on another connection only when none of it reached
the replica; one the replica read and dropped unanswered is a failed attempt for the
forwarder (its retry bounds, outlier ejection), never re-sent behind their back. Raw
asyncio servers on loopback play the replica."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable

import pytest

from router.service.upstream import MAX_IDLE_S, Pool, Target, Timeouts
from router.service.upstream_errors import ConnectFailed
from tests.backends import metric_sample
from tests.test_proxy_integrity import _read_request, _router
from tests.waiting import eventually

MODEL = "kimi-test"
ANSWER = json.dumps(
    {"id": "c1", "object": "chat.completion", "model": MODEL, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
    ], "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}
).encode()  # fmt: skip
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (
    len(ANSWER),
    ANSWER,
)
REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n\r\n{}"


class Replica:
    """A keep-alive replica that answers every request but the ones ``drop`` names (by
    their number, from 1, over all connections): those it reads whole, then closes the
    connection without a byte of answer, as an engine that died on them would; after
    answering those ``hang_up`` names it closes the connection (its keep-alive timeout)."""

    def __init__(
        self, drop: Callable[[int], bool], hang_up: Callable[[int], bool] = lambda n: False
    ) -> None:
        self.drop = drop
        self.hang_up = hang_up
        self.requests = 0
        self.connections = 0
        self.url = ""
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> Replica:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await _read_request(reader)
                self.requests += 1
                if self.drop(self.requests):
                    break
                writer.write(OK)
                await writer.drain()
                if self.hang_up(self.requests):
                    break
        writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def _pool(port: int) -> Pool:
    return Pool(Target("127.0.0.1", port), Timeouts(connect=3, read=30, total=60))


async def _exchange(pool: Pool) -> None:
    ex = await pool.send(REQUEST)
    assert await ex.read_all() == ANSWER
    ex.release()


async def test_a_request_read_on_a_reused_connection_and_dropped_is_not_sent_again() -> None:
    """The replica read the whole request on a pooled connection, then closed it with no
    answer: it may have acted on it (a POST to an engine is not idempotent: a prefill
    started, a stored response), so the pool gives up (``ConnectFailed``, connected)
    instead of sending it again. Before, it was re-sent up to twice more to the same
    replica, outside the forwarder's retry budget and unseen by outlier ejection."""
    replica = await Replica(drop=lambda n: n == 2).start()
    pool = _pool(replica.port)
    try:
        await _exchange(pool)  # pooled
        with pytest.raises(ConnectFailed) as failed:
            await pool.send(REQUEST)
        assert failed.value.connected
        assert replica.requests == 2  # the dropped one once
        await _exchange(pool)  # a fresh connection for the next request
        assert replica.connections == 2
    finally:
        pool.close()
        await replica.stop()


async def test_a_pooled_connection_the_replica_closed_while_idle_is_not_written_to() -> None:
    """The replica closes an idle pooled connection (its keep-alive timeout): the next
    request goes on a fresh connection, the replica gets it once, and nothing fails."""
    replica = await Replica(drop=lambda n: False, hang_up=lambda n: n == 1).start()
    pool = _pool(replica.port)
    try:
        await _exchange(pool)
        (idle,) = pool._idle
        await eventually(lambda: idle.closed)
        await _exchange(pool)
        assert replica.requests == 2 and replica.connections == 2
    finally:
        pool.close()
        await replica.stop()


async def test_a_connection_idle_past_the_limit_is_not_reused() -> None:
    """A pooled connection idle for more than ``MAX_IDLE_S`` (below the 5 s keep-alive of
    vLLM's and SGLang's uvicorn servers) is closed instead of reused: the replica may be
    closing it at that very moment, and a request caught in that race could not be told
    from one the replica read and dropped."""
    replica = await Replica(drop=lambda n: False).start()
    pool = _pool(replica.port)
    try:
        await _exchange(pool)
        await _exchange(pool)
        assert replica.connections == 1  # reused while fresh
        (idle,) = pool._idle
        idle.idle_since -= MAX_IDLE_S + 1  # as if it had waited that long
        await _exchange(pool)
        assert replica.connections == 2 and replica.requests == 3
        await eventually(lambda: idle.closed)
    finally:
        pool.close()
        await replica.stop()


async def test_a_dropped_request_is_the_forwarders_failed_attempt() -> None:
    """Through the router: the replica read a request on a reused connection and dropped
    it. The forwarder sees one failed attempt (a connect error on that replica for outlier
    ejection, its retry rules), the replica got the request once, and with no other replica
    the client gets the 502. Before, the pool sent it again on a fresh connection and the
    client got the second run's answer: the replica ran it twice, and nothing counted."""
    replica = await Replica(drop=lambda n: n == 2).start()
    try:
        async for url, session in _router(replica.url):
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 502, await r.text()
            assert replica.requests == 2
            async with session.get(url + "/metrics") as r:
                page = await r.text()
            failures = metric_sample(page, "kvrouter_replica_failures_total", kind="connect")
            assert failures == 1.0, failures
    finally:
        await replica.stop()
