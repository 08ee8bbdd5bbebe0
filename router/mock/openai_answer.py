"""The mock replica's OpenAI-compatible answers, as vLLM 0.34 writes them: the bodies of
``/v1/chat/completions`` and ``/v1/completions``, streamed (SSE chunks) or not, for one
sequence (router/mock/generation.py) and several (router/mock/multi.py). Pure: it builds bytes
and dicts; the callers run the engine and write them when its outputs come
(:func:`end_stream` is the one writer here: the stream's ending, shared by both).

* The answer text is filler, one word a token (:func:`word`).
* A chunk: ``{"id", "object": "chat.completion.chunk" | "text_completion", "created",
  "model", "choices": [one choice]}``, plus ``usage`` with ``continuous_usage_stats``
  (the prompt's tokens and the choice's so far; the chunk that names chat's ``role`` also
  the prompt's ``cached_tokens``).
* A choice's chunks (:class:`ChoiceStream`): its tokens (the first after its ``echo``),
  the chunk of its last tokens carrying its ``finish_reason`` as vLLM's last output does
  (a choice the engine ends short of its budget gets a chunk of no text with it); logprobs
  of the tokens of each chunk (with completions' ``echo``, the prompt's tokens first),
  offsets running over the text sent.
* Chat opens with a chunk of its own for every choice (the role, empty content, as vLLM's
  first iteration), then its ``echo`` (:meth:`Answer.opening`).
* The stream ends with the usage chunk (``include_usage``; vLLM's ``exclude_none`` dump),
  then ``[DONE]``; an engine refusal after the stream opened is an ``error`` event.
* ``system_fingerprint`` (vLLM's default ``vllm-<version>-<hash8>``): on a non-streamed
  answer, the usage chunk, and without one each choice's terminal chunk; no other chunk.
* A non-streamed answer: every field of vLLM's ``ChatCompletionResponse`` /
  ``CompletionResponse`` as it dumps them (:meth:`Answer.body`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from router.mock import logprobs as lp

DONE = b"data: [DONE]\n\n"


def word(i: int) -> str:
    """The filler text of output token ``i``."""
    return f" tok{i % 1000}"


def last_reason(produced: int, budget: int) -> str | None:
    """The ``finish_reason`` of the chunk whose tokens bring a choice to ``produced``:
    ``length`` when they spend its ``budget`` (the engine stops there), else None."""
    return "length" if produced >= budget else None


def sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def usage(
    prompt: int, cached: int, completion: int, kv_hit: int | None, created: int | None = None
) -> dict[str, Any]:
    """vLLM's ``UsageInfo`` as it dumps it (``--enable-prompt-tokens-details``): ``created``
    is chat's ``created_cache_tokens`` (None on completions, as vLLM leaves it); ``kv_hit``
    the mock's ``kv_hit_tokens`` (a hybrid profile's; None: absent)."""
    details: dict[str, Any] = {
        "cached_tokens": cached,
        "created_cache_tokens": created,
        "multimodal_tokens": None,
    }
    if kv_hit is not None:
        details["kv_hit_tokens"] = kv_hit
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": details,
        "completion_tokens_details": None,
    }


def without_nulls(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` as vLLM's ``exclude_none`` dumps it (its final usage chunk)."""
    return {
        k: without_nulls(v) if isinstance(v, dict) else v for k, v in obj.items() if v is not None
    }


def running_usage(prompt: int, produced: int, cached: int | None = None) -> dict[str, Any]:
    """A chunk's ``continuous_usage_stats``: the prompt's tokens and ``produced`` so far
    (``cached`` not None: the prompt's split too)."""
    used: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": produced,
        "total_tokens": prompt + produced,
    }
    if cached is not None:
        used["prompt_tokens_details"] = {"cached_tokens": cached}
    return used


def stream_error(reason: str, param: str | None = None) -> bytes:
    """An opened stream's ending when the engine refuses a sequence: the error (naming the
    ``param`` refused), ``[DONE]``."""
    error: dict[str, Any] = {"message": reason, "type": "BadRequestError"}
    error |= {"param": param, "code": 400}
    return sse({"error": error}) + DONE


