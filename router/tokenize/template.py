"""HF-style chat templates rendered with Jinja2, the way ``transformers`` and vLLM do it.

The template comes from ``tokenizer_config.json`` (``chat_template``: a string, or a list of
``{"name", "template"}`` of which ``default`` is used, or ``tool_use`` when tools are given),
or from a separate ``chat_template.jinja`` file. The environment matches transformers':
sandboxed, ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and the
``{% generation %}`` tag, a ``tojson`` filter that keeps non-ASCII text, ``raise_exception``
and ``strftime_now`` globals.

Messages are prepared as vLLM prepares them: content in the template's content format
(router.tokenize.content_format: text parts joined with newlines, or a list of parts for
templates that loop over it) and tool-call arguments given as JSON strings parsed into
objects, so templates that render ``arguments | tojson`` see what they would see in the
engine.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from pprint import pformat
from types import CodeType
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.core.errors import BadRequest, ConfigError
from router.tokenize.content_format import (
    BILLING_HEADER as _BILLING_HEADER,
)
from router.tokenize.content_format import (
    ContentFormat,
    content_text,
    detect_content_format,
    openai_parts,
    resolve_content_format,
    tool_content,
    without_billing_header,
)
from router.tokenize.local_template import LocalTemplate, RenderedParts, Resume, instrument
from router.tokenize.render_state import ListLike, StateMismatch, plain


class TemplateError(BadRequest):
    """The template refused the conversation (``raise_exception``) or failed on it."""


class NotIncremental(Exception):
    """The instrumented render failed where the plain one may not: render whole instead."""


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template error: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
        default=_plain_messages,
    )


def _pprint(value: Any) -> str:
    """Jinja's ``pprint``, with ``messages`` of an incremental render formatted as the list
    it stands for (pprint lays out real lists, not look-alikes, over several lines)."""
    return pformat(plain(value))


def _plain_messages(value: Any) -> Any:
    """``messages`` as an incremental render sees it (router.tokenize.render_state) is
    serialised as the list it stands for; anything else json can not serialise is an
    error, as without this hook."""
    if isinstance(value, ListLike):
        return value.as_list()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_SAFE_DICT_ATTRS = frozenset({"get", "items", "keys", "values"})
_SAFE_LOOP_ATTRS = frozenset(
    {"first", "last", "index", "index0", "length", "revindex", "revindex0", "previtem", "nextitem"}
)


class _TemplateSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with fast paths for what chat templates do per message
    (``message.get(...)``, ``loop.first``): those attributes are known safe, so the generic
    safety checks are skipped for them; everything else goes through the sandbox."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if (kind is dict and attribute in _SAFE_DICT_ATTRS) or (
            kind is LoopContext and attribute in _SAFE_LOOP_ATTRS
        ):
            return getattr(obj, attribute)
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        if type(obj) is dict and type(argument) is str and argument in obj:
            return obj[argument]
        return super().getitem(obj, argument)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers' AssistantTracker tag, which
    marks assistant text for training masks and renders its body unchanged (LFM2.5's
    template uses it). Here it is just its body, so the template compiles as in the engine
    and the message loop stays plain to the incremental renderer."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)  # the tag's name
        return list(parser.parse_statements(("name:endgeneration",), drop_needle=True))


def _environment() -> jinja2.Environment:
    env = _TemplateSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.filters["pprint"] = _pprint
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ARGS_CACHE: dict[str, dict[str, Any]] = {}
_ARGS_CACHE_MAX = 8192
# the memo's bound in characters of argument text (each entry holds the text and the object
# parsed from it); longer arguments (a file written by a tool call) are parsed each time
_ARGS_CACHE_CHARS = 8 * 2**20
_ARGS_MEMO_MAX_CHARS = 64 * 1024
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
    with _args_lock:  # (worker threads process large bodies)
        if len(_ARGS_CACHE) >= _ARGS_CACHE_MAX or _args_chars + len(text) > _ARGS_CACHE_CHARS:
            _ARGS_CACHE.clear()
            _args_chars = 0
        if text not in _ARGS_CACHE:
            _args_chars += len(text)
            _ARGS_CACHE[text] = value
    return value


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
    ``tool_call_id``, a developer message's ``tools`` (null when absent), in vLLM's order
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
            msg["tools"] = m.get("tools")
        out.append(msg)
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


def _names_developer(source: str | None) -> bool:
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


def _processor_template(directory: Path) -> str | None:
    """The chat template of a multimodal model's processor (transformers' legacy
    ``chat_template.json`` of a directory with processor files), None without one."""
    path = directory / "chat_template.json"
    has_processor = any(
        (directory / name).exists()
        for name in ("preprocessor_config.json", "processor_config.json")
    )
    if not has_processor or not path.exists():
        return None
    try:
        found = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{path}: not a chat template file: {exc}") from None
    if not isinstance(found, str):
        raise ConfigError(f"{path}: chat_template must be a string")
    return found


@dataclass(slots=True, frozen=True)
class _Derived:
    """What :meth:`ChatTemplate.build` derives from a template's source alone (the
    environment's settings are fixed): its compiled code, the content format vLLM's "auto"
    detects, the code of its message-local form (None: not message-local). Code objects
    hold no state: every template built from them renders and keeps its state on its own."""

    code: CodeType
    detected: ContentFormat
    local: CodeType | None


# per process, the sources built last: models of one family share a template, and each
# parse and compile of one costs tens of milliseconds
_DERIVED: dict[str, _Derived] = {}
_DERIVED_MAX = 32
_derived_lock = threading.Lock()


def _derived(env: jinja2.Environment, source: str) -> _Derived:
    """``source``'s :class:`_Derived`; raises ``TemplateSyntaxError`` (remembering nothing)."""
    with _derived_lock:
        found = _DERIVED.get(source)
    if found is not None:
        return found
    made = _Derived(
        env.compile(source), detect_content_format(env, source), instrument(env, source)
    )
    with _derived_lock:
        if source not in _DERIVED and len(_DERIVED) >= _DERIVED_MAX:
            del _DERIVED[next(iter(_DERIVED))]
        _DERIVED[source] = made
    return made


