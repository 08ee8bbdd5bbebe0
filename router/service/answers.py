"""What the router reads of an engine's answer (router/service/answer_relay.py relays it): the
usage in each shape the replicas answer (OpenAI's, the Anthropic Messages API's, the
Responses API's: :func:`usage_tokens`, found in a JSON body or a stream's tail by
:func:`usage_of`), where each kind's stream ends (:func:`closers_of`), a Responses stream's
final event (it carries the whole response), and what is no token: SSE comments and blank
lines (:class:`EventLines`), a Responses stream's opening events (:class:`ResponsesPreamble`),
the events after the first that carry none (:class:`TokenLines`: the usage chunk,
``[DONE]``). Pure functions of bytes, read once an answer is whole or per relayed piece."""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

_LINE_END = re.compile(rb"[\r\n]")
_NO_DATA = (b":", b"\r", b"\n")  # how a comment or a blank line begins


class EventLines:
    """Tells, of an event stream fed piece by piece, whether a line that carries data (not
    a comment, not blank) ended in a piece: only whole lines are judged, so vLLM's
    keep-alive comment (``": keep-alive"`` while a request queues or prefills, with
    ``--sse-keep-alive-interval``) is no token however the reads cut it (``b":"`` then
    ``b" keep-alive\\n\\n"``), and neither ends the prefill in the load model nor times a
    first token. A line ends at LF, CR or CRLF (a CRLF cut between its two bytes leaves a
    blank line). Only the first byte of a line still arriving is held across pieces."""

    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open = b""  # the first byte of the line still arriving (b"": at a line start)

    def data_ended(self, chunk: bytes) -> bool:
        """Whether a line of data ends in ``chunk``."""
        end = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
        if end < 0:  # no line ends here
            if not self._open:
                self._open = chunk[:1]
            return False
        first = self._open or chunk[:1]  # the first line to end here begins so
        self._open = chunk[end + 1 : end + 2]
        if first not in _NO_DATA:
            return True
        # the lines after the first, each ended within the piece
        lines = _LINE_END.split(chunk[:end])
        return any(line[:1] not in (b"", b":") for line in lines[1:])


# of a line still arriving, the start kept (enough for an event's name, ``[DONE]`` and
# ``"choices":[]``, which come first in vLLM's chunks)
_OPEN_HEAD = 512
_LINE_ENDS = re.compile(rb"\r\n|[\r\n]")
# a chunk without choices: the usage chunk (vLLM 0.34 openai/chat_completion/serving.py
# ``chat_completion_stream_generator``: ``final_usage_chunk``, ``choices=[]``)
_NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_DONE = b"[DONE]"


def _token_data(data: bytes) -> bool:
    """Whether an event's data carries output tokens: not ``[DONE]``, not a chunk whose
    ``choices`` are empty (its ``"choices"`` key is found first: a quote inside a string is
    escaped, so only a key matches)."""
    if data.startswith(_DONE):
        return False
    at = data.find(b'"choices"')
    return at < 0 or _NO_CHOICES.match(data, at) is None


def _token_event(name: bytes) -> bool:
    """Whether a named event carries output tokens: the Messages API's
    ``content_block_delta``, the Responses API's ``response.*.delta`` (text, reasoning, tool
    arguments); not their opening, closing, ``ping`` or usage events (``message_delta``: the
    stop reason and the output's usage)."""
    return name == b"content_block_delta" or name.endswith(b".delta")


