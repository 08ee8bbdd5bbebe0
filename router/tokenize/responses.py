"""An OpenAI Responses API body (``POST /v1/responses``) as the chat body vLLM renders.

vLLM 0.34 renders a Responses request of a non-harmony model as a chat: the body's
``instructions`` and ``input`` become chat messages (``construct_input_messages``,
vllm/entrypoints/openai/responses/utils.py, after the request model's ``input_item_parsing``
in protocol.py), its function ``tools`` chat tools (``construct_tool_dicts``), its
``reasoning.effort`` the template's ``reasoning_effort`` / ``enable_thinking``, and a last
assistant (or reasoning) item still ``in_progress`` / ``incomplete`` is continued
(``should_continue_final_message``); vllm/renderers/online_renderer.py
``render_responses``. :func:`to_chat_body` follows that:

* ``instructions`` (when not empty) -> a leading system message;
* ``input`` a string -> one user message; a list of items:

  - a message of role ``user`` / ``system`` / ``developer`` -> that message as sent (its
    ``input_text`` / ``input_image`` parts are the chat pipeline's, as they are vLLM's);
  - an assistant message -> an assistant message with the text of its first content part
    (a string content as it is), set on the previous assistant message when that has no
    content yet;
  - ``function_call`` -> a tool call (``call_id``, ``name``, ``arguments``) appended to the
    previous assistant message, else a new one (its keys reach the template in this
    order: vLLM does not validate these messages as a chat request's);
  - ``reasoning`` -> the assistant message's ``reasoning`` (its first content text, else
    its first summary text); ``encrypted_content`` is refused, as vLLM refuses it;
  - ``function_call_output`` -> a ``tool`` message (``output``, ``call_id``);
  - anything else is refused (vLLM: "Unsupported input item type");

* function tools -> chat function tools (``name``, ``description``, ``parameters``,
  ``strict``); ``chat_template_kwargs``, ``cache_salt``, ``kv_transfer_params`` as they are;
* the rendered text tokenized as ``ResponsesRequest.build_tok_params`` has it: with the
  tokenizer's special tokens (``add_special_tokens``), and cut to the context
  (``truncate_prompt_tokens`` -1) unless ``truncation`` is "disabled" (its default).

Where the router cannot follow vLLM the prompt is marked approximate (``exact`` False):
``previous_response_id`` (the history is in the replica's store, between the instructions
and the input: only the blocks before it are hashed, ``PromptProcessor.head_hashes``),
tools other than function tools (built-in tools, namespaces, custom tools), custom tool
calls. A harmony model's body (gpt-oss: vLLM renders those with openai_harmony) is known
by its size alone (:func:`responses_prompt`).

:func:`responses_prompt` is the routing view of such a body through the model's chat
pipeline (router.tokenize.pipeline). Only the fields read here are checked; a malformed
body is a BadRequest, as vLLM's request model refuses it with a 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from router.core.errors import BadRequest
from router.tokenize.request_fields import forwarded_prompt_ids

if TYPE_CHECKING:
    from router.tokenize.keying import ProcessedPrompt
    from router.tokenize.pipeline import PromptProcessor

# vLLM's key for a custom tool's free-form input (vllm/tool_parsers/utils.py)
CUSTOM_TOOL_INPUT_KEY = "input"
_PARTIAL = frozenset({"in_progress", "incomplete"})
# model names of harmony models (gpt-oss), which vLLM renders without the chat template
_HARMONY_MARKERS = ("gpt-oss", "gpt_oss")


@dataclass(slots=True, frozen=True)
class ChatConversion:
    """A Responses body as a chat body; ``exact``: the chat body is the one vLLM renders."""

    body: dict[str, Any]
    exact: bool
    # with ``previous_response_id``: how many of the messages come before the stored
    # history vLLM puts between the instructions and the input (construct_input_messages)
    history_at: int | None = None


def _first_text(parts: Any) -> str:
    """The text of the first part of a content list (vLLM reads ``content[0].text``)."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list) or not parts:
        return ""
    first = parts[0]
    if isinstance(first, Mapping):
        text = first.get("text", "")
        return text if isinstance(text, str) else ""
    return first if isinstance(first, str) else ""


