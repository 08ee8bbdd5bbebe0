"""Where an image's placeholder goes in the "string" content format, against vLLM 0.34's own
chat message parsing (``parse_chat_message_content``, run unmodified: tests/engines/chat_ref.py)
with a content parser that records the model's placeholder for each image part, as vLLM's
does: placeholders the text already holds are the images' own (``get_full_multimodal_text_
prompt`` adds only the missing ones, first), and an engine run with ``--interleave-mm-strings``
puts each image where its part is. The router's prompt (and so its block hashes) must be the
engine's in each case."""

from __future__ import annotations

import types
from typing import Any

import pytest

from router.tokenize.multimodal import ImageSettings, with_placeholders
from router.tokenize.pipeline import PromptProcessor
from tests.engines import chat_ref
from tests.test_engine_images import (
    MODEL,
    PAD,
    SETTINGS,
    chat,
    data_url,
    engine_side,
    png,
    processor,
)

__all__ = ["processor"]  # the fixture, shared with tests/test_engine_images.py

PLACEHOLDER = SETTINGS.placeholder


class _Parser:
    """vLLM's content parser as far as the string format reads it: each image part adds the
    model's placeholder to the storage (``BaseMultiModalContentParser._add_placeholder``)."""

    model_config = types.SimpleNamespace(enable_prompt_embeds=False)

    def __init__(self, placeholder: str) -> None:
        self.placeholder = placeholder
        self.storage: dict[str, list[str]] = {}

    def parse_image(self, image_url: str | None, uuid: str | None = None) -> None:
        self.storage.setdefault("<##IMAGE##>", []).append(self.placeholder)

    def mm_placeholder_storage(self) -> dict[str, list[str]]:
        return dict(self.storage)


class _Tracker:
    def __init__(self, placeholder: str) -> None:
        self.placeholder = placeholder

    def create_parser(self, mm_processor_kwargs: Any = None) -> _Parser:
        return _Parser(self.placeholder)

    def get_num_items(self, modality: str) -> int:
        return 0


def vllm_contents(body: dict[str, Any], interleave: bool) -> list[Any]:
    """Each message's content as vLLM 0.34 hands the template in the "string" format."""
    mods = chat_ref.load()
    parse = mods[chat_ref.NAME].parse_chat_message_content
    request = mods["vllm.entrypoints.openai.chat_completion.protocol"].ChatCompletionRequest(**body)
    tracker = _Tracker(PLACEHOLDER)
    out: list[Any] = []
    for message in request.messages:
        (msg,) = parse(message, tracker, "string", interleave)
        out.append(msg["content"])
    return out


def _user(*parts: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]}


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
BODIES = {
    "text then image": _user("look at this", IMAGE),
    "image between texts": _user("first", IMAGE, "second"),
    "two images": _user("a", IMAGE, "b", IMAGE),
    "placeholder in the text": _user(f"{PLACEHOLDER}\ndescribe it", IMAGE),
    "one of two placed": _user(f"compare {PLACEHOLDER} with", IMAGE, "this", IMAGE),
    "image only": _user(IMAGE),
}


# vLLM refuses placeholders in the text when it interleaves (more than the images)
REFUSED = {("placeholder in the text", True), ("one of two placed", True)}


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("name", list(BODIES))
def test_string_content_is_vllms(name: str, interleave: bool) -> None:
    """The router's string content equals vLLM's, images placed by the text or by vLLM
    (before: a placeholder the text held got another one in front, and
    ``--interleave-mm-strings`` was not modelled)."""
    body = BODIES[name]
    if (name, interleave) in REFUSED:
        with pytest.raises(ValueError, match="more"):
            vllm_contents(body, interleave)
        return
    got, urls = with_placeholders(body["messages"], PLACEHOLDER, interleave=interleave)
    assert [m["content"] for m in got] == vllm_contents(body, interleave)
    assert len(urls) == sum(p is IMAGE for p in body["messages"][0]["content"])


def _vl(processor: PromptProcessor, settings: ImageSettings) -> PromptProcessor:
    return PromptProcessor(
        MODEL, 16, tokenizer=processor.tokenizer, template=processor.template, images=settings
    )


def _rendered(processor: PromptProcessor, body: dict[str, Any], interleave: bool) -> str:
    contents = vllm_contents(body, interleave)
    messages = [{**m, "content": c} for m, c in zip(body["messages"], contents, strict=True)]
    text, _ = processor._render_text(messages, None, {}, True)
    return text


def test_an_image_placed_by_the_text_is_hashed_where_the_engine_has_it(
    processor: PromptProcessor,
) -> None:
    """A client that writes the model's placeholder into its text (LLaVA-style prompts):
    vLLM adds none of its own, and the image is where the text puts it. The router hashed
    a second placeholder in front and cut the prompt at the surplus one (no block from the
    image on predicted)."""
    data = png("RGB", (300, 200), 7)
    body = chat(data_url(data))
    text_part = body["messages"][1]["content"][0]
    text_part["text"] = f"Here: {PLACEHOLDER} -- " + text_part["text"]
    got = processor.chat(body)
    want = engine_side(processor, body, data, 16, _rendered(processor, body, False))
    assert got.exact and got.block_hashes == want


def test_an_engine_interleaving_images_is_hashed_as_it_renders(
    processor: PromptProcessor,
) -> None:
    """``--interleave-mm-strings``: the image where its part is, after the text before it.
    Unmodelled, the router put it first: a prompt the engine never renders, and one it
    also made of a message with the image first (a hit predicted where the engine's
    tokens differ)."""
    data = png("RGB", (300, 200), 7)
    body = chat(data_url(data))  # text, then the image
    settings = ImageSettings(PLACEHOLDER, PAD, model_id=SETTINGS.model_id, interleave=True)
    interleaved = _vl(processor, settings)
    got = interleaved.chat(body)
    want = engine_side(interleaved, body, data, 16, _rendered(processor, body, True))
    assert got.exact and got.block_hashes == want
    # the same parts with the image first: another prompt from the user turn on
    swapped = chat(data_url(data))
    swapped["messages"][1]["content"].reverse()
    other = interleaved.chat(swapped).block_hashes
    first = next(i for i, (a, b) in enumerate(zip(want, other, strict=False)) if a != b)
    assert not set(want[first:]) & set(other)
    # without the setting, the router keeps vLLM's default placement (placeholders first)
    assert processor.chat(body).block_hashes == processor.chat(swapped).block_hashes
