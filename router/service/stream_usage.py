"""Usage on every stream: the router asks the engine for it and keeps it from clients that
did not ask.

A streaming request without ``stream_options.include_usage: true`` gets it added
(``usage_patch`` / ``with_patch``: the client's other ``stream_options`` kept), so the engine
ends the stream with a usage chunk (``choices: []`` and a ``usage`` object) that carries
``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``: the router's feedback on
every request. ``UsageFilter`` then removes that chunk from what the client receives, so
the client sees the stream it asked for.

Cost on the hot path: one ``bytes.endswith`` and one substring search per relayed piece
of such streams; other requests are not touched.
"""

from __future__ import annotations

import json
from typing import Any

_USAGE = b'"usage"'
_EVENT_END = b"\n\n"
_MAX_HELD = 1 << 20  # a piece without an event end this long is relayed as it is


def usage_patch(body: dict[str, Any]) -> bytes | None:
    """What to append to the body's JSON object so the engine reports usage on this stream
    (its final usage chunk only, which ``UsageFilter`` takes out again; a client's
    ``continuous_usage_stats`` without ``include_usage`` asked for no usage, and stays so);
    None when it is not a stream, the client asked for usage already, or its
    ``stream_options`` is not an object (left for the engine to refuse)."""
    if body.get("stream") is not True:
        return None
    options = body.get("stream_options")
    if options is None:
        options = {}
    elif not isinstance(options, dict) or options.get("include_usage") is True:
        return None
    merged = {**options, "include_usage": True}
    if merged.get("continuous_usage_stats"):
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
    """Drops the usage-only SSE events (``"choices":[]`` with a usage object) of a stream;
    ``feed`` returns what to relay. An event cut by a piece boundary is held until its end
    arrives (the client could not use half an event anyway)."""

    __slots__ = ("_held", "_off")

    def __init__(self) -> None:
        self._held = b""
        self._off = False  # events not separated by blank LF lines: relay untouched

    def feed(self, chunk: bytes) -> bytes:
        if self._off:
            return chunk
        if self._held:
            chunk = self._held + chunk
            self._held = b""
        if b"\r\n\r\n" in chunk:
            self._off = True
            return chunk
        if not chunk.endswith(_EVENT_END) and len(chunk) < _MAX_HELD:
            at = chunk.rfind(_EVENT_END)
            cut = 0 if at < 0 else at + len(_EVENT_END)
            chunk, self._held = chunk[:cut], chunk[cut:]
        if _USAGE not in chunk:
            return chunk
        kept = [ev for ev in chunk.split(_EVENT_END) if not _usage_only(ev)]
        return _EVENT_END.join(kept)

    def flush(self) -> bytes:
        """What is still held at the end of the stream."""
        held, self._held = self._held, b""
        return b"" if _usage_only(held) else held


def _usage_only(event: bytes) -> bool:
    if _USAGE not in event:
        return False
    data = event.strip()
    if not data.startswith(b"data:"):
        return False
    try:
        obj = json.loads(data[5:])
    except ValueError:
        return False
    return isinstance(obj, dict) and obj.get("choices") == [] and isinstance(obj.get("usage"), dict)
