"""Forwarding a routed request to its replica, with retries; the answer goes back, byte for
byte, through :class:`~router.service.answer_relay.AnswerRelay`, the forwarder's base.

Engine-neutral: the HTTP front end (the aiohttp app or the fast server) hands over the raw
body, the client's raw header pairs and a :class:`Sink` that writes the answer to its client.

* Upstream calls use the pooled HTTP/1.1 client of :mod:`router.service.upstream`
  (keep-alive per replica).
* The request body is forwarded as received (unknown fields and vendor extensions included);
  hop-by-hop headers are dropped, ``X-Request-Id`` is set, and ``X-data-parallel-rank`` when
  the replica has several DP ranks.
* Failed attempts (a connect error, a 429 or 5xx, a broken answer, no first byte in time:
  all before any byte reached the client) are retried on the next-best replica of the
  decision's ranking, within bounds (router/service/retry.py), and feed outlier ejection
  (router/service/ejection.py).
* Errors the router makes are OpenAI-style, Anthropic-style for the Messages API
  (``anthropic``); a replica's pass through as it sent them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from router.core.load import LoadView
from router.core.types import ReplicaKey
from router.recorder import endpoint_of
from router.service.answer_relay import AnswerRelay
from router.service.answers import closers_of
from router.service.ejection import Ejections, outlier_settings
from router.service.replica_url import ReplicaUrl
from router.service.retry import (
    RetryBudget,
    expected_first_byte_s,
    first_byte_deadline,
    retry_after_s,
)
from router.service.state import Routed, RouterState
from router.service.upstream import Client, Exchange
from router.service.upstream_errors import ConnectFailed, TotalTimeout, UpstreamError
from router.service.wire import Sink, is_event_stream, request_head, send_error


class Carried:
    """What became of a request's ``body`` good for one replica (``Forwarder.forward``'s
    ``carried``: a decode leg's ``kv_transfer_params``): ``sent`` once an attempt wrote it
    to a replica, which may have read it and acted on it from then on; ``served``: the
    replica that answered it (a status below 400), None when none did."""

    __slots__ = ("sent", "served")

    def __init__(self) -> None:
        self.sent = False
        self.served: ReplicaKey | None = None

    def mark_sent(self) -> None:
        self.sent = True


def _routable(view: LoadView) -> bool:
    """Whether a retry may go to a replica in this state: in rotation and not draining (a
    retry is a new request to it; a drained replica takes none)."""
    return view.healthy and not view.draining


class Forwarder(AnswerRelay):
    """Sends routed requests upstream; one per app."""

    def __init__(self, state: RouterState, client: Client) -> None:
        s = state.settings.server
        super().__init__(state, Ejections(state, outlier_settings(s)), s.debug_header)
        self.client = client
        self.max_retries = s.max_retries
        self.budget = RetryBudget(s.retry_budget_ratio, s.retry_budget_min)
        self._hosts: dict[str, bytes] = {}
        state.fleet.on_forget.append(self._forget)

    def _forget(self, key: ReplicaKey) -> None:
        """A replica left: the connection pools (and Host headers) of the addresses no
        replica has any more go (a pod restarted elsewhere leaves its old address for
        good; the pool would keep its sockets for ever)."""
        live = {ep.base_url for ep in self.state.registry.endpoints()}
        self.client.forget(live)
        for url in [u for u in self._hosts if u not in live]:
            del self._hosts[url]

    def _host(self, base_url: str) -> bytes:
        host = self._hosts.get(base_url)
        if host is None:
            host = self._hosts[base_url] = ReplicaUrl.parse(base_url).netloc.encode()
        return host

    def _final(
        self,
        attempt: int,
        rest: Iterable[ReplicaKey],
        refused: set[str],
        tried: set[ReplicaKey],
        ends_by: float,
    ) -> bool:
        """Whether failed attempt ``attempt`` (from 0) is the last, judged when it failed
        (no await before the retry spends the budget): the retries, the retry budget or the
        request's time (``ends_by``: ``server.request_timeout_s`` after its first attempt)
        are spent, or no key of ``rest`` can be tried (all gone, at a URL that refused a
        connection, tried already, or out of rotation or drained since the decision). Replicas
        whose time out of rotation has ended are readmitted first, as routing does
        (``RouterState.decide``), for this judgement and the retry's own check."""
        now = self.event_loop().time()
        if attempt >= self.max_retries or now >= ends_by or not self.budget.allows(now):
            return True
        self.state.fleet.restore_health(now)
        registry = self.state.registry
        load = self.state.load
        for k in rest:
            ep = registry.endpoint(k)
            if (
                ep is not None
                and ep.base_url not in refused
                and k not in tried
                and _routable(load.view(k, now))
            ):
                return False
        return True

    async def forward(
        self,
        sink: Sink,
        path: bytes,
        client_headers: Iterable[tuple[bytes, bytes]],
        body: bytes,
        routed: Routed,
        *,
        stream: bool,
        strip_usage: bool = False,
        retry_body: bytes | None = None,
        anthropic: bool = False,
        record_ids: str | None = None,
        since: float | None = None,
        transfer_s: float | None = None,
        carried: Carried | None = None,
        ends_by: float | None = None,
    ) -> None:
        """``stream``: the client asked for one (the parsed body's top-level ``stream``; an
        answer that is not a stream has its decode inside the first-byte deadline).
        ``strip_usage``: the router added ``include_usage`` to this stream; the usage
        chunk is read for feedback and not relayed (router.service.stream_usage). Retries:
        router/service/retry.py; outcomes feed outlier ejection (router/service/ejection.py).
        ``retry_body``: sent instead of ``body`` once an attempt reached a replica (any
        failure but a refused connection), for a body good for one replica only (a decode
        leg's ``kv_transfer_params``: router/service/pd_serve.py). ``anthropic``: a Messages API
        request, whose errors the router answers in Anthropic's shape. ``record_ids``: a stored
        Responses API request's owner (router/service/stored_responses.py ``owner_of``); its
        answer's response id is recorded with the replica that made it and that owner
        (router/service/response_ids.py); None: not recorded. ``since``: when the request was
        dispatched, which its TTFT, SLO and trace are timed from (default: now; a request held by
        SLO-aware admission is timed from its arrival, as its deadline is; a disaggregated request's
        decode leg from its prefill leg's dispatch). ``transfer_s``: ``body`` carries a prompt
        computed elsewhere (a decode leg's ``kv_transfer_params``), pulled in about that many
        seconds: an attempt that sends it is predicted no prefill of the prompt (its first byte: the
        prefill queued there and the transfer), as its dispatch recorded it; ``retry_body`` is
        prefilled where it goes. ``carried``: told when ``body`` (not ``retry_body``) is written to
        a replica. ``ends_by``: the loop time the request's attempts end by when its time upstream
        began before this call (a decode leg's: ``server.request_timeout_s`` from its prefill leg's
        dispatch); default ``request_timeout_s`` from now."""
        state = self.state
        model = routed.request.model
        mm = state.metrics.model(model)
        rid = routed.request.request_id
        rid_b = rid.encode("latin-1")
        loop = self.event_loop()
        ranked = [routed.decision.replica, *routed.decision.ranking]
        started = loop.time()
        self.budget.request(started)
        # the request's attempts, retries included, end by then (each waits what is left)
        if ends_by is None:
            ends_by = started + state.settings.server.request_timeout_s
        if since is not None:
            started = min(since, started)
        last_error = "no replica answered"
        client_headers = list(client_headers)
        refused: set[str] = set()  # base URLs that refused a connection in this request
        tried: set[ReplicaKey] = set()  # keys tried in this request (never one twice)
        ejections = self.ejections
        attempt = -1
        key: ReplicaKey | None = None
        token: object = None
        kind = ""
        reached = False  # an attempt reached a replica (it may have acted on the body)
        dispatch = routed.dispatch  # what was guessed of the attempt's replica
        try:
            for i, key in enumerate(ranked):
                ep = state.registry.endpoint(key)
                if ep is None or ep.base_url in refused or key in tried:
                    continue  # gone, a replica tried already, or one that just refused
                if i and not _routable(state.load.view(key, loop.time())):
                    continue  # ejected, marked down or drained since the decision
                now = loop.time()
                if now >= ends_by:  # spent before the first attempt (a decode leg's, by its
                    # prefill leg): none is sent, and the request answers a timeout
                    mm.outcome(key, "timeout").inc()
                    last_error = "the request's time ran out before it was sent"
                    kind = "timeout"
                    break
                attempt += 1
                tried.add(key)
                retrying = reached and retry_body is not None
                pulled = transfer_s is not None and not retrying  # the prompt comes computed
                if key != routed.decision.replica:  # a retry: the request's record moves
                    self.budget.spend(now)
                    dispatch = state.retried(routed, key, now, pulled=pulled)
                sent = retry_body if retrying and retry_body is not None else body
                on_write = carried.mark_sent if carried is not None and sent is body else None
                head = request_head(
                    path, self._host(ep.base_url), client_headers, rid_b, ep.dp_rank, len(sent)
                )
                prompt = routed.request.prompt_tokens
                usable = prompt if pulled else (routed.decision.usable_tokens if i == 0 else 0)
                expect = self.expected_first_byte(
                    key, now, prompt, usable, stream, routed.request.max_output_tokens
                )
                if pulled and transfer_s is not None:
                    expect += transfer_s
                # the attempt's deadline is its token: an ejection for latency moves it to now
                # (the exchange keeps the deadline too: a cancellation can be lost); never
                # past the request's (reached: the request's time is up, which is no
                # failure of the replica's)
                at = min(now + self.deadline(expect), ends_by)
                wait = at - now
                token = deadline = asyncio.timeout_at(at)
                ejections.sent(key, token, now, expect)
                kind = ""
                upstream: Exchange | None = None
                sse = False
                try:
                    async with deadline:
                        upstream = await self.client.pool(ep.base_url).send(
                            head, sent, wait, ends_by - now, on_write
                        )
                        if upstream.status < 400:
                            sse = is_event_stream(upstream.header(b"content-type") or b"")
                            await upstream.ready(whole=not sse)
                except ConnectFailed as exc:
                    state.fleet.connect_failed(key, loop.time(), connected=exc.connected)
                    if exc.connected:  # it took the connection and dropped the request
                        reached = True
                    else:  # nothing listens at the URL every DP rank of the replica shares
                        refused.add(ep.base_url)
                    mm.outcome(key, "connect_error").inc()
                    last_error = f"replica {key} unreachable: {exc}"
                    kind = "connect"
                    # no answer byte: the replica did not take the prompt (or died with
                    # its cache); a timeout or a broken answer may be a prefill under way
                    state.withdraw(model, dispatch)
                except TimeoutError as exc:  # no first byte by the deadline
                    mm.outcome(key, "timeout").inc()
                    last_error = f"replica {key} did not answer in time"
                    kind = "timeout"
                    if isinstance(exc, TotalTimeout) or deadline.when() == ends_by:
                        # the request's time ran out, not the replica's first-byte deadline:
                        # no failure of its, and nothing left for a retry
                        if upstream is not None:
                            upstream.abort()
                        ejections.dropped(key, token, loop.time())
                        token = None
                        break
                except UpstreamError as exc:
                    mm.outcome(key, "upstream_broken").inc()
                    last_error = f"replica {key} failed: {exc}"
                    kind = "broken"
                except asyncio.CancelledError:
                    # the client left after the answer's head, before its first data (or
                    # its whole body): the replica sees the request cancelled
                    if upstream is not None:
                        upstream.abort()
                    raise
                if upstream is not None and kind:
                    upstream.abort()
                reached = reached or kind != "connect"
                if kind:
                    ejections.failed(key, kind, loop.time(), token)
                    # judged now, not when the attempt went out: the budget is spent by
                    # then, or the replicas left are out of rotation (or refused)
                    if self._final(attempt, ranked[i + 1 :], refused, tried, ends_by):
                        break
                    mm.retry(kind).inc()
                    continue
                assert upstream is not None
                if upstream.status >= 400:  # the replica refused the prompt: nothing cached
                    state.withdraw(model, dispatch)
                if upstream.status == 429 or upstream.status >= 500:
                    kind = "http_429" if upstream.status == 429 else "http_5xx"
                    pause = retry_after_s(upstream.header(b"retry-after"))
                    ejections.failed(key, kind, loop.time(), token, pause)
                    if not self._final(attempt, ranked[i + 1 :], refused, tried, ends_by):
                        upstream.abort()
                        mm.outcome(
                            key, "upstream_5xx" if kind == "http_5xx" else "upstream_4xx"
                        ).inc()
                        mm.retry(f"http_{upstream.status}").inc()
                        last_error = f"replica {key} answered {upstream.status}"
                        continue
                else:
                    # a stream's first byte is no success yet: its end decides (relay)
                    ejections.answered(key, token, loop.time(), succeeded=not sse)
                    if on_write is not None and carried is not None and upstream.status < 400:
                        carried.served = key
                ends = token if sse and upstream.status < 400 else None
                token = None
                try:
                    await self.relay(
                        sink,
                        upstream,
                        routed,
                        key,
                        attempt,
                        started,
                        strip_usage,
                        anthropic,
                        record_ids,
                        closers_of(path),
                        endpoint_of(path),
                        ends,
                        stream,
                        dispatch,
                    )
                finally:
                    upstream.release()
                return
            state.load.complete(rid)  # booked: a cancel during the write is not counted
            timed_out = kind == "timeout"
            status = 504 if timed_out else (502 if attempt >= 0 else 503)
            self.record_failed(routed, started, status, stream, endpoint_of(path))
            await send_error(
                sink,
                status,
                f"{last_error}; gave up after {attempt + 1} attempt(s)",
                code="timeout" if timed_out else "upstream_unavailable",
                headers=[(b"Retry-After", str(state.settings.server.retry_after_s).encode())],
                anthropic=anthropic,
            )
        except asyncio.CancelledError:
            # the client left before the replica's answer head (during the relay, ``relay``
            # books the outcome itself)
            if key is not None and state.load.replica_of(rid) is not None:
                mm.outcome(key, "cancelled").inc()
                self.record_cancelled(routed, started, stream, endpoint_of(path))
                state.withdraw(model, dispatch)  # no answer yet: the prefill was cut short
            raise
        finally:
            # whatever happened, the request no longer loads a replica (idempotent), and an
            # attempt still open is neither a latency sample nor a failure
            state.load.complete(rid)
            if key is not None and token is not None:
                ejections.dropped(key, token, loop.time())

    def expected_first_byte(
        self,
        key: ReplicaKey,
        now: float,
        prompt_tokens: int,
        usable_tokens: int,
        stream: bool,
        max_output_tokens: int | None,
    ) -> float:
        """Seconds until ``key``'s first byte for a request sent now: its prefill behind the
        prefill queued there (less a failing replica's phantom work), router/service/retry.py."""
        queued = self.state.load.view(key, now).queued_prefill_tokens
        return expected_first_byte_s(
            queued - self.ejections.phantom_tokens(key, now),
            prompt_tokens,
            usable_tokens,
            stream,
            max_output_tokens,
        )

    def deadline(self, expect_s: float) -> float:
        """Seconds an attempt predicted to take ``expect_s`` waits for its first byte (a
        disaggregated request's prefill leg too: router/service/pd_serve.py)."""
        s = self.state.settings.server
        return first_byte_deadline(
            expect_s, s.first_byte_min_s, s.first_byte_factor, s.first_byte_timeout_s
        )
