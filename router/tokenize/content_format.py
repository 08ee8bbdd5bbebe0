"""Message content as vLLM hands it to a chat template: the "string" or the "openai" format
(vLLM 0.34: vllm/renderers/hf.py, vllm/renderers/chat_utils/chat_message.py).

With ``--chat-template-content-format auto`` vLLM looks at the chat template's Jinja AST: a
template with a ``for`` loop over a message's ``content`` (``{% for part in
message['content'] %}``: Llama 4, Gemma 3, Qwen2-VL, Mistral-3 style) gets the **openai**
format, every other template the **string** format.

* string: the content is one string, the texts of its parts (a tool reference's name
  included) joined with newlines, empty ones left out; a missing content is empty
  (:func:`content_text`).
* openai: the content is a list: a string content and bare string parts become
  ``{"type": "text", "text": s}``, text-like parts too, media parts ``{"type": "image"}``
  (or ``audio`` / ``video``) for the template to place, tool references
  ``{"type": "tool_reference", "name": ...}``; a part's keys that no part type has are
  kept on it; ``text`` / ``refusal`` parts without text are left out, a missing content
  is ``[]`` (:func:`openai_parts`). A tool result whose parts are all text gets them
  joined into one string (:func:`tool_content`).

Either way a system message loses Claude Code's attribution line
(:func:`without_billing_header`). The two formats render differently wherever a message has
several parts (a template trimming each part joins them with nothing where the string
format puts a newline) or an image (placed where its part is, not first).

The detection is vLLM's rule, reimplemented: the names bound to ``messages`` (the variable,
names and namespace attributes assigned from it, a slice or a filter of it, transitively),
the targets of ``for`` loops over one of those, and then any loop over such a target's
``content`` (item or attribute, possibly sliced or filtered), over a macro parameter a call
passes such a ``content``, or over a name ``content`` outside macros. A template vLLM cannot
analyse (a loop target that is not a plain name) is "string", as there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal, cast

from router.core.errors import BadRequest, ConfigError

if TYPE_CHECKING:
    # Jinja2 loads only with a chat template (which detection reads): a router without one
    # uses the part helpers of this module and never imports it
    import jinja2
    from jinja2 import nodes

ContentFormat = Literal["string", "openai"]
# as vLLM's --chat-template-content-format: "auto" detects it from the template
CONTENT_FORMAT_OPTIONS = ("auto", "string", "openai")

# content-part types whose text vLLM reads, and the key it reads it from
_PART_TEXT_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# text-like parts vLLM leaves out when their text is missing (the others pass a None on)
_SKIP_WITHOUT_TEXT = frozenset({"text", "refusal"})
# media part types and the modality vLLM names in their {"type": ...} placeholder
_MEDIA_TYPES = {
    "image_url": "image",
    "input_image": "image",
    "image": "image",
    "image_pil": "image",
    "image_embeds": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "video_embeds": "video",
}
# keys that name a part's kind when it has no ``type`` (or has a ``uuid``), in vLLM's order
_UNTYPED_KEYS = (
    ("image_url", "image"),
    ("image_pil", "image"),
    ("image_embeds", "image"),
    ("audio_embeds", "audio"),
    ("video_embeds", "video"),
    ("audio_url", "audio"),
    ("input_audio", "audio"),
    ("video_url", "video"),
    ("tool_reference", "tool_reference"),
)
# the keys of vLLM's content-part types (vLLM collects them from its part types, openai's
# among them: ``prompt_cache_breakpoint`` is the openai package's text and image parts');
# the others a part has are kept on its openai form
_KNOWN_PART_KEYS = frozenset(
    {
        "type", "text", "image_url", "input_audio", "file", "audio_url", "image_embeds",
        "uuid", "audio_embeds", "video_embeds", "data", "video_url", "refusal", "image_pil",
        "thinking", "closed", "name", "prompt_cache_breakpoint",
    }
)  # fmt: skip
# Claude Code's per-request attribution line, which vLLM drops from system text
BILLING_HEADER = "x-anthropic-billing-header"


def _classify(part: Any) -> tuple[str | None, Any]:
    """What vLLM reads a content part as (``parse_chat_message_content_mm_part``):
    ("text", its text or None), ("tool_reference", a name), (a modality, None), or
    (None, None) for what the router leaves out (vLLM refuses an unknown type; a part
    without ``type`` is read as text here, which vLLM refuses too)."""
    if isinstance(part, str):
        return "text", part
    if not isinstance(part, Mapping):
        return None, None
    kind = part.get("type")
    if kind is None or part.get("uuid") is not None:  # vLLM reads such a part by its keys
        for key, what in _UNTYPED_KEYS:
            if key in part and (key != "input_audio" or part[key] is not None):
                return what, part.get("name") if what == "tool_reference" else None
        if kind is None:
            text = part.get("text")
            return ("text", text) if isinstance(text, str) else (None, None)
    if not isinstance(kind, str):
        return None, None
    text_key = _PART_TEXT_KEYS.get(kind)
    if text_key is not None:
        return "text", part.get(text_key)
    if kind == "tool_reference":
        return "tool_reference", part.get("name")
    return _MEDIA_TYPES.get(kind), None


def medium(part: Any) -> str | None:
    """The modality of a media part as vLLM reads it ("image", "audio", "video"), None for
    text and what is left out."""
    kind, _ = _classify(part)
    return kind if kind in ("image", "audio", "video") else None


def part_text(part: Any) -> str | None:
    """Text of one content part in the string format (a bare string, the text of a
    text-like part, a tool reference's name); None for parts without text (images, ...)."""
    kind, value = _classify(part)
    if kind in ("text", "tool_reference") and isinstance(value, str):
        return value
    return None


def content_text(content: Any) -> str | None:
    """Text of an OpenAI message ``content`` in the string format: a string, or the texts of
    a list's parts joined with newlines, empty ones left out. None for a missing content."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join([t for t in map(part_text, content) if t])
    raise BadRequest("message content must be a string or a list of content parts")


def _extra(part: Any) -> dict[str, Any]:
    if not isinstance(part, Mapping):
        return {}
    return {k: v for k, v in part.items() if k not in _KNOWN_PART_KEYS}


def _openai_part(part: Any) -> Any:
    """One part in the openai format; None for a part vLLM leaves out."""
    if isinstance(part, str):
        return {"type": "text", "text": part}
    kind, value = _classify(part)
    if kind is None:
        return None
    if kind == "text":
        if value is None and part.get("type", "text") in _SKIP_WITHOUT_TEXT:
            return None
        return {"type": "text", "text": value, **_extra(part)}
    if kind == "tool_reference":
        return {"type": "tool_reference", "name": value}  # (without a name too, as vLLM)
    return {"type": kind, **_extra(part)}


def openai_parts(content: Any) -> list[Any]:
    """An OpenAI message ``content`` in the openai format (module docstring)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest("message content must be a string or a list of content parts")
    out = []
    for part in content:
        made = _openai_part(part)
        if made is not None:
            out.append(made)
    return out


def tool_content(parts: list[Any]) -> Any:
    """A tool result's openai-format content as vLLM hands it over: the texts joined with
    newlines when every part is text (most templates expect a string there), else the
    parts."""
    if any(isinstance(p, Mapping) and p.get("type") != "text" for p in parts):
        return parts
    texts = [p.get("text", "") for p in parts if isinstance(p, Mapping)]
    return "\n".join(t if isinstance(t, str) else "" for t in texts)


def without_billing_header(content: Any) -> Any:
    """A system message's content without Claude Code's attribution line (its value changes
    on every request; vLLM drops it so the prefix cache holds): a text starting with it
    loses its first line, and is left out when nothing else remains."""
    parts = [content] if isinstance(content, str) else content
    if not isinstance(parts, list):
        return content
    out: list[Any] = []
    changed = False
    for part in parts:
        if isinstance(part, str):
            text: Any = part
        elif isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        changed = True
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    if not changed:
        return content
    return out


def resolve_content_format(option: str, env: jinja2.Environment, source: str) -> ContentFormat:
    """``option`` ("auto", "string" or "openai") for the template ``source``."""
    if option not in CONTENT_FORMAT_OPTIONS:
        raise ConfigError(
            f"chat_template_content_format: {option!r} is not one of "
            + ", ".join(CONTENT_FORMAT_OPTIONS)
        )
    if option != "auto":
        return cast(ContentFormat, option)
    return detect_content_format(env, source)


# ---------------------------------------------------------------------- detection


class _Unanalysable(Exception):
    """A construct vLLM's analysis stops at (it then takes the string format)."""


def detect_content_format(env: jinja2.Environment, source: str) -> ContentFormat:
    """The content format vLLM's ``auto`` picks for the template ``source`` (vLLM 0.34's
    rule: vllm/renderers/hf.py ``_detect_content_format``)."""
    import jinja2

    try:
        ast = env.parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    try:
        found = next(_content_loops(ast), None)
    except _Unanalysable:
        return "string"
    return "openai" if found is not None else "string"


def _is_name(node: nodes.Node, name: str) -> bool:
    """``node`` loads ``name`` (a dotted ``ns.rest`` matches an attribute of ``ns``)."""
    from jinja2 import nodes

    if isinstance(node, nodes.Name):
        return node.ctx == "load" and node.name == name
    if isinstance(node, nodes.Getattr) and "." in name:
        base, _, attr = name.rpartition(".")
        return node.attr == attr and _is_name(node.node, base)
    return False


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` is ``name`` (or ``name[key]`` / ``name.key``), possibly sliced, filtered or
    tested."""
    from jinja2 import nodes

    if isinstance(node, (nodes.Filter, nodes.Test)):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return _is_name(node, name)
    if isinstance(node, nodes.Getitem):
        return (
            _is_name(node.node, name)
            and isinstance(node.arg, nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, nodes.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _dotted(node: nodes.Node) -> str | None:
    """An attribute-assignment target (``ns.rest``) as a dotted name."""
    from jinja2 import nodes

    if isinstance(node, nodes.NSRef):
        return f"{node.name}.{node.attr}"
    attrs = []
    while isinstance(node, nodes.Getattr):
        attrs.append(node.attr)
        node = node.node
    if isinstance(node, nodes.Name):
        return ".".join([node.name, *reversed(attrs)])
    return None


def _aliases(root: nodes.Template, name: str) -> list[str]:
    """``name`` and the names assigned from it (sliced or filtered; namespace attributes
    too: ``namespace(rest=messages)``, ``ns.rest = messages``), transitively."""
    from jinja2 import nodes

    found = [name]
    queue = deque([name])
    while queue:
        current = queue.popleft()
        for assign in root.find_all(nodes.Assign):
            lhs, rhs = assign.target, assign.node
            names: list[str] = []
            if isinstance(lhs, nodes.Name) and _reads(rhs, current):
                names.append(lhs.name)
            if (
                isinstance(lhs, nodes.Name)
                and isinstance(rhs, nodes.Call)
                and isinstance(rhs.node, nodes.Name)
                and rhs.node.name == "namespace"
            ):
                names += [f"{lhs.name}.{kw.key}" for kw in rhs.kwargs if _reads(kw.value, current)]
            elif isinstance(lhs, (nodes.Getattr, nodes.NSRef)) and _reads(rhs, current):
                dotted = _dotted(lhs)
                names += [dotted] if dotted is not None else []
            for alias in names:
                if alias not in found:
                    found.append(alias)
                    queue.append(alias)
    return found


def _target_name(node: nodes.Node) -> str:
    from jinja2 import nodes

    if not isinstance(node, nodes.Name):
        raise _Unanalysable
    return node.name


def _content_loops(root: nodes.Template) -> Iterator[str]:
    """Targets of the loops vLLM takes for loops over a message's content: over a message's
    ``content``; over a macro parameter that a call passes a message's ``content``; over a
    name ``content`` outside macros."""
    from jinja2 import nodes

    messages = _aliases(root, "messages")
    per_message = [
        _target_name(loop.target)
        for loop in root.find_all(nodes.For)
        if any(_reads(loop.iter, name) for name in messages)
    ]
    in_macros: set[int] = set()
    params_of_loop: dict[int, set[str]] = {}
    for macro in root.find_all(nodes.Macro):
        names = [arg.name for arg in macro.args]
        bound: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(names) and any(_reads(arg, m, "content") for m in per_message):
                    bound.add(names[i])
            for kw in call.kwargs:
                if kw.key in names and any(_reads(kw.value, m, "content") for m in per_message):
                    bound.add(kw.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if bound:
                params_of_loop[id(loop)] = bound
    for loop in root.find_all(nodes.For):
        over = loop.iter
        if any(_reads(over, m, "content") for m in per_message):
            yield _target_name(loop.target)
            continue
        if not isinstance(over, nodes.Name):
            continue
        if over.name in params_of_loop.get(id(loop), ()) or (
            id(loop) not in in_macros and over.name == "content"
        ):
            yield _target_name(loop.target)