class TokenLines:
    """Tells, of an event stream fed piece by piece, whether a line of data that carries
    output tokens ended in a piece: the reads whose gaps are inter-token latencies, as vLLM
    counts them (vllm/v1/metrics/stats.py ``IterationStats.update_from_output``: one gap per
    engine output after the first). Not the usage chunk (``"choices":[]``: the router's own
    ``include_usage`` or the client's), ``data: [DONE]``, a named event that carries no token
    (:func:`_token_event`), a comment or a blank line. Of a line still arriving only its
    start is held across pieces."""

    __slots__ = ("_cr", "_open", "_quiet")

    def __init__(self) -> None:
        self._open = b""  # the start of the line still arriving
        self._quiet = False  # the event whose lines arrive is named, and carries no token
        self._cr = False  # the last piece ended with CR (a CRLF may be cut between its bytes)

    def token_ended(self, chunk: bytes) -> bool:
        """Whether a line of data carrying output tokens ends in ``chunk``."""
        if (
            not self._open
            and not self._quiet
            and not self._cr
            and chunk.startswith(b"data:")
            and chunk.find(b"\n") == len(chunk) - 2  # one event, ended: ``data: ...\n\n``
            and chunk.endswith(b"\n\n")
            and b"\r" not in chunk
        ):  # (the common read: the general path below judges it alike)
            return _token_data(chunk[5:-2].lstrip())
        if self._cr and chunk[:1] == b"\n":
            chunk = chunk[1:]
        end = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
        if end < 0:
            if len(self._open) < _OPEN_HEAD:
                self._open = (self._open + chunk)[:_OPEN_HEAD]
            self._cr = False
            return False
        self._cr = chunk.endswith(b"\r")
        ended = chunk[: end + 1]
        # (a plain split where no CR is: the common case, a fraction of the regex's time)
        lines = _LINE_ENDS.split(ended) if b"\r" in ended else ended.split(b"\n")
        lines.pop()  # b"": after the last line end
        if self._open:
            lines[0] = (self._open + lines[0])[:_OPEN_HEAD]
        self._open = chunk[end + 1 : end + 1 + _OPEN_HEAD]
        token = False
        for line in lines:
            if line.startswith(b"data:"):
                if not self._quiet and not token:
                    token = _token_data(line[5:].lstrip())
            elif line.startswith(b"event:"):
                self._quiet = not _token_event(line[6:].strip())
            elif not line:
                self._quiet = False  # the event's end
        return token


# the events a Responses API stream opens with before the engine's first output (vLLM 0.34
# responses/serving.py ``responses_stream_generator``: written before it reads the engine)
RESPONSES_PREAMBLE = (b"response.created", b"response.in_progress")
_LINE_HEAD = 64  # of an unfinished line, only its start is kept (all that is read of it)


class ResponsesPreamble:
    """Tells whether a Responses API stream, fed piece by piece, has begun an event that is
    not one of its :data:`RESPONSES_PREAMBLE` yet. vLLM writes ``response.created`` and
    ``response.in_progress`` before the engine's first output (while the prompt queues and
    prefills); every later event comes from an output (the first one with the first token),
    so the first token is the piece where such an event begins, as vLLM's own benchmark
    client times it. An event is known by its ``event:`` line; one without (``data:`` first)
    is taken as an output. Only the last line's start is held across pieces."""

    __slots__ = ("_line", "_named")

    def __init__(self) -> None:
        self._line = b""
        self._named = False  # the current event is named (a preamble event)

    def output_began(self, chunk: bytes) -> bool:
        """Whether an event other than the preamble began by the end of ``chunk``."""
        lines = (self._line + chunk).split(b"\n")
        last = lines.pop()
        self._line = last[:_LINE_HEAD]
        for line in lines:
            if self._is_output(line.rstrip(b"\r"), whole=True):
                return True
        return self._is_output(last, whole=False)

    def _is_output(self, line: bytes, whole: bool) -> bool:
        if line.startswith(b"event:"):
            name = line[6:].lstrip(b" ")
            if whole:
                self._named = True
                return name.rstrip(b" ") not in RESPONSES_PREAMBLE
            # a name still arriving: an output as soon as no preamble name can follow
            return not any(known.startswith(name[: len(known)]) for known in RESPONSES_PREAMBLE)
        if line.startswith(b"data:"):
            return not self._named
        if whole and not line:
            self._named = False  # the event's end
        return False


# the Responses API's last events (vLLM 0.34 responses/serving.py: the stream ends with one
# of them, pydantic's compact JSON with ``type`` its last key, and no ``[DONE]``)
RESPONSES_ENDS = (
    b'"type":"response.completed"}',
    b'"type":"response.failed"}',
    b'"type":"response.incomplete"}',
)


# what ends each kind's stream (the relay tests one kind's, one test a piece); the space
# after a field's colon is optional in SSE (every client drops it): ``data:[DONE]`` too
OPENAI_CLOSERS = (b"data: [DONE]", b"data:[DONE]")
ANTHROPIC_CLOSERS = (b'"message_stop"}', *OPENAI_CLOSERS)
RESPONSES_CLOSERS = (*RESPONSES_ENDS, *OPENAI_CLOSERS)
ALL_CLOSERS = (*RESPONSES_ENDS, *ANTHROPIC_CLOSERS)


# how many of a stream's last bytes :func:`closes_stream` reads (enough to hold the start of
# a Responses stream's final ``event: response.incomplete`` line too: answer_relay.py)
CLOSER_SPAN = 48


