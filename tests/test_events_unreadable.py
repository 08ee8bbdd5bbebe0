"""Batches the router cannot read in full, over real ZMQ: what they would have removed is
unknown, so they clear the engine as a lost batch does (docs/publisher.md, "Sequence gaps,
replay, restarts"); a store it cannot read is only missing, and clears nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest

from router.core.index import PrefixIndex
from router.events.direct import DirectEvents
from router.events.ingest import EndpointSpec
from router.events.model import EngineBlockStored
from router.events.zmq_pub import KVEventPublisher
from tests.ports import free_port
from tests.test_events_zmq import KEY, B, Engine, canonical
from tests.waiting import eventually


@pytest.fixture
async def pub() -> AsyncIterator[KVEventPublisher]:
    p = KVEventPublisher(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    p.start()
    yield p
    await p.close()


@pytest.fixture
async def direct(pub: KVEventPublisher) -> AsyncIterator[DirectEvents]:
    d = DirectEvents(PrefixIndex())
    d.add_replica("eng", "m", B, [EndpointSpec(pub.endpoint, pub.replay_endpoint)])
    await d.start()
    yield d
    await d.stop()


def _raw_stored(ev: EngineBlockStored) -> list[Any]:
    """vLLM's array layout of a ``BlockStored`` (tag first, trailing defaults omitted)."""
    return ["BlockStored", list(ev.block_hashes), ev.parent_block_hash, list(ev.token_ids), 16]


def _raw_removed(ev: EngineBlockStored) -> list[Any]:
    return ["BlockRemoved", list(ev.block_hashes), "GPU"]


def _blocks(direct: DirectEvents, tokens: list[int]) -> int:
    return direct.index.match(canonical(tokens)).get(KEY).kv_blocks


async def _stored(pub: KVEventPublisher, direct: DirectEvents, tokens: list[int]) -> None:
    await pub.publish([Engine().stored(tokens, 0, 4)])
    await eventually(lambda: _blocks(direct, tokens) == 2)


async def test_an_unreadable_batch_clears_the_engine_as_a_lost_one(
    pub: KVEventPublisher, direct: DirectEvents
) -> None:
    eng = Engine()
    a, b = eng.prompt(4), eng.prompt(4)
    await _stored(pub, direct, a)
    # the batch that evicts ``a``, with a timestamp the decoder refuses: the whole batch is
    # unusable, and what it removed cannot be known
    await pub.publish_raw(msgpack.packb(["late", [_raw_removed(eng.stored(a, 0, 4))]]))
    await _stored(pub, direct, b)
    assert _blocks(direct, a) == 0  # not kept as if still cached
    stats = direct.ingests["eng"].stats
    assert stats.malformed_payloads == 1 and stats.lost_batches == 1


async def test_an_unreadable_removal_clears_the_engine_and_the_rest_of_its_batch_applies(
    pub: KVEventPublisher, direct: DirectEvents
) -> None:
    eng = Engine()
    a, b, c = eng.prompt(4), eng.prompt(4), eng.prompt(4)
    await _stored(pub, direct, a)
    removal = _raw_removed(eng.stored(a, 0, 4))
    removal[1] = {"not": "a list"}  # its block_hashes unreadable
    stored_b, stored_c = _raw_stored(eng.stored(b, 0, 4)), _raw_stored(eng.stored(c, 0, 4))
    await pub.publish_raw(msgpack.packb([1.0, [stored_b, removal, stored_c]]))
    await eventually(lambda: _blocks(direct, c) == 2)
    assert _blocks(direct, a) == 0
    # before the unreadable removal: cleared with the rest (it may have removed them)
    assert _blocks(direct, b) == 0
    stats = direct.ingests["eng"].stats
    assert stats.malformed_events == 1 and stats.lost_batches == 1


async def test_an_unreadable_store_is_skipped_without_clearing(
    pub: KVEventPublisher, direct: DirectEvents
) -> None:
    eng = Engine()
    a, b = eng.prompt(4), eng.prompt(4)
    await _stored(pub, direct, a)
    bad = _raw_stored(eng.stored(b, 0, 4))
    bad[3] = "not tokens"
    await pub.publish_raw(msgpack.packb([1.0, [bad]]))
    c = eng.prompt(4)
    await _stored(pub, direct, c)
    assert _blocks(direct, a) == 2 and _blocks(direct, b) == 0
    stats = direct.ingests["eng"].stats
    assert stats.malformed_events == 1 and stats.lost_batches == 0
