"""The front door of the public port, and the two hot endpoints.

:func:`handle` is where every request of the public port goes, whatever its path, once the
HTTP server (router.service.fast_server) has parsed it: the :class:`~router.service.
security.Gate` checks (header size; for every path but the probes, ``/metrics`` and the
admin routes the client's API key and the per-key concurrency limit) hold for every route,
then ``POST /v1/chat/completions``, ``POST /v1/completions`` and the Anthropic Messages
API's ``POST /v1/messages`` are served here (:func:`serve_completion`: body -> checks ->
prompt processing -> routing -> metrics ->
:class:`~router.service.proxy.Forwarder`), ``POST /v1/messages/count_tokens``, ``/tokenize``,
``/detokenize`` and the pooling routes are passed to a replica of the model
(router.service.pass_through), the OpenAI Responses API's ``POST /v1/responses`` is a hot
endpoint too and its ``GET /v1/responses/{id}`` / ``POST /v1/responses/{id}/cancel`` go to
the replica holding the response (router.service.stored_responses), and every other path
by the route table (router.service.routes). A check added to the gate holds for every
route; the answer goes out through a :class:`~router.service.wire.Sink`.

Errors are OpenAI-style JSON, Anthropic-style on the ``/v1/messages`` paths
(router.service.errors). A hot endpoint's body is checked and its prompt processed by
router.service.intake; its request id and session are read by
router.service.request_identity.
"""

from __future__ import annotations

import asyncio

from router.core.admission import takes_engine_priority
from router.core.errors import KVRouterError, NoReplicaAvailable
from router.core.types import ReplicaKey
from router.recorder import CLIENT_CLOSED, endpoint_of
from router.service import disagg, pass_through, pd_serve, stored_responses
from router.service.answer_book import record_refused
from router.service.body_memo import Admitted
from router.service.errors import (
    ErrorReply,
    UnknownResponse,
    messages_path,
    refused_load,
    reply_for,
    response_not_found_body,
)
from router.service.gate import Gate
from router.service.http_types import HttpRequest
from router.service.intake import admit, body_model, default_if_unnamed, parse_body
from router.service.metrics import prompt_tier
from router.service.proxy import Carried, Forwarder
from router.service.request_identity import request_id_of, session_of, unique_in_flight
from router.service.routes import Routes
from router.service.slo_metric import count_refused
from router.service.state import Routed, RouterState
from router.service.stream_usage import with_patch
from router.service.wire import Sink, send_error

CHAT_PATH = b"/v1/chat/completions"
COMPLETIONS_PATH = b"/v1/completions"
MESSAGES_PATH = pass_through.MESSAGES_PATH
RESPONSES_PATH = pass_through.RESPONSES_PATH
KINDS = {
    CHAT_PATH: "chat",
    COMPLETIONS_PATH: "completion",
    MESSAGES_PATH: "messages",
    RESPONSES_PATH: "responses",
}


def too_large(state: RouterState) -> ErrorReply:
    return ErrorReply(
        413,
        f"request body exceeds the {state.settings.server.max_body_mb:g} MB limit "
        "(server.max_body_mb)",
        "request_too_large",
    )


def record(state: RouterState, routed: Routed) -> None:
    """Per-request metrics of a routed request."""
    m = state.metrics
    prompt = routed.prompt
    m.phase_tokenize.observe(prompt.tokenize_s)
    m.phase_hash.observe(prompt.hash_s)
    m.phase_lookup.observe(routed.lookup_s)
    m.phase_score.observe(routed.score_s)
    mm = m.model(routed.request.model)
    tokens = routed.request.prompt_tokens
    mm.prompt_tokens.inc(tokens)
    mm.prompt_tokens_hist.observe(tokens)
    mm.predicted_hit_tokens.inc(routed.decision.usable_tokens)
    sent, predicted = mm.replica(routed.decision.replica)
    sent.inc(tokens)
    predicted.inc(routed.decision.usable_tokens)
    mm.predicted_hit_ratio.observe(routed.decision.usable_tokens / tokens)
    d = routed.decision
    t_prompt, t_usable, t_kv, t_loss, t_best = mm.tiers[prompt_tier(tokens)]
    t_prompt.inc(tokens)
    t_usable.inc(d.usable_tokens)
    t_kv.inc(d.kv_tokens)
    t_loss.inc(max(0, d.kv_tokens - d.usable_tokens))
    t_best.inc(max(routed.best_usable_tokens, d.usable_tokens))
    if not prompt.exact:
        mm.approximate.inc()
    if prompt.reused_tokens:
        mm.prompt_cache_reused.inc(prompt.reused_tokens)


