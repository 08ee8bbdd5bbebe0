"""EAGLE / MTP engines that hash with lookahead tokens give back no block of a hit.

vLLM >= 0.33 with prefix caching (and no KV connector, or one supporting it) hashes each
block together with the token(s) its drafter reads after it (``num_hash_lookahead_tokens``)
and then turns its EAGLE block drop off (``Scheduler.__init__``: "Lookahead hashes prove
the boundary token, so EAGLE needs no drop"); its events carry ``lookahead_token_ids``. The
router learns that from the events (direct mode: ``EngineIngest.on_facts``; Redis mode:
the publisher's ``ReplicaInfo.lookahead_tokens``) and stops giving back a block where
``[models.NAME] eagle = true`` would (router/core/learned_layout.py ``drops_eagle_block``). vLLM's
own event classes, unmodified, publish over real ZMQ; a real Redis in Redis mode.

SGLang's EAGLE engines key each position's KV by the pair (its token, the next one)
(``RadixKey.is_bigram``) and publish those pairs as ``token_ids``: the same rule, read as
tokens plus one lookahead token a block (router/events/decode.py ``_bigrams``).
"""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest

from router.core.index import PrefixIndex
from router.core.load import LoadTracker
from router.core.policies import make_policy
from router.core.routing import RoutingEngine
from router.core.routing_settings import RoutingSettings
from router.core.state_layout import SOURCE_ENGINE, SOURCE_REGISTRY
from router.core.types import ReplicaKey, RouteRequest
from router.events.decode import decode_payload
from router.events.direct import DirectEvents
from router.events.encode import encode_batch
from router.events.model import EngineBatch, EngineBlockStored
from router.publisher.publisher import Publisher, PublisherSettings
from router.service.layout import ModelLayouts
from router.service.state_gauges import layout_metrics
from router.store.base import ReplicaInfo
from router.store.redis_store import RedisStore
from router.store.sync import IndexSync
from tests.engines.harness import RefEngine
from tests.test_engine_replay import Ports, canonical
from tests.test_engine_replay import engines as engines  # fixtures
from tests.test_engine_replay import store as store
from tests.waiting import eventually

B = 32  # router block: two 16-token engine blocks (tests.test_engine_replay's)
MODEL = "m"
KEY = ReplicaKey("eng")


def _routing(eagle: bool) -> RoutingEngine:
    settings = RoutingSettings(block_size=B, hybrid=False, eagle=eagle)
    return RoutingEngine(PrefixIndex(), LoadTracker(), make_policy("ours"), settings)


async def _follow(
    engine: str, engines: list[RefEngine]
) -> tuple[RefEngine, RoutingEngine, ModelLayouts, DirectEvents]:
    """``engine``'s own publisher, followed in direct mode by a model with ``eagle = true``
    whose layouts learn lookahead hashes from the events (started)."""
    ports = Ports()
    eng = RefEngine(engine, ports.pub, ports.replay)
    engines.append(eng)
    routing = _routing(eagle=True)
    layouts = ModelLayouts({MODEL: routing}, routing.index, lambda model: [KEY])
    direct = DirectEvents(routing.index)
    direct.add_replica(
        "eng",
        MODEL,
        B,
        ports.specs(),  # type: ignore[arg-type]
        on_facts=layouts.facts_observer(MODEL),
    )
    await direct.start()
    return eng, routing, layouts, direct


def _usable(engine: RoutingEngine, tokens: list[int], prompt_tokens: int) -> int:
    request = RouteRequest("r", MODEL, prompt_tokens, canonical(tokens), B)
    return engine.matches(request, [KEY], 0.0).get(KEY).usable_blocks