@dataclass(slots=True)
class _Converter:
    """One body's conversion; ``exact`` turns False where vLLM cannot be followed."""

    exact: bool = True

    def item(self, item: Any, out: list[dict[str, Any]]) -> None:
        if not isinstance(item, Mapping):
            raise BadRequest("each 'input' item must be an object")
        prev = out[-1] if out and out[-1].get("role") == "assistant" else None
        kind = item.get("type", "message")
        if kind in ("function_call", "custom_tool_call"):
            self.tool_call(item, prev, out)
        elif kind == "reasoning":
            self.reasoning(item, prev, out)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if kind != "function_call_output":
                self.exact = False
            out.append(
                {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
            )
        elif kind == "message" and item.get("role") == "assistant":
            text = _first_text(item.get("content"))
            if prev is not None and prev.get("content") is None:
                prev["content"] = text
            else:
                out.append({"role": "assistant", "content": text})
        elif kind == "message" and isinstance(item.get("role"), str):
            message = {k: v for k, v in item.items() if k not in ("type", "id", "status")}
            out.append(message)
        else:
            raise BadRequest(f"Unsupported input item type: {kind}")

    def tool_call(
        self, item: Mapping[str, Any], prev: dict[str, Any] | None, out: list[dict[str, Any]]
    ) -> None:
        name = item.get("name")
        call_id = item.get("call_id")
        if not isinstance(name, str) or not isinstance(call_id, str):
            raise BadRequest("a function_call item needs a string 'name' and 'call_id'")
        if item.get("type") == "custom_tool_call":
            self.exact = False
            payload = item.get("input") or ""
            arguments: Any = json.dumps({CUSTOM_TOOL_INPUT_KEY: payload}, ensure_ascii=False)
        else:
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise BadRequest("a function_call item's 'arguments' must be a string")
            if item.get("namespace"):
                self.exact = False  # vLLM flattens the name with its separator
        call = {"id": call_id, "function": {"name": name, "arguments": arguments},
                "type": "function"}  # fmt: skip
        if prev is not None:
            prev.setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "tool_calls": [call]})

    def reasoning(
        self, item: Mapping[str, Any], prev: dict[str, Any] | None, out: list[dict[str, Any]]
    ) -> None:
        if item.get("encrypted_content"):
            raise BadRequest("Encrypted content is not supported.")
        content, summary = item.get("content"), item.get("summary")
        text = _first_text(content) if content else _first_text(summary)
        if prev is not None and prev.get("reasoning") is None:
            prev["reasoning"] = text
        else:
            out.append({"role": "assistant", "reasoning": text})


def _continues(items: Any) -> bool:
    """vLLM's ``should_continue_final_message``: the last item is a message or reasoning
    item still ``in_progress`` / ``incomplete``."""
    if not isinstance(items, list) or not items or not isinstance(items[-1], Mapping):
        return False
    last = items[-1]
    status = last.get("status")
    if status is not None and not isinstance(status, str):
        raise BadRequest("an input item's 'status' must be a string")
    return last.get("type", "message") in ("message", "reasoning") and status in _PARTIAL


