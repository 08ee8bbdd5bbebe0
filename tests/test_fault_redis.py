"""Redis killed under steady load, with real processes: ``kvrouter serve`` (``redis_url``) in
front of two ``kvrouter mock-replica`` processes whose KV events reach Redis through two
``kvrouter publish`` sidecars, and a private ``redis-server``.

While Redis is dead (SIGKILL) no client request fails and the router keeps routing on its
local index and load. Redis comes back empty on the same port; the publishers re-register
and republish, the router notices the new instance token and re-bootstraps: its index equals
the publishers' state again (``-m soak``: within 5 s). Default: a 1.5 s outage; ``-m soak``: 30 s.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.bench.redis_server import LocalRedis
from tests.procs import Fleet, http_get, token_prompt
from tests.waiting import eventually

ADMIN = "admin-redis-fault"
PREFIX = "kvrfault"


@pytest.fixture
def fleet(tmp_path: Path) -> Any:
    with Fleet(tmp_path) as f:
        yield f


async def _router_blocks(url: str) -> dict[str, int]:
    code, body = await asyncio.to_thread(
        http_get, url + "/admin/replicas", 2.0, {"Authorization": f"Bearer {ADMIN}"}
    )
    assert code == 200, body
    return {r["name"]: r["index_kv_blocks"] for r in body["replicas"]}


async def _publisher_blocks(url: str) -> int:
    code, text = await asyncio.to_thread(http_get, url + "/metrics", 2.0)
    if code != 200:
        return -1
    m = re.search(r'kvrouter_publisher_cached_blocks\{dp_rank="0",kind="kv"\} ([0-9.e+]+)', text)
    return int(float(m.group(1))) if m else -1


async def _sync_up(url: str) -> float | None:
    """The router's ``kvrouter_index_sync_up`` gauge (None: not on the page)."""
    code, text = await asyncio.to_thread(http_get, url + "/metrics", 2.0)
    assert code == 200, text
    m = re.search(r"^kvrouter_index_sync_up ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else None


class Load:
    """Closed-loop clients sending short completions over a pool of shared prefixes."""

    def __init__(self, url: str, workers: int = 6) -> None:
        self.url = url
        self.workers = workers
        self.ok = 0
        self.failed: list[str] = []
        self.running = True
        self.n = 0

    async def _worker(self, session: aiohttp.ClientSession, w: int) -> None:
        while self.running:
            self.n += 1
            prompt = token_prompt(self.n % 40, 96) + token_prompt(self.n, 32)
            body = {"model": "m", "prompt": prompt, "max_tokens": 2}
            try:
                async with session.post(self.url + "/v1/completions", json=body) as resp:
                    await resp.read()
                    if resp.status == 200:
                        self.ok += 1
                    else:
                        self.failed.append(f"{resp.status}")
            except aiohttp.ClientError as exc:
                self.failed.append(type(exc).__name__)

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            await asyncio.gather(*(self._worker(session, w) for w in range(self.workers)))


async def _outage(fleet: Fleet, tmp_path: Path, outage_s: float) -> dict[str, Any]:
    redis = LocalRedis(tmp_path / "redis").start()
    try:
        mocks = {n: fleet.mock(n, events=True) for n in ("a", "b")}
        pubs = {
            n: fleet.publisher(n, m, redis.url, prefix=PREFIX, metrics=True)
            for n, m in mocks.items()
        }
        router = fleet.router(
            "router",
            [(n, m.url) for n, m in mocks.items()],
            server={"admin_token": ADMIN, "redis_url": redis.url, "redis_key_prefix": PREFIX},
        )
        load = Load(router.url)
        runner = asyncio.create_task(load.run())

        async def indexed() -> bool:  # both replicas' events reached the router via Redis
            return all(v > 0 for v in (await _router_blocks(router.url)).values())

        await eventually(indexed, 15)
        assert await _sync_up(router.url) == 1.0
        before = await _router_blocks(router.url)
        ok_before = load.ok

        assert redis.process is not None
        redis.process.kill()  # SIGKILL: no goodbye
        redis.process.wait()
        redis.process = None
        await asyncio.sleep(outage_s)
        # serving from its last view, and saying so

        async def sync_down() -> bool:
            return await _sync_up(router.url) == 0.0

        await eventually(sync_down, 10, message="kvrouter_index_sync_up not 0 during the outage")
        during = await _router_blocks(router.url)
        ok_during = load.ok - ok_before
        failed_during = list(load.failed)

        restarted = time.monotonic()
        await asyncio.to_thread(redis.start)  # same port, empty dataset
        ok_restart = load.ok
        await eventually(lambda: load.ok >= ok_restart + 20, 15)  # load goes on meanwhile
        load.running = False
        await runner

        async def converged() -> bool:
            rb = await _router_blocks(router.url)
            for n, p in pubs.items():
                if rb.get(n) != await _publisher_blocks(p.url) or rb.get(n, 0) <= 0:
                    return False
            return True

        await eventually(converged, 15, message="router and publishers' blocks differ")
        resync_s = time.monotonic() - restarted

        async def sync_up() -> bool:
            return await _sync_up(router.url) == 1.0

        await eventually(sync_up, 10, message="kvrouter_index_sync_up not 1 again")
        return {
            "outage_s": outage_s,
            "requests_ok": load.ok,
            "requests_ok_during_outage": ok_during,
            "failed": len(load.failed),
            "failed_during": failed_during,
            "index_before": before,
            "index_during": during,
            "resync_s": round(resync_s, 2),
        }
    finally:
        redis.stop()


def _check(result: dict[str, Any]) -> None:
    print(result)
    assert result["failed"] == 0, result
    assert result["requests_ok_during_outage"] > 0
    # the local index keeps serving while Redis is away
    assert all(v > 0 for v in result["index_during"].values())


async def test_redis_outage_under_load(fleet: Fleet, tmp_path: Path) -> None:
    _check(await _outage(fleet, tmp_path, 1.5))  # resynchronised: within the wait's bound


@pytest.mark.soak
async def test_soak_redis_outage_30s(fleet: Fleet, tmp_path: Path) -> None:
    result = await _outage(fleet, tmp_path, 30.0)
    _check(result)
    assert result["resync_s"] <= 5.0
