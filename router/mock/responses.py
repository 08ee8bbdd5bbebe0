"""The OpenAI Responses API on the mock replica, in vLLM 0.34's wire format.

vLLM serves ``POST /v1/responses`` of a non-harmony model by rendering the body as a chat
(router.tokenize.responses ``to_chat_body``, the router's reading of vLLM's conversion, is
what the mock's tokenizer renders) and writing the answer as a ``Response``:

* a JSON answer ``{"id": "resp_...", "object": "response", "status", "output": [a message
  with one output_text part], "usage": {"input_tokens", "input_tokens_details":
  {"cached_tokens", ...}, "output_tokens", "output_tokens_details", "total_tokens"}, ...}``;
* a stream of ``event: TYPE\\ndata: JSON\\n\\n`` events (pydantic's compact JSON):
  ``response.created``, ``response.in_progress``, ``response.output_item.added``,
  ``response.content_part.added``, ``response.output_text.delta`` per piece, then
  ``response.output_text.done``, ``response.content_part.done``,
  ``response.output_item.done`` and ``response.completed`` (or ``response.incomplete`` when
  cut by ``max_output_tokens``) with the whole response and its usage; no ``[DONE]``.

The store: vLLM keeps responses (and the chat messages that made them) only with
``VLLM_ENABLE_RESPONSES_API_STORE=1``; the mock keeps them as if that were set, for bodies
whose ``store`` is absent or true (router.tokenize.responses ``stores``: ``null`` stores
nothing), bounded, so ``previous_response_id``, ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel`` work, and an unknown id is vLLM's 404. vLLM 0.34's
``Response`` has no ``store`` field, nor has the mock's. A request
naming a previous response renders as vLLM renders it: the instructions, the previous
messages but their system ones, the previous answer as an assistant message, then the new
input (``construct_input_messages``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from router.core.errors import BadRequest
from router.service.errors import response_not_found_body
from router.tokenize.responses import previous_response, to_chat_body

MAX_STORED = 10_000


class UnknownResponse(BadRequest):
    """A ``previous_response_id`` or path id the store does not hold (vLLM: 404)."""


def not_found(response_id: str) -> web.Response:
    """vLLM's ``_make_not_found_error``."""
    body = response_not_found_body(response_id)
    return web.Response(body=body, status=404, content_type="application/json")


@dataclass(slots=True)
class Stored:
    """A stored response: the chat messages of its request and its JSON."""

    messages: list[dict[str, Any]]
    response: dict[str, Any]


@dataclass(slots=True)
class ResponseStore:
    """Responses by id, the oldest dropped beyond :data:`MAX_STORED`."""

    items: OrderedDict[str, Stored] = field(default_factory=OrderedDict)

    def put(self, response_id: str, stored: Stored) -> None:
        self.items[response_id] = stored
        while len(self.items) > MAX_STORED:
            self.items.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        return self.items.get(response_id)


def chat_body(store: ResponseStore, body: dict[str, Any]) -> dict[str, Any]:
    """The chat body the mock renders for a Responses body, with the history of its
    ``previous_response_id`` (module docstring); UnknownResponse for an id not stored."""
    chat = to_chat_body(body).body
    previous = previous_response(body)
    if previous is None:
        return chat
    found = store.get(previous)
    if found is None:
        raise UnknownResponse(previous)
    messages = chat["messages"]
    head = messages[:1] if messages and body.get("instructions") else []
    history = [m for m in found.messages if m.get("role") != "system"]
    answer = {"role": "assistant", "content": output_text(found.response)}
    return {**chat, "messages": [*head, *history, answer, *messages[len(head) :]]}


def output_text(response: dict[str, Any]) -> str:
    parts = [
        part.get("text", "")
        for item in response.get("output", [])
        if item.get("type") == "message"
        for part in item.get("content", [])
    ]
    return "".join(parts)


def usage(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    """vLLM's ``ResponseUsage`` of one turn."""
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [prompt],
            "cached_tokens_per_turn": [cached],
        },
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [completion],
            "tool_output_tokens_per_turn": [0],
        },
        "total_tokens": prompt + completion,
    }


def new_ids() -> tuple[str, str]:
    """A response id and its message item's id."""
    return f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"


def response(
    body: dict[str, Any],
    ids: tuple[str, str],
    model: str,
    text: str | None,
    status: str,
    used: dict[str, Any] | None,
    max_tokens: int,
) -> dict[str, Any]:
    """The ``Response`` object (``text`` None: no output yet)."""
    output = []
    if text is not None:
        part: dict[str, Any] = {
            "annotations": [],
            "text": text,
            "type": "output_text",
            "logprobs": None,
        }
        output.append(
            {
                "id": ids[1],
                "content": [part],
                "role": "assistant",
                "status": status,
                "type": "message",
            }
        )
    return {
        "id": ids[0],
        "created_at": int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "background": False,
        "max_output_tokens": max_tokens,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning"),
        "service_tier": body.get("service_tier", "auto"),
        "status": status,
        "text": None,
        "truncation": body.get("truncation", "disabled"),
        "usage": used,
        "user": body.get("user"),
    }


class EventWriter:
    """The SSE events of one streamed response, numbered as vLLM numbers them."""

    def __init__(self, ids: tuple[str, str]) -> None:
        self.ids = ids
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        # pydantic's order: the event's fields, then ``type`` last
        data = {**fields, "sequence_number": self.seq, "type": kind}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

    def opening(self, created: dict[str, Any]) -> bytes:
        """``response.created`` and ``response.in_progress``: vLLM writes them when the
        stream starts, before the engine's first output (the prompt still queued or
        prefilling)."""
        return self.event("response.created", response=created) + self.event(
            "response.in_progress", response=created
        )

    def first_output(self) -> bytes:
        """The message item and its text part, written with the first output token."""
        item = {
            "id": self.ids[1],
            "content": [],
            "role": "assistant",
            "status": "in_progress",
            "type": "message",
        }
        part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        return self.event("response.output_item.added", item=item, output_index=0) + self.event(
            "response.content_part.added",
            content_index=0,
            item_id=self.ids[1],
            output_index=0,
            part=part,
        )

    def delta(self, text: str) -> bytes:
        return self.event(
            "response.output_text.delta",
            content_index=0,
            delta=text,
            item_id=self.ids[1],
            logprobs=[],
            output_index=0,
        )

    def end(self, final: dict[str, Any]) -> bytes:
        message = final["output"][0]
        part = message["content"][0]
        text = part["text"]
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return (
            self.event(
                "response.output_text.done",
                content_index=0,
                item_id=self.ids[1],
                logprobs=[],
                output_index=0,
                text=text,
            )
            + self.event(
                "response.content_part.done",
                content_index=0,
                item_id=self.ids[1],
                output_index=0,
                part=part,
            )
            + self.event("response.output_item.done", item=message, output_index=0)
            + self.event(kind, response=final)
        )