def closes_stream(chunk: bytes, closers: tuple[bytes, ...] = ALL_CLOSERS) -> bool:
    """Whether a piece of an event stream ends with the stream's closing event: OpenAI's
    ``data: [DONE]``, the Messages API's ``message_stop`` (vLLM:
    ``data: {"type":"message_stop"}``), or the Responses API's ``response.completed`` /
    ``response.failed`` / ``response.incomplete``; ``closers``: one kind's alone. Only the
    last :data:`CLOSER_SPAN` bytes are read: a relay passes the stream's last bytes across
    its reads (:func:`stream_end`), since a read may cut the closing event."""
    return chunk[-CLOSER_SPAN:].rstrip().endswith(closers)


# how a stream's error event begins, at the start of a line: vLLM's (``data: {"error": {...}}``,
# ``ErrorResponse.model_dump_json``, then ``[DONE]``), the Messages API's and the Responses
# API's ``event: error``, and a Responses ``response.failed``, each with or without the
# optional space after the colon. A line cannot begin so inside an event's JSON: a newline
# there is escaped.
_ERROR_STARTS = (
    b'data: {"error":',
    b'data:{"error":',
    b"event: error",
    b"event:error",
    b"event: response.failed",
    b"event:response.failed",
)


def stream_error(tail: bytes) -> bool:
    """Whether a stream's tail (its last bytes, whole lines or not) holds the engine's error
    event: the client got an error, not a whole answer, though the stream was closed as
    usual."""
    return any(tail.startswith(start) or b"\n" + start in tail for start in _ERROR_STARTS)


def stream_end(end: bytes, chunk: bytes) -> bytes:
    """The last :data:`CLOSER_SPAN` bytes of a stream whose last bytes were ``end``, once
    ``chunk`` followed them (what :func:`closes_stream` reads, whatever cut the stream
    into pieces)."""
    if len(chunk) >= CLOSER_SPAN:
        return chunk[-CLOSER_SPAN:]
    return (end + chunk)[-CLOSER_SPAN:]


def closers_of(path: bytes) -> tuple[bytes, ...]:
    """The closing events of the streams of ``path`` (a hot endpoint's, a query string
    allowed)."""
    if path.startswith(b"/v1/responses"):
        return RESPONSES_CLOSERS
    if path.startswith(b"/v1/messages"):
        return ANTHROPIC_CLOSERS
    return OPENAI_CLOSERS


def responses_final_at(chunk: bytes) -> int:
    """Where a Responses API stream's final event (``response.completed`` / ``failed`` /
    ``incomplete``, which carries the whole response and its usage) begins in a piece of
    the stream; -1 when it does not. Its ``event:`` line may end with LF or CRLF, and the
    space after the colon is optional."""
    at = -1
    for found in _FINAL_EVENT.finditer(chunk):
        at = found.start()
    return at


_FINAL_EVENT = re.compile(rb"event: ?response\.(?:completed|failed|incomplete)\r?\n")


# the most of a Responses API stream's final event (the whole response) kept for its usage
MAX_FINAL_EVENT = 16 * 2**20
_DECODER = json.JSONDecoder()
_UNKNOWN: Any = object()
_WS = " \t\n\r"  # JSON's whitespace, and nothing else


def _top_level_usage(payload: bytes) -> Any:
    """The top-level ``usage`` value of a JSON object body, parsed without parsing what comes
    before it (long answers make the body large; ``usage`` comes after ``choices``), or
    ``_UNKNOWN`` when that cannot be shown safely (the caller then parses the whole body).

    For a valid JSON body the result is what a full parse gives. The last ``"usage"`` is a
    real key when its opening quote is not escaped (an unescaped quote cannot sit inside a
    string) and a colon follows. It is a key of the top-level object exactly when what follows
    its value closes one object level: either just ``}``, or ``, ...}`` that parses as an
    object once a ``{`` is put in front (a deeper key would leave closing brackets over). A
    later key spelled with escapes (``"us\\u0061ge"``) is the same key to a full parse, which
    keeps the last duplicate: that parse of the rest sees it. (For an invalid body the result
    may be a value where a full parse fails; it only feeds metrics.)"""
    at = payload.rfind(b'"usage"')
    slashes = 0
    while at - slashes > 0 and payload[at - slashes - 1] == 0x5C:  # backslash
        slashes += 1
    if at < 0 or slashes % 2:
        return _UNKNOWN
    try:
        text = payload[at + 7 :].decode()
    except UnicodeDecodeError:
        return _UNKNOWN
    rest = text.lstrip(_WS)
    if not rest.startswith(":"):
        return _UNKNOWN
    rest = rest[1:].lstrip(_WS)
    try:
        value, end = _DECODER.raw_decode(rest)
    except (ValueError, RecursionError):
        return _UNKNOWN
    after = rest[end:].strip(_WS)
    if after == "}":
        return value
    if after.startswith(","):
        try:
            others = json.loads("{" + after[1:])
        except (ValueError, RecursionError):
            return _UNKNOWN
        if isinstance(others, dict):
            return others.get("usage", value)
    return _UNKNOWN


