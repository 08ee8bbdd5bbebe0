"""What a worker that replaces a killed one (``server.workers > 1``) takes from the others
before it listens: state that lives in each worker's memory and that the router's answers
promise for every worker. Real ``kvrouter serve`` processes on loopback, a real Redis for
the discovered replicas; the order of a replacement's start-up in this process, with a peer
worker's control socket whose answer the test holds.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import grpc
import pytest

from router.rpc.gen import router_pb2, router_pb2_grpc
from router.service.app import create_app, start
from router.service.config import build_settings
from router.service.control import DRAINED_PATH, join_workers
from router.service.workers import PIDS_FILE, Workers
from router.store.base import ReplicaInfo
from router.store.redis_store import RedisStore
from router.store.schema import KeySchema
from tests.backends import Backend
from tests.ports import free_port
from tests.procs import Fleet
from tests.test_workers_admin import call, replacement, start_router, worker_pids
from tests.waiting import eventually


@pytest.fixture
def fleet(tmp_path: Path) -> Any:
    with Fleet(tmp_path) as f:
        yield f


async def test_a_replacement_keeps_a_whole_replica_drain_for_its_later_ranks(
    fleet: Fleet, redis_url: str, key_prefix: str
) -> None:
    """``POST /admin/replicas/a/drain`` of a discovered replica also covers the DP ranks it
    registers later (docs/service.md). The worker that replaces a killed one must take that
    too, not only the ranks drained then: else it routes to the new ranks of a replica
    under maintenance while every other worker keeps away."""
    b = await Backend("a", ["m"]).start()
    publisher = RedisStore.from_url(redis_url, KeySchema(key_prefix))
    try:
        await publisher.register(ReplicaInfo("a", url=b.url, model="m"), "pub-a", 30)
        server = {"redis_url": redis_url, "redis_key_prefix": key_prefix}
        proc = await start_router(fleet, [], workers=2, engine="fast", server=server)

        async def drained_on_both() -> bool:
            # (idempotent: a worker still learning its peer, or the replica from Redis, on a
            # loaded machine answers 502 "retry it")
            status, out = await call(proc, "POST", "/admin/replicas/a/drain")
            return status == 200 and out["workers_applied"] == 2

        await eventually(drained_on_both, timeout=20, message="the drain never reached both")
        dead, alive = sorted(await worker_pids(proc, 2))
        os.kill(dead, signal.SIGKILL)  # a worker of the router this test started
        new = await replacement(proc, dead, alive)
        # the publisher's engine comes back with two ranks (a rolling update)
        await publisher.register(
            ReplicaInfo("a", url=b.url, model="m", dp_ranks=(0, 1)), "pub-a", 30
        )

        async def both_ranks_everywhere() -> dict[int, dict[str, bool]]:
            views = {
                pid: {r["replica"]: r["draining"] for r in answer["replicas"]}
                for pid, answer in (await worker_pids(proc, 2)).items()
            }
            assert set(views) == {alive, new}, views
            return views if all(len(v) == 2 for v in views.values()) else {}

        await eventually(both_ranks_everywhere, timeout=20)
        views = await both_ranks_everywhere()
        assert views[alive] == {"a": True, "a#dp1": True}, views
        assert views[new] == {"a": True, "a#dp1": True}, views
    finally:
        await publisher.close()
        await b.stop()


async def test_a_replacement_serves_grpc_only_once_it_has_the_drains(tmp_path: Path) -> None:
    """The gRPC port, as the HTTP port, opens once the replacement took the others' drains:
    bound before (SO_REUSEPORT hands it its share of the gateways' connections at once), it
    answered Picks with a replica every other worker holds drained."""
    group = Workers(str(tmp_path), 2)
    peer = 1  # the other worker's pid, as the parent lists it (never this process's)
    (tmp_path / PIDS_FILE).write_text(f"{os.getpid()}\n{peer}\n")
    asked, release = asyncio.Event(), asyncio.Event()

    async def other_worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.split()[1] == DRAINED_PATH.encode():
            asked.set()
            await release.wait()
            body = json.dumps({"drained": ["b1"], "drained_replicas": ["b1"]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        else:
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    peer_server = await asyncio.start_unix_server(other_worker, group.socket(peer))
    grpc_port = free_port()
    settings = build_settings(
        {
            "server": {"grpc_port": grpc_port, "load_share_interval_s": 0, "health_interval_s": 0},
            "replicas": [
                {"name": "b0", "url": "http://127.0.0.1:9", "model": "m"},
                {"name": "b1", "url": "http://127.0.0.1:10", "model": "m"},
            ],
            "models": {"m": {"block_size": 16, "policy": "round_robin"}},
        }
    )
    app = create_app(settings)
    join_workers(app, group, 1, replacing=True)
    starting = asyncio.ensure_future(start(app, "127.0.0.1", 0))
    try:
        await asyncio.wait_for(asked.wait(), 20)
        picked = []
        for i in range(4):  # (round robin: b0, b1, ... were the port open)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                pick = router_pb2.PickRequest(
                    model="m", token_ids=router_pb2.TokenIds(ids=[i] * 40)
                )
                try:
                    got = await router_pb2_grpc.RouterStub(channel).Pick(pick, timeout=10)
                    picked.append(got.replica)
                except grpc.aio.AioRpcError as exc:
                    picked.append(exc.code().name)
        release.set()
        running = await starting
        try:
            assert picked == ["UNAVAILABLE"] * 4, picked  # not listening yet
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                for i in range(4):
                    pick = router_pb2.PickRequest(
                        model="m", token_ids=router_pb2.TokenIds(ids=[i] * 40)
                    )
                    assert (await stub.Pick(pick, timeout=10)).replica == "b0"
        finally:
            await running.cleanup(0)
    finally:
        release.set()
        if not starting.done():
            starting.cancel()
        peer_server.close()
