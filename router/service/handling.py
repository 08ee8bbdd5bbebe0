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

The router validates only what it needs (model, messages / prompt, stream flag, a few
types); the body is forwarded untouched. Errors are OpenAI-style JSON, Anthropic-style on
the ``/v1/messages`` paths (router.service.errors).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar, cast

import xxhash

from router import jsonload
from router.core.admission import parse_service_tier
from router.core.errors import BadRequest, KVRouterError, NoReplicaAvailable
from router.core.types import ReplicaKey
from router.service import disagg, pass_through, stored_responses
from router.service.body_memo import Admitted
from router.service.errors import ErrorReply, messages_path, reply_for
from router.service.gate import Gate
from router.service.http_types import HttpRequest
from router.service.metrics import prompt_tier
from router.service.proxy import Forwarder
from router.service.routes import Routes
from router.service.security import check_prompt_tokens
from router.service.state import BODY_MEMO_MAX_BYTES, Routed, RouterState
from router.service.stream_usage import usage_patch, with_patch
from router.service.wire import Sink, send_error
from router.tokenize.anthropic import messages_prompt
from router.tokenize.anthropic import session_of as anthropic_session
from router.tokenize.keying import ProcessedPrompt
from router.tokenize.lax import INVALID, lax_bool, lax_int
from router.tokenize.request_fields import asks_prompt_logprobs, sampled_sequences
from router.tokenize.responses import previous_response, responses_prompt, stores

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

# Bodies this large or larger are tokenized on a worker thread, off the event loop.
THREAD_MIN_BODY = BODY_MEMO_MAX_BYTES

_A = TypeVar("_A")


def too_large(state: RouterState) -> ErrorReply:
    return ErrorReply(
        413,
        f"request body exceeds the {state.settings.server.max_body_mb:g} MB limit "
        "(server.max_body_mb)",
        "request_too_large",
    )


