"""The logprobs and echoed prompts of the mock replica's answers, in vLLM 0.34's shapes.

The filler answer's tokens, and the prompt's, were each certain: logprob 0.0, rank 1. What
is asked and where it goes, as vLLM answers:

* sampled tokens: chat's ``logprobs: true``, completions' ``logprobs: k``; a position's
  candidates are, as vLLM's engine gives them, the sampled token then the ``k`` best, once
  each (``append_logprobs_for_next_position``): the filler's token is the best, so ``max(k, 1)``
  of them, the others impossible (logprob -inf, written -9999.0). Chat lists the first
  ``top_logprobs`` (none unset), completions the first ``logprobs + 1``
  (``chat_top_logprobs_limit`` / ``completion_top_logprobs_limit``): :func:`top_shown`;
* prompt logprobs (``prompt_logprobs``, or ``echo`` with chat's ``top_logprobs``, default 0,
  or completions' ``logprobs``: ``to_sampling_params``): one entry a prompt token, ``None``
  for the first (nothing predicts it), then ``{token id: Logprob}`` (vLLM's
  ``prompt_logprobs``: the choice's on completions, the answer's on chat); refused on a
  stream, as vLLM's request validation refuses it;
* completions' ``echo``: the prompt's text before the answer's, and with ``logprobs`` the
  prompt's tokens before the answer's (``OpenAIServingCompletion``); with ``max_tokens: 0``
  the prompt's alone (:func:`echo_only`); chat's ``echo``: the
  last message's content before the answer when that message has the role answered
  (``OpenAIServingChat``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from router.core.errors import BadRequest
from router.tokenize.lax import lax_bool, lax_int
from router.tokenize.request_fields import asks_prompt_logprobs

Decode = Callable[[Sequence[int]], str]


def asks_logprobs(body: Mapping[str, Any], chat: bool) -> bool:
    """Sampled-token logprobs asked: chat's ``logprobs: true``, completions' ``logprobs: k``."""
    value = body.get("logprobs")
    return value is True if chat else isinstance(value, int) and not isinstance(value, bool)


def top_shown(body: Mapping[str, Any], chat: bool) -> int:
    """How many top logprobs each position lists (the module docstring): chat's
    ``top_logprobs`` (0 unset), completions' ``max(logprobs, 1)``."""
    k = lax_int(body.get("top_logprobs" if chat else "logprobs"))
    k = k if isinstance(k, int) and k > 0 else 0
    return k if chat else max(k, 1)


IMPOSSIBLE = -9999.0  # vLLM's JSON stand-in for a logprob of -inf


def _tops(token: str, top: int) -> list[tuple[str, float]]:
    """A position's ``top`` listed candidates: its certain ``token``, then impossible ones."""
    return [(token, 0.0), *((f" alt{r}", IMPOSSIBLE) for r in range(2, top + 1))][:top]


def check(body: dict[str, Any], kind: str) -> bool:
    """Whether a chat or completion ``body`` asks prompt logprobs; BadRequest where vLLM's
    request validation refuses them (vLLM's words)."""
    if kind not in ("chat", "completion"):
        return False  # the Messages and Responses APIs have no such field
    value = body.get("prompt_logprobs")
    if value is not None:
        if not isinstance(value, int) or isinstance(value, bool):
            raise BadRequest("'prompt_logprobs' must be an integer")
        if body.get("stream") and (value > 0 or value == -1):
            raise BadRequest("`prompt_logprobs` are not available when `stream=True`.")
        if value < 0 and value != -1:
            raise BadRequest("`prompt_logprobs` must be a positive value or -1.")
    return asks_prompt_logprobs(body, kind)


def echoes(body: Mapping[str, Any]) -> bool:
    return lax_bool(body.get("echo")) is True


def echo_only(body: Mapping[str, Any], kind: str) -> bool:
    """Completions' ``echo`` with ``max_tokens: 0`` (vLLM's ``echo_without_generation``):
    the engine runs one token, and the answer is the prompt alone (its text and, asked, its
    logprobs), the token counted in ``completion_tokens`` and ending it with ``length``."""
    value = body.get("max_tokens")
    return kind == "completion" and type(value) is int and value == 0 and echoes(body)


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def sampled(words: Sequence[str], chat: bool, offset: int = 0, top: int = 1) -> dict[str, Any]:
    """vLLM's logprobs of the filler tokens ``words`` (the text from ``offset`` on, for
    completions' ``text_offset``), ``top`` candidates listed a position (:func:`top_shown`)."""
    if chat:
        content = []
        for w in words:
            tops = [_chat_entry(t, p) for t, p in _tops(w, top)]
            content.append({**_chat_entry(w, 0.0), "top_logprobs": tops})
        return {"content": content}
    offsets = []
    for w in words:
        offsets.append(offset)
        offset += len(w)
    return {
        "text_offset": offsets,
        "token_logprobs": [0.0] * len(words),
        "tokens": list(words),
        "top_logprobs": [dict(_tops(w, top)) for w in words],
    }


def prompt_entries(ids: Sequence[int], decode: Decode) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` of the prompt ``ids`` as it dumps them."""
    out: list[dict[str, Any] | None] = [None]
    for token in ids[1:]:
        out.append({str(token): {"logprob": 0.0, "rank": 1, "decoded_token": decode([token])}})
    return out


def echoed(
    ids: Sequence[int], decode: Decode, words: Sequence[str], top: int = 1
) -> dict[str, Any]:
    """Completions' logprobs with ``echo``: the prompt's tokens (the first with no logprob),
    then the answer's ``words``, offsets running over the echoed text; ``top`` candidates
    listed a position (the prompt's are asked as many: vLLM's ``to_sampling_params``)."""
    tokens = [decode([t]) for t in ids]
    offsets = []
    offset = 0
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    answer = sampled(words, False, offset, top)
    return {
        "text_offset": offsets + answer["text_offset"],
        "token_logprobs": [None, *([0.0] * (len(tokens) - 1)), *answer["token_logprobs"]],
        "tokens": tokens + answer["tokens"],
        "top_logprobs": [None, *(dict(_tops(t, top)) for t in tokens[1:]), *answer["top_logprobs"]],
    }


def completion_echo(body: Mapping[str, Any], ids: Sequence[int], decode: Decode) -> str:
    """The prompt text completions' ``echo`` repeats: the prompt as sent, or its ids decoded
    (``return_token_ids``: none, as vLLM)."""
    if lax_bool(body.get("return_token_ids")) is True:
        return ""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else decode(ids)


def _last_message(body: Mapping[str, Any]) -> dict[str, Any] | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return None
    return messages[-1]


def answered_role(body: Mapping[str, Any]) -> str:
    """The role chat answers with (vLLM's ``get_chat_request_role``): ``assistant``, or
    without a generation prompt the last message's own."""
    last = _last_message(body)
    if lax_bool(body.get("add_generation_prompt", True)) is not False or last is None:
        return "assistant"
    role = last.get("role")
    return role if isinstance(role, str) else "assistant"


def chat_echo(body: Mapping[str, Any]) -> str:
    """The text chat's ``echo`` repeats: the last message's content when its role is the
    one answered (:func:`answered_role`)."""
    last = _last_message(body)
    if last is None or last.get("role") != answered_role(body):
        return ""
    content = last.get("content") or ""
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""