def rejected(state: RouterState, raw_model: object, outcome: str = "rejected") -> None:
    """Count a request that ended before any replica took it (``outcome``: ``rejected``,
    or ``cancelled``), labelled by model only for configured models: request bodies must
    not be able to create label values."""
    if isinstance(raw_model, str) and raw_model in state.processors:
        state.metrics.model(raw_model).outcome(None, outcome).inc()
    else:
        state.metrics.requests.labels("", "", outcome).inc()


async def send_reply(sink: Sink, reply: ErrorReply, anthropic: bool = False) -> None:
    """Answer ``reply`` (``anthropic``: in the Messages API's error shape)."""
    await send_error(
        sink,
        reply.status,
        reply.message,
        code=reply.code,
        param=reply.param,
        headers=[(k.encode(), v.encode()) for k, v in reply.headers],
        anthropic=anthropic,
    )


class FrontDoor:
    """What :func:`handle` answers with: the routing state, the forwarder, the gate and the
    routes of the other paths."""

    __slots__ = ("forwarder", "gate", "routes", "state")

    def __init__(
        self, state: RouterState, forwarder: Forwarder, gate: Gate, routes: Routes
    ) -> None:
        self.state = state
        self.forwarder = forwarder
        self.gate = gate
        self.routes = routes


async def handle(door: FrontDoor, req: HttpRequest, sink: Sink) -> None:
    """Answer one request of the public port (see the module docstring). An exception that
    escapes is a bug: the server logs it and answers 500, or aborts the connection when the
    answer had begun."""
    path = req.path
    # the Messages API's paths answer the router's own errors in its shape
    shaped = messages_path(path)
    refused, ident = door.gate.admit(path, req.headers, req.header_bytes, req.peer)
    if refused is not None:
        await send_reply(sink, refused, shaped)
        return
    try:
        if req.too_large:
            await send_reply(sink, too_large(door.state), shaped)
        elif req.method == b"POST" and path in KINDS:
            await serve_completion(
                door.state, door.forwarder, sink, path, req.body, req.headers, req.target
            )
        elif req.method == b"POST" and path in pass_through.PATHS:
            await serve_pass_through(door.state, door.forwarder, sink, req)
        elif path.startswith(stored_responses.PREFIX) and stored_responses.response_id(req):
            rid = request_id_of(req.headers)
            await stored_responses.serve(door.state, door.forwarder, sink, req, rid)
        else:
            reply = await door.routes.answer(req)
            await sink.respond(reply.status, list(reply.headers), reply.body)
    finally:
        if ident is not None:
            door.gate.release(ident)


async def serve_pass_through(
    state: RouterState, forwarder: Forwarder, sink: Sink, req: HttpRequest
) -> None:
    """A ``POST`` of router.service.pass_through ``PATHS``: the body checked as a hot
    endpoint's (JSON object, a model the router routes, the one model when it names none),
    then passed to a healthy replica of the model as sent."""
    shaped = pass_through.PATHS[req.path]
    try:
        parsed = parse_body(req.body)
        # only its model: vLLM's models of these bodies have no stream or output limit; the
        # Messages API's (count_tokens: Anthropic-shaped) requires one, as its hot endpoint
        default = None if shaped else default_if_unnamed(state, parsed)
        model = body_model(parsed, default)
        state.processor(model)  # a model the router does not route: 404
    except KVRouterError as exc:
        await send_reply(sink, reply_for(exc, state.settings.server.retry_after_s), shaped)
        return
    rid = request_id_of(req.headers)
    await pass_through.pass_through(
        state, forwarder, sink, model, req.target, req.headers, req.body, rid, anthropic=shaped
    )


def holder_keys(state: RouterState, admitted: Admitted) -> list[ReplicaKey]:
    """The keys of the body's model on the engine holding the stored response a Responses
    body continues (router/service/response_ids.py; :func:`serve_completion` has looked it
    up in the other processes first when this one did not know it); empty when nobody knows
    it. vLLM keeps the response in the API server that made it, by id alone: a follow-up
    naming another model that server serves (a LoRA adapter of the response's model, an
    entry of its own on the same URL) continues it there, so the holder is its URL."""
    if admitted.previous_response is None:
        return []
    holder = state.response_ids.get(admitted.previous_response)
    if holder is None:
        return []
    registry = state.registry
    held = registry.find(holder.replica)
    serving = registry.keys_for(admitted.model)
    if holder.model == admitted.model:
        return [k for k in held if k in serving]
    urls = {ep.base_url for k in held if (ep := registry.endpoint(k)) is not None}
    return [k for k in serving if (ep := registry.endpoint(k)) is not None and ep.base_url in urls]


