"""How the mock replica turns a request into token ids, behind one small seam.

``MockTokenizer`` has two methods, ``chat(body)`` and ``completion(body)``, returning token
ids. Token-id prompts (``/v1/completions`` with a list of ints) are used as they are by
every implementation, exactly as the router hashes them, so hits are real.

* ``ByteTokenizer``: a deterministic stand-in for text: UTF-8 bytes are token ids 0-255,
  chats are rendered ``<|role|>content\\n`` (roles as reserved ids 256+). A router hashing
  text differently will not see these hits; use token-id prompts or ``RouterTokenizer``.
* ``RouterTokenizer``: the router's own tokenizer pipeline (``router.tokenize``): the model's
  chat template and tokenizer files, so text prompts tokenize as the router tokenizes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from router.core.errors import BadRequest

if TYPE_CHECKING:
    from router.tokenize.incremental import IncrementalTokenizer
    from router.tokenize.pipeline import PromptProcessor

ROLE_IDS = {"system": 256, "user": 257, "assistant": 258, "tool": 259, "developer": 260}


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
    def chat(
        self, body: Mapping[str, Any], *, from_responses: bool = False, from_messages: bool = False
    ) -> list[int]: ...

    def completion(self, body: Mapping[str, Any]) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


_ROLE_NAMES = {v: k for k, v in ROLE_IDS.items()}


class ByteTokenizer:
    def chat(
        self, body: Mapping[str, Any], *, from_responses: bool = False, from_messages: bool = False
    ) -> list[int]:
        out: list[int] = []
        for m in _messages(body):
            out.append(ROLE_IDS.get(str(m["role"]), 261))
            out.extend(_content(m.get("content")).encode("utf-8"))
            out.append(10)
        out.append(ROLE_IDS["assistant"])
        return out

    def completion(self, body: Mapping[str, Any]) -> list[int]:
        ids = token_id_prompt(body.get("prompt"))
        if ids is not None:
            return ids
        return list(_text_prompt(body).encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; role ids as ``<|role|>`` (other ids above 255: ``<|id|>``)."""
        out: list[str] = []
        run = bytearray()
        for t in ids:
            if t < 256:
                run.append(t)
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

    def chat(
        self, body: Mapping[str, Any], *, from_responses: bool = False, from_messages: bool = False
    ) -> list[int]:
        """``from_responses`` / ``from_messages``: PromptProcessor.chat's (a Responses /
        Messages API request's chat)."""
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
        cls, model: str, block_size: int, directory: str, bpe_file: str | None = None
    ) -> RouterTokenizer:
        from router.tokenize.incremental import IncrementalTokenizer
        from router.tokenize.pipeline import PromptProcessor
        from router.tokenize.template import ChatTemplate
        from router.tokenize.tokenizers import load_tokenizer_dir

        files = load_tokenizer_dir(directory, bpe_file=bpe_file)
        template = ChatTemplate.from_tokenizer_config(files.config, Path(directory))
        processor = PromptProcessor(
            model, block_size, tokenizer=IncrementalTokenizer(files.tokenizer), template=template
        )
        return cls(processor)
