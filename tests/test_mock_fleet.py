"""Mock replicas + publishers + Redis + two routers, in process and as real CLI processes."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web

from router.bench.redis_server import LocalRedis
from router.core.hashing import hash_prompt, root_hash
from router.core.index import PrefixIndex
from router.core.load import LoadTracker
from router.core.types import ReplicaKey
from router.events.ingest import EndpointSpec
from router.mock.server import MockSettings, create_app
from router.publisher.publisher import Publisher, PublisherSettings
from router.store.base import ReplicaInfo
from router.store.redis_store import RedisStore
from router.store.schema import KeySchema
from router.store.sync import IndexSync
from router.store.sync_listener import LoadTrackerListener
from tests.ports import free_port
from tests.waiting import eventually

B = 64
FAST = {"audit_interval_s": 0.1, "block_s": 0.05}


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


@pytest.mark.parametrize("server", ["redis", "redis_cluster"])
async def test_two_routers_publishers_and_mock_replicas_converge(
    server: str, request: pytest.FixtureRequest, key_prefix: str
) -> None:
    redis_url = (
        request.getfixturevalue("redis_cluster").url
        if server == "redis_cluster"
        else request.getfixturevalue("redis_url")
    )
    schema = KeySchema(key_prefix, stream_shards=4)
    runners, publishers, stores, clients = [], [], [], []
    try:
        for name, be, enc in (("mock-1", 16, "array"), ("mock-2", 128, "map")):
            s = MockSettings(
                model="m",
                replica=name,
                block_size=B,
                engine_block_size=be,
                encoding=enc,
                zmq_endpoint=f"tcp://127.0.0.1:{free_port()}",
                replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
            )
            runner = web.AppRunner(create_app(s))
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            url = f"http://127.0.0.1:{port}"
            clients.append(
                openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
            )
            store = RedisStore.from_url(redis_url, schema)
            stores.append(store)
            pub = Publisher(
                PublisherSettings(
                    ReplicaInfo(name, url=url, model="m", block_size=B),
                    (EndpointSpec(s.zmq_endpoint, s.replay_endpoint),),
                    engine_metrics_url=f"{url}/metrics",
                    load_interval_s=0.1,
                ),
                store,
            )
            await pub.start()
            publishers.append(pub)
        routers = [PrefixIndex(), PrefixIndex()]
        trackers = [LoadTracker(), LoadTracker()]
        syncs = []
        for index, tracker in zip(routers, trackers, strict=True):
            store = RedisStore.from_url(redis_url, schema)
            stores.append(store)
            sync = IndexSync(store, index, listener=LoadTrackerListener(tracker), **FAST)
            await sync.start()
            syncs.append(sync)
        await asyncio.sleep(0.3)
        prompts = [_prompt(i, 6 * B + 3) for i in range(4)]
        for i, prompt in enumerate(prompts):
            await clients[i % 2].completions.create(model="m", prompt=prompt, max_tokens=2)
        hashes = [hash_prompt(p, B, root_hash("m")).hashes for p in prompts]
        for index in routers:
            for i, hs in enumerate(hashes):
                key = ReplicaKey(f"mock-{i % 2 + 1}")
                other = ReplicaKey(f"mock-{2 - i % 2}")
                await eventually(
                    lambda index=index, hs=hs, key=key: index.match(hs).get(key).kv_blocks == 6
                )
                assert index.match(hs).get(other).kv_blocks == 0
        for tracker in trackers:
            await eventually(
                lambda tracker=tracker: tracker.view(ReplicaKey("mock-2"), 0).engine is not None
            )
        # A router restarted mid-run recovers the index from Redis.
        await syncs[0].stop()
        fresh = PrefixIndex()
        store = RedisStore.from_url(redis_url, schema)
        stores.append(store)
        async with IndexSync(store, fresh, **FAST):
            for i, hs in enumerate(hashes):
                assert fresh.match(hs).get(ReplicaKey(f"mock-{i % 2 + 1}")).kv_blocks == 6
        await syncs[1].stop()
    finally:
        for pub in publishers:
            await pub.stop()
        for client in clients:
            await client.close()
        for runner in runners:
            await runner.cleanup()
        for store in stores:
            await store.close()


async def test_cli_processes_mock_replica_and_publish(tmp_path: Path) -> None:
    """``kvrouter mock-replica`` + ``kvrouter publish`` as real processes, Redis with AUTH."""
    exe = [sys.executable, "-m", "router.cli"]
    http, zport, rport = free_port(), free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with LocalRedis(tmp_path / "redis", password="pw") as redis:
        mock = subprocess.Popen(
            [
                *exe,
                "mock-replica",
                "--port",
                str(http),
                "--model",
                "m",
                "--replica",
                "cli-1",
                "--zmq",
                f"tcp://127.0.0.1:{zport}",
                "--replay",
                f"tcp://127.0.0.1:{rport}",
                "--engine-block-size",
                "32",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        pub = subprocess.Popen(
            [
                *exe,
                "publish",
                "--replica",
                "cli-1",
                "--model",
                "m",
                "--url",
                f"http://127.0.0.1:{http}",
                "--zmq",
                f"tcp://127.0.0.1:{zport}",
                "--replay",
                f"tcp://127.0.0.1:{rport}",
                "--redis",
                redis.url,
                "--engine-metrics",
                f"http://127.0.0.1:{http}/metrics",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        store = RedisStore.from_url(redis.url)
        index = PrefixIndex()
        try:
            async with aiohttp.ClientSession() as session:
                for _ in range(100):
                    try:
                        async with session.get(f"http://127.0.0.1:{http}/health") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        await asyncio.sleep(0.1)
            async with IndexSync(store, index, **FAST):
                await eventually(lambda: ReplicaKey("cli-1") in index)
                await asyncio.sleep(0.3)
                client = openai.AsyncOpenAI(
                    base_url=f"http://127.0.0.1:{http}/v1", api_key="x", max_retries=0
                )
                prompt = _prompt(9, 5 * B)
                await client.completions.create(model="m", prompt=prompt, max_tokens=1)
                await client.close()
                hs = hash_prompt(prompt, B, root_hash("m")).hashes
                await eventually(lambda: index.match(hs).get(ReplicaKey("cli-1")).kv_blocks == 5)
        finally:
            await store.close()
            for proc in (pub, mock):
                proc.terminate()
            for proc in (pub, mock):
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        assert pub.returncode == 0, pub.stderr.read().decode()[-2000:] if pub.stderr else ""
