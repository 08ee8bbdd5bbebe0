"""What the incremental tokenizer's cache (router.tokenize.incremental) keeps, how an entry
is located, and what it costs.

Keys: :func:`message_keys` gives one key per message prefix of a conversation; a key only
*locates* candidate entries (exactness comes from comparing rendered texts or messages).
Entries: a :class:`TextEntry` is a rendered prompt with its ids and the special tokens near
its end where a longer prompt may continue (:class:`Cut`); a :class:`LocalEntry` is a
conversation rendered with a message-local template, with the render state a longer one
resumes from; a :class:`LocalPrefix` is such an entry found for a new request. Costs: an
entry references the request's message strings instead of copying them, and counts them
for the byte budget at :func:`text_bytes` (their width in memory, at least 2 bytes a
character) with what else the messages hold (:func:`held_bytes`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.tokenize.tokenizers import TokenArray

if TYPE_CHECKING:  # (Jinja2's, loaded with a chat template only: router/tokenize/pipeline.py)
    from router.tokenize.local_template import Resume


def message_keys(
    messages: Sequence[Mapping[str, Any]], context: Mapping[str, Any] | None = None
) -> list[int]:
    """``keys[k]`` locates cache entries for ``messages[:k + 1]`` under ``context`` (tools,
    template arguments).

    Keys only *locate* candidates: exactness comes from comparing rendered texts, so a key may
    summarise a long content by its length, head and tail instead of hashing all of it. The
    keys use Python's built-in (per-process salted) ``hash``: the cache lives in one process,
    and hashing a tuple of short strings in C costs a fifth of formatting and digesting it.
    """
    h = hash(repr(sorted((context or {}).items())))
    keys = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            summary: Any = (
                (len(content), content[:64], content[-64:]) if len(content) > 128 else content
            )
        else:
            summary = repr(content)[:256]
        h = hash((h, m.get("role"), m.get("name"), m.get("tool_call_id"), len(m), summary))
        keys.append(h)
    return keys


_REASONING_KEYS = ("reasoning", "reasoning_content", "thinking")


def text_bytes(text: str) -> int:
    """What the byte budget counts a message string at: 2 bytes a character, or its size in
    memory where that is more (a str takes 1, 2 or 4 bytes a character, by its widest: one
    character outside the BMP, an emoji, makes it 4). O(1): no pass over the text."""
    return max(2 * len(text), sys.getsizeof(text))


def held_bytes(messages: Sequence[Mapping[str, Any]]) -> int:
    """Bytes ``messages`` hold besides their text content (what ``content_bytes`` of
    :meth:`router.tokenize.incremental.IncrementalTokenizer.remember_local` counts), at
    :func:`text_bytes`: reasoning, and tool-call arguments counted twice (the text as sent
    and the object parsed from it, which the prepared messages keep)."""
    n = 0
    for m in messages:
        for key in _REASONING_KEYS:
            v = m.get(key)
            if type(v) is str:
                n += text_bytes(v)
        calls = m.get("tool_calls")
        if type(calls) is not list:
            continue
        for call in calls:
            fn = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping):
                n += 2 * len(repr(call))
                continue
            args = fn.get("arguments")
            n += 2 * (text_bytes(args) if type(args) is str else 2 * len(repr(args))) + 128
    return n


@dataclass(slots=True, frozen=True)
class Cut:
    pos: int  # start of a special token in the cached text
    anchor: str  # that special token
    idx: int  # its index in the token ids: ids[:idx] are the ids of text[:pos]


@dataclass(slots=True)
class TextEntry:
    text: str  # the whole rendered prompt this entry was made from
    tokens: TokenArray  # its ids
    cuts: tuple[Cut, ...]  # the last few special tokens, latest first
    hashes: dict[tuple[int, int], list[int]]  # (root, block_size) -> hashes of full blocks
    nbytes: int


@dataclass(slots=True)
class LocalEntry:
    """A conversation rendered with an incrementally renderable template
    (router.tokenize.local_template): ``tokens[:loop_idx]`` are exactly the ids of ``head`` and
    the bodies of ``messages[:resume.start]``; a render of a longer conversation starts at
    message ``resume.start`` from ``resume``."""

    messages: list[Mapping[str, Any]]  # as the client sent them (compared on reuse)
    prepared: list[Mapping[str, Any]]  # as the template saw them (reused)
    context: tuple[Any, ...]  # (tools, template kwargs, add_generation_prompt)
    head: str
    tokens: TokenArray
    loop_idx: int
    hashes: dict[tuple[int, int], list[int]]
    nbytes: int
    resume: Resume
    # templates whose head reads the whole conversation: the rendered text, and where the
    # resume point is in it (the next turn's text, when it resumes, is text[:text_at] + ...)
    text: str | None = None
    text_at: int = 0


@dataclass(slots=True, frozen=True)
class LocalPrefix:
    """A cached conversation prefix a new request extends (from
    :meth:`router.tokenize.incremental.IncrementalTokenizer.probe_local`)."""

    entry: LocalEntry
    start: int  # the message loop's bodies before its ``start``-th are cached; it starts there
    key: int  # where ``entry`` is cached (an entry kept for the request supersedes it)

    @property
    def prepared(self) -> list[Mapping[str, Any]]:
        """The cached conversation's messages, as the template saw them (the request's
        first ones are the same)."""
        return self.entry.prepared

    @property
    def resume(self) -> Resume:
        """Where and from what state the render of the new request starts."""
        return self.entry.resume
