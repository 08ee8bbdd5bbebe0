"""The gRPC Router service (``kvrouter.v1.Router``): Pick routes a request as the HTTP
front door would and books its decision; Report tells how the request went on the replica.

Pick reads its prompt (token ids, text, chat messages, or a whole HTTP request body as
``request_json``) through the same prompt processing, limits and admission as the HTTP
endpoints (router/service/handling.py), routes it with the same RouterState, and counts it
in their per-request metrics. The decision is booked (router/rpc/decisions.py) under the
caller's ``request_id`` within the caller's scope, holding the load and, for a client key,
one of its per-key slots until the decision ends: a COMPLETED, FAILED or REFUSED Report,
its expiry or eviction (counted outcome ``expired``), or the Pick's reply never reaching its
caller. Report applies the outcome as the HTTP forwarder applies an answer's (load, outcome
and SLO metrics, outlier ejection, withdrawing a refused request's speculative entries); a
decision another worker process booked is relayed to the workers
(router/service/report_relay.py).

What a Pick asks for (its prompt, its size, the replicas it may name) is read by
router/rpc/pick_request.py. Core errors end a Pick with the status of router/rpc/calls.py
``status_of``.
"""

from __future__ import annotations

import array
import asyncio
import functools
import math
import uuid
from collections.abc import Callable
from dataclasses import replace

import grpc

from router.core.errors import BadRequest, KVRouterError, NoReplicaAvailable, ShuttingDown
from router.core.types import ReplicaKey
from router.recorder import CLIENT_CLOSED
from router.rpc.calls import CALLER, DELIVERY, Delivery, abort_error, abort_reply, metadata_headers
from router.rpc.decisions import (
    DecisionBook,
    Pending,
    RetryWindow,
    Unanswered,
    owner_of,
    scoped_id,
)
from router.rpc.gen import router_pb2, router_pb2_grpc
from router.rpc.pick_request import (
    ENDPOINT_OF_KIND,
    admitted_body,
    candidate_keys,
    check_id_size,
    first_routed,
    pinned_holders,
    prompt_bytes,
    prompt_reader,
    whole_pools,
)
from router.service.answer_book import (
    count_slo,
    judged,
    record_answer,
    record_refused,
    record_request,
)
from router.service.body_memo import Admitted
from router.service.ejection import Ejections
from router.service.errors import refused_load, reply_for
from router.service.gate import Gate
from router.service.handling import (
    holder_unavailable,
    record,
    rejected,
    too_large,
)
from router.service.intake import THREAD_MIN_BODY, checked_prompt
from router.service.report_relay import Reported, report_to_peers
from router.service.request_identity import (
    in_flight,
    scoped_session,
    session_key,
    unique_in_flight,
)
from router.service.slo_metric import count_refused, count_unanswered
from router.service.state import RouterState
from router.service.stopping import Stopping
from router.service.workers import Workers
from router.tokenize.keying import ProcessedPrompt
from router.tokenize.request_fields import asks_prompt_logprobs

Clock = Callable[[], float]


