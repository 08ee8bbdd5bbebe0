"""Gaps and restarts against the engines' own publishers (``ZmqEventPublisher`` of vLLM and
SGLang, tests/engines), two data-parallel ranks: a gap the engine's replay buffer no longer
holds, and an engine restart (its seqs from 0 again), each clear their own rank and no other;
what the rank stores afterwards is indexed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from router.core.index import PrefixIndex
from router.core.types import ReplicaKey
from tests.engines.harness import RefEngine
from tests.test_engine_replay import Ports, _follow, _until_live, canonical, engine_name
from tests.waiting import eventually

__all__ = ["engine_name"]  # the fixture, parametrized over the engines


@pytest.fixture
def engines() -> Iterator[list[RefEngine]]:
    made: list[RefEngine] = []
    yield made
    for eng in made:
        eng.close()


def _blocks(index: PrefixIndex, tokens: list[int], rank: int) -> int:
    return index.match(canonical(tokens)).get(ReplicaKey("eng", rank)).kv_blocks


async def test_a_gap_past_the_buffer_and_a_restart_clear_their_own_rank_only(
    engine_name: str, engines: list[RefEngine]
) -> None:
    ports = Ports(ranks=2)
    ranks = [
        RefEngine(engine_name, ports.pub, ports.replay, dp_rank=r, seed=r, buffer_steps=4)
        for r in range(2)
    ]
    engines.extend(ranks)
    index = PrefixIndex()
    direct = await _follow(ports, index, ranks=2)
    try:
        await _until_live(direct, ranks)
        a = [eng.prompt(4) for eng in ranks]
        for eng, tokens in zip(ranks, a, strict=True):
            eng.publish(eng.stored(tokens))
        for r in range(2):
            await eventually(lambda r=r: _blocks(index, a[r], r) == 2)
        # rank 0: six batches never reach the subscriber; its buffer keeps four, the last of
        # them the one that shows the gap: three are lost
        # one of them evicts ``a``
        eng0 = ranks[0]
        eng0.wire.drop = 6
        eng0.publish(eng0.removed(a[0], 0, 4))
        for _ in range(5):
            eng0.publish()
        b = eng0.prompt(4)
        eng0.publish(eng0.stored(b))
        await eventually(lambda: _blocks(index, b, 0) == 2)
        assert _blocks(index, a[0], 0) == 0  # cleared: the batches lost could have evicted it
        assert _blocks(index, a[1], 1) == 2  # the other rank untouched
        ingest = direct.ingests["eng"]
        assert ingest.stats.lost_batches == 3 and ingest.stats.restarts == 0
        # rank 0's engine restarts: a new publisher on the same ports counts from 0 again
        eng0.close()
        engines.remove(eng0)
        made: list[RefEngine] = []

        def bound() -> bool:  # ZMQ's I/O thread releases the old engine's ports soon
            try:
                made.append(RefEngine(engine_name, ports.pub, ports.replay, seed=7))
            except zmq.ZMQError:
                return False
            return True

        await eventually(bound)
        eng0 = made[0]
        engines.append(eng0)
        c = eng0.prompt(4)
        eng0.publish(eng0.stored(c))
        await eventually(lambda: _blocks(index, c, 0) == 2)
        await eventually(lambda: ingest.stats.restarts == 1)
        assert _blocks(index, b, 0) == 0  # the old engine's blocks are gone with it
        assert _blocks(index, a[1], 1) == 2
        assert ingest.stats.lost_batches == 3
    finally:
        await direct.stop()