def _lookahead(eng: RefEngine, tokens: list[int], n: int = 1) -> list[list[int]]:
    """vLLM's ``lookahead_token_ids`` of every engine block of ``tokens``: the ``n`` tokens
    after it (the prompt goes on past the last one in these tests)."""
    be = eng.block_size
    return [tokens[(i + 1) * be : (i + 1) * be + n] for i in range(len(tokens) // be)]


def test_the_decoder_reads_vllms_lookahead_token_ids() -> None:
    """Both encodings vLLM's tools write: the field present (a list per block) or left out
    (``omit_defaults``: no lookahead hashing); a malformed one fails that event alone."""
    stored = EngineBlockStored((1, 2), None, tuple(range(32)), 16, None, "GPU", None)
    ahead = EngineBlockStored(
        (3, 4), None, tuple(range(32)), 16, None, "GPU", None, lookahead_token_ids=((7,), (8,))
    )
    batch = decode_payload(encode_batch(EngineBatch(1.0, (stored, ahead)))).batch
    assert batch is not None
    got = [ev for ev in batch.events if isinstance(ev, EngineBlockStored)]
    assert [ev.lookahead_token_ids for ev in got] == [None, ((7,), (8,))]
    assert [ev.lookahead_tokens for ev in got] == [0, 1]
    raw = msgpack.unpackb(encode_batch(EngineBatch(1.0, (ahead,))))
    for bad in ("x", [1, 2], [["a"]], [[-1]]):
        raw[1][0]["lookahead_token_ids"] = bad
        result = decode_payload(msgpack.packb(raw))
        assert result.batch is not None and result.batch.events == ()
        assert result.errors and "lookahead_token_ids" in result.errors[0]


def test_lookahead_hashes_turn_the_eagle_block_drop_off() -> None:
    """``eagle = true``: one engine block (here the router block) given back of every hit
    until the engines are known to hash with lookahead."""
    engine = _routing(eagle=True)
    tokens = list(range(1, 8 * B + 1))
    engine.index.store(KEY, canonical(tokens))
    assert engine.drops_eagle_block
    assert _usable(engine, tokens, 8 * B + 5) == 7
    assert engine.learn(lookahead=(1, SOURCE_ENGINE))
    assert not engine.drops_eagle_block and engine.learned_lookahead == (1, SOURCE_ENGINE)
    assert _usable(engine, tokens, 8 * B + 5) == 8
    assert not engine.learn(lookahead=(1, SOURCE_REGISTRY))  # nothing new
    # vLLM 0.33's multi-module MTP: hashes cover 3 tokens, so a block is found only where 3
    # more of the prompt follow it
    assert engine.learn(lookahead=(3, SOURCE_REGISTRY))
    assert engine.lookahead_tokens == 3 and _usable(engine, tokens, 8 * B + 5) == 8
    assert _usable(engine, tokens, 8 * B + 2) == 7
    assert _usable(engine, tokens, 8 * B + 3) == 8
    # without eagle nothing is given back either way
    plain = _routing(eagle=False)
    plain.index.store(KEY, canonical(tokens))
    assert not plain.drops_eagle_block and _usable(plain, tokens, 8 * B + 5) == 8


async def test_direct_mode_learns_lookahead_from_vllms_own_events(
    engines: list[RefEngine],
) -> None:
    """vLLM 0.33's own ``BlockStored`` with ``lookahead_token_ids`` over ZMQ into direct
    mode: the model's routing stops giving back a block, and the metrics say why."""
    eng, routing, layouts, direct = await _follow("vllm-0.33.0", engines)
    index = routing.index
    try:
        tokens = eng.prompt(9)
        first = eng.stored(tokens[: 4 * 16])  # no lookahead hashing: the drop stays
        ahead = eng.stored(
            tokens, 4, 8, group={"lookahead_token_ids": _lookahead(eng, tokens)[4:8]}
        )

        def sent(event: object) -> bool:
            if not index.match(canonical(tokens)).get(KEY).kv_blocks:
                eng.publish(event)
            return index.match(canonical(tokens)).get(KEY).kv_blocks == 2

        await eventually(lambda: sent(first))
        assert routing.drops_eagle_block and _usable(routing, tokens[: 4 * 16], 9 * 16) == 1
        eng.publish(ahead)
        await eventually(lambda: routing.lookahead_tokens == 1)
        assert direct.ingests["eng"].facts.lookahead_tokens == 1
        assert not routing.drops_eagle_block
        assert _usable(routing, tokens, 9 * 16) == 4
        (report,) = layouts.check()
        assert (report.lookahead_tokens, report.lookahead_source) == (1, SOURCE_ENGINE)
        metrics = {m.name: m.samples for m in layout_metrics([report])}
        assert metrics["kvrouter_model_lookahead_tokens"][0].value == 1
        assert metrics["kvrouter_model_eagle_block_drop"][0].value == 0
    finally:
        await direct.stop()


async def test_redis_mode_learns_lookahead_from_the_publishers_registration(
    engines: list[RefEngine], store: RedisStore
) -> None:
    """The publisher sees vLLM's lookahead hashes, registers ``lookahead_tokens``, and a
    router following the registry stops giving back a block."""
    ports = Ports()
    eng = RefEngine("vllm-0.33.0", ports.pub, ports.replay)
    engines.append(eng)
    info = ReplicaInfo("eng", url="http://eng", model=MODEL, block_size=B)
    settings = PublisherSettings(info=info, endpoints=ports.specs(), flush_interval_s=0.01)  # type: ignore[arg-type]
    publisher = Publisher(settings, store)
    index = PrefixIndex()
    routing = RoutingEngine(
        index, LoadTracker(), make_policy("ours"), RoutingSettings(block_size=B, eagle=True)
    )
    layouts = ModelLayouts({MODEL: routing}, index, lambda model: [KEY])
    sync = IndexSync(store, index, audit_interval_s=0.1, block_s=0.05)
    await publisher.start()
    await sync.start()
    try:
        tokens = eng.prompt(9)
        ahead = eng.stored(tokens, 0, 8, group={"lookahead_token_ids": _lookahead(eng, tokens)})

        def sent() -> bool:
            if publisher.ingest.facts.lookahead_tokens == 0:
                eng.publish(ahead)
            return publisher.ingest.facts.lookahead_tokens == 1

        await eventually(sent)

        async def registered() -> bool:
            infos = [i for i in await store.list_replicas() if i.replica == "eng"]
            if infos:
                layouts.registered(infos[0])
            return bool(infos) and infos[0].lookahead_tokens == 1

        await eventually(registered)
        assert routing.learned_lookahead == (1, SOURCE_REGISTRY)
        await eventually(lambda: index.match(canonical(tokens)).get(KEY).kv_blocks == 4)
        assert not routing.drops_eagle_block
        assert _usable(routing, tokens, 9 * 16) == 4
        assert ReplicaInfo.from_json(info.to_json()).lookahead_tokens == 0
        with pytest.raises(ValueError):
            ReplicaInfo.from_json('{"replica": "x", "lookahead_tokens": -1}')
    finally:
        await sync.stop()
        await publisher.stop()


def _sglang_bigram_store(eng: RefEngine, tokens: list[int], first: int, last: int) -> object:
    """SGLang 0.5.23's store of pages [first, last) of an EAGLE engine's radix tree, in its
    own class: ``KVCacheEventRecorder.record_store`` publishes each page's positions as
    ``(t_j, t_j+1)`` pairs (block_size = the pairs in the page) and ``enqueue`` coalesces
    the chained pages of one node into one event (sglang/srt/mem_cache/events.py)."""
    page = eng.block_size
    pairs = [[tokens[j], tokens[j + 1]] for j in range(first * page, last * page)]
    return eng.mod.BlockStored(
        block_hashes=[eng.block_hash(tokens, i) for i in range(first, last)],
        parent_block_hash=eng.block_hash(tokens, first - 1) if first else None,
        token_ids=pairs,
        block_size=page,
        lora_id=None,
        medium="GPU",
    )


def test_sglang_bigram_pairs_decode_as_tokens_and_lookahead() -> None:
    chained = [[1, 2], [2, 3], [3, 4], [4, 5]]
    event: dict[str, Any] = {"type": "BlockStored", "block_hashes": [7, 8]}
    event["parent_block_hash"] = None
    event.update(token_ids=chained, block_size=2, lora_id=None, medium="GPU")
    raw = [0.0, [event]]
    batch = decode_payload(msgpack.packb(raw)).batch
    assert batch is not None
    (ev,) = batch.events
    assert isinstance(ev, EngineBlockStored)
    assert ev.token_ids == (1, 2, 3, 4) and ev.lookahead_token_ids == ((3,), (5,))
    for bad, why in (
        ([[1, 2], [3, 4]], "do not chain"),
        ([[1, 2, 3]], "bigram pairs"),
        ([[1, "a"]], "bigram pairs"),
        ([[1, -2]], "bigram pairs"),
    ):
        event["token_ids"] = bad
        result = decode_payload(msgpack.packb(raw))
        assert result.batch is not None and result.batch.events == ()
        assert why in result.errors[0]


async def test_direct_mode_indexes_sglangs_eagle_stores(engines: list[RefEngine]) -> None:
    """SGLang 0.5.23's own classes and publisher, an EAGLE engine's bigram stores: indexed
    under the canonical hashes of the plain tokens (before, every one was malformed and the
    replica indexed nothing), and the model learns that its engines drop no block."""
    eng, routing, _, direct = await _follow("sglang-0.5.23", engines)
    index = routing.index
    try:
        tokens = eng.prompt(9)
        first = _sglang_bigram_store(eng, tokens, 0, 4)
        rest = _sglang_bigram_store(eng, tokens, 4, 8)

        def sent() -> bool:
            if not index.match(canonical(tokens)).get(KEY).kv_blocks:
                eng.publish(first)
            return index.match(canonical(tokens)).get(KEY).kv_blocks == 2

        await eventually(sent)
        eng.publish(rest)
        await eventually(lambda: index.match(canonical(tokens)).get(KEY).kv_blocks == 4)
        assert direct.ingests["eng"].stats.malformed_events == 0
        assert routing.lookahead_tokens == 1 and not routing.drops_eagle_block
        assert _usable(routing, tokens, 9 * 16) == 4
    finally:
        await direct.stop()


def _lookahead_chain(
    eng: RefEngine, tokens: list[int], first: int, last: int
) -> tuple[list[int], int | None, list[list[int]]]:
    """Engine hashes of blocks [first, last) of ``tokens`` as a lookahead engine names them
    (each block's hash covers the token after it: vLLM's ``num_hash_lookahead_tokens`` 1),
    the parent's, and the lookahead tokens."""
    be = eng.block_size

    def name(i: int) -> int:
        return hash(("lookahead", tuple(tokens[: (i + 1) * be + 1]))) & (2**63 - 1)

    parent = name(first - 1) if first else None
    ahead = [tokens[(i + 1) * be : (i + 1) * be + 1] for i in range(first, last)]
    return [name(i) for i in range(first, last)], parent, ahead


async def test_a_block_cached_twice_under_lookahead_stays_until_both_go(
    engines: list[RefEngine],
) -> None:
    """A lookahead engine caches the same tokens at the same position once for each next
    token it saw: two conversations branching right after a block hold it twice, under two
    hashes. Evicting one copy leaves the block cached (before, the router dropped it and
    every block after it on that replica); evicting both removes it."""
    eng, routing, _, direct = await _follow("vllm-0.33.0", engines)
    index = routing.index
    try:
        rng = random.Random(5)
        shared = [rng.randrange(1, 30_000) for _ in range(2 * B)]
        a = shared + [rng.randrange(1, 30_000) for _ in range(B + 1)]
        c = shared + [a[2 * B] + 1] + [rng.randrange(1, 30_000) for _ in range(B)]

        def stored(tokens: list[int], first: int, last: int) -> object:
            hashes, parent, ahead = _lookahead_chain(eng, tokens, first, last)
            return eng.mod.BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=tokens[first * 16 : last * 16],
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                lookahead_token_ids=ahead,
            )

        def removed(tokens: list[int], first: int, last: int) -> object:
            hashes, _, _ = _lookahead_chain(eng, tokens, first, last)
            return eng.mod.BlockRemoved(block_hashes=hashes, medium="GPU")

        def held(tokens: list[int]) -> int:
            return index.match(canonical(tokens)).get(KEY).kv_blocks

        def sent() -> bool:
            if not held(a):
                eng.publish(stored(a, 0, 6))
            return held(a) == 3

        await eventually(sent)
        # the branch: its first block is a hit, its second the same tokens with another
        # next token (a second copy), then its own
        eng.publish(stored(c, 3, 6))
        await eventually(lambda: held(c) == 3)
        eng.publish(removed(a, 3, 6))  # the first conversation's copy and the rest go
        await eventually(lambda: held(a) == 2)  # its last router block went, not the one
        assert held(c) == 3  # both hold, nor the branch after it
        eng.publish(removed(c, 3, 6))
        await eventually(lambda: held(c) == 1)
        eng.publish(removed(a, 0, 3))
        await eventually(lambda: held(c) == 0)
    finally:
        await direct.stop()
