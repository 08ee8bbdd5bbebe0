"""Relaying a replica's answer to its client, and booking it: :class:`AnswerRelay`, the base
of the forwarder (router.service.proxy ``Forwarder``), runs once an attempt has an answer
head.

* Bodies pass through exactly as the replica sent them.
* Streams (``text/event-stream``) are relayed piece by piece as they arrive (an event cut
  by a read waits for its end: router.service.stream_usage ``UsageFilter``). A client that
  disconnects cancels the handler or fails a write; either way the upstream connection is
  closed, which aborts the request on the replica.
* Feedback: first body data (a stream's first whole line of data: not a keep-alive
  comment however reads cut it, nor a Responses stream's ``response.created`` /
  ``in_progress``) ->
  ``LoadTracker.first_token``; end -> ``complete``; the
  replica's cached prompt tokens (non-streaming body, or the last usage of a stream:
  router.service.answers ``usage_tokens`` reads OpenAI's ``usage``, the Anthropic one of
  ``/v1/messages`` and the Responses API's, in a JSON answer or a stream's final
  ``response.completed`` event) are compared with the predicted usable hit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Any

from router.core.routing import Dispatch
from router.core.types import ReplicaKey
from router.recorder import CLIENT_CLOSED
from router.service.answer_book import count_slo, judged, record_answer, record_request
from router.service.answers import (
    MAX_FINAL_EVENT,
    OPENAI_CLOSERS,
    RESPONSES_CLOSERS,
    EventLines,
    ResponsesPreamble,
    TokenLines,
    closes_stream,
    responses_final_at,
    stream_end,
    stream_error,
    usage_of,
    usage_tokens,
)
from router.service.ejection import Ejections
from router.service.response_ids import id_of_answer, id_of_stream
from router.service.slo_metric import count_unanswered
from router.service.state import Routed, RouterState
from router.service.stream_usage import UsageFilter
from router.service.upstream import Exchange
from router.service.upstream_errors import (
    TotalTimeout,
    UpstreamBroken,
    UpstreamError,
    UpstreamTimeout,
)
from router.service.wire import Sink, response_headers, send_error, stream_error_event

# how much of a Responses stream's start is searched for its response id
MAX_ID_SCAN = 1 << 16
# how many of a stream's last bytes are kept for its usage (the usage event and what follows)
TAIL_SPAN = 8192


class AnswerRelay:
    """Relays an attempt's answer to its client and books it; the base of
    :class:`~router.service.proxy.Forwarder`, which sends the attempts."""

    def __init__(self, state: RouterState, ejections: Ejections, debug_header: bool) -> None:
        self.state = state
        self.ejections = ejections
        self.debug_header = debug_header
        self._loop: asyncio.AbstractEventLoop | None = None

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop this forwarder serves on, looked up once: ``asyncio.get_running_loop``
        makes a ``getpid`` system call each time (CPython checks for a fork), three per
        request before this."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def _debug(self, routed: Routed, key: ReplicaKey, attempt: int) -> bytes:
        d = routed.decision
        first = key == d.replica  # other replicas' hits were not predicted
        return (
            f"replica={key}; policy={d.policy}; "
            f"usable_tokens={d.usable_tokens if first else 0}; "
            f"kv_tokens={d.kv_tokens if first else 0}; "
            f"prompt_tokens={routed.request.prompt_tokens}; "
            f"exact={str(routed.prompt.exact).lower()}; attempt={attempt}"
        ).encode()

    async def relay(
        self,
        sink: Sink,
        upstream: Exchange,
        routed: Routed,
        key: ReplicaKey,
        attempt: int,
        started: float,
        strip_usage: bool = False,
        anthropic: bool = False,
        record_ids: str | None = None,
        closers: tuple[bytes, ...] = OPENAI_CLOSERS,
        endpoint: str | None = None,
        ends: object = None,
        stream: bool | None = None,
        dispatch: Dispatch | None = None,
    ) -> None:
        """Relay the answer of ``key``. ``ends``: the attempt's token when its first byte was
        no success for outlier ejection yet (a stream): how the stream ends is booked for it
        (whole, the engine's error event, broken off, or left by the client). ``stream``:
        the client asked for a stream (a failed request's trace row says so; None: as the
        answer came). ``dispatch``: what routing guessed of the attempt's replica, taken
        back when the client leaves before the first token (``RouterState.withdraw``)."""
        state = self.state
        mm = state.metrics.model(routed.request.model)
        # equality, not identity: compiled (mypyc) code may hand over a copy of the tuple
        responses = closers == RESPONSES_CLOSERS
        # usage dropped when the router asked for it; cut events held on every stream
        strip = UsageFilter(drop_usage=strip_usage)
        rid = routed.request.request_id
        headers, streaming, has_rid = response_headers(upstream.headers)
        if not has_rid:
            headers.append((b"X-Request-Id", rid.encode("latin-1")))
        if self.debug_header:
            headers.append((b"X-KVRouter-Decision", self._debug(routed, key, attempt)))
        status = upstream.status
        loop = self.event_loop()
        tail: deque[bytes] = deque()  # at least the stream's last TAIL_SPAN bytes (usage)
        done_relayed = False  # the client has the stream's closing ``data: [DONE]`` event
        first_at = 0.0  # when the stream's first token came (0: none yet)
        last = 0.0  # when its last token came (the TPOT's end, as vLLM's)
        failed = False  # booked a failure (its trace row): a cancel while telling it is none
        whole: bytes | None = None  # the answer, not streamed, the router has whole
        try:
            if not streaming:
                try:
                    payload = upstream.body()
                    if payload is None:
                        payload = await upstream.read_all()
                except UpstreamError as exc:
                    timeout = isinstance(exc, UpstreamTimeout)
                    mm.outcome(key, "timeout" if timeout else "upstream_broken").inc()
                    upstream.abort()
                    self.record_failed(routed, started, 504 if timeout else 502, stream, endpoint)
                    failed = True
                    await send_error(
                        sink,
                        504 if timeout else 502,
                        f"replica {key} {'timed out' if timeout else 'broke off its answer'}",
                        code="upstream_timeout" if timeout else "upstream_error",
                        anthropic=anthropic,
                    )
                    return
                whole = payload
                state.load.first_token(rid)
                if record_ids is not None and status == 200:
                    self._record_id(routed, key, id_of_answer(payload), record_ids)
                await sink.respond(status, headers, payload)  # the client gone: cancelled
                self._answered(routed, key, started, status, payload, False, 0.0, endpoint, stream)
                if ends is not None:
                    self.ejections.ended(key, ends, loop.time())
                    ends = None
                return
            # Each piece goes out as soon as it is here, in as few writes as what is at hand
            # allows: the head alone when the replica sent no data with it yet (the client
            # learns the status before the first token), else with the first data; the
            # stream's end with the last data when both arrived together.
            # A body delimited by the connection's end has no end of its own: only the
            # stream's closing event tells a finished answer from a replica that died.
            until_close = upstream.until_close
            # a stream that ended without data
            ended = head_sent = upstream.at_end and not until_close
            if ended:
                await sink.start(status, headers, end=True)
            elif not upstream.data_ready:
                head_sent = True
                await sink.start(status, headers)
            tail_bytes = 0
            keep_final = False  # the tail holds a Responses API stream's final event
            head_seen = b""  # the stream's start, until its response id is found
            end = b""  # the stream's last bytes (a read may cut its closing event)
            first = True
            # a Responses stream's response.created / in_progress come before the engine's
            # first output: no token either
            preamble = ResponsesPreamble() if responses and status == 200 else None
            lines = EventLines()  # only whole lines of data are tokens (not a keep-alive)
            # after the first token, the gaps between reads with tokens are inter-token
            # latencies: not those before the usage chunk or [DONE]
            tokens = TokenLines()
            while (chunk := await upstream.read()) is not None:
                now = loop.time()
                data = lines.data_ended(chunk)
                token = tokens.token_ended(chunk)
                if preamble is not None and not preamble.output_began(chunk):
                    pass  # (fed every piece: it holds a line cut by a read)
                elif not data:
                    pass  # keep-alive comments (vLLM --sse-keep-alive-interval): no token
                elif first:
                    preamble = None
                    state.load.first_token(rid)
                    mm.ttft.observe(now - started)
                    first_at = last = now
                    first = False
                elif token:
                    mm.itl.observe(now - last)
                    last = now
                ended = upstream.at_end
                before, end = end, stream_end(end, chunk)
                done_seen = closes_stream(end, closers)
                cut = ended and until_close and not done_seen
                ended = ended and not cut
                out = strip.feed(chunk)
                if ended:
                    out += strip.flush()
                if not head_sent:
                    head_sent = True
                    await sink.start(status, headers, out, end=ended)
                elif ended:
                    await sink.end(out)
                elif out:
                    await sink.write(out)
                done_relayed = done_seen
                if record_ids is not None and status == 200:
                    # the response.created event may come in pieces: read the stream's start
                    head_seen = head_seen + chunk if head_seen else chunk
                    found = id_of_stream(head_seen)
                    if found is not None or len(head_seen) > MAX_ID_SCAN:
                        self._record_id(routed, key, found, record_ids)
                        record_ids = None
                        head_seen = b""
                at = -1
                probe = chunk
                if responses:  # the final event's first line may start in an earlier read
                    probe = before + chunk
                    if b"response." in probe:
                        at = responses_final_at(probe)
                if at >= 0:  # the whole response (and its usage) follows: kept whole
                    tail.clear()
                    tail_bytes = 0
                    keep_final = True
                    chunk = probe[at:]
                tail.append(chunk)
                tail_bytes += len(chunk)
                # whole reads go while the rest still holds the span: a read may cut the
                # usage event, whose start is then in the read before
                span = MAX_FINAL_EVENT if keep_final else TAIL_SPAN
                while len(tail) > 1 and tail_bytes - len(tail[0]) >= span:
                    tail_bytes -= len(tail.popleft())
                if cut:
                    break
            if until_close and not done_relayed:
                raise UpstreamBroken("the connection closed before the stream's [DONE]")
            if not ended:  # the end came on its own, after the last data
                await sink.end(strip.flush())
            errored = self._answered(
                routed, key, started, status, b"".join(tail), True, first_at, endpoint, stream,
                last,
            )  # fmt: skip
            self._stream_ended(key, ends, errored)
            ends = None
        except (asyncio.CancelledError, ConnectionResetError) as exc:
            # The client went away: abort the request on the replica. A stream whose closing
            # [DONE] event the client already has is complete for it (SSE clients stop
            # reading there, often before the replica's end of the body arrives): answered,
            # not cancelled.
            if done_relayed:
                errored = self._answered(
                    routed, key, started, status, b"".join(tail), True, first_at, endpoint,
                    stream, last,
                )  # fmt: skip
                self._stream_ended(key, ends, errored)
                ends = None
            else:
                mm.outcome(key, "cancelled").inc()
                if first_at == 0.0 and whole is None:  # no token yet: a prefill cut short
                    state.withdraw(routed.request.model, dispatch)
                if not failed:
                    # a whole answer: the engine's output was all produced (its usage)
                    produced = None
                    if whole is not None:
                        produced = usage_tokens(usage_of(whole, False)).completion
                    self.record_cancelled(routed, started, stream, endpoint, produced)
            upstream.abort()
            if isinstance(exc, asyncio.CancelledError):
                raise
        except (UpstreamTimeout, UpstreamBroken) as exc:
            upstream.abort()
            if done_relayed:
                # after the stream's closing event: the client has the whole answer (as
                # when it leaves there), so nothing broke for it
                errored = self._answered(
                    routed, key, started, status, b"".join(tail), True, first_at, endpoint,
                    stream, last,
                )  # fmt: skip
                self._stream_ended(key, ends, errored)
                ends = None
                with contextlib.suppress(ConnectionResetError):
                    await sink.end(strip.flush())
                return
            # The replica stalled or broke mid-stream: tell the client in an SSE error event,
            # then abort its connection too, so a truncated stream is never mistaken for a
            # complete one (no [DONE] follows).
            mm.outcome(key, "upstream_broken").inc()
            if not isinstance(exc, TotalTimeout):  # (else the request's time is up: the
                # attempt is dropped, by ``finally``)
                self.ejections.failed(key, "broken", loop.time(), ends)
                ends = None
            timeout = isinstance(exc, UpstreamTimeout)
            self.record_failed(routed, started, 504 if timeout else 502, stream, endpoint)
            event = stream_error_event(
                504 if timeout else 502,
                f"replica {key} {'timed out' if timeout else 'broke off the stream'}",
                "upstream_timeout" if timeout else "upstream_error",
                anthropic,
            )
            held = strip.pending()  # events it had whole (never half of one)
            with contextlib.suppress(ConnectionResetError, RuntimeError, OSError):
                await sink.write(held + event)
            raise
        finally:
            state.load.complete(rid)
            if ends is not None:  # neither a success nor a failure of the replica's
                self.ejections.dropped(key, ends, loop.time())

    def _stream_ended(self, key: ReplicaKey, ends: object, errored: bool) -> None:
        """Book a stream the client has whole for outlier ejection (``ends``: see
        :meth:`relay`): ended by the engine's error event, a failure; else a success."""
        if ends is not None:
            now = self.event_loop().time()
            if errored:
                self.ejections.failed(key, "error_event", now, ends)
            else:
                self.ejections.ended(key, ends, now)

    def _record_id(
        self, routed: Routed, key: ReplicaKey, response_id: str | None, owner: str
    ) -> None:
        """Remember which replica holds a stored response, ``owner``'s
        (router/service/response_ids.py; with Redis, queued for the other pods:
        router/service/response_share.py)."""
        if response_id is not None:
            self.state.response_share.record(response_id, routed.request.model, key.replica, owner)

    def _answered(
        self,
        routed: Routed,
        key: ReplicaKey,
        started: float,
        status: int,
        payload: bytes,
        sse: bool,
        first_at: float = 0.0,
        endpoint: str | None = None,
        stream: bool | None = None,
        last_at: float = 0.0,
    ) -> bool:
        """Book an answer the client has whole: engine feedback, the live-traffic trace, the
        outcome, and whether it met its SLO: a stream (``first_at``: when its first data
        came; ``last_at``: its last token) by its TTFT and TPOT, a 2xx body by its E2E (an
        error status, a stream the engine ended with its error event: no SLO, and a trace
        row without the outcome: :meth:`record_failed`).
        ``payload``: the body, or a stream's tail, whose usage is read once here (a
        Responses stream's final event carries the whole response). Returns whether the
        engine ended the stream with its error event."""
        usage = usage_of(payload, sse) if b'"usage"' in payload else None
        self._feedback(routed, key, usage)
        # a stream the engine ended with its error event is an error, not an answer
        errored = sse and status < 400 and stream_error(payload)
        if sse and first_at and status < 400 and not errored:
            self._slo(routed, started, first_at, usage, True, last_at)
        elif not sse and 200 <= status < 300:
            self._slo(routed, started, 0.0, usage, False)
        if status >= 400 or errored:
            # (the router tells of a broken stream with 502 too)
            self.record_failed(routed, started, 502 if errored else status, stream, endpoint)
        elif self.state.recorder is not None:
            self._record(routed, key, started, usage, first_at, sse, endpoint)
        outcome = "ok" if status < 400 else ("upstream_5xx" if status >= 500 else "upstream_4xx")
        if errored:
            outcome = "upstream_error"
        self.state.metrics.model(routed.request.model).outcome(key, outcome).inc()
        return errored

    def record_failed(
        self,
        routed: Routed,
        started: float,
        status: int,
        stream: bool | None,
        endpoint: str | None,
    ) -> None:
        """Count a request that got no answer (``status``: see :func:`record_request`) a
        miss of its SLO (:func:`count_unanswered`) and append it to the live-traffic trace,
        if one is kept: the load it offered, which a replay of a faulty hour offers again."""
        req = routed.request
        count_unanswered(self.state, req.model, req.prompt_tokens, routed.service_class, status)
        self._record_unanswered(routed, started, status, stream, endpoint)

    def record_cancelled(
        self,
        routed: Routed,
        started: float,
        stream: bool | None,
        endpoint: str | None,
        completion_tokens: int | None = None,
    ) -> None:
        """Append a request its client left before it had the whole answer to the trace,
        if one is kept: offered load, as a failed one (:func:`record_request`, ``status``
        router.recorder ``CLIENT_CLOSED``). No miss of its SLO: nobody waited for it.
        ``completion_tokens``: the usage of an answer the router had whole (the engine's
        work, which a replay offers again), else None (the request's max tokens)."""
        self._record_unanswered(routed, started, CLIENT_CLOSED, stream, endpoint, completion_tokens)

    def _record_unanswered(
        self,
        routed: Routed,
        started: float,
        status: int,
        stream: bool | None,
        endpoint: str | None,
        completion_tokens: int | None = None,
    ) -> None:
        if self.state.recorder is not None:
            finished = self.event_loop().time()
            record_request(
                self.state, routed.request, routed.prompt, started, finished,
                completion_tokens, None, 0.0, stream, endpoint, status=status,
            )  # fmt: skip

    def _slo(
        self,
        routed: Routed,
        started: float,
        first_at: float,
        usage: dict[str, Any] | None,
        streamed: bool,
        last_at: float = 0.0,
    ) -> None:
        """Count an answer by its prompt's SLO tier and which targets it met
        (:func:`count_slo`), its E2E from ``started`` (a disaggregated request's: its
        prefill leg's start) to now, when the client has it whole. A stream's TPOT runs from
        its first token to its last (``last_at``), not to its end (the usage chunk and
        ``[DONE]`` come after); its output length is the usage the replica reported (the
        router asks for it on every stream); without one the TPOT half is not judged; a
        body's TPOT is not judged."""
        req = routed.request
        e2e = self.event_loop().time() - started
        count_slo(
            self.state,
            req.model,
            req.prompt_tokens,
            routed.ttft_factor,
            routed.service_class,
            first_at - started if streamed else e2e,
            e2e,
            usage_tokens(usage).completion,
            req.samples * req.prompts,
            streamed,
            (last_at or first_at) - started if streamed else None,
        )

    def _record(
        self,
        routed: Routed,
        key: ReplicaKey,
        started: float,
        usage: dict[str, Any] | None,
        first_at: float,
        stream: bool,
        endpoint: str | None,
    ) -> None:
        counts = usage_tokens(usage)
        finished = self.event_loop().time()
        record_answer(
            self.state, routed, key, started, finished, counts.completion, counts.cached,
            first_at, stream, endpoint,
        )  # fmt: skip

    def _feedback(self, routed: Routed, key: ReplicaKey, usage: dict[str, Any] | None) -> None:
        if not usage:
            return
        mm = self.state.metrics.model(routed.request.model)
        prompt_tokens, _, cached = usage_tokens(usage)
        if routed.prompt.exact and prompt_tokens is not None:
            drift = prompt_tokens - routed.prompt.prompt_tokens
            mm.drift.observe(drift)
            if drift:
                mm.mismatch.inc()
        if cached is None:
            return
        mm.engine_cached_tokens.inc(cached)
        # the same request's prompt, as kvrouter_prompt_tokens counts it: the hit rate's
        # denominator over the answers that report their cached tokens
        mm.engine_cached_prompt_tokens.inc(routed.request.prompt_tokens)
        # the predicted replica, and the cached tokens of the prompt it predicted
        if key == routed.decision.replica and judged(routed):
            mm.prediction(routed.decision.usable_tokens, routed.request.prompt_tokens, cached)
