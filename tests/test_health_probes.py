"""Active ``/health`` probing at fleet scale: replicas that hang do not slow the detection of
one that dies (probes run concurrently), and a replica's DP ranks share one probe."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from router.core.types import ReplicaKey
from router.service.app import STATE
from router.service.config import build_settings
from tests.backends import Backend, kimi_model_table, start_router
from tests.waiting import eventually

MODEL = "kimi-test"


async def test_a_dead_replica_is_seen_within_a_sweep_while_others_hang() -> None:
    hanging: list[asyncio.Server] = []
    probed: dict[int, int] = {}

    def hang(
        port_box: list[int],
    ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            probed[port_box[0]] = probed.get(port_box[0], 0) + 1
            await asyncio.sleep(3600)  # accepts, never answers

        return handler

    for _ in range(10):
        box: list[int] = []
        server = await asyncio.start_server(hang(box), "127.0.0.1", 0)
        box.append(server.sockets[0].getsockname()[1])
        hanging.append(server)
    dying = await Backend("dying", [MODEL]).start()
    replicas = [
        {
            "url": f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}",
            "model": MODEL,
            "name": f"h{i}",
        }
        for i, s in enumerate(hanging)
    ] + [{"url": dying.url, "model": MODEL, "name": "dying", "dp_ranks": 4}]
    settings = build_settings(
        {
            "server": {"health_interval_s": 1.0},
            "replicas": replicas,
            "models": {MODEL: kimi_model_table()},
        }
    )
    runner, _ = await start_router(settings)
    try:
        state = runner.app[STATE]
        keys = [ReplicaKey("dying", r) for r in range(4)]
        await eventually(lambda: len(probed) == 10)  # a sweep with everybody up
        assert all(state.load.view(k, 0.0).healthy for k in keys)
        await dying.stop()
        await eventually(
            lambda: not any(state.load.view(k, 0.0).healthy for k in keys),
            4.0,
            message="a dead replica must be seen within ~2 sweeps",
        )
        # one probe per hanging URL per sweep (not one per key, not serialised)
        assert all(n >= 1 for n in probed.values()) and len(probed) == 10
    finally:
        await runner.cleanup()
        for server in hanging:
            server.close()
