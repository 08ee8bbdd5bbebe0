"""What a worker that replaces a killed one (``server.workers > 1``) takes from the others
before it listens: state that lives in each worker's memory and that the router's answers
promise for every worker. Real ``kvrouter serve`` processes on loopback, a real Redis for
the discovered replicas.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from router.store.base import ReplicaInfo
from router.store.redis_store import RedisStore
from router.store.schema import KeySchema
from tests.backends import Backend
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
        status, out = await call(proc, "POST", "/admin/replicas/a/drain")
        assert status == 200 and out["workers_applied"] == 2, out
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