def _tools(tools: Any, conv: _Converter) -> list[dict[str, Any]] | None:
    """The function tools as chat tools (vLLM's ``construct_tool_dicts``); other tools are
    not the template's, and mark the conversion approximate."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be an array")
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, Mapping) or not isinstance(tool.get("type"), str):
            raise BadRequest("each tool must be an object with a string 'type'")
        if tool["type"] != "function":
            conv.exact = False  # built-in, namespace and custom tools: not followed
            continue
        if not isinstance(tool.get("name"), str):
            raise BadRequest("a function tool needs a string 'name'")
        function: dict[str, Any] = {
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": tool.get("parameters"),
        }
        for key in ("strict", "defer_loading"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out or None


def to_chat_body(body: Mapping[str, Any]) -> ChatConversion:
    """The chat body vLLM 0.34 renders for the Responses body ``body`` (module docstring)."""
    conv = _Converter(exact=body.get("previous_response_id") is None)
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            conv.item(item, messages)
    else:
        raise BadRequest("'input' is a required string or array of input items")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    tools = _tools(body.get("tools"), conv)
    if tools is not None:
        chat["tools"] = tools
        choice = body.get("tool_choice", "auto")
        if isinstance(choice, str):
            chat["tool_choice"] = choice
    for key in ("chat_template_kwargs", "cache_salt", "kv_transfer_params"):
        if body.get(key) is not None:
            chat[key] = body[key]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    if _continues(items):
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False
    # tokenized as ``ResponsesRequest.build_tok_params`` says: with the tokenizer's special
    # tokens (the TokenizeParams default, where a chat's is false) and, for a truncation
    # other than "disabled" (the default), cut to the context
    chat["add_special_tokens"] = True
    if body.get("truncation", "disabled") != "disabled":
        chat["truncate_prompt_tokens"] = -1
        # 0 cuts to the whole context, not one less (TokenizeParams.max_truncation_tokens)
        if body.get("max_output_tokens") is not None:
            chat["max_completion_tokens"] = body["max_output_tokens"]
    history_at = None if body.get("previous_response_id") is None else int(bool(instructions))
    return ChatConversion(chat, conv.exact, history_at)


def is_harmony(model: str) -> bool:
    """Whether a model name looks like a harmony model (gpt-oss), which vLLM renders with
    openai_harmony rather than the chat template."""
    low = model.lower()
    return any(marker in low for marker in _HARMONY_MARKERS)


def responses_prompt(processor: PromptProcessor, body: Mapping[str, Any]) -> ProcessedPrompt:
    """The routing view of a Responses body: its chat body (:func:`to_chat_body`) through
    the model's chat pipeline, not exact where the conversion is not (or for a harmony
    model)."""
    named = body.get("model")
    if processor.harmony or (isinstance(named, str) and is_harmony(named)):
        # vLLM 0.34 renders it with openai_harmony (OnlineRenderer
        # _render_responses_with_harmony, which takes input items the chat conversion
        # does not), forwarded ids or not: known by its size alone
        return processor.unknown(body)
    conv = to_chat_body(body)
    if not conv.body["messages"]:  # nothing to render: routed on load
        return processor.unknown(body)
    # vLLM hands the template the messages it built as they are (no chat request model
    # validates them): tool calls keep their keys' order
    prompt = processor.chat(conv.body, from_responses=True)
    # the stored history comes after the instructions: only what precedes it is known
    # (unless the prompt is ids forwarded in kv_transfer_params, which vLLM runs as sent)
    if (
        conv.history_at is not None
        and forwarded_prompt_ids(conv.body, conv.body["messages"]) is None
    ):
        hashes = processor.head_hashes(conv.body, conv.history_at, from_responses=True)
        prompt = replace(prompt, block_hashes=hashes)
    return prompt if conv.exact else replace(prompt, exact=False)


# the strings pydantic's (lax) ``bool`` reads as true; its false ones, and ``null``, store
# nothing, and a value it refuses is the engine's 400 (nothing stored either)
_TRUE_STRINGS = frozenset(("1", "on", "t", "true", "y", "yes"))


def stores(body: Mapping[str, Any]) -> bool:
    """Whether the engine keeps the response a Responses API ``body`` asks for (with its
    store enabled): vLLM 0.34's ``ResponsesRequest.store`` is ``bool | None`` defaulting to
    true, and ``serving_responses`` stores only when it is true (``if request.store:``), so
    an absent ``store`` stores and ``"store": null`` does not."""
    value = body.get("store", True)
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value == 1
    return isinstance(value, str) and value.lower() in _TRUE_STRINGS


def previous_response(body: Mapping[str, Any]) -> str | None:
    """The ``previous_response_id`` a body names, if a non-empty string."""
    found = body.get("previous_response_id")
    return found if isinstance(found, str) and found else None
