"""Incremental tokenization of growing conversations.

An agentic session resends its whole history every turn; tokenizing 1M tokens costs hundreds
of milliseconds, the new messages a few. The cache keeps, for recent rendered prompts, the
token ids (and canonical block hashes) of the text up to the *last special token*, keyed by the
chained hash of the message list that produced them
(:func:`router.tokenize.cache_entries.message_keys`; the entries and what they cost are
defined there).

A new request computes the keys of all its message prefixes and probes them longest first.
An entry is used only if the new rendered text starts with the entry's text followed by the
same special token (so templates that re-render history differently, e.g. dropping old
reasoning, fall back safely). Because tokenizers cut text at special tokens before anything
else (see :mod:`router.tokenize.tokenizers`), ``encode(prefix + suffix) == encode(prefix) ++
encode(suffix)`` whenever ``suffix`` starts with a special token: the result is exactly the
cold tokenization (property-tested in tests/test_tokenize_incremental.py). Block hashes
continue the chain from the last full block of the reused prefix.

Entries are evicted least-recently-used under a byte budget, except that an entry a newer one
was made from (the previous turn of a conversation that has moved on) is put first in line:
one long session's earlier turns can not push other sessions' latest entries out. Thread-safe:
the service encodes long prompts on worker threads.
"""

from __future__ import annotations

import bisect
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from router.core.hashing import hash_prompt
from router.tokenize.cache_entries import (
    Cut,
    LocalEntry,
    LocalPrefix,
    TextEntry,
    held_bytes,
    text_bytes,
)
from router.tokenize.tokenizers import SpecialSplitter, TokenArray, Tokenizer, encode

if TYPE_CHECKING:  # (Jinja2's, loaded with a chat template only: router/tokenize/pipeline.py)
    from router.tokenize.local_template import RenderedParts

