"""Router process life cycle, with real processes on loopback.

* SIGTERM: the listener closes at once (new connections are refused), and so do the
  connections kept between requests (each busy one after its answer), in-flight streams run
  to their ``[DONE]``, and the process exits 0; a stream longer than
  ``server.shutdown_timeout_s`` is cut at the deadline (the client sees an error, not a
  short answer) and the process still exits 0; a second SIGTERM / SIGINT cuts at once.
* Router restart with Redis (``server.redis_url``): a new router process recovers the index
  from Redis (the publisher's snapshot) and serves within seconds.
* Publisher start: what the engine cached before (its ZMQ replay buffer) is loaded at once,
  whether the engine is idle then or still publishing.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import signal
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.bench.redis_server import LocalRedis
from router.core.index import PrefixIndex
from router.core.types import ReplicaKey
from router.events.direct import DirectEvents
from router.events.ingest import EndpointSpec
from router.events.model import EngineBlockStored
from router.events.zmq_pub import KVEventPublisher
from tests.ports import free_port
from tests.procs import Fleet, http_get, token_prompt
from tests.waiting import eventually

ADMIN = "admin-lifecycle"


@pytest.fixture
def fleet(tmp_path: Path) -> Any:
    with Fleet(tmp_path) as f:
        yield f


async def _stream(session: aiohttp.ClientSession, url: str, seed: int, tokens: int) -> str:
    body = {"model": "m", "prompt": token_prompt(seed, 32), "max_tokens": tokens, "stream": True}
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            done = False
            async for line in resp.content:
                done = done or line.startswith(b"data: [DONE]")
            return "done" if done else "truncated"
    except aiohttp.ClientError as exc:
        return f"error:{type(exc).__name__}"


async def _running(mock_url: str) -> int:
    """Requests in the mock engine's running batch (its vLLM gauge)."""
    _, page = await asyncio.to_thread(http_get, mock_url + "/metrics")
    for line in str(page).splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def _refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return False
    except OSError:
        return True


async def test_sigterm_drains_in_flight_streams_and_exits_0(fleet: Fleet) -> None:
    mock = fleet.mock("a")
    router = fleet.router("router", [("a", mock.url)], server={"shutdown_timeout_s": 20.0})
    async with aiohttp.ClientSession() as session:
        # ~300 tokens take ~1.5-2 s on the mock's default profile
        tasks = [asyncio.create_task(_stream(session, router.url, i, 300)) for i in range(4)]

        async def all_running() -> bool:
            return await _running(mock.url) == 4

        await eventually(all_running, message="the streams did not all reach the engine")
        t0 = time.monotonic()
        router.signal(signal.SIGTERM)
        port: int = router.port  # type: ignore[attr-defined]
        await eventually(lambda: _refused(port), message="the listener must close on SIGTERM")
        results = await asyncio.gather(*tasks)
    assert results == ["done"] * 4, results
    code = await asyncio.to_thread(router.wait, 15)
    assert code == 0, router.log()[-2000:]
    assert time.monotonic() - t0 < 15


async def test_sigterm_deadline_cuts_long_streams(fleet: Fleet) -> None:
    mock = fleet.mock("a")
    router = fleet.router("router", [("a", mock.url)], server={"shutdown_timeout_s": 1.0})
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(_stream(session, router.url, 1, 20_000))
        await eventually(lambda: _running(mock.url), message="the stream did not reach the engine")
        t0 = time.monotonic()
        router.signal(signal.SIGTERM)
        code = await asyncio.to_thread(router.wait, 15)
        elapsed = time.monotonic() - t0
        result = await task
    assert code == 0
    assert result.startswith("error:"), result  # cut: an error, never a clean-looking end
    assert elapsed < 6.0, elapsed


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
async def test_a_second_signal_ends_the_drain_at_once(fleet: Fleet, second: int) -> None:
    """SIGTERM drains for up to ``shutdown_timeout_s`` (60 s here); a second SIGTERM or
    SIGINT while it drains (an operator's second Ctrl-C) cuts the streams still running at
    once, as the deadline would, and the process exits 0."""
    mock = fleet.mock("a")
    router = fleet.router("router", [("a", mock.url)], server={"shutdown_timeout_s": 60.0})
    port: int = router.port  # type: ignore[attr-defined]
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(_stream(session, router.url, 1, 20_000))
        await eventually(lambda: _running(mock.url), message="the stream did not reach the engine")
        router.signal(signal.SIGTERM)
        await eventually(lambda: _refused(port), message="the listener must close on SIGTERM")
        assert router.alive()  # draining the stream
        router.signal(second)
        code = await asyncio.to_thread(router.wait, 15)  # well within the 60 s drain
        result = await task
    assert code == 0, router.log()[-2000:]
    assert result.startswith("error:"), result