class RouterServicer(router_pb2_grpc.RouterServicer):
    """``ejections``: the HTTP forwarder's outlier ejection (router/service/ejection.py), fed
    by the reports as the forwarder's own attempts feed it (None: not fed). ``workers``: the
    worker processes of a ``kvrouter serve --workers N``; a Report whose decision another
    worker made (the gateway's connection landed elsewhere) is handed to them. ``gate``: the
    HTTP front door's (router/service/gate.py): a Pick of a client held to per-key limits
    (:data:`CALLER`) holds one of its slots, as an HTTP request does for its whole answer,
    from the call until its decision ends: a COMPLETED or FAILED Report, the decision's
    expiry or eviction from the book, or the Pick failing. A decision is its caller's: a
    Report of any other caller is answered as one of an unknown id (:func:`owner_of`)."""

    def __init__(
        self,
        state: RouterState,
        clock: Clock,
        book: DecisionBook | None = None,
        ejections: Ejections | None = None,
        workers: Workers | None = None,
        gate: Gate | None = None,
    ) -> None:
        self.state = state
        self.clock = clock
        # the process's stop (serve_grpc sets it): from its start no Pick is routed here
        self.stopping: Stopping | None = None
        self.book = book if book is not None else DecisionBook()
        # decisions reported failed, awaiting a retry's Pick (counted a miss without one)
        self.retries = RetryWindow()
        self.ejections = ejections
        self.workers = workers
        self.gate = gate
        # ids of Picks awaiting admission (in flight, though in neither book nor load yet)
        self._picking: set[str] = set()

    async def Pick(
        self, request: router_pb2.PickRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.PickResponse:
        # decisions past their time end first: their callers' slots are free for this one
        self._expire(self.clock())
        held = await self._hold(context)
        booked = False
        try:
            reply = await self._pick(request, context, held)
            booked = True  # the decision's entry in the book holds the slot now
            return reply
        finally:
            if not booked:  # refused, failed, cancelled or past its deadline
                self._release(held)

    async def _hold(self, context: grpc.aio.ServicerContext) -> object:
        """One slot of the caller's per-key limit, taken with the HTTP front door's gate (as
        an HTTP request takes it); None when the caller is not counted. A caller at its
        limit gets RESOURCE_EXHAUSTED with the retry-after trailers (HTTP: 429)."""
        caller = CALLER.get()
        if self.gate is None or caller is None:
            return None
        refused, held = self.gate.hold(caller)
        if refused is not None:
            await abort_reply(context, refused)
        return held

    def _release(self, held: object) -> None:
        if held is not None and self.gate is not None:
            self.gate.release(held)

    async def _pick(
        self, request: router_pb2.PickRequest, context: grpc.aio.ServicerContext, held: object
    ) -> router_pb2.PickResponse:
        if prompt_bytes(request) > self.state.settings.server.max_body_mb * 2**20:
            # what the HTTP front door would answer 413 (not counted as a request, there
            # either), whatever grpc_max_message_mb lets through
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, too_large(self.state).message)
        started = self.clock()
        offered: ProcessedPrompt | None = None  # its prompt, once processed (trace rows)
        body_session: str | None = None
        max_out: int | None = None  # the body's output limit (as HTTP routes with it)
        row_endpoint: str | None = None  # its trace row's (router.recorder ENDPOINTS)
        tier: object = None  # the body's service_tier (admission's class, as on HTTP)
        # the call's metadata as HTTP headers: the API key (admission's tenant and class, the
        # session's scope) and what else the HTTP endpoints read
        headers = metadata_headers(context.invocation_metadata())
        try:
            if self.stopping is not None and self.stopping.started:
                # as the HTTP side, whose listener closes when the drain begins; Reports of
                # the decisions made before are still taken, until the drain ends
                raise ShuttingDown()
            if not request.model:
                raise BadRequest("model is required")
            pinned: list[ReplicaKey] = []
            admitted: Admitted | None = None
            if request.WhichOneof("prompt") == "request_json":
                admitted, kind = await admitted_body(self.state, request)
                row_endpoint = ENDPOINT_OF_KIND.get(kind)
                prompt, body_session = admitted.prompt, admitted.session_id
                max_out = admitted.max_output_tokens
                tier = admitted.service_tier
                pinned = await pinned_holders(self.state, request, admitted)
            else:
                fn, arg, size = prompt_reader(self.state, request)
                # the HTTP endpoints' limits, and a large prompt processed off the event loop
                kind = None
                if not isinstance(arg, array.array):
                    kind = "chat" if "messages" in arg else "completion"
                    # text: sent to which endpoint, unknown
                    row_endpoint = "chat" if kind == "chat" else None
                prompt = await checked_prompt(
                    self.state, request.model, fn, arg, offload=size >= THREAD_MIN_BODY, kind=kind
                )
                if isinstance(arg, dict) and asks_prompt_logprobs(arg, kind):
                    prompt = replace(prompt, reads_cache=False)  # as the HTTP endpoints read it
            offered = prompt
            now = self.clock()
            decision_id = request.request_id or uuid.uuid4().hex
            if "\x00" in decision_id:  # the separator of scoped ids (decisions.scoped_id)
                raise BadRequest("request_id must not contain NUL")
            check_id_size(decision_id, self.state.settings.server.max_header_kb)
            owner = owner_of(CALLER.get())
            # the id this process knows it by: its caller's, so no caller can take (or learn
            # of) another's ids; the reply and the caller's Reports use ``decision_id``
            internal = scoped_id(decision_id, owner)
            # in flight here or through the HTTP endpoints (a disaggregated request's prefill
            # leg included: its decode leg takes the id): the load tracker keys both by id
            if (
                internal in self._picking
                or self.book.get(internal) is not None
                or in_flight(self.state, internal)
            ):
                raise BadRequest(f"request_id {decision_id!r} is already in flight")
            # kept as the HTTP endpoints keep it (over 128 characters: its digest; scoped by
            # the API key the call's metadata presents), so a session's turns meet whichever
            # front end they come through
            session = scoped_session(headers, session_key(request.session_id) or body_session)
            slo_gate = self.state.admission
            arrived: float | None = None  # a Pick held by admission: when it came
            pd = request.model in self.state.disagg
            tenant: str | None = None  # the tenant admission charged for it (None: none did)
            # (disaggregated models are not admission-controlled, as on HTTP; nor are a stored
            # response's follow-ups, which only its holder can serve)
            if not pinned and slo_gate is not None and slo_gate.enabled(request.model) and not pd:
                # SLO-aware admission; a shed is RESOURCE_EXHAUSTED. Class and tenant as
                # HTTP gives them: the body's service_tier capped by the key's class, the key
                klass = slo_gate.service_class(tier, headers)
                arrived = now  # timed from here, as its deadline is (HTTP's ``since``)
                tenant = slo_gate.tenant(headers)
                self._picking.add(internal)
                try:
                    routed = await slo_gate.route(
                        request.model,
                        prompt,
                        internal,
                        now,
                        klass=klass,
                        tenant=tenant,
                        session_id=session,
                        max_output_tokens=max_out,
                        size=request.ByteSize(),  # (what it keeps while held)
                        replicas=candidate_keys(self.state, request),  # judged among them only
                    )
                finally:
                    self._picking.discard(internal)
            else:
                route = functools.partial(
                    self.state.route,
                    request.model,
                    prompt,
                    # not one a request held by admission will be routed under (renamed)
                    unique_in_flight(self.state, internal),
                    now,
                    session_id=session,
                    max_output_tokens=max_out,
                )
                try:
                    routed = first_routed(
                        route, [pinned] if pinned else whole_pools(self.state, request)
                    )
                except NoReplicaAvailable as exc:
                    if not pinned or admitted is None:
                        raise
                    raise holder_unavailable(exc, admitted, pinned) from None  # as on HTTP
                if slo_gate is not None:  # judged in its class without admission too
                    routed = slo_gate.classed(routed, tier, headers)
        except KVRouterError as exc:
            rejected(self.state, request.model)  # counted as the HTTP endpoints count it
            retry_after = self.state.fleet.retry_after_s(request.model, self.clock())
            if offered is not None and refused_load(exc):  # a miss in goodput's denominator
                self.retries.take(scoped_id(request.request_id, owner_of(CALLER.get())))
                count_refused(
                    self.state, exc, request.model, offered, tier,
                    headers,
                    reply_for(exc, retry_after).status,
                )  # fmt: skip
            if self.state.recorder is not None and offered is not None and refused_load(exc):
                # offered load, recorded as the HTTP endpoints record it (its status theirs)
                record_refused(
                    self.state, request.model, offered,
                    scoped_session(headers, session_key(request.session_id) or body_session),
                    max_out, None,
                    row_endpoint, started, self.clock(), reply_for(exc, retry_after).status,
                )  # fmt: skip
            await abort_error(context, exc, retry_after)
        except asyncio.CancelledError:
            # the caller left (cancelled, or its deadline passed) before the request reached
            # a replica (held by admission, or while its prompt was processed): its one
            # outcome, on no replica, as the HTTP endpoints count it
            rejected(self.state, request.model, "cancelled")
            # a retry's client left: the request is not judged (as on HTTP)
            self.retries.take(scoped_id(request.request_id, owner_of(CALLER.get())))
            if self.state.recorder is not None and offered is not None:
                # offered load all the same, recorded as the HTTP endpoints record it
                record_refused(
                    self.state, request.model, offered,
                    scoped_session(headers, session_key(request.session_id) or body_session),
                    max_out, None,
                    row_endpoint, started, self.clock(), CLIENT_CLOSED,
                )  # fmt: skip
            raise
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            # the deadline passed while this call held the loop: the answer cannot reach the
            # caller, so no request goes to the replica and no Report will come; undo the
            # dispatch (its load, and what it guessed the replica would cache) rather than
            # keep it an hour
            self._finish(request.model, routed.request.request_id)
            self.state.withdraw(request.model, routed.dispatch)
            if tenant is not None and self.state.admission is not None:  # nor charged to it
                uncached = routed.request.prompt_tokens - routed.decision.usable_tokens
                self.state.admission.unserved(request.model, tenant, uncached)
            rejected(self.state, request.model, "cancelled")
            self.retries.take(internal)  # a retry's client left: not judged (as on HTTP)
            if self.state.recorder is not None:  # offered load, as a Pick left unrouted
                record_refused(
                    self.state, request.model, routed.prompt, session, max_out, None,
                    row_endpoint, started, self.clock(), CLIENT_CLOSED,
                )  # fmt: skip
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        record(self.state, routed)  # the per-request metrics of the HTTP endpoints
        decision = routed.decision
        endpoint = self.state.registry.endpoint(decision.replica)
        reply = router_pb2.PickResponse(
            decision_id=decision_id,
            replica=decision.replica.replica,
            dp_rank=decision.replica.dp_rank,
            endpoint=endpoint.base_url if endpoint is not None else "",
            prompt_tokens=routed.request.prompt_tokens,
            usable_hit_tokens=decision.usable_tokens,
            kv_hit_tokens=decision.kv_tokens,
            policy=decision.policy,
            score=decision.score,
            terms=dict(decision.terms),
            fallbacks=[str(k) for k in decision.ranking[:8]],
        )
        prior = self.retries.take(internal)  # a retry: its request came with the first Pick
        if prior is not None:
            arrived = prior.since if arrived is None else min(arrived, prior.since)
            if tenant is not None and self.state.admission is not None:
                # one request, charged to its tenant once (by its first Pick), as the HTTP
                # forwarder's retries of a request are
                uncached = routed.request.prompt_tokens - decision.usable_tokens
                self.state.admission.unserved(request.model, tenant, uncached)
        pending = Pending(
            # the id routed under: admission renames one whose id another request holds
            routed.request.request_id,
            request.model,
            decision.usable_tokens,
            self.clock(),  # dispatched now (after any wait in admission)
            decision.replica,
            routed.request.prompt_tokens,
            routed.ttft_factor,
            routed.service_class,
            exact=judged(routed),
            held=held,
            owner=owner,
            arrived=arrived,
            dispatch=routed.dispatch,
            sequences=routed.request.samples * routed.request.prompts,
            routed=routed if self.state.settings.server.record_path else None,
            endpoint=row_endpoint,
            tenant=tenant,
        )
        if self.ejections is not None:
            # an attempt, as the HTTP forwarder's (a replica readmitted after an ejection
            # takes one at a time until one is answered); no latency sample: the gateway's
            # own delays are in its reports
            self.ejections.sent(decision.replica, pending.token, pending.created, math.inf)
        # last: from here the book holds the caller's slot (``held``) until the decision ends
        for old in self.book.add(internal, pending):
            self._lapse(old)
        unreached = functools.partial(self._unreached, internal, pending, DELIVERY.get())
        context.add_done_callback(unreached)
        return reply

    def _unreached(
        self,
        internal: str,
        pending: Pending,
        delivery: Delivery | None,
        context: grpc.aio.ServicerContext,
    ) -> None:
        """A booked Pick's call ended without its reply written to the caller's stream
        (``delivery``, router/rpc/server.py: the caller cancelled, or its deadline passed,
        after the last check), or past its deadline (the client ends its call at the
        deadline, whatever the server sends later): the reply never reached the caller, so
        no request goes to the replica and no Report comes. The decision ends now, with what
        it guessed the replica would cache, as one past its deadline before the reply does,
        and is a row of offered load in the trace (``status`` CLIENT_CLOSED), as one whose
        caller left before it was routed."""
        remaining = context.time_remaining()
        late = remaining is not None and remaining <= 0
        unsent = delivery is not None and not delivery.sent
        if not (late or unsent or context.cancelled()) or self.book.get(internal) is not pending:
            return
        self.book.pop(internal)
        self._end(pending)
        self.state.withdraw(pending.model, pending.dispatch)
        pending.unsent(self.state.admission)  # nor charged to its tenant
        rejected(self.state, pending.model, "cancelled")
        routed = pending.routed
        if self.state.recorder is not None and routed is not None:
            record_request(
                self.state, routed.request, routed.prompt, pending.since, self.clock(), None,
                None, 0.0, None, pending.endpoint, status=CLIENT_CLOSED,
            )  # fmt: skip

    def _expire(self, now: float) -> None:
        for old in self.book.expire(now):
            self._lapse(old)
        for failed in self.retries.expire(now):
            self._missed(failed)

    def _missed(self, failed: Unanswered) -> None:
        """A decision reported failed that no retry followed: a miss of its SLO."""
        count_unanswered(
            self.state, failed.model, failed.prompt_tokens, failed.service_class, failed.status
        )

    def _lapse(self, pending: Pending) -> None:
        """A decision ended with no Report ending it: past its TTL, or evicted beyond the
        book's bound. :meth:`_end` it, and count its one outcome, ``expired`` on its replica
        (what the request did there is unknown; every Pick that books a decision counts
        one outcome, as every HTTP request does)."""
        self._end(pending)
        self.state.metrics.model(pending.model).outcome(pending.replica, "expired").inc()

    def sweep(self) -> None:
        """End the decisions past their TTL now (a Pick does it first too), so a gateway
        that stopped calling leaves neither load nor per-key slots held (router/rpc/server.py
        runs it every :data:`router.rpc.server.SWEEP_S`)."""
        self._expire(self.clock())

    def _end(self, pending: Pending) -> None:
        """A booked decision is over (reported, expired or evicted): :meth:`_finish` it and
        give its caller's slot back; an attempt never answered ends for outlier ejection
        (a probation it held is over)."""
        self._finish(pending.model, pending.request_id)
        self._release(pending.held)
        if self.ejections is not None and pending.replica is not None:
            self.ejections.dropped(pending.replica, pending.token, self.clock())

    def _finish(self, model: str, request_id: str) -> None:
        """A dispatched request is over: out of the load model and of admission's ledger."""
        self.state.load.complete(request_id)
        if self.state.admission is not None:
            self.state.admission.finished(model, request_id)

    async def Report(
        self, request: router_pb2.ReportRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ReportResponse:
        phase = request.phase
        if phase == router_pb2.ReportRequest.PHASE_UNSPECIFIED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "phase is required")
        if phase not in _PHASES:  # an open enum: a newer proto's value, or garbage
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"phase {phase} is not one of {', '.join(_PHASES.values())}",
            )
        if not request.decision_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "decision_id is required")
        cached = request.cached_tokens if request.HasField("cached_tokens") else None
        owner = owner_of(CALLER.get())
        status = request.http_status if request.HasField("http_status") else None
        if status is not None and not 100 <= status <= 599:  # no HTTP status (RFC 9110 15)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"http_status {status} is not in 100-599"
            )
        report = Reported(request.decision_id, phase, request.output_tokens, cached, owner, status)
        accepted = self.apply_report(report)
        if not accepted and self.workers is not None and self.workers.count > 1:
            accepted = await report_to_peers(self.workers, report)
        return router_pb2.ReportResponse(accepted=accepted)

    def apply_report(self, report: Reported) -> bool:
        """Apply ``report`` to a decision of this process; False when it has none by that
        id (unknown, expired, or another worker's) or the decision is not the reporting
        caller's (:func:`owner_of`: the same answer, so another caller learns nothing)."""
        phase = report.phase
        internal = scoped_id(report.decision_id, report.owner)
        pending = self.book.get(internal)
        if pending is None or pending.owner != report.owner:
            return False
        if report.cached_tokens is not None and report.cached_tokens > pending.prompt_tokens:
            # an engine reuses no more than the prompt: a count past it (a uint64 the caller
            # filled) would step the cached-token counter out of every later count's reach
            report = replace(report, cached_tokens=pending.prompt_tokens)
        now = self.clock()
        mm = self.state.metrics.model(pending.model)
        # a 4xx other than 429 is the client's error, answered correctly: no failure of the
        # replica's (as the HTTP forwarder counts it), though it took nothing of the request
        client_error = report.http_status is not None and _client_error(report.http_status)
        cancelled = phase == router_pb2.ReportRequest.CANCELLED
        if self.ejections is not None and pending.replica is not None:
            # a failure counts toward ejecting the replica; a first token or an answer ends
            # its failure run (as the HTTP forwarder's attempts do); a request its client
            # left is neither (dropped, as the forwarder drops an attempt still open)
            if cancelled:
                self.ejections.dropped(pending.replica, pending.token, now)
            elif phase in _FAILURES and not client_error:
                self.ejections.failed(pending.replica, "reported", now, pending.token)
            else:
                self.ejections.answered(pending.replica, pending.token, now)
        if phase == router_pb2.ReportRequest.FIRST_TOKEN:
            self.state.load.first_token(pending.request_id)
            if not pending.first_at:
                pending.first_at = now
                mm.ttft.observe(now - pending.since)
        elif cancelled:
            self.book.pop(internal)
            self._end(pending)
            if not pending.first_at:  # the engine aborted its prefill (RouterState.withdraw)
                self.state.withdraw(pending.model, pending.dispatch)
            mm.outcome(pending.replica, "cancelled").inc()  # no miss of its SLO: nobody waited
            if self.state.recorder is not None and pending.routed is not None:
                record_request(
                    self.state, pending.routed.request, pending.routed.prompt, pending.since,
                    now, report.output_tokens or None, None, 0.0,
                    True if pending.first_at else None, pending.endpoint, status=CLIENT_CLOSED,
                )  # fmt: skip
        else:
            self.book.pop(internal)
            self._end(pending)
            if phase == router_pb2.ReportRequest.REFUSED and not pending.first_at:
                # its replica holds nothing of it (one that gave a first token computed it)
                self.state.withdraw(pending.model, pending.dispatch)
            # the outcome and SLO metrics of the HTTP endpoints (router/service/answer_relay.py)
            ok = phase == router_pb2.ReportRequest.COMPLETED
            outcome = "ok" if ok else ("upstream_4xx" if client_error else "failed")
            mm.outcome(pending.replica, outcome).inc()
            if ok:  # without a FIRST_TOKEN: an answer not streamed, judged by its E2E
                streamed = pending.first_at > 0
                count_slo(
                    self.state,
                    pending.model,
                    pending.prompt_tokens,
                    pending.ttft_factor,
                    pending.service_class,
                    (pending.first_at if streamed else now) - pending.since,
                    now - pending.since,
                    report.output_tokens or None,
                    pending.sequences,
                    streamed,
                )
                if self.state.recorder is not None and pending.routed is not None:
                    record_answer(
                        self.state, pending.routed, pending.routed.decision.replica,
                        pending.since, now, report.output_tokens or None, report.cached_tokens,
                        pending.first_at, streamed, pending.endpoint,
                    )  # fmt: skip
            elif not client_error:  # a miss of its SLO unless a retry's Pick follows
                failed = Unanswered(
                    pending.model, pending.prompt_tokens, pending.service_class,
                    report.http_status or 502, pending.since, now,
                )  # fmt: skip
                for lost in self.retries.add(internal, failed):
                    self._missed(lost)
            if not ok and self.state.recorder is not None and pending.routed is not None:
                # no answer: offered load, with the status its client got (as on HTTP)
                record_request(
                    self.state, pending.routed.request, pending.routed.prompt, pending.since,
                    now, None, None, 0.0, True if pending.first_at else None, pending.endpoint,
                    status=report.http_status or 502,
                )  # fmt: skip
        if report.cached_tokens is not None and not pending.cached_counted:
            # once a request, as the forwarder counts its answer's usage: the first report
            # that carries them (a later one, or a retried Report, repeats the same tokens)
            pending.cached_counted = True
            mm.engine_cached_tokens.inc(report.cached_tokens)
            mm.engine_cached_prompt_tokens.inc(pending.prompt_tokens)
            if pending.exact and pending.prompt_tokens > 0 and pending.replica is not None:
                mm.prediction(pending.predicted_tokens, pending.prompt_tokens, report.cached_tokens)
        return True


_FAILURES = (router_pb2.ReportRequest.FAILED, router_pb2.ReportRequest.REFUSED)
# the phases a Report may carry (PHASE_UNSPECIFIED is "missing")
_PHASES = {
    number: name
    for name, number in router_pb2.ReportRequest.Phase.items()
    if number != router_pb2.ReportRequest.PHASE_UNSPECIFIED
}


def _client_error(status: int) -> bool:
    """A replica's answer status that is the client's error: 4xx other than 429 (busy)."""
    return 400 <= status < 500 and status != 429
