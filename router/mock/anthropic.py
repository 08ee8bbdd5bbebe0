"""The Anthropic Messages API on the mock replica, in vLLM 0.34's wire format.

vLLM serves ``POST /v1/messages`` by converting the body to a chat request and converting
the chat answer back (vllm/entrypoints/anthropic/serving.py); the mock does the same: the
body's chat conversion (router.tokenize.anthropic ``to_chat_body``, the router's reading of
vLLM's) is what its tokenizer renders, and its chat answer is written as vLLM writes an
Anthropic one:

* a JSON answer ``{"id", "type": "message", "role": "assistant", "content": [{"type":
  "text", "text"}], "model", "stop_reason", "usage"}`` (no ``stop_sequence``: vLLM drops
  nulls there);
* a stream of ``event: message_start`` (usage known at the first token), ``content_block_start``,
  ``content_block_delta`` (``text_delta``) per piece, ``content_block_stop``,
  ``message_delta`` (``stop_reason``, the final usage) and ``message_stop``, each
  ``event: NAME\\ndata: JSON\\n\\n`` with compact JSON (pydantic's ``model_dump_json``);
* usage as ``_build_anthropic_usage`` builds it: ``input_tokens`` the prompt less its
  cached tokens, ``output_tokens``, ``cache_read_input_tokens`` (vLLM with
  ``--enable-prompt-tokens-details``);
* errors ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from router.service.errors import anthropic_error_body

STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def event(name: str, data: dict[str, Any]) -> bytes:
    """One SSE event as vLLM's ``wrap_data_with_event`` writes it."""
    return f"event: {name}\ndata: {_dumps(data)}\n\n".encode()


def usage(prompt: int, cached: int, completion: int) -> dict[str, int]:
    """vLLM's Anthropic usage of a prompt of ``prompt`` tokens, ``cached`` of them found in
    the cache, and ``completion`` output tokens."""
    return {
        "input_tokens": max(0, prompt - cached),
        "output_tokens": completion,
        "cache_read_input_tokens": cached,
    }


def error(status: int, message: str) -> web.Response:
    return web.Response(
        body=anthropic_error_body(status, message),
        status=status,
        content_type="application/json",
    )


def start_events(message_id: str, model: str, first: dict[str, int]) -> bytes:
    """``message_start`` (with the usage known at the first token) and the text block's
    ``content_block_start``."""
    message: dict[str, Any] = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": first,
    }
    block = {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    return event("message_start", {"type": "message_start", "message": message}) + event(
        "content_block_start", block
    )


def text_event(text: str) -> bytes:
    delta = {"type": "text_delta", "text": text}
    return event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})


def end_events(finish_reason: str, final: dict[str, int]) -> bytes:
    """``content_block_stop``, ``message_delta`` (stop reason, final usage), ``message_stop``."""
    delta = {"stop_reason": STOP_REASONS.get(finish_reason, "end_turn"), "stop_sequence": None}
    return (
        event("content_block_stop", {"type": "content_block_stop", "index": 0})
        + event("message_delta", {"type": "message_delta", "delta": delta, "usage": final})
        + event("message_stop", {"type": "message_stop"})
    )


def answer(
    message_id: str, model: str, text: str, finish_reason: str, final: dict[str, int]
) -> dict[str, Any]:
    """The JSON answer of a request that was not streamed."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "model": model,
        "stop_reason": STOP_REASONS.get(finish_reason, "end_turn"),
        "usage": final,
    }
