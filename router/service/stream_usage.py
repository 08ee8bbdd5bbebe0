"""Usage on every stream: the router asks the engine for it and keeps it from clients that
did not ask.

A streaming request without ``stream_options.include_usage: true`` gets it added
(``usage_patch`` / ``with_patch``: the client's other ``stream_options`` kept), so the engine
ends the stream with a usage chunk (``choices: []`` and a ``usage`` object) that carries
``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``: the router's feedback on
every request. ``UsageFilter`` then removes that chunk from what the client receives, so
the client sees the stream it asked for.

Asking for usage changes one more thing in vLLM's stream (vLLM 0.34
``openai/chat_completion/serving.py`` and ``openai/completion/serving.py``: "Stamp the
fingerprint on terminal chunks only when no trailing usage chunk will follow"): its
``system_fingerprint`` moves from the chunks that end a choice (``finish_reason`` set) to
the usage chunk. So ``UsageFilter`` holds a chunk that ends a choice until the next event
arrives, and when that is the usage chunk it takes out, the chunk gets the usage chunk's
``system_fingerprint`` (added as the object's last member). With ``n`` > 1 only the choices
that end right before the usage chunk get it (holding the others would hold back the other
choices' tokens).

Events end at a blank line, LF (``\n\n``, as vLLM writes them) or CRLF (``\r\n\r\n``,
sse-starlette's default): the filter reads a stream by its first event end (none can sit
inside an event's JSON, whose newlines are escaped). A stream whose lines end with a bare CR
is relayed untouched.

Cost on the hot path: one ``bytes.endswith``, one substring search and one regular
expression search per relayed piece of such streams. Every other stream goes through a
``UsageFilter(drop_usage=False)``, which only holds an event cut by a piece boundary until
its end (one substring search and one ``bytes.endswith`` a piece, three more searches
until the stream's first event end).
"""

from __future__ import annotations

import json
import re
from typing import Any

from router.tokenize.lax import INVALID, lax_bool

_USAGE = b'"usage"'
# a choice's end: ``"finish_reason": "stop"`` (a string, not null)
_ENDS_CHOICE = re.compile(rb'"finish_reason"\s*:\s*"')
_FINGERPRINT = b'"system_fingerprint"'
_EVENT_END = b"\n\n"
_CRLF_END = b"\r\n\r\n"  # an event's end on a stream whose lines end with CRLF
_CR_END = b"\r\r"  # ... with a bare CR
_ENDS = (_EVENT_END, _CRLF_END, _CR_END)
_MAX_HELD = 1 << 20  # a piece without an event end this long is relayed as it is


def usage_patch(body: dict[str, Any]) -> bytes | None:
    """What to append to the body's JSON object so the engine reports usage on this stream
    (its final usage chunk only, which ``UsageFilter`` takes out again; a client's
    ``continuous_usage_stats`` without ``include_usage`` asked for no usage, and stays so);
    None when it is not a stream, the client asked for usage already, or its
    ``stream_options`` is not what the engine takes (left for the engine to refuse). Flags
    are read as vLLM reads them (router.service.lax: ``"include_usage": "true"`` asked for
    usage)."""
    if lax_bool(body.get("stream")) is not True:
        return None
    options = body.get("stream_options")
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        return None
    include = lax_bool(options.get("include_usage"))
    continuous = lax_bool(options.get("continuous_usage_stats"))
    if include is True or include is INVALID or continuous is INVALID:
        return None
    merged = {**options, "include_usage": True}
    if continuous:
        # engines count per-chunk usage only with include_usage (vLLM:
        # ``include_usage and continuous_usage_stats``): the client's stream had none
        merged["continuous_usage_stats"] = False
    return b',"stream_options":' + json.dumps(merged, separators=(",", ":")).encode()


def with_patch(raw: bytes, patch: bytes) -> bytes:
    """``raw`` (a JSON object) with ``patch`` added as its last member: JSON parsers keep the
    last of repeated keys, so it overrides the client's ``stream_options``."""
    end = raw.rstrip().rfind(b"}")
    if end < 0:
        return raw
    head = raw[:end].rstrip()
    if head.endswith(b"{"):  # an empty object: no comma before the member
        patch = patch[1:]
    return head + patch + raw[end:]