def usage_of(payload: bytes, sse: bool | None = None) -> dict[str, Any] | None:
    """The last ``usage`` object of a JSON body or of SSE ``data:`` lines, if any. ``sse``:
    whether the payload is an event stream (None: guessed from ``data:`` in it, which a JSON
    answer may contain too, e.g. a ``data:image/png`` URI)."""
    if b'"usage"' not in payload:
        return None
    if sse is None:
        sse = b"data:" in payload
    if not sse and (payload[:1] == b"{" or payload.lstrip(b" \t\n\r")[:1] == b"{"):
        usage = _top_level_usage(payload)
        if usage is not _UNKNOWN:
            return usage if isinstance(usage, dict) else None
    candidates = [payload]
    if sse:
        candidates = [
            line[5:].strip()
            for line in payload.splitlines()
            if line.startswith(b"data:") and b'"usage"' in line
        ]
    for raw in reversed(candidates):
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        usage = obj.get("usage") if isinstance(obj, dict) else None
        if usage is None and isinstance(obj, dict) and isinstance(obj.get("response"), dict):
            usage = obj["response"].get("usage")  # a Responses API event's response
        if isinstance(usage, dict):
            return usage
    return None


class UsageTokens(NamedTuple):
    """What a ``usage`` object says, None where it says nothing: the prompt's tokens, the
    answer's, and the prompt tokens the engine found cached."""

    prompt: int | None
    completion: int | None
    cached: int | None


def _int(value: object) -> int | None:
    """A token count: a non-negative int (a negative one, from a faulty engine or proxy, is
    no count: it would step the counters fed from it back)."""
    return value if type(value) is int and value >= 0 else None


def usage_tokens(usage: dict[str, Any] | None) -> UsageTokens:
    """The token counts of a ``usage`` object, in either shape the replicas answer:
    OpenAI's (``prompt_tokens``, ``completion_tokens``,
    ``prompt_tokens_details.cached_tokens``), the Messages API's as vLLM 0.34 builds it
    (``_build_anthropic_usage``: ``input_tokens`` is the prompt less
    ``cache_read_input_tokens`` and ``cache_creation_input_tokens``, ``output_tokens``), or
    the Responses API's (``input_tokens`` the whole prompt, ``output_tokens``,
    ``input_tokens_details.cached_tokens``); the one place the forwarder reads usage. A
    count that is not a non-negative int is None (not said)."""
    if not usage:
        return UsageTokens(None, None, None)
    details = usage.get("input_tokens_details")
    if isinstance(details, dict):  # the Responses API's: input_tokens is the whole prompt
        return UsageTokens(
            _int(usage.get("input_tokens")),
            _int(usage.get("output_tokens")),
            _int(details.get("cached_tokens")),
        )
    if "input_tokens" in usage and "prompt_tokens" not in usage:
        uncached = _int(usage.get("input_tokens"))
        read = _int(usage.get("cache_read_input_tokens"))
        created = _int(usage.get("cache_creation_input_tokens")) or 0
        prompt = None if uncached is None else uncached + (read or 0) + created
        return UsageTokens(prompt, _int(usage.get("output_tokens")), read)
    # OpenAI's, the common case: the checks inline (this runs for every answer)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if type(details) is dict else None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    return UsageTokens(
        prompt if type(prompt) is int and prompt >= 0 else None,
        completion if type(completion) is int and completion >= 0 else None,
        cached if type(cached) is int and cached >= 0 else None,
    )


def cached_tokens_of(payload: bytes, sse: bool | None = None) -> int | None:
    """The cached prompt tokens of the usage in a JSON body or SSE lines, if any
    (:func:`usage_tokens`)."""
    if b"cached_tokens" not in payload and b"cache_read_input_tokens" not in payload:
        return None
    return usage_tokens(usage_of(payload, sse)).cached