def route_pinned(
    state: RouterState,
    forwarder: Forwarder,
    admitted: Admitted,
    client_headers: list[tuple[bytes, bytes]],
    keys: list[ReplicaKey],
) -> Routed:
    """Route to the replica holding the previous response (``keys``: its ranks). When none
    of them can take it now (unhealthy, draining, over its busy threshold) the request is
    refused as one no replica can take (503, or 429 when busy, with ``Retry-After``; gRPC
    Pick's UNAVAILABLE likewise), naming the holder: any other replica could only answer
    that the response does not exist."""
    try:
        return state.route(
            admitted.model,
            admitted.prompt,
            unique_in_flight(state, request_id_of(client_headers)),
            forwarder.event_loop().time(),
            session_id=session_of(client_headers, admitted.session_id),
            max_output_tokens=admitted.max_output_tokens,
            replicas=keys,
        )
    except NoReplicaAvailable as exc:
        raise holder_unavailable(exc, admitted, keys) from None


def holder_unavailable(
    exc: NoReplicaAvailable, admitted: Admitted, keys: list[ReplicaKey]
) -> NoReplicaAvailable:
    """``exc`` of a request routed to the holder of its stored response (``keys``), naming
    the holder: what :func:`route_pinned` and gRPC Pick raise."""
    return NoReplicaAvailable(
        f"replica {keys[0].replica!r}, the only one holding response "
        f"{admitted.previous_response!r}, cannot take requests now: {exc}",
        busy=exc.busy,
    )