# Prompts shorter than this are tokenized cold: the cache would cost more than it saves.
MIN_CACHED_CHARS = 16 * 1024
# Short prompts instead memoise the token ids of their *pieces* (text cut at special tokens:
# system prompts, tool definitions and earlier messages repeat across requests). Pieces
# shorter than PIECE_MIN_CHARS are encoded directly; the memo holds at most PIECE_MEMO_BYTES.
PIECE_MIN_CHARS = 128
PIECE_MEMO_BYTES = 32 * 2**20


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (64 KiB compared at a time,
    then a bisection: a few memcmp passes over the text, no per-character loop)."""
    n = min(len(a), len(b))
    lo, step = 0, 65536
    while lo < n and a[lo : lo + step] == b[lo : lo + step]:
        lo += step
    if lo >= n:
        return n
    base, hi = lo, min(lo + step, n)
    while lo < hi:  # a[:lo] == b[:lo]; the first difference is before hi
        mid = (lo + hi + 1) // 2
        if a[base:mid] == b[base:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


_EMPTY: TokenArray = np.zeros(0, dtype=np.uint32)

# Special tokens near the end of a cached prompt that may serve as cut points: the last one
# is usually inside the generation prompt, which the next turn may not repeat (e.g. when it
# appends a user or tool message); earlier ones end the previous message.
CUTS_KEPT = 6


@dataclass(slots=True, frozen=True)
class Encoded:
    """Token ids and canonical block hashes of one rendered prompt.

    ``reused_tokens``: ids taken from the cache (0 on a cold encode). ``tokenize_s`` and
    ``hash_s`` are wall-clock seconds spent tokenizing (including the cache probe) and hashing.
    """

    tokens: TokenArray
    hashes: list[int]
    reused_tokens: int
    tokenize_s: float
    hash_s: float


@dataclass(slots=True, frozen=True)
class CacheStats:
    entries: int
    bytes: int
    hits: int
    misses: int
    reused_tokens: int


class IncrementalTokenizer:
    """Tokenizer + prefix cache for one vocabulary (shared by every model using it)."""

    def __init__(self, tokenizer: Tokenizer, budget_bytes: int = 256 * 2**20) -> None:
        self.tokenizer = tokenizer
        # texts are cut only before the special tokens where that is exact (an HF tokenizer's
        # ``cut_tokens``); the others are text between cuts
        cuts: dict[str, int] = getattr(tokenizer, "cut_tokens", tokenizer.special_tokens)
        self.splitter = SpecialSplitter.for_tokens(cuts)
        self._special_ids = frozenset(cuts.values())
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[int, TextEntry | LocalEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0
        # FIFO by insertion; an OrderedDict pops its oldest entry in O(1) (a dict would scan
        # the holes left by earlier pops)
        self._pieces: OrderedDict[str, TokenArray] = OrderedDict()
        self._pieces_bytes = 0

    def encode_text(self, text: str) -> TokenArray:
        """Cold encode (parallel for long texts), special tokens recognised."""
        return encode(self.tokenizer, self.splitter, text)

    def encode_short(self, text: str) -> TokenArray:
        """``encode_text(text)`` for a short text, memoising the ids of its pieces.

        The text is cut at the start of every special token; by the tokenizer contract (see
        :mod:`router.tokenize.tokenizers`) the ids of the pieces, concatenated, are the ids of
        the text, so the result is exactly ``encode_text(text)``. Pieces of
        ``PIECE_MIN_CHARS`` or more are looked up alone; consecutive shorter ones (template
        scaffolding such as ``<|im_end|><|im_user|>user<|im_middle|>``) as one run. Both go
        through a memo bounded by ``PIECE_MEMO_BYTES`` (oldest entries dropped first): system
        prompts, tool definitions, earlier messages and the template's own text repeat across
        requests, so most requests tokenize only their new content.
        """
        if self.splitter.pattern is None or len(text) < PIECE_MIN_CHARS:
            return self.tokenizer.encode_segment(text)
        memo = self._pieces
        piece = self._piece
        parts: list[TokenArray] = []
        run = 0  # start of the pending run of short pieces
        prev = 0  # start of the current piece
        # (the starts of a scan of the whole text: no special token straddles them, even
        # where tokens can overlap, so these cuts need no ``clean_cut`` check)
        for start in self.splitter.starts(text):
            if start - prev >= PIECE_MIN_CHARS:
                if run < prev:
                    parts.append(piece(text[run:prev], memo))
                parts.append(piece(text[prev:start], memo))
                run = start
            prev = start
        if len(text) - prev >= PIECE_MIN_CHARS:
            if run < prev:
                parts.append(piece(text[run:prev], memo))
            parts.append(piece(text[prev:], memo))
        elif run < len(text):
            parts.append(piece(text[run:], memo))
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts)

    def _piece(self, piece: str, memo: OrderedDict[str, TokenArray]) -> TokenArray:
        ids = memo.get(piece)
        if ids is not None:
            return ids
        ids = self.tokenizer.encode_segment(piece)
        ids.flags.writeable = False  # shared by every request that repeats the piece
        size = sys.getsizeof(piece) + ids.nbytes + 120
        with self._lock:
            if piece not in memo:
                memo[piece] = ids
                self._pieces_bytes += size
                while self._pieces_bytes > PIECE_MEMO_BYTES and memo:
                    old, old_ids = memo.popitem(last=False)
                    self._pieces_bytes -= sys.getsizeof(old) + old_ids.nbytes + 120
        return ids

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                len(self._entries),
                self._bytes + self._pieces_bytes,  # prefix entries + the short-prompt piece memo
                self.hits,
                self.misses,
                self.reused_tokens,
            )

    def _probe(self, text: str, keys: Sequence[int]) -> tuple[int, TextEntry, Cut] | None:
        with self._lock:
            for key in reversed(keys):
                entry = self._entries.get(key)
                if not isinstance(entry, TextEntry):
                    continue
                cut = self._usable_cut(text, entry)
                if cut is not None:
                    self._entries.move_to_end(key)
                    return key, entry, cut
        return None

    @staticmethod
    def _usable_cut(text: str, entry: TextEntry) -> Cut | None:
        """The latest cut where ``text`` agrees with the cached text and has the same special
        token. Usually the old prompt is a prefix of the new one: one comparison, no copy."""
        old = entry.text
        if text.startswith(old):
            return entry.cuts[0]
        low = entry.cuts[-1].pos
        if not text.startswith(old[:low]):
            return None
        for cut in entry.cuts:
            if text.startswith(cut.anchor, cut.pos) and text[low : cut.pos] == old[low : cut.pos]:
                return cut
        return None

    def encode(
        self, text: str, keys: Sequence[int], root: int, block_size: int, *, remember: bool = True
    ) -> Encoded:
        """Tokens and block hashes of ``text``, rendered from messages whose prefix keys are
        ``keys`` (from :func:`~router.tokenize.cache_entries.message_keys`); remembers the
        result under ``keys[-1]``."""
        t0 = time.perf_counter()
        use_cache = bool(keys) and self.budget_bytes > 0 and len(text) >= MIN_CACHED_CHARS
        found = self._probe(text, keys) if use_cache else None
        reused = 0
        extends: tuple[int, TextEntry] | None = None
        if found is not None:
            key, entry, cut = found
            extends = key, entry
            suffix = self.encode_text(text[cut.pos :])
            tokens = np.concatenate([entry.tokens[: cut.idx], suffix])
            reused = cut.idx
            full = entry.hashes.get((root, block_size))
            base_hashes = full[: cut.idx // block_size] if full is not None else None
        elif len(text) < MIN_CACHED_CHARS:
            tokens = self.encode_short(text)
            base_hashes = None
        else:
            tokens = self.encode_text(text)
            base_hashes = None
        enc = self._finish(tokens, base_hashes, reused, root, block_size, t0)
        if remember and use_cache:
            self._remember(keys[-1], text, tokens, enc.hashes, root, block_size, extends)
        return enc

    def _finish(
        self,
        tokens: TokenArray,
        base_hashes: list[int] | None,
        reused: int,
        root: int,
        block_size: int,
        t0: float,
    ) -> Encoded:
        """Block hashes of ``tokens`` (continuing ``base_hashes``, the hashes of the reused
        full blocks, when given), hit/miss counts, timings from ``t0``."""
        t1 = time.perf_counter()
        if base_hashes is not None:
            parent = base_hashes[-1] if base_hashes else None
            more = hash_prompt(
                tokens, block_size, root, start=len(base_hashes) * block_size, parent=parent
            )
            hashes = base_hashes + more.hashes
        else:
            hashes = hash_prompt(tokens, block_size, root).hashes
        t2 = time.perf_counter()
        with self._lock:
            if reused:
                self.hits += 1
                self.reused_tokens += reused
            else:
                self.misses += 1
        return Encoded(tokens, hashes, reused, t1 - t0, t2 - t1)

    def _remember(
        self,
        key: int,
        text: str,
        tokens: TokenArray,
        hashes: list[int],
        root: int,
        block_size: int,
        extends: tuple[int, TextEntry] | None,
    ) -> None:
        special = self.splitter.pattern
        if special is None:
            return
        # the cut points are the last special tokens; their indices in ``tokens`` are those of
        # the last special ids (by the tokenizer contract each occurrence is one id, and text
        # between them none: checked by their counts), so nothing is tokenized again
        starts = self.splitter.starts(text)
        at = self._special_at(tokens)
        if not starts or len(at) != len(starts):
            return  # the contract does not hold here; never cache an inexact prefix
        ids = self.tokenizer.special_tokens
        cuts = []
        for pos, idx in zip(starts[-CUTS_KEPT:], at[-CUTS_KEPT:].tolist(), strict=True):
            m = special.match(text, pos)
            if m is None or ids.get(m.group()) != int(tokens[idx]):
                return
            if self.splitter.clean_cut(text, pos):
                cuts.append(Cut(pos, m.group(), idx))
        if not cuts:
            return
        # (a str takes 1, 2 or 4 bytes a character, by its widest: one emoji makes it 4)
        nbytes = sys.getsizeof(text) + tokens.nbytes + 40 * len(hashes) + 512
        self._store(
            key,
            TextEntry(text, tokens, tuple(reversed(cuts)), {(root, block_size): hashes}, nbytes),
            extends,
        )

    def _store(
        self,
        key: int,
        entry: TextEntry | LocalEntry,
        extends: tuple[int, TextEntry | LocalEntry] | None = None,
    ) -> None:
        """Keep ``entry`` under ``key``, the most recently used; ``extends``: the cached
        entry (and its key) it was made from, which it supersedes. That one, if still cached
        under another key, is put first in line for eviction: superseded entries go before
        any entry that is still a conversation's latest (a retry of the earlier turn hits it
        while it lasts)."""
        if entry.nbytes > self.budget_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[key] = entry
            self._bytes += entry.nbytes
            if extends is not None:
                at, previous = extends
                if at != key and self._entries.get(at) is previous:
                    self._entries.move_to_end(at, last=False)
            while self._bytes > self.budget_bytes and self._entries:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes

    # ------------------------------------------------------------ message-local templates
    #
    # With a message-local template the rendered prompt is head + one body per message +
    # tail, and the text of a conversation prefix never changes (router.tokenize.local_template).
    # An entry keeps the ids of head + bodies of a conversation; a request that extends it
    # (its first messages *equal* the cached ones, same tools / kwargs / generation flag)
    # renders only its new messages and tokenizes only them and the tail. The ids are exact
    # when the new text after the cached bodies starts with a special token (checked), by the
    # same tokenizer contract as the text cache.

    def probe_local(
        self, messages: Sequence[Mapping[str, Any]], keys: Sequence[int], context: tuple[Any, ...]
    ) -> LocalPrefix | None:
        """The longest cached conversation that ``messages`` extends, if any."""
        if self.budget_bytes <= 0:
            return None
        # (a message-local template's, which loaded it)
        from router.tokenize.render_state import same_value as same_json

        with self._lock:
            for key in reversed(keys):
                entry = self._entries.get(key)
                if not isinstance(entry, LocalEntry):
                    continue
                k = len(entry.messages)
                if (
                    k <= len(messages)
                    and same_json(list(entry.context), list(context))
                    and all(
                        same_json(a, b) for a, b in zip(entry.messages, messages[:k], strict=True)
                    )
                ):
                    self._entries.move_to_end(key)
                    return LocalPrefix(entry, entry.resume.start, key)
        return None

    def encode_local(
        self,
        parts: RenderedParts,
        prefix: LocalPrefix | None,
        root: int,
        block_size: int,
        fallback: LocalEntry | None = None,
    ) -> tuple[Encoded, int] | None:
        """Tokens and block hashes of ``head + bodies + tail``, where ``parts`` was rendered
        from message ``prefix.start`` on (0 and ``prefix`` None: the whole conversation).
        Returns the result and the token index where the body of ``parts.resume.start``
        starts (-1: unknown, the entry cannot be extended), or None when ``prefix`` can not
        be used exactly (the caller renders whole).

        Pieces are tokenized apart only where the second starts with a special token (the
        tokenizer contract that makes that exact); elsewhere the resume point is dropped.
        Without ``prefix``, the ids of the text shared with ``fallback`` (a cached
        conversation that this one extends but could not resume, kept with its text) are
        taken from it."""
        t0 = time.perf_counter()
        special = self.splitter.pattern

        def separable(text: str) -> bool:
            return not text or (special is not None and special.match(text) is not None)

        def clean(before: str) -> bool:  # a cut after ``before`` is exact (see SpecialSplitter)
            return self.splitter.clean_cut(before, len(before))

        resume = parts.resume
        offset = len(parts.bodies) if resume is None else resume.offset
        # what a later render re-renders: the bodies from the resume point, and the tail
        rest = parts.bodies[offset:] + parts.tail
        rest_ids = None
        if not rest:
            rest_ids = _EMPTY
        elif (
            separable(rest)
            and (
                prefix is not None
                or not self.splitter.unsafe_before  # (no copy of the text for the usual tokens)
                or clean(parts.head + parts.bodies[:offset])
            )
        ):
            rest_ids = self.tokenizer.encode_segment(rest)
        reused = 0
        base_hashes: list[int] | None = None
        if prefix is not None:
            entry = prefix.entry
            if parts.head != entry.head or not separable(parts.tail):
                return None
            if not separable(parts.bodies):
                return None  # (the cut before the bodies was checked when it was cached)
            reused = entry.loop_idx
            done = parts.bodies[:offset]
            if rest_ids is not None and separable(parts.bodies[offset:]) and clean(done):
                done_ids = self.encode_text(done) if done else _EMPTY
                tokens = np.concatenate([entry.tokens[:reused], done_ids, rest_ids])
                loop_idx = reused + len(done_ids)
            else:  # the resume point is not at a special token: one piece, no resume
                if parts.bodies and not clean(parts.bodies):
                    return None  # nor is the cut between the bodies and the tail exact
                tail_ids = self.tokenizer.encode_segment(parts.tail) if parts.tail else _EMPTY
                bodies = self.encode_text(parts.bodies) if parts.bodies else _EMPTY
                tokens = np.concatenate([entry.tokens[:reused], bodies, tail_ids])
                loop_idx = -1
            full = entry.hashes.get((root, block_size))
            base_hashes = full[: reused // block_size] if full is not None else None
        else:
            text = parts.head + parts.bodies + parts.tail
            shared = None
            if fallback is not None and fallback.text is not None:
                shared = self._shared_ids(text, fallback.text, fallback.tokens)
            if fallback is not None and shared is not None:
                chars, reused = shared
                tail = self.encode_text(text[chars:])
                tokens = np.concatenate([fallback.tokens[:reused], tail])
                full = fallback.hashes.get((root, block_size))
                base_hashes = full[: reused // block_size] if full is not None else None
            else:
                tokens = self.encode_text(text)
            loop_idx = -1
            if rest_ids is not None and len(rest_ids) <= len(tokens):
                at = len(tokens) - len(rest_ids)
                if np.array_equal(tokens[at:], rest_ids):
                    loop_idx = at
        if resume is None:
            loop_idx = -1
        return self._finish(tokens, base_hashes, reused, root, block_size, t0), loop_idx

    def _special_at(self, tokens: TokenArray) -> np.ndarray:
        """Indices of the special-token ids in ``tokens``, in order."""
        return np.flatnonzero(np.isin(tokens, np.fromiter(self._special_ids, dtype=tokens.dtype)))

    def _shared_ids(self, text: str, old: str, old_ids: TokenArray) -> tuple[int, int] | None:
        """``(chars, n)``: ``text[:chars] == old[:chars]``, both continue with a special
        token there, and ``old_ids[:n]`` are the ids of ``old[:chars]`` (the special tokens of
        ``old`` are found in order in ``old_ids``: checked for all of them); None if there is
        no such cut."""
        special = self.splitter.pattern
        if special is None:
            return None
        shared = common_prefix(text, old)
        starts = self.splitter.starts(old)
        ids = self.tokenizer.special_tokens
        at = self._special_at(old_ids)
        if len(at) != len(starts):
            return None  # the tokenizer did not keep every special token: no exact cut
        j = bisect.bisect_right(starts, shared) - 1
        while j >= 0:
            pos = starts[j]
            here = special.match(text, pos)
            if (
                here is not None
                and pos + len(here.group()) <= shared
                and self.splitter.clean_cut(text, pos)
            ):
                if ids.get(here.group()) != int(old_ids[at[j]]):
                    return None
                return pos, int(at[j])
            j -= 1
        return None

    def remember_local(
        self,
        key: int,
        messages: Sequence[Mapping[str, Any]],
        prepared: Sequence[Mapping[str, Any]],
        context: tuple[Any, ...],
        parts: RenderedParts,
        encoded: Encoded,
        loop_idx: int,
        root: int,
        block_size: int,
        content_bytes: int,
        text: tuple[str, int] | None = None,
        extends: LocalPrefix | None = None,
    ) -> None:
        """Keep a conversation for :meth:`probe_local` (``content_bytes``: its text content
        at :func:`text_bytes`, for the byte budget; the message strings are shared with the
        request, not copied; ``extends``: the cached conversation this one was found to
        extend, superseded by it).

        ``text`` (the whole rendered text, and where the resume point is in it) is given for
        templates whose head reads the whole conversation: a turn that can not resume (a
        new user query moved what the head computed) is rendered whole, and the ids of the
        text it shares with this one come from here (:meth:`encode_local`)."""
        resume = parts.resume
        if loop_idx < 0 or resume is None or self.budget_bytes <= 0:
            return
        # the message strings and the head (the tools, rendered; the tools themselves are
        # the request's) at their width, at least 2 bytes a character; besides the content,
        # what else the messages hold: tool-call arguments, twice (as sent, and parsed in
        # ``prepared``)
        held = content_bytes + held_bytes(messages) + text_bytes(parts.head)
        nbytes = held + 200 * len(messages) + encoded.tokens.nbytes
        nbytes += 40 * len(encoded.hashes) + 512
        full, text_at = None, 0
        if text is not None:
            full, text_at = text
            nbytes += sys.getsizeof(full)
        entry = LocalEntry(
            list(messages),
            list(prepared),
            context,
            parts.head,
            encoded.tokens,
            loop_idx,
            {(root, block_size): encoded.hashes},
            nbytes,
            resume,
            full,
            text_at,
        )
        self._store(key, entry, None if extends is None else (extends.key, extends.entry))