def _closed_by_peer(sock: socket.socket) -> bool:
    """The server closed ``sock`` (EOF or reset; nothing unread is pending on it)."""
    sock.settimeout(0.05)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def _kept_connection(port: int) -> http.client.HTTPConnection:
    """A connection kept alive after one answer, as a load balancer's pool keeps one."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    assert resp.status == 200 and not resp.will_close
    resp.read()
    return conn


async def test_sigterm_closes_kept_connections_so_no_new_request_lands(fleet: Fleet) -> None:
    """A load balancer sends new requests on the connections it keeps, not only on new
    ones: a drain that closes the listener but keeps those open goes on taking requests
    (and ``/ready`` answers 200 on them) for as long as any stream runs. Idle kept
    connections close at once on SIGTERM; one whose answer is in flight closes at its end
    (``Connection: close`` on answers begun after it)."""
    mock = fleet.mock("a")
    router = fleet.router("router", [("a", mock.url)], server={"shutdown_timeout_s": 30.0})
    port: int = router.port  # type: ignore[attr-defined]
    idle = _kept_connection(port)
    busy = _kept_connection(port)
    body = {"model": "m", "prompt": token_prompt(2, 32), "max_tokens": 300, "stream": True}
    busy.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    async with aiohttp.ClientSession() as session:
        long = asyncio.create_task(_stream(session, router.url, 1, 3000))

        async def both_running() -> bool:
            return await _running(mock.url) == 2

        await eventually(both_running, message="the streams did not reach the engine")
        router.signal(signal.SIGTERM)
        await eventually(lambda: _refused(port), message="the listener must close on SIGTERM")
        assert idle.sock is not None
        await eventually(
            lambda: _closed_by_peer(idle.sock), message="an idle kept connection stayed open"
        )
        resp = await asyncio.to_thread(busy.getresponse)
        assert resp.status == 200
        assert b"data: [DONE]" in await asyncio.to_thread(resp.read)  # its answer runs out
        assert busy.sock is not None
        await eventually(
            lambda: _closed_by_peer(busy.sock), message="a connection stayed open after its answer"
        )
        assert router.alive()  # still draining the stream
        long.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await long
    idle.close()
    busy.close()
    assert await asyncio.to_thread(router.wait, 15) == 0


def _redis(
    server_kind: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    stack: contextlib.ExitStack,
    prefix: str,
) -> tuple[str, str]:
    """(URL, key prefix): the session's 3-node Redis Cluster, or a private redis-server that
    ``stack`` stops."""
    if server_kind == "redis_cluster":
        return request.getfixturevalue("redis_cluster").url, request.getfixturevalue("key_prefix")
    return stack.enter_context(LocalRedis(tmp_path / "redis")).url, prefix


async def _index_blocks(url: str, name: str) -> int:
    code, body = await asyncio.to_thread(
        http_get, url + "/admin/replicas", 2.0, {"Authorization": f"Bearer {ADMIN}"}
    )
    if code != 200:
        return -1
    return sum(r["index_kv_blocks"] for r in body["replicas"] if r["name"] == name)


@pytest.mark.parametrize("server_kind", ["redis", "redis_cluster"])
async def test_idle_engines_history_is_loaded_and_a_restarted_router_recovers_it(
    fleet: Fleet, tmp_path: Path, server_kind: str, request: pytest.FixtureRequest
) -> None:
    """Real ``kvrouter serve`` / ``kvrouter publish`` processes on a private redis-server,
    then on the session's 3-node Redis Cluster (``redis+cluster://``); one fleet checks both
    facts (each process start costs about half a second of CPU).

    A publisher started while its engine is idle must still load what the engine cached
    before: the engine's ZMQ replay buffer holds it, but no new event will come to trigger
    the fetch (a router restart test flaked on a loaded machine for this: its publisher
    subscribed only after the completions, and the index stayed empty). Then a new router
    process, after the first crashed, recovers that index from Redis (the publisher's
    snapshot) and serves."""
    with contextlib.ExitStack() as stack:
        url, prefix = _redis(server_kind, tmp_path, request, stack, "kvrlife")
        mock = fleet.mock("a", events=True)
        async with aiohttp.ClientSession() as session:
            for i in range(8):  # straight to the engine, before any publisher runs
                body = {"model": "m", "prompt": token_prompt(i, 160), "max_tokens": 2}
                async with session.post(mock.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.read()
        fleet.publisher("a", mock, url, prefix=prefix)
        server = {"admin_token": ADMIN, "redis_url": url, "redis_key_prefix": prefix}
        router = fleet.router("router1", [("a", mock.url)], server=server)

        async def loaded() -> bool:  # 8 prompts x 10 full 16-token blocks
            return await _index_blocks(router.url, "a") >= 8 * 10

        await eventually(loaded)
        blocks = await _index_blocks(router.url, "a")
        assert blocks == 80
        router.kill()  # a crash, not a clean stop

        started = time.monotonic()
        router2 = fleet.router("router2", [("a", mock.url)], server=server)

        async def recovered() -> bool:
            return await _index_blocks(router2.url, "a") >= blocks

        await eventually(recovered)
        again = await _index_blocks(router2.url, "a")
        recovered_s = time.monotonic() - started
        print({"router_restart_recovered_blocks": again, "seconds": round(recovered_s, 2)})
        assert again == blocks
        code, _ = await asyncio.to_thread(http_get, router2.url + "/ready")
        assert code == 200

        # the publisher's load samples carry the engine's prefix-cache counters to the router
        async def engine_counters() -> bool:
            _, page = await asyncio.to_thread(http_get, router2.url + "/metrics")
            line = next(
                (ln for ln in str(page).splitlines()
                 if ln.startswith("kvrouter_engine_prefix_cache_queries_tokens_total{")
                 and 'replica="a"' in ln),
                "",
            )  # fmt: skip
            return bool(line) and float(line.rsplit(" ", 1)[1]) >= 8 * 160

        await eventually(engine_counters, message="no engine prefix-cache counters")


async def test_subscriber_started_while_the_engine_publishes_takes_each_batch_once() -> None:
    """The start-up history fetch and the live stream overlap: batches published while the
    replay answer is on its way arrive twice (queued on the SUB socket, and in the history).
    The live copies are duplicates, not an engine restart (a seq far behind the last one),
    and the index ends up with every block."""
    pub = KVEventPublisher(
        f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", buffer_steps=1000
    )
    index = PrefixIndex()
    direct = DirectEvents(index)
    ingest = direct.add_replica("eng", "m", 16, [EndpointSpec(pub.endpoint, pub.replay_endpoint)])
    sub = direct._groups[0].subscribers[0]
    sub.replay_timeout_s = 10.0  # the replay answer is held back below
    tokens = token_prompt(7, 16 * 60)

    def stored(i: int) -> EngineBlockStored:  # engine block i of ``tokens``
        parent = hash(tuple(tokens[: i * 16])) if i else None
        return EngineBlockStored(
            (hash(tuple(tokens[: (i + 1) * 16])),), parent, tuple(tokens[i * 16 : (i + 1) * 16]), 16
        )

    try:
        for i in range(10):  # before the subscriber: only in the replay buffer
            await pub.publish([stored(i)])
        await direct.start()  # subscribes, then asks for the history (not answered yet)
        await asyncio.sleep(0.5)  # ZMQ slow joiner: the SUB is connected after this
        for i in range(10, 60):  # live, while the history request waits
            await pub.publish([stored(i)])
        await asyncio.sleep(0.3)
        pub.start()  # now the replay socket answers: seqs 0-59
        deadline = time.monotonic() + 10
        while index.replica_size(ReplicaKey("eng"))[0] < 60 or sub.stats.messages < 50:
            assert time.monotonic() < deadline, (index.replica_size(ReplicaKey("eng")), sub.stats)
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert sub.stats.replayed == 60 and sub.stats.duplicates == 50, sub.stats
        assert sub.stats.restarts == 0 and ingest.stats.restarts == 0, sub.stats
        assert index.replica_size(ReplicaKey("eng"))[0] == 60
    finally:
        await direct.stop()
        await pub.close()
