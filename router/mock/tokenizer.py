"""How the mock replica turns a request into token ids, behind one small seam.

``MockTokenizer`` has two methods, ``chat(body)`` and ``completion(body)``, returning token
ids. Token-id prompts (``/v1/completions`` with a list of ints) are used as they are by
every implementation, exactly as the router hashes them, so hits are real.

* ``ByteTokenizer``: a deterministic stand-in for text: UTF-8 bytes are token ids 0-255,
  chats are rendered ``<|role|>content\\n`` (roles as reserved ids 256+), an image part as its
  placeholder tokens (id ``IMAGE_ID``) where the part is, as many as its ``ImageSettings``
  count (router/mock/images.py). A router hashing text differently will not see these hits;
  use token-id prompts, a ``render = "engine"`` model or ``RouterTokenizer``.
* ``RouterTokenizer``: the router's own tokenizer pipeline (``router.tokenize``): the model's
  chat template and tokenizer files, so text prompts tokenize as the router tokenizes them.
  With image settings (the router's ``[models.NAME.images]``: ``--image-placeholder``,
  ``--image-token``, ``--image-tokens``) a chat's images are placed, expanded and named as the
  router's pipeline does for its hashes (``PromptProcessor.image_prompt``), so the router's
  own prediction is exact against the mock; an image URL it does not fetch is refused (400).
  Without them it serves no images (400: a text-only model).

``chat_prompt`` gives the token ids with the prompt's images (``MockPrompt``); ``chat`` the
ids alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from router.core.errors import BadRequest
from router.mock.images import ImageItem, MockPrompt, byte_settings, image_of
from router.tokenize.multimodal import ImageSettings, has_images, image_url

if TYPE_CHECKING:
    from router.tokenize.incremental import IncrementalTokenizer
    from router.tokenize.pipeline import PromptProcessor

ROLE_IDS = {"system": 256, "user": 257, "assistant": 258, "tool": 259, "developer": 260}
IMAGE_ID = 262  # the byte tokenizer's image placeholder token (261: other roles)


def token_id_prompt(prompt: Any) -> list[int] | None:
    """The prompt as token ids when it is a list of ints (or a batch whose first is)."""
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, list):
            prompt = first
        if prompt and set(map(type, prompt)) == {int}:  # one C-level pass; bool is no int
            if min(prompt) < 0 or max(prompt) >= 2**32:
                raise BadRequest("'prompt' token ids must be in [0, 2**32)")
            return list(prompt)
    return None


def _text_prompt(body: Mapping[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string, array of strings or token ids")
    return prompt


def _messages(body: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array of message objects")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
    return messages


def _content(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(
            str(p.get("text", ""))
            for p in value
            if isinstance(p, Mapping) and p.get("type") == "text"
        )
    raise BadRequest("message content must be a string or an array of parts")


class MockTokenizer(Protocol):
    def chat_prompt(
        self, body: Mapping[str, Any], *, from_responses: bool = False, from_messages: bool = False
    ) -> MockPrompt: ...

    def chat(
        self, body: Mapping[str, Any], *, from_responses: bool = False, from_messages: bool = False
    ) -> list[int]: ...

    def completion(self, body: Mapping[str, Any]) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


_ROLE_NAMES = {v: k for k, v in ROLE_IDS.items()}


class ByteTokenizer:
    """``images``: how an image part expands (default ``byte_settings()``); ``model``: the
    engine's ``--model``, which vLLM's image hash takes (``ImageSettings.model_id`` wins)."""

    def __init__(self, images: ImageSettings | None = None, model: str = "") -> None:
        self.images = images or byte_settings()
        self.model = model

    def chat_prompt(
        self, body: Mapping[str, Any], *, from_responses: bool = False, from_messages: bool = False
    ) -> MockPrompt:
        out: list[int] = []
        images: list[ImageItem] = []
        for m in _messages(body):
            out.append(ROLE_IDS.get(str(m["role"]), 261))
            content = m.get("content")
            if isinstance(content, list) and has_images([m]):
                self._parts(content, out, images)
            else:
                out.extend(_content(content).encode("utf-8"))
            out.append(10)
        out.append(ROLE_IDS["assistant"])
        return MockPrompt(out, tuple(images))

    def _parts(self, content: list[Any], out: list[int], images: list[ImageItem]) -> None:
        """A content list with images: text parts as bytes (joined as ``_content`` joins
        them), each image as its placeholder tokens where the part is."""
        for part in content:
            if not isinstance(part, Mapping):
                continue
            url = image_url(part)
            if url is not None:
                count, ident = image_of(part, url, self.images, self.model)
                images.append(ImageItem(len(out), count, ident))
                out.extend([IMAGE_ID] * count)
            elif part.get("type") == "text":
                out.extend(str(part.get("text", "")).encode("utf-8"))

    def chat(
        self, body: Mapping[str, Any], *, from_responses: bool = False, from_messages: bool = False
    ) -> list[int]:
        return self.chat_prompt(body).tokens

    def completion(self, body: Mapping[str, Any]) -> list[int]:
        ids = token_id_prompt(body.get("prompt"))
        if ids is not None:
            return ids
        return list(_text_prompt(body).encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; role ids as ``<|role|>`` (the other roles' and the image's:
        ``<|id|>``); ids outside the vocabulary are dropped, as HF ``tokenizers`` drops them."""
        out: list[str] = []
        run = bytearray()
        for t in ids:
            if t < 256:
                run.append(t)
                continue
            if t > IMAGE_ID:
                continue
            out.append(run.decode("utf-8", "replace"))
            run.clear()
            out.append(f"<|{_ROLE_NAMES.get(t, t)}|>")
        out.append(run.decode("utf-8", "replace"))
        return "".join(out)


