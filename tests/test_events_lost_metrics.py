"""What a router following an engine's KV events directly tells operators about the losses
that clear a replica's index entries: batches lost beyond the engine's replay
(``kvrouter_events_lost_batches_total``, alert ``KVRouterEventsLost``) and engine restarts
found by sequence (``kvrouter_events_engine_restarts_total``). Before, only publishers
counted them: a router in direct mode cleared replicas without a trace on its page (real
ZMQ, a real router, its /metrics as Prometheus scrapes it)."""

from __future__ import annotations

import random

import aiohttp

from router.core.types import ReplicaKey
from router.events.model import EngineBlockStored
from router.events.zmq_pub import KVEventPublisher
from router.service.app import STATE
from router.service.config import build_settings
from tests.backends import metric_sample, start_router
from tests.ports import free_port
from tests.waiting import eventually

LOST = "kvrouter_events_lost_batches_total"
RESTARTS = "kvrouter_events_engine_restarts_total"


def _stored(rng: random.Random) -> list[EngineBlockStored]:
    tokens = tuple(rng.randrange(1, 9999) for _ in range(64))
    return [EngineBlockStored((rng.getrandbits(63),), None, tokens, 64)]


async def test_lost_batches_and_engine_restarts_are_counted_per_replica() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(endpoint)  # no replay socket: a gap cannot be refilled
    settings = build_settings(
        {
            "replicas": [{"url": "http://127.0.0.1:9", "model": "m", "name": "a", "zmq": endpoint}],
            "models": {"m": {"block_size": 64}},
        }
    )
    router, url = await start_router(settings)
    state = router.app[STATE]
    rng = random.Random(3)

    async def page() -> str:
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
            return await resp.text()

    async def counted(name: str) -> float | None:
        return metric_sample(await page(), name, replica="a")

    try:

        async def subscribed() -> bool:
            await pub.publish(_stored(rng))  # again until one gets through (slow joiner)
            return state.index.replica_size(ReplicaKey("a"))[0] > 0

        await eventually(subscribed, interval=0.1)
        assert await counted(LOST) == 0.0 and await counted(RESTARTS) == 0.0
        pub.drop_next = 3  # three batches never reach the subscriber
        for _ in range(4):
            await pub.publish(_stored(rng))

        async def lost() -> bool:
            return await counted(LOST) == 3.0

        await eventually(lost)
        await pub.close()  # the engine restarts on the same port: its seqs start again
        pub = KVEventPublisher(endpoint)

        async def restarted() -> bool:
            await pub.publish(_stored(rng))
            return await counted(RESTARTS) == 1.0

        await eventually(restarted, interval=0.1)
        assert await counted(LOST) == 3.0  # a restart is no loss
    finally:
        await router.cleanup()
        await pub.close()
