"""Message content as vLLM hands it to a chat template: the "string" or the "openai" format.

vLLM (``vllm/entrypoints/chat_utils.py``, ``--chat-template-content-format auto``) looks at
the chat template's Jinja AST: a template with a ``for`` loop over a message's ``content``
(``{% for part in message['content'] %}``: Llama 4, Gemma 3, Qwen2-VL, Mistral-3 style) gets
the **openai** format, every other template the **string** format.

* string: the content is one string, the text of its parts joined with newlines, empty ones
  left out; a missing content is empty (:func:`content_text`).
* openai: the content is a list: a string content becomes ``[{"type": "text", "text": s}]``,
  text-like parts ``{"type": "text", "text": ...}``, media parts ``{"type": "image"}`` (or
  ``audio`` / ``video``) for the template to place, bare string parts stay strings; empty
  string parts and ``text`` / ``refusal`` parts without text are left out, a missing content
  is ``[]`` (:func:`openai_parts`).

The two render differently wherever a message has several parts (a template trimming each part
joins them with nothing where the string format puts a newline) or an image (placed where its
part is, not first). The detection is vLLM's rule, reimplemented: the names bound to
``messages`` (the variable itself, and names assigned from it, a slice of it or a filter of
it, transitively), the targets of ``for`` loops over one of those, and then any ``for`` loop
whose iterable is such a target's ``content`` (item or attribute, possibly sliced or filtered).
A template vLLM cannot analyse (a loop target that is not a plain name) is "string", as there.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Literal, cast

import jinja2
from jinja2 import nodes

from router.core.errors import BadRequest, ConfigError

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
}
# keys that name a part's medium when it has no ``type``
_UNTYPED_MEDIA_KEYS = (
    ("image_url", "image"),
    ("image_pil", "image"),
    ("image_embeds", "image"),
    ("audio_embeds", "audio"),
    ("audio_url", "audio"),
    ("input_audio", "audio"),
    ("video_url", "video"),
)


def part_text(part: Any) -> str | None:
    """Text of one content part as vLLM reads it (a bare string, or the text of a text-like
    part; a part without ``type`` is read as text here, which vLLM refuses); None for parts
    without text (images, ...)."""
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping):
        kind = part.get("type")
        key = (
            "text" if kind is None else _PART_TEXT_KEYS.get(kind) if isinstance(kind, str) else None
        )
        value = part.get(key) if key is not None else None
        return value if isinstance(value, str) else None
    return None


def content_text(content: Any) -> str | None:
    """Text of an OpenAI message ``content`` in the string format: a string, or the texts of
    a list's parts joined with newlines, empty ones left out. None for a missing content."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join([t for t in map(part_text, content) if t])
    raise BadRequest("message content must be a string or a list of content parts")


def _openai_part(part: Any) -> Any:
    """One part in the openai format; None for a part vLLM leaves out."""
    if isinstance(part, str):
        return part or None
    if not isinstance(part, Mapping):
        return None
    kind = part.get("type")
    if kind is None or part.get("uuid") is not None:  # vLLM reads such a part by its keys
        for key, modality in _UNTYPED_MEDIA_KEYS:
            if key in part and (key != "input_audio" or part[key] is not None):
                return {"type": modality}
        if kind is None:
            text = part.get("text")  # vLLM refuses it; read as text, as in the string format
            return {"type": "text", "text": text} if isinstance(text, str) else None
    if not isinstance(kind, str):
        return None
    text_key = _PART_TEXT_KEYS.get(kind)
    if text_key is not None:
        value = part.get(text_key)
        if value is None and kind in _SKIP_WITHOUT_TEXT:
            return None
        return {"type": "text", "text": value}
    medium = _MEDIA_TYPES.get(kind)
    return {"type": medium} if medium is not None else None


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
    """The content format vLLM's ``auto`` picks for the template ``source``."""
    try:
        ast = env.parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    try:
        found = next(_content_loops(ast), None)
    except _Unanalysable:
        return "string"
    return "openai" if found is not None else "string"


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` is ``name`` (or ``name[key]`` / ``name.key``), possibly sliced, filtered or
    tested."""
    if isinstance(node, (nodes.Filter, nodes.Test)):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, nodes.Getitem):
        return (
            _reads(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
        )
    if isinstance(node, nodes.Getattr):
        return _reads(node.node, name) and node.attr == key
    return False


def _target_name(node: nodes.Node) -> str:
    if not isinstance(node, nodes.Name):
        raise _Unanalysable
    return node.name


def _aliases(root: nodes.Template, name: str) -> list[str]:
    """``name`` and the names assigned from it (sliced or filtered), transitively."""
    found = [name]
    queue = [name]
    while queue:
        current = queue.pop(0)
        for assign in root.find_all(nodes.Assign):
            if _reads(assign.node, current):
                target = _target_name(assign.target)
                if target not in found:  # (vLLM would loop on a = messages; messages = a)
                    found.append(target)
                    queue.append(target)
    return found


def _loop_targets(root: nodes.Template, names: list[str], key: str | None) -> Iterator[str]:
    """Targets of ``for`` loops over one of ``names`` (over its ``key`` when given)."""
    for loop in root.find_all(nodes.For):
        if any(_reads(loop.iter, name, key) for name in names):
            yield _target_name(loop.target)


def _content_loops(root: nodes.Template) -> Iterator[str]:
    messages = _aliases(root, "messages")
    per_message = list(_loop_targets(root, messages, None))
    return _loop_targets(root, per_message, "content")