class RouterTokenizer:
    """Adapter over ``router.tokenize.pipeline.PromptProcessor`` (exact mode)."""

    def __init__(self, processor: PromptProcessor) -> None:
        if processor.tokenizer is None:
            raise ValueError("RouterTokenizer needs a processor with a tokenizer")
        self.processor = processor
        self._tokenizer: IncrementalTokenizer = processor.tokenizer

    def chat_prompt(
        self, body: Mapping[str, Any], *, from_responses: bool = False, from_messages: bool = False
    ) -> MockPrompt:
        """``from_responses`` / ``from_messages``: PromptProcessor.chat's (a Responses /
        Messages API request's chat). Images as the module docstring says."""
        messages = body.get("messages")
        if not (isinstance(messages, list) and has_images(messages)):
            return MockPrompt(
                self.chat(body, from_responses=from_responses, from_messages=from_messages)
            )
        if self.processor.images is None or self.processor.template is None:
            raise BadRequest(
                f"{self.processor.model} is not a multimodal model: the mock replica has no "
                "image settings (--image-placeholder, --image-token)"
            )
        found = self.processor.image_prompt(
            body, from_responses=from_responses, from_messages=from_messages
        )
        if found.known_until is not None:
            raise BadRequest("the mock replica fetches no image URLs: send a data: URL")
        images = tuple(
            ImageItem(item.start, n, item.identifier)
            for item, n in zip(found.items, found.lengths, strict=True)
        )
        return MockPrompt([int(t) for t in found.tokens], images)

    def chat(
        self, body: Mapping[str, Any], *, from_responses: bool = False, from_messages: bool = False
    ) -> list[int]:
        """The token ids of :meth:`chat_prompt`."""
        messages = body.get("messages")
        if isinstance(messages, list) and has_images(messages):
            return self.chat_prompt(
                body, from_responses=from_responses, from_messages=from_messages
            ).tokens
        text, _ = self.processor.render_chat(
            body, from_responses=from_responses, from_messages=from_messages
        )
        return [int(t) for t in self._tokenizer.encode_text(text)]

    def completion(self, body: Mapping[str, Any]) -> list[int]:
        ids = token_id_prompt(body.get("prompt"))
        if ids is not None:
            return ids
        return [int(t) for t in self._tokenizer.encode_text(_text_prompt(body))]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.tokenizer.decode(list(ids))

    @classmethod
    def from_dir(
        cls,
        model: str,
        block_size: int,
        directory: str,
        bpe_file: str | None = None,
        images: ImageSettings | None = None,
    ) -> RouterTokenizer:
        from router.tokenize.incremental import IncrementalTokenizer
        from router.tokenize.pipeline import PromptProcessor
        from router.tokenize.template import ChatTemplate
        from router.tokenize.tokenizers import load_tokenizer_dir

        files = load_tokenizer_dir(directory, bpe_file=bpe_file)
        template = ChatTemplate.from_tokenizer_config(files.config, Path(directory))
        processor = PromptProcessor(
            model,
            block_size,
            tokenizer=IncrementalTokenizer(files.tokenizer),
            template=template,
            images=images,
        )
        return cls(processor)
