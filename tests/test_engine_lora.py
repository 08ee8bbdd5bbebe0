"""LoRA adapters served by one engine: whose blocks a request can reuse.

vLLM 0.34 keys every block of a LoRA request with the adapter (``_gen_lora_extra_hash_keys``:
name and path) and names it in the event (``lora_name``, and leading each block's
``extra_keys``); a request is a LoRA request when its ``model`` is an adapter's name
(``OpenAIServing._maybe_get_adapters``). So on one engine, a request for the base model
reuses only blocks stored without an adapter, a request naming adapter A only blocks stored
with A. The router routes an adapter as a model of its own when it is configured as one
(``[[replicas]]`` entries with ``model = "A"`` on the engine's URL and event endpoint, beside
the base model's), and hashes its requests as any model's: ``root_hash("A", salt)``.
vLLM's own event classes publish over real ZMQ into the router's direct mode.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest

from router.core.index import PrefixIndex
from router.core.types import EventBatch, ReplicaKey
from router.events.decode import decode_payload
from router.events.direct import DirectEvents
from router.events.reblock import Reblocker
from router.tokenize.pipeline import PromptProcessor
from tests.engines.harness import RefEngine
from tests.test_engine_replay import Ports
from tests.waiting import eventually

B = 32  # router block: two 16-token engine blocks
ENGINE = "vllm-0.33.0"  # kv_events.py byte-identical to 0.34.0's (tests/engines/README.md)
BASE, ADAPTER = "base", "sql-lora"


def _hashes(model: str, tokens: list[int], salt: str | None = None) -> list[int]:
    """The request's block hashes as the router computes them for ``model``."""
    body: dict[str, object] = {"prompt": tokens}
    if salt is not None:
        body["cache_salt"] = salt
    return PromptProcessor(model, B).completion(body).block_hashes


class _Entry:
    """One replica entry's re-blocker feeding a real index, fed the engine's own events."""

    def __init__(self, model: str, eng: RefEngine) -> None:
        self.model, self.eng = model, eng
        self.rb = Reblocker(B, model)
        self.index = PrefixIndex()
        self.key = ReplicaKey("eng")

    def feed(self, *events: object) -> None:
        batch = self.eng.mod.KVEventBatch(ts=1.0, events=list(events))
        result = decode_payload(msgspec.msgpack.encode(batch))
        assert result.batch is not None and not result.errors
        converted = self.rb.convert(result.batch.events)
        self.index.apply(EventBatch(self.key, tuple(converted)))

    def hit(self, tokens: list[int], salt: str | None = None) -> int:
        """Blocks of a request for the entry's model predicted cached."""
        return self.index.match(_hashes(self.model, tokens, salt)).get(self.key).kv_blocks


@pytest.fixture
def engine() -> Iterator[RefEngine]:
    ports = Ports()
    eng = RefEngine(ENGINE, ports.pub, ports.replay, seed=3)
    eng.ports = ports  # type: ignore[attr-defined]
    yield eng
    eng.close()


def test_an_adapters_own_blocks_are_its_requests_and_the_base_models_are_not(
    engine: RefEngine,
) -> None:
    """The re-blocker of a replica entry whose model is an adapter: the adapter's blocks are
    indexed under what a request for it hashes to; the base model's blocks (the same engine
    serving base-model traffic) are not, once the entry is known to name an adapter (its
    first block stored with that adapter), and those indexed before are withdrawn."""
    entry = _Entry(ADAPTER, engine)
    shared, other, later = engine.prompt(4), engine.prompt(4), engine.prompt(3)
    entry.feed(engine.stored(other))  # base-model traffic before any adapter request
    entry.feed(engine.stored(shared, lora_name=ADAPTER))
    assert entry.hit(shared) == 2  # the adapter's own blocks
    assert entry.hit(other) == 0  # the base model's, indexed before: withdrawn
    entry.feed(engine.stored(later), engine.stored(shared))  # more base-model traffic
    assert entry.hit(later) == 0
    assert entry.hit(shared) == 2
    # a base-model entry on the same engine: the other way round
    base = _Entry(BASE, engine)
    base.feed(engine.stored(other), engine.stored(later, lora_name=ADAPTER))
    assert base.hit(other) == 2 and base.hit(later) == 0


def test_salted_adapter_blocks_match_the_salted_adapter_request(engine: RefEngine) -> None:
    entry = _Entry(ADAPTER, engine)
    tokens = engine.prompt(4)
    entry.feed(engine.stored(tokens, salt="t1", lora_name=ADAPTER))
    assert entry.hit(tokens, "t1") == 2
    assert entry.hit(tokens) == 0 and entry.hit(tokens, "t2") == 0


async def test_one_engine_serving_a_base_model_and_an_adapter_is_predicted_per_model(
    engine: RefEngine,
) -> None:
    """Two replica entries on one engine's event endpoint, the base model's and the
    adapter's: each is predicted a hit only for blocks its own requests can reuse."""
    index = PrefixIndex()
    direct = DirectEvents(index)
    ports = engine.ports  # type: ignore[attr-defined]
    direct.add_replica("eng-base", BASE, B, ports.specs())
    direct.add_replica("eng-sql", ADAPTER, B, ports.specs())
    await direct.start()
    base_key, sql_key = ReplicaKey("eng-base"), ReplicaKey("eng-sql")
    try:
        base_prompt, sql_prompt, later = engine.prompt(4), engine.prompt(4), engine.prompt(4)

        def hit(key: ReplicaKey, model: str, tokens: list[int]) -> int:
            return index.match(_hashes(model, tokens)).get(key).kv_blocks

        def stored(event: object, key: ReplicaKey, model: str, tokens: list[int]) -> bool:
            if not hit(key, model, tokens):
                engine.publish(event)  # again until the subscriber has joined
            return hit(key, model, tokens) == 2

        await eventually(lambda: stored(engine.stored(base_prompt), base_key, BASE, base_prompt))
        sql_store = engine.stored(sql_prompt, lora_name=ADAPTER)
        await eventually(lambda: stored(sql_store, sql_key, ADAPTER, sql_prompt))
        engine.publish(engine.stored(later))  # more base-model traffic
        await eventually(lambda: hit(base_key, BASE, later) == 2)
        # the adapter's requests: its own blocks, not the base model's
        assert hit(sql_key, ADAPTER, base_prompt) == 0
        assert hit(sql_key, ADAPTER, later) == 0
        # the base model's requests: its own blocks, not the adapter's
        assert hit(base_key, BASE, sql_prompt) == 0
        assert hit(base_key, BASE, base_prompt) == 2
    finally:
        await direct.stop()
