"""The messages and tools a chat template is given, prepared as vLLM 0.34 prepares them.

A template renders what the engine's copy renders only when it is handed the same values,
their keys in the same order (templates serialise messages and tools with ``tojson``).
This module holds vLLM's rules for those values; router.tokenize.template compiles the
template and renders it with them.

* :func:`prepare_messages`: each message's content in the template's content format
  (router.tokenize.content_format: text parts joined with newlines, or a list of parts for
  templates that loop over it), tool-call arguments given as JSON strings parsed into
  objects (so templates that render ``arguments | tojson`` see what they would see in the
  engine), the keys vLLM keeps, in vLLM's order.
* :func:`developer_as_system`: ``developer`` messages as vLLM gives them to a template
  that does not name that role (:func:`names_developer`).
* :func:`prepare_tools`: ``tools`` as the dump of vLLM's request model.

Contracts: no Jinja here, and no I/O. The functions never mutate their arguments; their
results may hold values of the arguments (messages already as vLLM gives them) and memoised
parsed arguments, unchanged and not copied, which callers must not mutate either (templates
render in an immutable sandbox). The arguments memo is per process, bounded and
thread-safe; it changes no result, only how often a text is parsed.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from router.tokenize.content_format import (
    BILLING_HEADER as _BILLING_HEADER,
)
from router.tokenize.content_format import (
    ContentFormat,
    content_text,
    openai_parts,
    tool_content,
    without_billing_header,
)

_ARGS_CACHE: dict[str, dict[str, Any]] = {}
_ARGS_CACHE_MAX = 8192
# the memo's bound in units of its entries' cost (:func:`_args_cost`: about the bytes an
# entry holds, the text and the object parsed from it); longer arguments (a file written by
# a tool call) are parsed each time
_ARGS_CACHE_CHARS = 8 * 2**20
_ARGS_MEMO_MAX_CHARS = 64 * 1024
# what a container or a value of the parsed object costs beyond its characters: an empty
# dict is 64 bytes, a list slot 8, a dict entry ~30, a small int 28
_ARGS_ITEM_COST = 96
_args_chars = 0
_args_lock = threading.Lock()


def _parse_arguments(text: str) -> dict[str, Any]:
    """Tool-call arguments as vLLM 0.34 hands them to the template
    (``_postprocess_messages``): the JSON object ``text`` holds, else ``{}`` (empty, not
    JSON, or JSON that is not an object: an array, a number, a string, null). Memoised
    (at most ``_ARGS_CACHE_MAX`` texts of ``_ARGS_MEMO_MAX_CHARS`` or fewer characters,
    ``_ARGS_CACHE_CHARS`` in all): every turn of a session resends the same calls;
    templates cannot mutate the result."""
    global _args_chars
    found = _ARGS_CACHE.get(text)
    if found is not None:
        return found
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        value = {}
    if not isinstance(value, dict):
        value = {}
    if len(text) > _ARGS_MEMO_MAX_CHARS:
        return value
    cost = _args_cost(text)
    with _args_lock:  # (worker threads process large bodies)
        if len(_ARGS_CACHE) >= _ARGS_CACHE_MAX or _args_chars + cost > _ARGS_CACHE_CHARS:
            _ARGS_CACHE.clear()
            _args_chars = 0
        if text not in _ARGS_CACHE:
            _args_chars += cost
            _ARGS_CACHE[text] = value
    return value


def _args_cost(text: str) -> int:
    """What a memo entry of ``text`` holds, about: the text, and the parsed object, whose
    containers and values cost far more than their characters (``[{},{}]``: 7 characters,
    ~200 bytes parsed), counted by the separators and brackets that make them."""
    items = text.count(",") + text.count("{") + text.count("[")
    return 2 * len(text) + _ARGS_ITEM_COST * items


# the keys of a tool call and of its function in the order vLLM's request model validates
# them into (openai's ``ChatCompletionMessageFunctionToolCallParam`` / ``Function``), the
# other keys after them
_CALL_KEYS = ("id", "function", "type")
_FUNCTION_KEYS = ("arguments", "name")


def _in_order(value: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """``value`` with ``keys`` (those present) first, in that order, then its other keys."""
    out = {k: value[k] for k in keys if k in value}
    out.update((k, v) for k, v in value.items() if k not in out)
    return out


def _prepare_call(call: Any, as_sent: bool = False) -> Any:
    """A tool call as vLLM 0.34 hands it over: its keys in its request model's order (in
    their own order when ``as_sent``: messages vLLM builds itself and does not validate,
    a Responses API request's), the function's ``arguments`` an object
    (:func:`_parse_arguments`; an object given as such kept, anything else ``{}``)."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping):
        return call
    args = fn.get("arguments")
    if isinstance(args, str):
        args = _parse_arguments(args)
    elif not isinstance(args, dict):
        args = {}
    if as_sent:  # vLLM parses the arguments in place
        return {**call, "function": {**fn, "arguments": args}}
    function = _in_order({**fn, "arguments": args}, _FUNCTION_KEYS)
    return _in_order({**call, "function": function}, _CALL_KEYS)


