"""Proxy faults that must leave the load model straight: a client that leaves before the
replica's answer head, and a dead replica with several data-parallel ranks (one URL)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import aiohttp
import pytest

from router.core.load import decode_weight
from router.service.app import STATE
from router.service.config import build_settings
from router.service.state import RouterState
from tests.backends import Backend, kimi_model_table, start_router
from tests.ports import RefusedPort
from tests.waiting import eventually

MODEL = "kimi-test"
TOKEN = "admin-secret"


@pytest.fixture(params=["fast"])
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def _router(
    engine: str, replicas: list[dict[str, Any]], **server: Any
) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    settings = build_settings(
        {
            "server": {"admin_token": TOKEN, **server},
            "replicas": replicas,
            "models": {MODEL: kimi_model_table()},
        }
    )
    runner, url = await start_router(settings, engine)
    session = aiohttp.ClientSession()
    try:
        yield url, session
    finally:
        await session.close()
        await runner.cleanup()


async def _replicas(url: str, session: aiohttp.ClientSession) -> dict[str, dict[str, Any]]:
    async with session.get(url + "/admin/replicas", headers={"X-Admin-Token": TOKEN}) as r:
        return {x["replica"]: x for x in (await r.json())["replicas"]}


async def _settled(url: str, session: aiohttp.ClientSession) -> bool:
    """No request loads any replica."""
    return sum(r["in_flight"] for r in (await _replicas(url, session)).values()) == 0


async def _outcomes(url: str, session: aiohttp.ClientSession) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        page = await r.text()
    out: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith("kvrouter_requests_total{"):
            labels, _, value = line.rpartition(" ")
            outcome = labels.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = out.get(outcome, 0.0) + float(value)
    return out


def _chat(stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": stream,
        "messages": [{"role": "user", "content": "a question that takes a while"}],
    }


@pytest.mark.parametrize("stream", [False, True])
async def test_client_leaving_before_the_answer_head_completes_the_request(
    engine: str, stream: bool
) -> None:
    backend = await Backend("b0", [MODEL], delay_s=1.0).start()
    try:
        async for url, session in _router(
            engine, [{"url": backend.url, "model": MODEL, "name": "b0"}]
        ):
            with pytest.raises(asyncio.TimeoutError):
                async with session.post(
                    url + "/v1/chat/completions",
                    json=_chat(stream),
                    timeout=aiohttp.ClientTimeout(total=0.3),
                ) as resp:
                    await resp.read()
            # the router must notice at once, not when the replica answers
            for _ in range(40):
                reps = await _replicas(url, session)
                if sum(r["in_flight"] for r in reps.values()) == 0:
                    break
                await asyncio.sleep(0.02)
            assert sum(r["in_flight"] for r in reps.values()) == 0, reps
            outcomes = await _outcomes(url, session)
            assert outcomes.get("cancelled") == 1.0, outcomes
            assert "ok" not in outcomes, outcomes
    finally:
        await backend.stop()


async def test_a_dead_replica_with_several_dp_ranks_is_skipped_whole(engine: str) -> None:
    """A connection refused at one DP rank's URL is refused at all of them: the retry goes to
    another replica, and every rank of the dead one is marked unhealthy."""
    live = await Backend("live", [MODEL]).start()
    dead = RefusedPort()
    dead_url = dead.url
    try:
        async for url, session in _router(
            engine,
            [
                {"url": dead_url, "model": MODEL, "name": "dead", "dp_ranks": 4},
                {"url": live.url, "model": MODEL, "name": "live"},
            ],
            max_retries=1,
        ):
            statuses = []
            for i in range(6):
                body = _chat(False)
                body["messages"][0]["content"] += f" {i}"
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    statuses.append(resp.status)
                    await resp.read()
            assert statuses == [200] * 6
            assert len(live.received) == 6
            reps = await _replicas(url, session)
            dead_ranks = [r for name, r in reps.items() if name.startswith("dead")]
            assert len(dead_ranks) == 4, reps
            assert all(r["healthy"] is False for r in dead_ranks), dead_ranks
            assert sum(r["in_flight"] for r in reps.values()) == 0
    finally:
        dead.close()
        await live.stop()


async def test_a_replica_that_drops_a_request_loses_that_rank_only(engine: str) -> None:
    """A replica that accepts the connection and closes it without answering is not "down":
    only the rank that dropped the request is marked unhealthy (the retry may go to another
    rank of the same replica), whereas a refused connection takes out every rank."""

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    live = await Backend("live", [MODEL]).start()
    try:
        async for url, session in _router(
            engine,
            [
                {"url": f"http://127.0.0.1:{port}", "model": MODEL, "name": "drop", "dp_ranks": 4},
                {"url": live.url, "model": MODEL, "name": "live"},
            ],
            max_retries=1,
            health_interval_s=0,  # probes would find every rank dropping: passive marks only
        ):
            async with session.post(
                url + "/admin/replicas/live/drain", headers={"X-Admin-Token": TOKEN}
            ) as r:
                assert r.status == 200
            async with session.post(url + "/v1/chat/completions", json=_chat(False)) as resp:
                assert resp.status == 502
                message = (await resp.json())["error"]["message"]
            assert "gave up after 2 attempt(s)" in message, message
            reps = await _replicas(url, session)
            down = sorted(name for name, r in reps.items() if not r["healthy"])
            assert len(down) == 2 and all(n.startswith("drop") for n in down), down
            assert sum(r["in_flight"] for r in reps.values()) == 0
    finally:
        server.close()
        await live.stop()


class HeadFirst:
    """A replica that sends its answer's head at once and then nothing (vLLM sends a stream's
    head before the prefill; ``head-only`` replicas promise a body that never comes), and
    notes when the router closes the connection: how a replica learns a request was
    cancelled."""

    def __init__(self, head: bytes) -> None:
        self.head = head
        self.answering = asyncio.Event()  # the head went out
        self.closed = asyncio.Event()  # the router closed the connection
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> HeadFirst:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(self.head)
        await writer.drain()
        self.answering.set()
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):  # the request's body, then the router's end
                pass
        self.closed.set()
        writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
JSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"


@pytest.mark.parametrize("stream", [False, True])
async def test_client_leaving_after_the_answer_head_aborts_the_upstream_request(
    engine: str, stream: bool
) -> None:
    """The replica's head came, its first data did not (a stream prefilling, a JSON answer
    decoding): a client that leaves then must close the upstream request, else the replica
    goes on generating for nobody and the connection is never closed."""
    replica = await HeadFirst(SSE_HEAD if stream else JSON_HEAD).start()
    try:
        async for url, session in _router(
            engine, [{"url": replica.url, "model": MODEL, "name": "r0"}], health_interval_s=0
        ):
            body = json.dumps(_chat(stream)).encode()
            port = int(url.rsplit(":", 1)[1])
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                % (len(body), body)
            )
            await replica.answering.wait()
            writer.close()  # the client leaves, before any byte of the answer
            await eventually(replica.closed.is_set, message="the replica saw no cancel")

            await eventually(partial(_settled, url, session))
            outcomes = await _outcomes(url, session)
            assert outcomes.get("cancelled") == 1.0, outcomes
    finally:
        await replica.stop()


async def test_a_retry_takes_the_request_record_to_the_replica_that_serves_it(
    engine: str,
) -> None:
    """A request whose first replica fails is retried on the next one: what the router
    recorded of it moves along, so the replica serving it counts its decode weight (its
    output limit's, read by the goodput policy's interference term) and its session's
    next turn is hinted to the replica that holds its prompt now, not the one that
    failed it."""
    backends = [await Backend(f"b{i}", [MODEL]).start() for i in range(2)]
    settings = build_settings(
        {
            "server": {"admin_token": TOKEN, "health_interval_s": 0},
            "replicas": [{"url": b.url, "model": MODEL, "name": b.name} for b in backends],
            "models": {MODEL: kimi_model_table()},
        }
    )
    running, url = await start_router(settings, engine)
    state: RouterState = running.app[STATE]
    http = aiohttp.ClientSession()
    try:
        messages = [{"role": "user", "content": "a long question about the sky " * 40}]
        body = {"model": MODEL, "max_tokens": 2, "messages": messages}
        session = {"X-Session-Id": "s1"}
        async with http.post(url + "/v1/chat/completions", json=body, headers=session) as r:
            assert r.status == 200
        (first,) = [b for b in backends if b.received]
        (other,) = [b for b in backends if not b.received]
        first.fail_next = 1
        other.gate = asyncio.Event()  # the retry stays in flight there
        messages += [
            {"role": "assistant", "content": "it scatters"},
            {"role": "user", "content": "and at sunset?"},
        ]

        async def ask() -> int:
            async with http.post(url + "/v1/chat/completions", json=body, headers=session) as r:
                await r.read()
                return r.status

        asked = asyncio.create_task(ask())
        await eventually(lambda: other.received)
        assert len(first.received) == 2  # the session's turn went to its replica first
        keys = {ep.key.replica: ep.key for ep in state.registry.endpoints()}
        now = asyncio.get_running_loop().time()
        view = state.load.view(keys[other.name], now)
        assert view.in_flight == 1
        assert view.decode_weight == pytest.approx(decode_weight(2))
        sessions = state.engines[MODEL].sessions
        assert sessions is not None
        hint = sessions.get("s1", now)
        assert hint is not None and hint.replica == keys[other.name], hint
        other.gate.set()
        assert await asked == 200
        await eventually(partial(_settled, url, http))
    finally:
        await http.close()
        await running.cleanup()
        for b in backends:
            await b.stop()