class UsageFilter:
    """Drops the usage-only SSE events (``"choices":[]`` with a usage object) of a stream, and
    gives the events that end a choice the ``system_fingerprint`` such a usage chunk carried
    (see the module docstring); ``feed`` returns what to relay. An event cut by a piece
    boundary is held until its end arrives (the client could not use half an event anyway),
    an event that ends a choice until the next event (or the stream's end).

    ``drop_usage=False``: only the holding of cut events, for every relayed stream, so that
    one that breaks off mid-event never has the router's error event glued to half an event
    (a client would parse the two as one garbled event).

    The stream's first event end tells how its lines end (module docstring)."""

    __slots__ = ("_drop", "_end", "_ending", "_held", "_known", "_off")

    def __init__(self, drop_usage: bool = True) -> None:
        self._drop = drop_usage
        self._held = b""
        self._end = _EVENT_END  # what ends an event: a blank LF line, or a CRLF one
        self._known = False  # the stream's first event end was seen (and _end set by it)
        self._ending: list[bytes] = []  # events that end a choice, not relayed yet
        self._off = False  # lines ended by a bare CR: relay untouched

    def feed(self, chunk: bytes) -> bytes:
        if self._off:
            return chunk
        if self._held:
            chunk = self._held + chunk
            self._held = b""
        sep = self._end
        if not self._known:  # the stream's first event end tells how its lines end
            first = -1
            for end in _ENDS:
                at = chunk.find(end)
                if at >= 0 and (first < 0 or at < first):
                    first, sep = at, end
            if first >= 0:
                self._known = True
                if sep == _CR_END:
                    self._off = True
                    return self.pending() + chunk
                self._end = sep
        if not chunk.endswith(sep) and len(chunk) < _MAX_HELD:
            at = chunk.rfind(sep)
            cut = 0 if at < 0 else at + len(sep)
            chunk, self._held = chunk[:cut], chunk[cut:]
        if not self._drop:
            return chunk
        if not self._ending and _USAGE not in chunk and _ENDS_CHOICE.search(chunk) is None:
            return chunk
        events = chunk.split(sep)
        rest = events.pop()  # b"" after an event's end; else a piece relayed as it is
        out: list[bytes] = []
        for ev in events:
            usage = _usage_only(ev)
            if usage is not None:
                self._stamp(usage.get("system_fingerprint"))
                continue
            out += self._ending
            self._ending = []
            if _ENDS_CHOICE.search(ev) is not None:
                self._ending.append(ev)
            else:
                out.append(ev)
        relayed = b"".join(ev + sep for ev in out)
        if rest:
            relayed += self.pending() + rest
        return relayed

    def _stamp(self, fingerprint: object) -> None:
        """Give the held events that end a choice the usage chunk's ``fingerprint``."""
        if not isinstance(fingerprint, str):
            return
        member = b',"system_fingerprint":' + json.dumps(fingerprint).encode()
        for i, ev in enumerate(self._ending):
            end = ev.rfind(b"}")
            if end > 0 and _FINGERPRINT not in ev:
                self._ending[i] = ev[:end] + member + ev[end:]

    def pending(self) -> bytes:
        """The events held for ending a choice, taken out (to relay before anything else)."""
        ending, self._ending = self._ending, []
        sep = self._end
        return b"".join(ev + sep for ev in ending)

    def flush(self) -> bytes:
        """What is still held at the end of the stream."""
        held, self._held = self._held, b""
        dropped = self._drop and _usage_only(held) is not None
        return self.pending() + (b"" if dropped else held)


def _usage_only(event: bytes) -> dict[str, Any] | None:
    """The event's JSON object when it is a usage-only chunk, else None."""
    if _USAGE not in event:
        return None
    data = event.strip()
    if not data.startswith(b"data:"):
        return None
    try:
        obj = json.loads(data[5:])
    except ValueError:
        return None
    if isinstance(obj, dict) and obj.get("choices") == [] and isinstance(obj.get("usage"), dict):
        return obj
    return None
