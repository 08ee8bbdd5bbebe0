"""HF-style chat templates rendered with Jinja2, the way ``transformers`` and vLLM do it.

The template comes from ``tokenizer_config.json`` (``chat_template``: a string, or a list of
``{"name", "template"}`` of which ``default`` is used, or ``tool_use`` when tools are given),
or from a separate ``chat_template.jinja`` file, or for a multimodal model from its
processor's ``chat_template.json``. The environment matches transformers': sandboxed,
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and the
``{% generation %}`` tag, a ``tojson`` filter that keeps non-ASCII text, ``raise_exception``
and ``strftime_now`` globals.

:class:`ChatTemplate` renders messages already prepared as vLLM prepares them
(:meth:`ChatTemplate.prepare`, with vLLM's rules in router.tokenize.template_inputs) to the
prompt text the engine sees, whole (:meth:`ChatTemplate.render`) or, for a message-local
template, in parts (:meth:`ChatTemplate.render_parts`, router.tokenize.local_template).

What depends on a template's source alone (its compiled code, the content format vLLM's
"auto" detects, its message-local form) is derived once per process and source, and kept
for ``_DERIVED_MAX`` sources (the one derived first dropped first): :meth:`ChatTemplate.build`
of a kept source parses and compiles nothing, and each template built from it keeps its own
render state.
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
    ContentFormat,
    detect_content_format,
    resolve_content_format,
)
from router.tokenize.local_template import LocalTemplate, RenderedParts, Resume, instrument
from router.tokenize.render_state import ListLike, StateMismatch, plain
from router.tokenize.template_inputs import developer_as_system, names_developer, prepare_messages


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
        return not names_developer(source) and any(m.get("role") == "developer" for m in messages)

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