# the keys (in their order) a message may have and still reach the template as it is: those
# of the message vLLM builds from it
_PLAIN_ORDERS = frozenset({("role", "content"), ("role", "content", "name")})
_PLAIN_TOOL_ORDERS = _PLAIN_ORDERS | {
    ("role", "content", "tool_call_id"),
    ("role", "content", "tool_call_id", "name"),
}


def prepare_messages(
    messages: Sequence[Mapping[str, Any]],
    content_format: ContentFormat = "string",
    calls_as_sent: bool = False,
) -> list[dict[str, Any]]:
    """``messages`` as vLLM hands them to the template (vLLM 0.34,
    vllm/renderers/chat_utils/chat_message.py): the content in ``content_format``
    (router.tokenize.content_format: a string of the text parts, a missing one empty; or a
    list of parts, a tool result's all-text parts joined; a system message without Claude
    Code's attribution line); of the other keys only ``name`` and a string ``task``, an
    assistant's ``tool_calls`` (arguments parsed, see :func:`_parse_arguments`; an empty list
    dropped) and ``reasoning`` (also given as ``reasoning_content``, and as ``thinking``
    before the role, as transformers 5.21+ adds it), a tool result's
    ``tool_call_id``, a developer message's ``tools`` (null when absent; their keys in vLLM's
    order too), in vLLM's order
    (``role``, ``content``, the role's own keys, ``name``, ``task``, ``tools``: a template
    serialising a message sees them so). Plain messages of the string format whose keys are
    already so are passed as they are, the others rebuilt. A tool call's keys are in the
    order of vLLM's chat request model, or with ``calls_as_sent`` in their own (the chat
    messages vLLM builds from a Responses API request are not validated by that model)."""
    openai = content_format == "openai"
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m.get("content")
        role = m.get("role")
        if (
            not openai
            and type(m) is dict
            and type(content) is str
            and (tuple(m) in (_PLAIN_TOOL_ORDERS if role == "tool" else _PLAIN_ORDERS))
            and type(m.get("name", "")) is str
            and role != "developer"
            and not (role == "system" and content.startswith(_BILLING_HEADER))
        ):
            out.append(m)  # nothing to change; the sandbox keeps templates from mutating it
            continue
        if role == "system":
            content = without_billing_header(content)
        if not openai:
            prepared: Any = content_text(content) or ""
        elif role == "tool":
            prepared = tool_content(openai_parts(content))
        else:
            prepared = openai_parts(content)
        msg: dict[str, Any] = {"role": role, "content": prepared}
        if role == "assistant":
            calls = m.get("tool_calls")
            if isinstance(calls, list):
                if calls:
                    msg["tool_calls"] = [_prepare_call(c, calls_as_sent) for c in calls]
            elif calls is not None:
                msg["tool_calls"] = calls
            reasoning = m.get("reasoning")
            if reasoning is None:  # vLLM before ``reasoning`` read ``reasoning_content``
                reasoning = m.get("reasoning_content")
            if reasoning is not None:
                # transformers 5.21+ (vLLM 0.34 takes up to 5.22) also gives it as
                # ``thinking``, first (chat_template_utils._alias_reasoning_fields)
                msg = {"thinking": reasoning, **msg}
                msg["reasoning"] = reasoning
                msg["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        name = m.get("name")
        if isinstance(name, str):
            msg["name"] = name
        task = m.get("task")
        if isinstance(task, str):
            msg["task"] = task
        if role == "developer":
            msg["tools"] = _developer_tools(m.get("tools"))
        out.append(msg)
    return out


# the keys of a developer message's tool and of its function in the order vLLM's request
# model validates them into (openai's ``ChatCompletionFunctionToolParam`` /
# ``FunctionDefinition``), the other keys after them
_DEV_TOOL_KEYS = ("function", "type")
_DEV_FUNCTION_KEYS = ("name", "description", "parameters", "strict")


def _developer_tools(tools: Any) -> Any:
    """A developer message's ``tools`` as vLLM 0.34 hands them over: each tool's and
    function's keys in its request model's order, their values as sent."""
    if not isinstance(tools, list):
        return tools
    out = []
    for t in tools:
        if not isinstance(t, Mapping):
            out.append(t)
            continue
        fn = t.get("function")
        if isinstance(fn, Mapping):
            t = {**t, "function": _in_order(fn, _DEV_FUNCTION_KEYS)}
        out.append(_in_order(t, _DEV_TOOL_KEYS))
    return out


def developer_as_system(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """vLLM's treatment of ``developer`` messages for a template that does not name that
    role (vllm/renderers/hf.py): each becomes a ``system`` message, then, when a system
    message is not first or there are several, all of them are merged into one first
    message, their texts (parts' texts joined with newlines) joined with blank lines."""
    converted = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
        if m.get("role") == "developer"
        else m
        for m in messages
    ]
    texts: list[str] = []
    rest: list[Mapping[str, Any]] = []
    merge = False
    for i, m in enumerate(converted):
        if m.get("role") != "system":
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(texts)
        content = m.get("content", "")
        if isinstance(content, list):
            found = [p.get("text") if isinstance(p, Mapping) else p for p in content]
            content = "\n".join(t for t in found if isinstance(t, str))
        if content:
            texts.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def names_developer(source: str | None) -> bool:
    """Whether a template's ``source`` names the ``developer`` role (the word quoted, with
    single or double quotes); None, no template, does not. vLLM converts the ``developer``
    messages of a conversation for a template that does not (:func:`developer_as_system`)."""
    return source is not None and ('"developer"' in source or "'developer'" in source)


def prepare_tools(tools: Any) -> Any:
    """``tools`` as vLLM 0.34 hands them to the template: each the ``model_dump()`` of its
    ``ChatCompletionToolsParam``: ``type``, then ``function`` (``name``, ``description``,
    ``parameters``, absent ones null, then ``strict`` and ``defer_loading`` where not null; a
    tool's ``defer_loading`` is its function's when that has none), then the tool's
    ``defer_loading`` where not null. Other keys are dropped, as the dump drops them."""
    if not isinstance(tools, list):
        return tools
    out = []
    for t in tools:
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(fn, Mapping):
            out.append(t)
            continue
        defer = t.get("defer_loading")
        f = {
            "name": fn.get("name"),
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
            "strict": fn.get("strict"),
            "defer_loading": defer if fn.get("defer_loading") is None else fn["defer_loading"],
        }
        tool: dict[str, Any] = {
            "type": t.get("type", "function"),
            "function": {k: v for k, v in f.items() if v is not None or k in _FUNCTION_DUMP},
        }
        if defer is not None:
            tool["defer_loading"] = defer
        out.append(tool)
    return out


# the keys of a tool's function that its dump keeps when null
_FUNCTION_DUMP = frozenset({"name", "description", "parameters"})
