"""An Anthropic Messages API body (``POST /v1/messages``) as the OpenAI chat body vLLM runs.

vLLM 0.34 serves ``/v1/messages`` by converting the request to a chat completion request
(``AnthropicServingMessages.to_chat_completion_request``, vllm/entrypoints/anthropic/
serving.py) and rendering that with the model's chat template. :func:`to_chat_body` follows
that conversion for everything that decides the prompt:

* ``system`` (a string, or text blocks joined without a separator; Claude Code's
  ``x-anthropic-billing-header`` blocks dropped) -> a leading system message;
* messages: text blocks (one text block alone becomes a string content), images (base64
  sources as ``data:`` URLs, ``url`` sources as they are), ``thinking`` blocks -> the
  assistant message's ``reasoning``, ``tool_use`` -> ``tool_calls`` (arguments
  ``json.dumps(input)``), a user's ``tool_result`` -> a ``tool`` message before the user
  message (text parts joined by newlines; its images in a user message after it), an
  assistant's ``tool_result`` -> ``"Tool result: ..."`` text; inline ``system`` messages;
* ``tools`` (after ``tool_addition`` / ``tool_removal`` blocks) -> functions whose
  ``parameters`` is the ``input_schema`` (``"type": "object"`` added when missing),
  ``tool_choice`` (default ``auto`` with tools);
* ``output_config.effort`` and ``thinking`` -> ``reasoning_effort`` (the template's
  ``reasoning_effort`` / ``enable_thinking``), ``chat_template_kwargs``, ``cache_salt``,
  ``kv_transfer_params``.

Where the router cannot know what vLLM decides, the conversion says so (``exact`` False)
rather than pass a guess off as exact:

* inline ``system`` messages, without the model's template: vLLM keeps them in place or
  merges them into the leading system message depending on a probe of the chat template
  at start-up (``_should_merge_inline_system``). With the template (``render = "local"``)
  the router runs the same probe (:func:`merges_inline_system`) and is exact; only a
  conversation the template then refuses in place is rendered merged, not exact (vLLM
  answers it with an error);
* ``thinking`` ``disabled`` / ``between_tools``: the ``reasoning_effort`` vLLM sends is
  its ``--anthropic-disabled-thinking-effort`` (the model's
  ``anthropic_disabled_thinking_effort``, exact when set to an effort). Its default,
  ``"auto"``, is a probe of the template, once per model at the first such request
  (``DisabledThinkingEffortResolver``): ``[{"role": "user", "content": "Hi"}]`` rendered
  with ``reasoning_effort`` ``"none"``, then with each Anthropic effort; ``"low"`` when
  ``"none"`` fails to render or renders as one of them does (a template that ignores it,
  or reads an unknown effort as ``"max"`` as GLM-5.3's does), else ``"none"``. With the
  template the router runs the same probe through the model's chat pipeline
  (:func:`disabled_thinking_effort`) and is exact; without one it has nothing to probe and
  takes ``"none"``, not exact. (``render = "engine"``: the engine's render is the prompt;
  the router's stand-in for it, never exact, probes the router's template if it has one);
* a ``tool_use`` block without an ``id``: vLLM names the call after the clock.

:func:`messages_prompt` is the routing view of such a body through the model's ordinary chat
pipeline (router.tokenize.pipeline). Only the fields read here are checked; a malformed body
is a BadRequest, as vLLM's request model refuses it with a 400: content blocks as its
``AnthropicContentBlock`` takes them (a type it does not know is refused, not dropped).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any, cast

from router.core.errors import BadRequest
from router.tokenize.lax import INVALID, lax_bool, lax_int

if TYPE_CHECKING:
    from router.tokenize.keying import ProcessedPrompt
    from router.tokenize.pipeline import PromptProcessor
    from router.tokenize.template import ChatTemplate

BILLING_HEADER = "x-anthropic-billing-header"
# vLLM 0.34's AnthropicEffort, AnthropicDisabledThinkingEffort and the choices of
# --anthropic-disabled-thinking-effort (vllm/entrypoints/anthropic/protocol.py)
EFFORTS = ("low", "medium", "high", "xhigh", "max")
DISABLED_THINKING_EFFORTS = ("none", *EFFORTS)
DISABLED_THINKING_EFFORT_OPTIONS = ("auto", *DISABLED_THINKING_EFFORTS)
# the reasoning_effort taken for thinking "disabled" / "between_tools" where vLLM's is not
# known (an "auto" setting the router cannot probe: the docstring)
DISABLED_THINKING_EFFORT = "none"
# the conversation vLLM's DisabledThinkingEffortResolver renders to probe the template
_EFFORT_PROBE = ({"role": "user", "content": "Hi"},)
_ROLES = frozenset({"user", "assistant", "system"})
# vLLM 0.34's AnthropicThinkingConfig: its types, and an enabled one's least budget
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
MIN_THINKING_BUDGET = 1024
# vLLM 0.34's AnthropicContentBlock: its types, and its string fields
BLOCK_TYPES = frozenset({
    "text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
    "redacted_thinking", "tool_addition", "tool_removal",
})  # fmt: skip
_STR_FIELDS = ("text", "id", "tool_use_id", "name", "tool_name", "thinking", "signature", "data")
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_log = logging.getLogger("kvrouter.tokenize")


@dataclass(slots=True, frozen=True)
class ChatConversion:
    """An Anthropic body as a chat body. ``exact``: the chat body is the one vLLM builds;
    False where vLLM decides by something the router cannot see (module docstring).
    ``inline_system``: the body has inline system messages (placed as asked: in place, or
    merged; vLLM places them by a probe of its template, :func:`merges_inline_system`), so
    ``exact`` is False; ``placed_exact``: exact apart from where they go."""

    body: dict[str, Any]
    exact: bool
    inline_system: bool = False
    placed_exact: bool = True


def _blocks(value: Any, where: str) -> list[Mapping[str, Any]]:
    """A list of content blocks, each checked as vLLM's ``AnthropicContentBlock`` checks
    it (:func:`_check_block`)."""
    if not isinstance(value, list):
        raise BadRequest(f"'{where}' must be a string or an array of content blocks")
    for i, block in enumerate(value):
        _check_block(block, f"{where}[{i}]")
    return value


def _check_block(block: Any, where: str) -> None:
    """A content block as vLLM 0.34's ``AnthropicContentBlock`` takes it: one of its types
    (:data:`BLOCK_TYPES`; any other, e.g. ``document``, is a 400 there, not a block to
    drop), its string, object and boolean fields of those types (extra fields ignored)."""
    if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
        raise BadRequest(f"'{where}' must be an object with a string 'type'")
    if block["type"] not in BLOCK_TYPES:
        raise BadRequest(
            f"'{where}.type' {block['type']!r} is not supported; "
            f"expected one of {', '.join(sorted(BLOCK_TYPES))}"
        )
    for key in _STR_FIELDS:
        value = block.get(key)
        if value is not None and not isinstance(value, str):
            raise BadRequest(f"'{where}.{key}' must be a string")
    for key in ("source", "input"):
        value = block.get(key)
        if value is not None and not isinstance(value, Mapping):
            raise BadRequest(f"'{where}.{key}' must be an object")
    content = block.get("content")
    if not (content is None or isinstance(content, str)) and not (
        isinstance(content, list) and all(isinstance(item, Mapping) for item in content)
    ):
        raise BadRequest(f"'{where}.content' must be a string or an array of objects")
    if lax_bool(block.get("is_error")) is INVALID:
        raise BadRequest(f"'{where}.is_error' must be a boolean")


def _text_of(block: Mapping[str, Any]) -> str | None:
    """A text block's non-empty text (vLLM: ``block.type == "text" and block.text``)."""
    if block.get("type") != "text":
        return None
    text = block.get("text")
    if text is not None and not isinstance(text, str):
        raise BadRequest("a text block's 'text' must be a string")
    return text or None