def _from_derived(
    env: jinja2.Environment, derived: _Derived, option: str, source: str
) -> tuple[jinja2.Template, ContentFormat, LocalTemplate | None]:
    """A template's compiled form, content format (``option`` as for ``build``) and
    message-local form, each new, from ``derived``."""
    compiled = env.template_class.from_code(env, derived.code, env.make_globals(None), None)
    fmt = derived.detected if option == "auto" else resolve_content_format(option, env, source)
    local = None if derived.local is None else LocalTemplate(env, derived.local)
    return compiled, fmt, local


# transformers' marker for continue_final_message: appended to the final message's content,
# the render is cut where it starts
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(messages: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The final message with transformers' marker after its text: after a string content,
    or after the text of its last part that has one."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, str):
        return {**messages[-1], "content": content + _CONTINUE_TAG}
    if isinstance(content, list):
        for at in range(len(content) - 1, -1, -1):
            part = content[at]
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                tagged = {**part, "text": part["text"] + _CONTINUE_TAG}
                return {**messages[-1], "content": [*content[:at], tagged, *content[at + 1 :]]}
    raise TemplateError("continue_final_message is set but there is nothing to continue")


def _cut_at_continue_tag(text: str) -> str:
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise TemplateError(
            "continue_final_message is set but the final message does not appear in the chat"
            " after applying the chat template"
        )
    if text.startswith(_CONTINUE_TAG, at):
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing spacing


@dataclass(slots=True, frozen=True)
class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    source: str
    tool_source: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    extra: Mapping[str, str] = field(default_factory=dict)
    # how each template wants message content (router.tokenize.content_format)
    content_format: ContentFormat = "string"
    tool_content_format: ContentFormat = "string"
    # set by build(), which every ChatTemplate comes from
    _compiled: jinja2.Template | None = field(default=None, compare=False, repr=False)
    _compiled_tools: jinja2.Template | None = field(default=None, compare=False, repr=False)
    # instrumented forms when the templates are message-local (router.tokenize.local_template)
    _local: LocalTemplate | None = field(default=None, compare=False, repr=False)
    _local_tools: LocalTemplate | None = field(default=None, compare=False, repr=False)

    @classmethod
    def build(
        cls,
        source: str,
        *,
        tool_source: str | None = None,
        bos_token: str = "",
        eos_token: str = "",
        extra: Mapping[str, str] | None = None,
        content_format: str = "auto",
    ) -> ChatTemplate:
        """``content_format``: vLLM's ``--chat-template-content-format`` ("auto" detects it
        from each template as vLLM does)."""
        env = _environment()
        try:
            main = _derived(env, source)
            tools = _derived(env, tool_source) if tool_source else None
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"chat template does not compile: {exc}") from None
        compiled, fmt, local = _from_derived(env, main, content_format, source)
        tool_fmt: ContentFormat = "string"
        compiled_tools, local_tools = None, None
        if tools is not None and tool_source:
            compiled_tools, tool_fmt, local_tools = _from_derived(
                env, tools, content_format, tool_source
            )
        return cls(
            source,
            tool_source,
            bos_token,
            eos_token,
            dict(extra or {}),
            fmt,
            tool_fmt,
            compiled,
            compiled_tools,
            local,
            local_tools,
        )

    @classmethod
    def from_tokenizer_config(
        cls,
        config: Mapping[str, Any],
        directory: Path | None = None,
        content_format: str = "auto",
    ) -> ChatTemplate | None:
        """The template of a ``tokenizer_config.json`` (or ``chat_template.jinja`` beside it);
        ``content_format`` as for :meth:`build`.

        A multimodal model's processor template (``chat_template.json`` beside a
        ``preprocessor_config.json`` / ``processor_config.json``) is the one vLLM renders
        requests without ``tools`` with; requests with tools get the tokenizer's."""
        raw = config.get("chat_template")
        if raw is None and directory is not None and (directory / "chat_template.jinja").exists():
            raw = (directory / "chat_template.jinja").read_text(encoding="utf-8")
        processor = _processor_template(directory) if directory is not None else None
        if raw is None and processor is None:
            return None
        tool_source = None
        if isinstance(raw, list):
            named = {t.get("name"): t.get("template") for t in raw if isinstance(t, Mapping)}
            source = named.get("default") or next(iter(named.values()), None)
            tool_source = named.get("tool_use")
        else:
            source = raw
        if processor is not None:  # without tools: the processor's; with: the tokenizer's
            tool_source = tool_source or source
            source = processor
        if not isinstance(source, str) or not isinstance(tool_source, str | None):
            raise ConfigError("chat_template must be a string or a list of named templates")

        def tok(key: str) -> str:
            v = config.get(key)
            if isinstance(v, Mapping):
                v = v.get("content")
            return v if isinstance(v, str) else ""

        extra = {k: tok(k) for k in ("unk_token", "pad_token") if tok(k)}
        return cls.build(
            source,
            tool_source=tool_source,
            bos_token=tok("bos_token"),
            eos_token=tok("eos_token"),
            extra=extra,
            content_format=content_format,
        )

    def content_format_for(self, tools: Sequence[Any] | None) -> ContentFormat:
        """The content format of the template :meth:`render` uses for a request with
        ``tools``."""
        if tools is not None and self._compiled_tools is not None:
            return self.tool_content_format
        return self.content_format

    def converts_developer(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None
    ) -> bool:
        """Whether :meth:`prepare` turns ``developer`` messages into system ones (the
        template for ``tools`` does not name that role; :func:`developer_as_system`)."""
        uses_tools = tools is not None and self._compiled_tools is not None
        source = self.tool_source if uses_tools else self.source
        return not _names_developer(source) and any(m.get("role") == "developer" for m in messages)

    def prepare(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
        calls_as_sent: bool = False,
    ) -> list[Mapping[str, Any]]:
        """:func:`prepare_messages` in this template's content format for ``tools``, with
        ``developer`` messages as vLLM gives them to a template that does not know them."""
        prepared = prepare_messages(messages, self.content_format_for(tools), calls_as_sent)
        if self.converts_developer(messages, tools):
            return developer_as_system(prepared)
        return list(prepared)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """Render ``messages`` (already prepared) to the prompt text the engine will see.

        ``continue_final_message``: the text ends where the final message's content does (no
        end-of-turn after it), found as transformers finds it: a marker appended to that
        content, the render cut where the marker starts (and trailing spacing dropped when
        the template trimmed the content)."""
        # transformers takes the tool_use template whenever tools are given, [] included
        template = (
            self._compiled_tools if tools is not None and self._compiled_tools else self._compiled
        )
        assert template is not None, "ChatTemplate.build compiles the template"
        if continue_final_message:
            messages = [*messages[:-1], _tag_final_message(messages)]
        variables = self._variables(messages, tools, add_generation_prompt, kwargs)
        try:
            text = str(template.render(variables))
            return _cut_at_continue_tag(text) if continue_final_message else text
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError, ValueError) as exc:
            raise TemplateError(f"chat template failed on this conversation: {exc}") from None

    def local_for(self, tools: Sequence[Any] | None) -> LocalTemplate | None:
        """The instrumented template that :meth:`render` would use for a request with
        ``tools``, if it is message-local (None: render whole)."""
        local = self._local_tools if tools is not None and self._compiled_tools else self._local
        return local if local is not None and local.enabled else None

    def render_parts(
        self,
        local: LocalTemplate,
        messages: Sequence[Mapping[str, Any]],
        start: int,
        *,
        resume: Resume | None = None,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        kwargs: Mapping[str, Any] | None = None,
    ) -> RenderedParts:
        """:meth:`render` split into (head, bodies of ``messages[start:]``, tail) with the
        instrumented template ``local`` (from :meth:`local_for`); only the bodies of
        ``messages[start:]`` are rendered, from ``resume`` (the :class:`Resume` of a render
        this conversation extends, whose resume point is ``start``).

        Raises TemplateError where :meth:`render` would (the template refused the
        conversation), and :class:`NotIncremental` when only the instrumented render failed
        (it sees ``messages`` through a tracking wrapper, which e.g. ``tojson`` can not
        serialise): the caller renders whole."""
        variables = self._variables(messages, tools, add_generation_prompt, kwargs)
        try:
            return local.render_parts(variables, start, resume)
        except TemplateError:
            raise
        except StateMismatch as exc:
            raise NotIncremental(str(exc)) from None
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError, ValueError) as exc:
            raise NotIncremental(f"instrumented render failed: {exc}") from None

    def _variables(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
        add_generation_prompt: bool,
        kwargs: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        # as transformers passes them: tools and documents always (None when absent), the
        # special tokens, then the request's chat_template_kwargs (which may override them)
        return {
            "tools": tools,
            "documents": None,
            **self.extra,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **(kwargs or {}),
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
