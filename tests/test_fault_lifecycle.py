"""Router process life cycle, with real processes on loopback.

* SIGTERM: the listener closes at once (new connections are refused), in-flight streams run
  to their ``[DONE]``, and the process exits 0; a stream longer than
  ``server.shutdown_timeout_s`` is cut at the deadline and the process still exits 0.
* Router restart with Redis (``server.redis_url``): a new router process recovers the index
  from Redis (the publisher's snapshot) and serves within seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.store.local_redis import LocalRedis
from tests.procs import Fleet, http_get, token_prompt

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
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        router.signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        assert _refused(router.port), "the listener must close on SIGTERM"  # type: ignore[attr-defined]
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
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        router.signal(signal.SIGTERM)
        code = await asyncio.to_thread(router.wait, 15)
        elapsed = time.monotonic() - t0
        result = await task
    assert code == 0
    assert result != "done"  # cut, and never mistaken for a complete answer
    assert elapsed < 6.0, elapsed


async def _index_blocks(url: str, name: str) -> int:
    code, body = await asyncio.to_thread(
        http_get, url + "/admin/replicas", 2.0, {"Authorization": f"Bearer {ADMIN}"}
    )
    if code != 200:
        return -1
    return sum(r["index_kv_blocks"] for r in body["replicas"] if r["name"] == name)


@pytest.mark.parametrize("server_kind", ["redis", "redis_cluster"])
async def test_router_restart_recovers_index_from_redis(
    fleet: Fleet, tmp_path: Path, server_kind: str, request: pytest.FixtureRequest
) -> None:
    """Real ``kvrouter serve`` / ``kvrouter publish`` processes on a private redis-server,
    then on the session's 3-node Redis Cluster (``redis+cluster://``)."""
    with contextlib.ExitStack() as stack:
        if server_kind == "redis_cluster":
            url = request.getfixturevalue("redis_cluster").url
            prefix = request.getfixturevalue("key_prefix")
        else:
            url = stack.enter_context(LocalRedis(tmp_path / "redis")).url
            prefix = "kvrlife"
        mock = fleet.mock("a", events=True)
        fleet.publisher("a", mock, url, prefix=prefix)
        server = {"admin_token": ADMIN, "redis_url": url, "redis_key_prefix": prefix}
        router = fleet.router("router1", [("a", mock.url)], server=server)
        async with aiohttp.ClientSession() as session:
            for i in range(8):  # fill the mock's cache; events flow to Redis, then the router
                body = {"model": "m", "prompt": token_prompt(i, 160), "max_tokens": 2}
                async with session.post(router.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.read()

        async def filled() -> int:
            return await _index_blocks(router.url, "a")

        t0 = time.monotonic()
        while (blocks := await filled()) < 8 * 10 and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.1)
        assert blocks >= 80, blocks  # 8 prompts x 10 full 16-token blocks
        router.kill()  # a crash, not a clean stop

        started = time.monotonic()
        router2 = fleet.router("router2", [("a", mock.url)], server=server)
        while (again := await _index_blocks(router2.url, "a")) < blocks:
            assert time.monotonic() - started < 10, again
            await asyncio.sleep(0.05)
        recovered_s = time.monotonic() - started
        print({"router_restart_recovered_blocks": again, "seconds": round(recovered_s, 2)})
        assert again == blocks
        assert recovered_s < 10
        code, _ = await asyncio.to_thread(http_get, router2.url + "/ready")
        assert code == 200
        # the publisher's load samples carry the engine's prefix-cache counters to the router
        deadline = time.monotonic() + 10
        while True:
            _, page = await asyncio.to_thread(http_get, router2.url + "/metrics")
            line = next(
                (ln for ln in str(page).splitlines()
                 if ln.startswith("kvrouter_engine_prefix_cache_queries_tokens_total{")
                 and 'replica="a"' in ln),
                "",
            )  # fmt: skip
            if line and float(line.rsplit(" ", 1)[1]) >= 8 * 160:
                break
            assert time.monotonic() < deadline, line or "no engine prefix-cache counters"
            await asyncio.sleep(0.1)