def _system_text(content: Any, where: str) -> str | None:
    """The text of a system prompt or inline system message, billing headers dropped
    (vLLM's ``_extract_system_text``); None when nothing is left."""
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [
        text
        for block in _blocks(content, where)
        if (text := _text_of(block)) is not None and not text.startswith(BILLING_HEADER)
    ]
    return "".join(parts) if parts else None


def image_url(source: Any) -> str:
    """An Anthropic image source as the URL vLLM passes on (``url`` sources as they are,
    anything else as a base64 ``data:`` URL)."""
    if not isinstance(source, Mapping):
        return ""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _user_tool_result(block: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    """A user's ``tool_result`` block -> a ``tool`` message (and a user message with its
    images), appended to ``out`` (vLLM's ``_convert_user_tool_result``)."""
    content = block.get("content")
    text = ""
    images: list[str] = []
    refs: list[dict[str, Any]] = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts: list[str] = []
        for item in content:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "text":
                part = item.get("text", "")
                if not isinstance(part, str):  # (vLLM's join of the parts fails: a 400)
                    raise BadRequest("a tool_result's text items need a string 'text'")
                parts.append(part)
            elif kind == "image":
                url = image_url(item.get("source", {}))
                if url:
                    images.append(url)
            elif kind == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    refs.append({"type": "tool_reference", "name": name})
        text = "\n".join(parts)
    tool_content: str | list[dict[str, Any]] = text or ""
    if refs:
        tool_content = refs
        if text:
            tool_content.append({"type": "text", "text": text})
    out.append(
        {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": tool_content}
    )
    if images:
        parts_ = [{"type": "image_url", "image_url": {"url": u}} for u in images]
        out.append({"role": "user", "content": parts_})


@dataclass(slots=True)
class _Converter:
    """One body's conversion; ``exact`` turns False on what vLLM decides unseen."""

    merge_inline_system: bool
    exact: bool = True
    inline_system: bool = False

    def system(self, body: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
        parts: list[str] = []
        system = body.get("system")
        if system:
            if isinstance(system, str):  # (a string is kept whole, billing header or not)
                parts.append(system)
            else:
                found = _system_text(system, "system")
                _no_tool_changes(system, "system")
                if found is not None:
                    parts.append(found)
        if self.merge_inline_system:
            for msg in body["messages"]:
                if msg.get("role") == "system":
                    text = _system_text(msg.get("content"), "messages.content")
                    if text:
                        parts.append(text)
        if parts:
            out.append({"role": "system", "content": "".join(parts)})

    def messages(self, messages: list[Mapping[str, Any]], out: list[dict[str, Any]]) -> None:
        for msg in messages:
            role = msg["role"]
            content = msg.get("content")
            if role == "system":
                self.inline_system = True
                if self.merge_inline_system:
                    continue
                text = _system_text(content, "messages.content")
                if text:
                    out.append({"role": "system", "content": text})
                continue
            converted: dict[str, Any] = {"role": role}
            if isinstance(content, str):
                converted["content"] = content
            else:  # (its blocks checked: check_messages)
                self.content(role, cast("list[Mapping[str, Any]]", content), converted, out)
            if not (role == "user" and "content" not in converted):
                out.append(converted)

    def content(
        self,
        role: str,
        blocks: list[Mapping[str, Any]],
        converted: dict[str, Any],
        out: list[dict[str, Any]],
    ) -> None:
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for block in blocks:
            kind = block["type"]
            if kind == "text":
                text = _text_of(block)
                if text is not None:
                    parts.append({"type": "text", "text": text})
            elif kind == "image":
                if block.get("source"):
                    url = image_url(block["source"])
                    parts.append({"type": "image_url", "image_url": {"url": url}})
            elif kind == "thinking":
                thinking = block.get("thinking")
                if thinking is not None:
                    reasoning.append(str(thinking))
            elif kind == "tool_use":
                calls.append(self.tool_call(block))
            elif kind == "tool_result":
                if role == "user":
                    _user_tool_result(block, out)
                else:
                    result = block.get("content")
                    text = str(result) if result else ""
                    parts.append({"type": "text", "text": f"Tool result: {text}"})
            # redacted_thinking, tool_reference, tool_addition / tool_removal: no content
        if reasoning:
            converted["reasoning"] = "".join(reasoning)
        if calls:
            converted["tool_calls"] = calls
        if parts:
            if len(parts) == 1 and parts[0]["type"] == "text":
                converted["content"] = parts[0]["text"]
            else:
                converted["content"] = parts

    def tool_call(self, block: Mapping[str, Any]) -> dict[str, Any]:
        ident = block.get("id")
        if not ident:
            self.exact = False  # vLLM names it call_<unix time>
            ident = "call_0"
        return {
            "id": ident,
            "type": "function",
            "function": {
                "name": block.get("name") or "",
                "arguments": json.dumps(block.get("input") or {}),
            },
        }


def _tool(tool: Any) -> dict[str, Any]:
    """An Anthropic tool as vLLM's function tool (``parameters`` its ``input_schema``)."""
    _tool_name(tool)
    schema = tool["input_schema"]
    if "type" not in schema:
        schema = {**schema, "type": "object"}
    function: dict[str, Any] = {
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": schema,
    }
    # vLLM's FunctionDefinition leaves these out of its dump when unset
    for key in ("strict", "defer_loading"):
        value = lax_bool(tool.get(key))
        if value is not None:
            function[key] = value
    return {"type": "function", "function": function}


def _tool_name(tool: Any) -> str:
    """A declared tool's name, the tool checked as vLLM's ``AnthropicTool`` checks it: a
    custom tool (no ``type``, or ``custom``: Anthropic's own, ``bash_20250124`` and the
    like, are refused), a string ``name`` and ``description``, an object ``input_schema``,
    booleans ``strict`` and ``defer_loading``."""
    if not isinstance(tool, Mapping):
        raise BadRequest("each tool must be an object with a string 'name'")
    if tool.get("type") not in (None, "custom"):
        raise BadRequest(
            f"tool type {tool['type']!r} is not supported; only custom tools with an "
            "input_schema are supported"
        )
    if not isinstance(tool.get("name"), str):
        raise BadRequest("each tool must be an object with a string 'name'")
    if not isinstance(tool.get("input_schema"), Mapping):
        raise BadRequest("a tool's 'input_schema' must be an object")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise BadRequest("a tool's 'description' must be a string")
    for key in ("strict", "defer_loading"):
        if lax_bool(tool.get(key)) is INVALID:
            raise BadRequest(f"a tool's '{key}' must be a boolean")
    name: str = tool["name"]
    return name


def _resolved_tools(body: Mapping[str, Any]) -> list[Any] | None:
    """``tools`` after the messages' ``tool_addition`` / ``tool_removal`` blocks (vLLM's
    ``_resolve_tools``: the tools in effect at the conversation's end)."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("'tools' must be an array")
    changes = [
        block
        for msg in body["messages"]
        if isinstance(msg.get("content"), list)
        for block in msg["content"]
        if isinstance(block, Mapping) and block.get("type") in ("tool_addition", "tool_removal")
    ]
    for tool in tools or []:
        _tool_name(tool)  # (every declared tool, removed or not)
    if not changes:
        return tools
    by_name: dict[str, Any] = {}
    for tool in tools or []:
        by_name[_tool_name(tool)] = tool
    removed: set[str] = set()
    for block in changes:
        change = block.get("tool")
        if not isinstance(change, Mapping):
            raise BadRequest(f"tool is required for {block['type']} blocks")
        if change.get("type") not in ("tool_reference", "tool_definition"):
            raise BadRequest(
                f"a {block['type']}'s tool must be a tool_reference or a tool_definition"
            )
        if block["type"] == "tool_removal" and change["type"] != "tool_reference":
            raise BadRequest("tool_removal only accepts a tool_reference")
        if change["type"] == "tool_definition":
            definition = change.get("definition")
            if not isinstance(definition, Mapping):
                raise BadRequest("a tool_definition needs a 'definition' object")
            name = _tool_name(definition)
            by_name[name] = definition
        else:
            if not isinstance(change.get("name"), str):
                raise BadRequest(f"a {block['type']}'s tool_reference needs a string 'name'")
            name = change["name"]
            if name not in by_name:
                raise BadRequest(
                    f"{block['type']} references tool {name!r}, which is not declared in tools"
                )
            if block["type"] == "tool_addition":
                by_name[name] = {**by_name[name], "defer_loading": None}
        if block["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in by_name.items() if name not in removed]


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, Mapping):
        raise BadRequest("'tool_choice' must be an object")
    kind = choice.get("type")
    if kind in _TOOL_CHOICES:
        return _TOOL_CHOICES[kind]
    if kind == "tool":
        if not choice.get("name"):
            raise BadRequest("tool_choice.name is required when type is 'tool'")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadRequest("'tool_choice.type' must be one of auto, any, tool, none")


def check_messages(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The body's ``messages``, each an object with a known ``role`` and a string or block
    list ``content``."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadRequest("'messages' is a required array of message objects")
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or msg.get("role") not in _ROLES:
            raise BadRequest(f"messages[{i}] must be an object with role user, assistant or system")
        content = msg.get("content")
        if not isinstance(content, str):
            blocks = _blocks(content, f"messages[{i}].content")
            if msg["role"] != "system":
                _no_tool_changes(blocks, f"messages[{i}].content")
    return messages


def _no_tool_changes(blocks: list[Mapping[str, Any]], where: str) -> None:
    """vLLM's ``_reject_tool_changes``: ``tool_addition`` / ``tool_removal`` blocks belong
    in ``system`` messages only (not in ``system`` itself, nor a user's or an assistant's)."""
    for block in blocks:
        if block["type"] in ("tool_addition", "tool_removal"):
            raise BadRequest(
                f'{where}: {block["type"]} blocks are only allowed in messages with role "system"'
            )


def _check_settings(body: Mapping[str, Any]) -> None:
    """``system``, ``thinking`` and ``output_config`` as vLLM's request models take them
    (``AnthropicThinkingConfig``: one of its types, an ``enabled`` one with a
    ``budget_tokens`` of at least 1024; ``AnthropicOutputConfig``: an effort of
    :data:`EFFORTS`)."""
    system = body.get("system")
    if system is not None and not isinstance(system, (str, list)):
        raise BadRequest("'system' must be a string or an array of content blocks")
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, Mapping) or thinking.get("type") not in THINKING_TYPES:
            raise BadRequest(f"'thinking.type' must be one of {', '.join(THINKING_TYPES)}")
        if thinking["type"] == "enabled":
            budget = lax_int(thinking.get("budget_tokens"))
            if not isinstance(budget, int) or budget < MIN_THINKING_BUDGET:
                raise BadRequest(
                    f"'thinking.budget_tokens' must be an integer of at least {MIN_THINKING_BUDGET}"
                )
    output = body.get("output_config")
    if output is not None:
        if not isinstance(output, Mapping):
            raise BadRequest("'output_config' must be an object")
        effort = output.get("effort")
        if effort is not None and effort not in EFFORTS:
            raise BadRequest(f"'output_config.effort' must be one of {', '.join(EFFORTS)}")


def check_thinking_budget(body: Mapping[str, Any], max_tokens: int) -> None:
    """vLLM's ``validate_thinking_budget`` of a Messages API body (``max_tokens`` its output
    limit): an ``enabled`` thinking's ``budget_tokens`` must be less than ``max_tokens``,
    but on a prefill leg (``kv_transfer_params.do_remote_decode``, sent with max_tokens
    1). ``body``: as the engine gets it."""
    params = body.get("kv_transfer_params")
    if isinstance(params, Mapping) and params.get("do_remote_decode"):
        return
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") == "enabled":
        budget = lax_int(thinking.get("budget_tokens"))
        if isinstance(budget, int) and budget >= max_tokens:
            raise BadRequest("thinking.budget_tokens must be less than max_tokens")


def disables_thinking(body: Mapping[str, Any]) -> bool:
    """Whether ``body``'s ``thinking`` is ``disabled`` / ``between_tools``: vLLM then sends
    its disabled-thinking effort as the ``reasoning_effort``."""
    thinking = body.get("thinking")
    return isinstance(thinking, Mapping) and thinking.get("type") in ("disabled", "between_tools")


def to_chat_body(
    body: Mapping[str, Any],
    *,
    merge_inline_system: bool = False,
    disabled_thinking_effort: str | None = None,
) -> ChatConversion:
    """The chat body vLLM 0.34 builds from the Anthropic body ``body`` for its prompt
    (module docstring); ``merge_inline_system``: as vLLM does for templates that need the
    system message first; ``disabled_thinking_effort``: the ``reasoning_effort`` vLLM sends
    for thinking disabled / between_tools (:func:`disabled_thinking_effort`), None where it
    is not known: ``"none"`` is taken and the conversion is not exact."""
    check_messages(body)
    _check_settings(body)
    conv = _Converter(merge_inline_system)
    out: list[dict[str, Any]] = []
    conv.system(body, out)
    conv.messages(body["messages"], out)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": out}
    for key in ("chat_template_kwargs", "cache_salt", "kv_transfer_params"):
        if body.get(key) is not None:
            chat[key] = body[key]
    effort: Any = None
    output = body.get("output_config")
    if isinstance(output, Mapping) and output.get("effort") is not None:
        effort = output["effort"]
    if disables_thinking(body):
        effort = disabled_thinking_effort or DISABLED_THINKING_EFFORT
        if disabled_thinking_effort is None:
            conv.exact = False  # vLLM's is a probe of a template the router has not got
    if effort is not None:
        chat["reasoning_effort"] = effort
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice)
        chat["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use")
    tools = _resolved_tools(body)
    if tools is not None:
        chat["tools"] = [_tool(t) for t in tools]
        chat.setdefault("tool_choice", "auto")
    exact = conv.exact and not conv.inline_system
    return ChatConversion(chat, exact, conv.inline_system, conv.exact)


@lru_cache(maxsize=64)
def _probe_refuses(source: str | None) -> bool:
    """vLLM 0.34's ``_detect_merge_inline_system``: ``source`` rendered on
    [system, user, system, user] in a bare sandboxed environment (no ``raise_exception``,
    ``bos_token`` or other variables, no HF extensions), without a generation prompt; any
    failure, or no template, means the template needs the system message first."""
    if not source:
        return True
    # (a template's: Jinja2 loaded when it was built, at start-up)
    import jinja2.ext
    import jinja2.sandbox

    try:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        probe = [{"role": role, "content": "t"} for role in ("system", "user") * 2]
        env.from_string(source).render(messages=probe, add_generation_prompt=False)
    except Exception:  # as vLLM: whatever fails (undefined names, filters) means merge
        return True
    return False


def merges_inline_system(template: ChatTemplate) -> bool:
    """Whether vLLM merges a body's inline system messages into the leading system message
    for a model with ``template`` (``AnthropicServingMessages._should_merge_inline_system``
    for a Jinja template: the probe fails on the template vLLM renders requests without
    tools with, or on the one for requests with tools)."""
    return _probe_refuses(template.source) or _probe_refuses(
        template.tool_source or template.source
    )


def _probe_render(processor: PromptProcessor, effort: str) -> str | None:
    """The probe conversation rendered by the model's chat pipeline with ``reasoning_effort``
    ``effort`` (vLLM's ``_render_probe_prompt``), None when that fails."""
    body = {"messages": list(_EFFORT_PROBE), "reasoning_effort": effort}
    try:
        text, _ = processor.render_chat(body)
    except Exception:  # as vLLM: whatever fails to render counts as a failed probe
        return None
    return text


@lru_cache(maxsize=64)
def _probed_effort(processor: PromptProcessor) -> str:
    """vLLM 0.34's ``DisabledThinkingEffortResolver._probe`` on ``processor``'s rendering
    (its template, default template kwargs and effort map, as vLLM's renderer has them):
    ``"low"`` if ``"none"`` fails to render or renders as one of :data:`EFFORTS` does, else
    ``"none"``. vLLM compares token ids and text; the ids are the text's, so the text alone
    decides. Once per processor (one per model), as vLLM resolves once per server."""
    none = _probe_render(processor, "none")
    if none is None or any(_probe_render(processor, effort) == none for effort in EFFORTS):
        found = "low"
    else:
        found = "none"
    _log.info(
        "model %s: Anthropic thinking disabled / between_tools maps to reasoning_effort %r "
        "(vLLM's --anthropic-disabled-thinking-effort auto)",
        processor.model,
        found,
    )
    return found


def disabled_thinking_effort(processor: PromptProcessor) -> str | None:
    """The ``reasoning_effort`` vLLM sends for thinking disabled / between_tools to the model
    of ``processor``: its ``--anthropic-disabled-thinking-effort``
    (``processor.disabled_thinking_effort``) when set to an effort, else (``"auto"``) vLLM's
    probe of the template run on the router's (:func:`_probed_effort`); None without a
    template, where there is nothing to probe."""
    option = processor.disabled_thinking_effort
    if option != "auto":
        return option
    return None if processor.template is None else _probed_effort(processor)


def messages_prompt(processor: PromptProcessor, body: Mapping[str, Any]) -> ProcessedPrompt:
    """The routing view of an Anthropic body: its chat body (:func:`to_chat_body`) through
    the model's chat pipeline, not exact where the conversion is not. Inline system
    messages are merged into the leading system message when vLLM's start-up probe of the
    model's template says so (:func:`merges_inline_system`), else rendered in place; a
    conversation the template refuses in place is rendered merged (vLLM refuses it), not
    exact. Thinking disabled / between_tools takes the model's disabled-thinking effort
    (:func:`disabled_thinking_effort`: probed at the first such body, as vLLM does)."""
    template = processor.template
    merge = template is not None and merges_inline_system(template)
    effort = disabled_thinking_effort(processor) if disables_thinking(body) else None
    conv = to_chat_body(body, merge_inline_system=merge, disabled_thinking_effort=effort)
    if not conv.body["messages"]:  # nothing to render: routed on load
        return processor.unknown(body)
    # inline system messages placed as vLLM's probe of the template places them: exact
    exact = conv.exact or (conv.inline_system and conv.placed_exact and template is not None)
    try:
        prompt = processor.chat(conv.body, from_messages=True)
    except BadRequest:
        if not conv.inline_system or merge:
            raise
        # refused in place (vLLM answers with an error): the merged prompt, as a guess
        merged = to_chat_body(body, merge_inline_system=True, disabled_thinking_effort=effort)
        prompt = processor.chat(merged.body, from_messages=True)
        exact = False
    return prompt if exact else replace(prompt, exact=False)


def session_of(body: Mapping[str, Any]) -> Any:
    """Anthropic's ``metadata.user_id`` (Claude Code puts its session there), else None."""
    metadata = body.get("metadata")
    return metadata.get("user_id") if isinstance(metadata, Mapping) else None