async def serve_completion(
    state: RouterState,
    forwarder: Forwarder,
    sink: Sink,
    path: bytes,
    raw: bytes,
    client_headers: list[tuple[bytes, bytes]],
    target: bytes | None = None,
) -> None:
    """Serve one ``POST`` of a hot endpoint (``path`` is a key of :data:`KINDS`); the
    replica gets ``target`` (the path with the client's query string, as sent; default
    ``path``), so a query parameter reaches the engine as it would without the router.

    A body seen before byte for byte takes its admission from the memo
    (router/service/body_memo.py): only routing, which depends on live state, runs again."""
    kind = KINDS[path]
    shaped = kind == "messages"  # errors in the Messages API's shape
    # whose stored responses a Responses body may name, and whose its answer's is
    owner = stored_responses.owner_of(state, client_headers) if kind == "responses" else ""
    upstream_path = target or path
    model: object = None
    started = forwarder.event_loop().time()
    admitted: Admitted | None = None
    try:
        admitted = state.body_memo.get(kind, raw)
        if admitted is None:
            body = parse_body(raw)
            model = body.get("model")
            admitted = await admit(state, body, len(raw), kind)
            # (a body naming no model is for the model routed now: not memoised)
            if not admitted.prompt.provisional and model == admitted.model:
                state.body_memo.put(kind, raw, admitted)
        else:
            model = admitted.model
            state.processor(admitted.model)  # the model may have lost its replicas since: 404
        slo_gate = state.admission
        pd = state.disagg.get(admitted.model) if state.disagg else None
        # a disaggregated model's bodies never carry a client's kv_transfer_params
        no_transfer = pd is not None
        routed: Routed | disagg.PdFlow
        pinned: list[ReplicaKey] = []
        arrived: float | None = None  # a request held by admission: when it came
        priority = b""  # the engine's priority for its class (Admission.priority_patch)
        if admitted.previous_response is not None:
            # a response another worker or pod recorded: asked there (only when not known
            # here); nothing of this for the requests naming none
            holder = await state.response_share.find(admitted.previous_response)
            if holder is not None and stored_responses.held_for(holder, owner) is None:
                # another key's: its holder would continue that key's conversation
                raise UnknownResponse(admitted.previous_response)
            pinned = holder_keys(state, admitted)
        if pinned:  # a stored response's follow-up: only its replica holds the response
            pd = slo_gate = None
            routed = route_pinned(state, forwarder, admitted, client_headers, pinned)
        elif pd is not None:  # prefilled on one replica, decoded on another (service/disagg.py)
            routed = disagg.route(
                state,
                pd,
                admitted.model,
                admitted.prompt,
                # checked here, after any await: another request may have taken the id
                unique_in_flight(state, request_id_of(client_headers)),
                forwarder.event_loop().time(),
                session_id=session_of(client_headers, admitted.session_id),
                max_output_tokens=admitted.max_output_tokens,
                keep_local=admitted.keep_local,
            )
            slo_gate = None  # disaggregated flows are not admission-controlled (docs/admission.md)
        elif slo_gate is not None and slo_gate.enabled(admitted.model):  # SLO-aware admission
            loop = forwarder.event_loop()
            # timed from here, as its deadline is: a hold counts toward its TTFT
            arrived = loop.time()
            routed = await slo_gate.route_admitted(admitted, client_headers, loop.time, len(raw))
            if takes_engine_priority(kind):
                priority = slo_gate.priority_patch(admitted, client_headers)
        else:
            routed = state.route(
                admitted.model,
                admitted.prompt,
                # checked here, after any await: another request may have taken the id
                unique_in_flight(state, request_id_of(client_headers)),
                forwarder.event_loop().time(),
                session_id=session_of(client_headers, admitted.session_id),
                max_output_tokens=admitted.max_output_tokens,
            )
            slo_gate = None
        if arrived is None and state.admission is not None:
            # judged in its class without admission too (Admission.classed)
            if isinstance(routed, disagg.PdFlow):
                leg = state.admission.classed(routed.routed, admitted.service_tier, client_headers)
                routed = routed._replace(routed=leg)
            else:
                routed = state.admission.classed(routed, admitted.service_tier, client_headers)
    except UnknownResponse as exc:
        rejected(state, model)
        await sink.respond(404, [stored_responses.JSON], response_not_found_body(exc.response_id))
        return
    except KVRouterError as exc:
        rejected(state, model)
        now = forwarder.event_loop().time()
        retry_after = state.fleet.retry_after_s(model if isinstance(model, str) else "", now)
        reply = reply_for(exc, retry_after)
        if admitted is not None and refused_load(exc):  # a miss in goodput's denominator
            count_refused(
                state, exc, admitted.model, admitted.prompt, admitted.service_tier,
                client_headers, reply.status,
            )  # fmt: skip
        if state.recorder is not None and admitted is not None and refused_load(exc):
            record_refused(
                state, admitted.model, admitted.prompt,
                session_of(client_headers, admitted.session_id), admitted.max_output_tokens,
                admitted.stream, endpoint_of(path), started, now, reply.status,
            )  # fmt: skip
        await send_reply(sink, reply, shaped)
        return
    except asyncio.CancelledError:
        # the client left before the request reached a replica (held by admission, or
        # while its prompt was processed): its one outcome, on no replica
        rejected(state, model, "cancelled")
        if state.recorder is not None and admitted is not None:  # offered load all the same
            record_refused(
                state, admitted.model, admitted.prompt,
                session_of(client_headers, admitted.session_id), admitted.max_output_tokens,
                admitted.stream, endpoint_of(path), started, forwarder.event_loop().time(),
                CLIENT_CLOSED,
            )  # fmt: skip
        raise
    if no_transfer:
        raw = with_patch(raw, pd_serve.NO_TRANSFER)
    if priority:
        raw = with_patch(raw, priority)
    if isinstance(routed, disagg.PdFlow):
        record(state, routed.routed)
        sent = raw if admitted.usage_patch is None else with_patch(raw, admitted.usage_patch)
        strip = admitted.usage_patch is not None
        await pd_serve.serve(
            state,
            forwarder,
            sink,
            routed,
            upstream_path,
            client_headers,
            sent,
            stream=admitted.stream,
            strip_usage=strip,
            prefill_caps=admitted.prefill_caps,
        )
        return
    record(state, routed)
    patch = admitted.usage_patch
    carried = Carried()  # whether a replica got the body (admission's charge stands)
    try:
        if patch is None:
            await forwarder.forward(
                sink,
                upstream_path,
                client_headers,
                raw,
                routed,
                stream=admitted.stream,
                anthropic=shaped,
                record_ids=owner if admitted.stores else None,
                since=arrived,
                carried=carried,
            )
        else:  # the engine reports usage; the client gets the stream it asked for
            patched = with_patch(raw, patch)
            await forwarder.forward(
                sink,
                upstream_path,
                client_headers,
                patched,
                routed,
                stream=admitted.stream,
                strip_usage=True,
                since=arrived,
                carried=carried,
            )
    finally:
        if slo_gate is not None:
            if not carried.sent:  # no replica got any of it (refused, or the client left
                # first): nor is its tenant charged for it
                uncached = routed.request.prompt_tokens - routed.decision.usable_tokens
                slo_gate.unserved(admitted.model, slo_gate.tenant(client_headers), uncached)
            slo_gate.finished(admitted.model, routed.request.request_id)