@dataclass(slots=True, frozen=True)
class Answer:
    """What every chunk and body of one answer shares: its id, API (``chat`` or
    completions), ``created``, model and ``fingerprint`` (its ``system_fingerprint``); what
    it asks: sampled-token ``logprobs``, completions' logprobs with ``echo``
    (``echo_logprobs``: the prompt's tokens first, decoded by ``decode``), the usage chunk
    (``include_usage``) and ``continuous`` usage stats."""

    answer_id: str
    chat: bool
    created: int
    model: str
    decode: lp.Decode
    fingerprint: str | None = None
    with_logprobs: bool = False
    top_logprobs: int = 1  # the candidates listed a position (logprobs.top_shown)
    role: str = "assistant"  # chat's answering role (logprobs.answered_role)
    echo_only: bool = False  # the prompt's echo alone, no token shown (logprobs.echo_only)
    echo_logprobs: bool = False
    include_usage: bool = False
    continuous: bool = False

    @property
    def object_type(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return f"{self.object_type}.chunk" if self.chat else self.object_type

    def chunk(self, choice: dict[str, Any], used: dict[str, Any] | None = None) -> bytes:
        """The SSE chunk of one ``choice`` (``used``: its usage, None: none); a choice's
        terminal chunk names the fingerprint when no usage chunk follows (vLLM's)."""
        obj: dict[str, Any] = {
            "id": self.answer_id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if used is not None:
            obj["usage"] = used
        ends = choice.get("finish_reason") is not None
        if ends and not self.include_usage and self.fingerprint is not None:
            obj["system_fingerprint"] = self.fingerprint
        return sse(obj)

    def usage_chunk(self, used: dict[str, Any]) -> bytes:
        """The stream's last chunk before ``[DONE]`` (``include_usage``)."""
        obj = {
            "id": self.answer_id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": without_nulls(used),
        }
        if self.fingerprint is not None:
            obj["system_fingerprint"] = self.fingerprint
        return sse(obj)

    def opening(self, indices: list[int], prompt: int, cached: int, echo: str) -> bytes:
        """Chat's first chunks, before any token's: every choice's role (empty content),
        then its ``echo`` (vLLM's first output); ``prompt``, ``cached``: the first prompt's
        tokens and hit."""
        deltas: list[dict[str, Any]] = [{"role": self.role, "content": ""}]
        deltas += [{"content": echo}] if echo else []
        out = b""
        for k, delta in enumerate(deltas):
            for index in indices:
                used: dict[str, Any] | None = None
                if self.continuous:
                    # vLLM: the role chunks' usage has the prompt's split
                    used = running_usage(prompt, 0, cached if k == 0 else None)
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                out += self.chunk(choice, used)
        return out

    def text(self, echo: str, words: list[str]) -> str:
        """A whole choice's text: its ``echo``, then its tokens' ``words`` (none shown with
        ``echo_only``)."""
        return echo if self.echo_only else echo + "".join(words)

    def logprobs(self, prompt_ids: list[int], words: list[str]) -> dict[str, Any] | None:
        """A whole choice's logprobs (None: not asked)."""
        if not self.with_logprobs:
            return None
        if self.echo_only:
            words = []
        if self.echo_logprobs:
            return lp.echoed(prompt_ids, self.decode, words, self.top_logprobs)
        return lp.sampled(words, self.chat, top=self.top_logprobs)

    def choice(
        self,
        index: int,
        text: str,
        logprobs: dict[str, Any] | None,
        finish: str | None,
        prompt_logprobs: list[dict[str, Any] | None] | None = None,
    ) -> dict[str, Any]:
        """A non-streamed choice as vLLM dumps it (``prompt_logprobs``: completions')."""
        choice: dict[str, Any]
        if self.chat:
            message = {"role": self.role, "content": text, "refusal": None, "audio": None}
            message |= {"function_call": None, "reasoning": None}
            choice = {"index": index, "message": message, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs}
        choice |= {"finish_reason": finish, "stop_reason": None, "token_ids": None}
        if not self.chat:
            choice |= {"prompt_logprobs": prompt_logprobs, "prompt_token_ids": None}
        choice |= {"routed_experts": None, "weight_versions": None}
        return choice

    def body(
        self,
        choices: list[dict[str, Any]],
        used: dict[str, Any],
        prompt_logprobs: list[dict[str, Any] | None] | None = None,
        transfer: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The non-streamed answer (``prompt_logprobs``: chat's; ``transfer``: a prefill
        leg's ``kv_transfer_params``)."""
        extra: dict[str, Any] = {}
        if self.chat:
            extra = {"prompt_logprobs": prompt_logprobs, "prompt_token_ids": None}
            extra["prompt_text"] = None
        if transfer is not None:
            extra["kv_transfer_params"] = transfer
        return {
            "id": self.answer_id,
            "object": self.object_type,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": used,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
            **extra,
        }


@dataclass(slots=True)
class ChoiceStream:
    """One choice's streamed chunks: its ``index``, prompt token ids, the ``echo`` its first
    tokens come after (completions'; chat's is in :meth:`Answer.opening`); ``offset``: the
    text sent so far (completions' logprobs' ``text_offset``)."""

    answer: Answer
    index: int
    prompt_ids: list[int]
    echo: str = ""
    offset: int = 0
    started: bool = False
    finished: bool = False

    def tokens(self, words: list[str], produced: int, finish: str | None = None) -> bytes:
        """The chunk of new tokens ``words``, ``produced`` the choice's tokens so far with
        them; ``finish``: the ``finish_reason`` they end the choice with (vLLM's last
        output carries its last tokens and the reason)."""
        a = self.answer
        first = not self.started
        self.started = True
        if a.echo_only:
            words = []
        text = "".join(words)
        logprobs = None
        if a.with_logprobs and (words or (first and a.echo_logprobs)):
            if first and a.echo_logprobs:
                logprobs = lp.echoed(self.prompt_ids, a.decode, words, a.top_logprobs)
                self.offset += len("".join(logprobs["tokens"]))
            else:
                logprobs = lp.sampled(words, a.chat, self.offset, a.top_logprobs)
                self.offset += len(text)
        if first:
            text = self.echo + text
        choice: dict[str, Any]
        if a.chat:
            choice = {"index": self.index, "delta": {"content": text}, "logprobs": logprobs}
            choice["finish_reason"] = finish
            if finish is not None:
                choice["stop_reason"] = None
        else:
            choice = {"index": self.index, "text": text, "logprobs": logprobs}
            choice |= {"finish_reason": finish, "stop_reason": None}
        self.finished = finish is not None
        return a.chunk(choice, self._usage(produced))

    def finish(self, reason: str, produced: int) -> bytes:
        """The choice's last chunk, its ``finish_reason`` alone (nothing when its last
        tokens' chunk carried it)."""
        if self.finished:
            return b""
        self.finished = True
        if self.answer.chat:
            choice: dict[str, Any] = {"index": self.index, "delta": {}, "logprobs": None}
        else:
            choice = {"index": self.index, "text": "", "logprobs": None}
        choice |= {"finish_reason": reason, "stop_reason": None}
        return self.answer.chunk(choice, self._usage(produced))

    def _usage(self, produced: int) -> dict[str, Any] | None:
        if not self.answer.continuous:
            return None
        return running_usage(len(self.prompt_ids), produced)


async def end_stream(
    response: web.StreamResponse, answer: Answer, used: dict[str, Any] | None
) -> web.StreamResponse:
    """End an OpenAI stream: its usage chunk (``include_usage``: ``used`` not None), then
    ``[DONE]``."""
    if used is not None:
        await response.write(answer.usage_chunk(used))
    await response.write(DONE)
    await response.write_eof()
    return response