def json_value(raw: bytes | str, what: str) -> Any:
    """The JSON value of ``raw`` (router/jsonload.py); BadRequest naming ``what`` when it is
    not valid JSON or is nested deeper than the parser recurses. The one parse of client
    JSON for every front end (a request body here, gRPC Pick's JSON fields)."""
    try:
        return jsonload.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest(f"{what} is nested too deeply") from None


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object (:func:`json_value`)."""
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    body = json_value(raw, "request body")
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def field_types(
    body: dict[str, Any], default_model: str | None = None, kind: str = "chat"
) -> tuple[str, bool]:
    """The request's model and stream flag, read as vLLM reads them (router.service.lax):
    a missing or empty ``model`` is the one model served (vLLM's served model; the router's
    ``default_model``, when it routes exactly one); ``"stream": "yes"`` is a stream. Its
    output limits are checked too: a completion (``kind``) has no ``max_completion_tokens``
    (vLLM ignores the field)."""
    model = body.get("model")
    if model is None or model == "":
        if default_model is None:
            raise BadRequest("'model' is a required property")
        model = default_model
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    stream = lax_bool(body.get("stream", False))
    if stream is INVALID:
        raise BadRequest("'stream' must be a boolean")
    for key in ("max_tokens",) if kind == "completion" else ("max_tokens", "max_completion_tokens"):
        v = lax_int(body.get(key))
        if v is INVALID or (v is not None and v < 0):
            raise BadRequest(f"'{key}' must be a non-negative integer")
    return model, bool(stream)


MAX_OUTPUT_TOKENS = 1 << 53
"""The most output tokens the router's load and cost models count for one request: beyond
any context length, and exact as a float. A larger limit (JSON integers have no bound; the
engine refuses it or stops at its context) is counted as this many: the models multiply it
with floats, which an integer past about 1e308 cannot become."""


COMPLETION_MAX_TOKENS = 16
"""vLLM's ``max_tokens`` of a completion whose body leaves it out: its request model's
default (vLLM 0.34 ``CompletionRequest``). An explicit null stays None there: no limit but
the context (``get_max_tokens``)."""


def max_output_tokens(body: dict[str, Any], kind: str = "chat") -> int | None:
    """``max_completion_tokens`` when not null, else ``max_tokens`` (as :func:`field_types`
    checked them), as vLLM's chat reads them; a completion's ``max_tokens``,
    ``COMPLETION_MAX_TOKENS`` when absent, None (unknown) when null (vLLM's completions have
    no ``max_completion_tokens``); for
    the Responses API (``kind`` ``responses``) its ``max_output_tokens``, checked here; at
    most ``MAX_OUTPUT_TOKENS`` (the body goes on as it came)."""
    if kind == "responses":
        found = lax_int(body.get("max_output_tokens"))
        if found is INVALID or (found is not None and found < 0):
            raise BadRequest("'max_output_tokens' must be a non-negative integer")
    elif kind == "completion":
        found = lax_int(body.get("max_tokens", COMPLETION_MAX_TOKENS))
    else:
        found = lax_int(body.get("max_completion_tokens"))
        if found is None:
            found = lax_int(body.get("max_tokens"))
    return min(found, MAX_OUTPUT_TOKENS) if type(found) is int else None


def default_model(state: RouterState) -> str | None:
    """The model a request naming none is for: the one model the router routes (vLLM serves
    one model and takes a request without ``model`` as one for it), None with several."""
    found = None
    for name in state.processors:
        if state.registry.keys_for(name):
            if found is not None:
                return None
            found = name
    return found


def _default_if_unnamed(state: RouterState, body: dict[str, Any]) -> str | None:
    """:func:`default_model`, looked up only for a body naming no model."""
    named = body.get("model")
    return default_model(state) if named is None or named == "" else None


class _RandomIds:
    """Fresh 32-hex-digit request ids from the OS's random bytes, drawn 4 KiB at a time.

    Unpredictable (ids are echoed to clients, and one client must not be able to guess
    another's), with one ``os.urandom`` system call per 256 ids rather than one per request.
    A forked worker starts with a fresh buffer, so workers never repeat each other's ids."""

    __slots__ = ("_buf", "_pos")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._buf = b""
        self._pos = 0

    def next(self) -> str:
        pos = self._pos
        if pos + 16 > len(self._buf):
            self._buf, pos = os.urandom(4096), 0
        self._pos = pos + 16
        return self._buf[pos : pos + 16].hex()


_ids = _RandomIds()
os.register_at_fork(after_in_child=_ids.reset)


def request_id_of(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The client's ``X-Request-Id``, else a fresh 32-hex-digit id. Decoded as latin-1, byte
    for byte: the replica and the client get the id back as ``.encode("latin-1")``."""
    for k, v in headers:
        if len(k) == 12 and k.lower() == b"x-request-id" and v:
            return v.decode("latin-1")
    return _ids.next()


_MAX_SESSION_ID = 128


def session_key(value: object) -> str | None:
    """A session id as the router keeps it: a non-empty string, at most 128 characters
    (longer ones are replaced by their 64-bit digest, so a client cannot grow the session
    table's memory with its ids); None for anything else."""
    if not isinstance(value, str) or not value:
        return None
    if len(value) > _MAX_SESSION_ID:
        return "xxh3:" + xxhash.xxh3_64_hexdigest(value.encode("utf-8", "surrogatepass"))
    return value


def session_of(headers: Iterable[tuple[bytes, bytes]], body_session: str | None) -> str | None:
    """The request's session: the ``X-Session-Id`` header (vllm-router's), else what the body
    named (``metadata.session_id``, else ``user``; see :func:`admit`)."""
    for k, v in headers:
        if len(k) == 12 and k.lower() == b"x-session-id" and v:
            return session_key(v.decode("latin-1"))
    return body_session


def body_session(body: dict[str, Any]) -> str | None:
    """``session_id`` (vLLM's request field), else ``metadata.session_id`` (OpenAI's
    free-form request metadata), else ``user``."""
    found = session_key(body.get("session_id"))
    if found is not None:
        return found
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        found = session_key(metadata.get("session_id"))
        if found is not None:
            return found
    return session_key(body.get("user"))


def unique_in_flight(state: RouterState, request_id: str) -> str:
    """``request_id``, made unique among this process's requests in flight: the load tracker
    keys requests by id, so a client re-sending an id that is still in flight (a retry that
    did not wait, or two clients with the same id) gets ``<id>-<8 hex digits>`` instead of
    taking over the other request's accounting. The replica sees that id too. A disaggregated
    request's prefill leg is in flight as ``<id>#p`` (router/service/disagg.py) and its
    replica gets ``<id>``: that counts too (:func:`in_flight`), as does an id admission
    holds or has not released yet (router/service/admission.py ``taken``), and so does a
    request ``<id>#p`` in its prefill leg (``<id>#p#p``): its decode leg will be ``<id>#p``,
    this request's own prefill leg, and the load tracker keeps one record per id. Call it
    right before routing (no ``await`` in between)."""
    if (
        in_flight(state, request_id)
        or state.load.replica_of(request_id + "#p#p") is not None
        or (state.admission is not None and state.admission.taken(request_id))
    ):
        request_id = f"{request_id}-{_ids.next()[:8]}"
    return request_id


def in_flight(state: RouterState, request_id: str) -> bool:
    """Whether ``request_id`` is in flight in this process's load tracker: as a request, or
    as a disaggregated request's prefill leg (``<id>#p``, whose decode leg is ``<id>``)."""
    load = state.load
    return load.replica_of(request_id) is not None or load.replica_of(request_id + "#p") is not None


async def admit(state: RouterState, body: dict[str, Any], size: int, kind: str) -> Admitted:
    """Check and process the prompt of a parsed body (``size`` bytes raw) of ``kind``
    (``chat``, ``completion``, ``messages``: an Anthropic Messages API body, whose prompt is
    its chat conversion, router.tokenize.anthropic; ``responses``: an OpenAI Responses API
    body, likewise, router.tokenize.responses): everything before routing, a pure
    function of the body and the settings (what the body memo keeps); raises KVRouterError
    for a bad request."""
    model, stream = field_types(body, _default_if_unnamed(state, body), kind)
    processor = state.processor(model)
    messages = kind == "messages"
    responses = kind == "responses"
    fn: Callable[[dict[str, Any]], ProcessedPrompt]
    if messages:
        fn = partial(messages_prompt, processor)
    elif responses:
        fn = partial(responses_prompt, processor)
    else:
        fn = processor.chat if kind == "chat" else processor.completion
    offload = size >= THREAD_MIN_BODY and not _token_ids(body)
    prompt = await checked_prompt(state, model, fn, body, offload=offload, kind=kind)
    max_out = max_output_tokens(body, kind)
    # the Messages API's service_tier ("standard_only") is Anthropic's, which vLLM ignores
    # (the Responses API's "scale" tier is OpenAI's, which vLLM ignores too)
    tier = body.get("service_tier")
    if messages or (responses and tier == "scale"):
        tier = None
    parse_service_tier(tier)  # a bad value is a 400, admission on or off
    if asks_prompt_logprobs(body, kind):
        prompt = replace(prompt, reads_cache=False)
    samples = sampled_sequences(body, kind)
    if samples > 1:
        prompt = replace(prompt, samples=samples)
    session = body_session(body)
    if messages and session is None:
        session = session_key(anthropic_session(body))
    return Admitted(
        model,
        prompt,
        session,
        max_out,
        # the engine reports usage on every Messages API stream (vLLM asks its chat
        # stream for it) and in every Responses API stream's final event: nothing to add,
        # and the body reaches the replica as sent
        None if messages or responses else usage_patch(body),
        tier,
        stream=stream,
        keep_local=disagg.keep_local(body, kind),
        prefill_caps=disagg.prefill_caps(body),
        previous_response=previous_response(body) if responses else None,
        stores=responses and stores(body),
    )


async def checked_prompt(
    state: RouterState,
    model: str,
    fn: Callable[[_A], ProcessedPrompt],
    arg: _A,
    *,
    offload: bool,
    kind: str | None = None,
) -> ProcessedPrompt:
    """``fn(arg)``, the processed prompt, within the limits of every front end (the model's
    context length, ``server.max_prompt_tokens``); ``offload``: processed on a worker
    thread, off the event loop (large prompts: the loop serves every other request
    meanwhile). The HTTP endpoints (:func:`admit`) and gRPC Pick both call it.

    ``kind`` ("chat" / "completion" / "messages": ``arg`` is such a request body): for a
    model rendered
    by the engine (router/service/render.py) the engine's render comes first; ``fn(arg)``
    stands in, marked provisional, when no engine answered.

    A body the parser took but nested too deeply to process (a chat template recursing
    through 1,000 nested arrays) is a BadRequest, as one too deep to parse is
    (:func:`json_value`), not an unexpected error."""
    try:
        return await _processed(state, model, fn, arg, offload=offload, kind=kind)
    except RecursionError:
        raise BadRequest("request is nested too deeply to process") from None


async def _processed(
    state: RouterState,
    model: str,
    fn: Callable[[_A], ProcessedPrompt],
    arg: _A,
    *,
    offload: bool,
    kind: str | None,
) -> ProcessedPrompt:
    """:func:`checked_prompt` but for its RecursionError."""
    renderer = state.renderer
    rendered = kind is not None and renderer is not None and renderer.serves(model)
    t0 = time.perf_counter() if rendered else 0.0
    if rendered:
        from_engine = await renderer.prompt(
            model, kind, arg, state.processor(model), offload=offload
        )
        if from_engine is not None:
            return _checked(state, model, from_engine)
    try:
        if offload:
            prompt = await asyncio.get_running_loop().run_in_executor(None, fn, arg)
        else:
            prompt = fn(arg)
    except BadRequest:
        if not rendered:
            raise
        # the router's own processing of a model it cannot render exactly routes the
        # request on what it gives, never refuses it (a template the router misreads)
        prompt = state.processor(model).unknown(cast(dict[str, Any], arg))
    if rendered:
        waited = time.perf_counter() - t0
        prompt = replace(prompt, exact=False, provisional=True, tokenize_s=waited)
    return _checked(state, model, prompt)


def _checked(state: RouterState, model: str, prompt: ProcessedPrompt) -> ProcessedPrompt:
    """``prompt`` within the model's context length and ``server.max_prompt_tokens``."""
    state.check_context(model, prompt)
    check_prompt_tokens(state.settings.server, prompt.prompt_tokens)
    return prompt


def _token_ids(body: dict[str, Any]) -> bool:
    """A completion whose prompt is token ids: processing it is a few array operations
    (no tokenizer that releases the GIL), so a worker thread would only add hand-offs."""
    prompt = body.get("prompt")
    return isinstance(prompt, list) and bool(prompt) and type(prompt[0]) is int


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
        model, _ = field_types(parsed, _default_if_unnamed(state, parsed))
        state.processor(model)  # a model the router does not route: 404
    except KVRouterError as exc:
        await send_reply(sink, reply_for(exc, state.settings.server.retry_after_s), shaped)
        return
    rid = request_id_of(req.headers)
    await pass_through.pass_through(
        state, forwarder, sink, model, req.target, req.headers, req.body, rid, anthropic=shaped
    )


def holder_keys(state: RouterState, admitted: Admitted) -> list[ReplicaKey]:
    """The keys of the replica holding the stored response a Responses body continues
    (router/service/response_ids.py; :func:`serve_completion` has looked it up in the other
    processes first when this one did not know it); empty when nobody knows it."""
    if admitted.previous_response is None:
        return []
    holder = state.response_ids.get(admitted.previous_response)
    if holder is None or holder.model != admitted.model:
        return []
    serving = state.registry.keys_for(admitted.model)
    return [k for k in state.registry.find(holder.replica) if k in serving]


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
    upstream_path = target or path
    model: object = None
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
            await state.response_share.find(admitted.previous_response)
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
            if not shaped:  # vLLM's Messages API takes no priority
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
    except KVRouterError as exc:
        rejected(state, model)
        now = forwarder.event_loop().time()
        retry_after = state.fleet.retry_after_s(model if isinstance(model, str) else "", now)
        await send_reply(sink, reply_for(exc, retry_after), shaped)
        return
    except asyncio.CancelledError:
        # the client left before the request reached a replica (held by admission, or
        # while its prompt was processed): its one outcome, on no replica
        rejected(state, model, "cancelled")
        raise
    if no_transfer:
        raw = with_patch(raw, disagg.NO_TRANSFER)
    if priority:
        raw = with_patch(raw, priority)
    if isinstance(routed, disagg.PdFlow):
        record(state, routed.routed)
        sent = raw if admitted.usage_patch is None else with_patch(raw, admitted.usage_patch)
        strip = admitted.usage_patch is not None
        await disagg.serve(
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
                record_ids=admitted.stores,
                since=arrived,
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
            )
    finally:
        if slo_gate is not None:
            slo_gate.finished(admitted.model, routed.request.request_id)
