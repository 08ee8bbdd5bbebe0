"""Serving a disaggregated request with vLLM's protocol (docs/pd.md).

Every body of a disaggregated model goes upstream with :data:`NO_TRANSFER` appended
(router/service/handling.py). A request ``disagg.route`` planned as a ``PdFlow`` is served
by :func:`serve` (:func:`prefill_caps`, read from the parsed body at intake, says what its
prefill leg caps):

1. the prefill replica gets the client's body with ``stream: false``, ``max_tokens: 1``
   (``max_completion_tokens: 1`` too when the client used it, ``min_tokens: 0`` when it set
   that: the decode leg keeps the client's), no ``stream_options`` and
   ``kv_transfer_params: {do_remote_decode: true, do_remote_prefill: false, remote_*: null}``
   (members appended to the JSON object: parsers keep the last of repeated keys);
2. its answer's ``kv_transfer_params`` go on the client's original body, sent to the decode
   replica picked then (``Disaggregator.pick_decode``: load, the link from the prefill
   replica, its rack); the decode replica's answer (streamed if the client asked) is the one
   OpenAI response the client gets, through the usual ``Forwarder``.

Failures: a prefill that cannot be sent, fails, or answers without ``kv_transfer_params``
falls back to a local prefill on the decode replica (the original body, no transfer
params; recorded there as a local request: load, speculative entries, the session's hint;
a prefill replica that refused the leg or answered an error has its guesses withdrawn);
the decode request is retried on the next decode replica while no byte reached the
client (the Forwarder's retries over the pick's ranking), with the original body once a
decode replica got the transfer params (local prefill: vLLM frees the prefill's blocks when
the first decode replica to get them finishes with the request, pulled or not). The request
is never dropped. When no decode replica is left after the prefill answered, the client gets
the 503 / 429 and the prefill's blocks are handed back at once (router/service/pd_release.py)
rather than left to vLLM's KV lease; so are they when the transfer params reached no decode
replica (the client left before the decode leg was written, or every decode replica refused
its connection). A decode replica that got them hands them back itself if its request is
aborted (vLLM's connector ``request_finished``), so the router then sends no release."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

from aiohttp import web

from router.core.disagg import DecodePick
from router.core.errors import KVRouterError
from router.core.types import ReplicaKey, RouteRequest
from router.recorder import endpoint_of
from router.service import pd_release
from router.service.disagg import ModelDisagg, PdFlow
from router.service.errors import refused_load, reply_for
from router.service.keys import STATE
from router.service.proxy import Carried, Forwarder
from router.service.replica_url import ReplicaUrl
from router.service.retry import retry_after_s
from router.service.state import Routed, RouterState
from router.service.stream_usage import with_patch
from router.service.upstream import Exchange
from router.service.upstream_errors import (
    ConnectFailed,
    TotalTimeout,
    UpstreamError,
    UpstreamTimeout,
)
from router.service.wire import Sink, request_head, send_error

REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
NO_TRANSFER = b',"kv_transfer_params":null'
"""Appended to every body of a disaggregated model: the router speaks the protocol, so a
client's own ``kv_transfer_params`` (a decode leg naming any host and blocks) never reach a
replica; the legs append theirs after it (the last of repeated keys wins)."""
_PREFILL_PATCH = (
    b',"stream":false,"stream_options":null,"max_tokens":1,"kv_transfer_params":'
    + json.dumps(REMOTE_DECODE, separators=(",", ":")).encode()
)


def prefill_caps(body: dict[str, Any]) -> bytes:
    """What the prefill leg appends beyond ``max_tokens: 1``, from the parsed body (a key
    spelled with JSON escapes is the same key): ``max_completion_tokens: 1`` when the client
    set it (it wins over ``max_tokens`` in vLLM), ``min_tokens: 0`` when it set that (vLLM
    refuses ``min_tokens`` above ``max_tokens``; the toy proxy drops it)."""
    caps = b""
    if "max_completion_tokens" in body:
        caps += b',"max_completion_tokens":1'
    if "min_tokens" in body:
        caps += b',"min_tokens":0'
    return caps


async def _prefill(
    state: RouterState,
    forwarder: Forwarder,
    flow: PdFlow,
    path: bytes,
    client_headers: list[tuple[bytes, bytes]],
    body: bytes,
    caps: bytes,
    ends_by: float,
) -> tuple[dict[str, Any] | None, str]:
    """Run the prefill leg: (the answer's ``kv_transfer_params``, '') or (None, cause). The
    leg is an upstream attempt as the forwarder's are: its answer must come by the
    first-byte deadline of its predicted prefill (``Forwarder.deadline``; a hung replica
    costs the request that, not ``first_byte_timeout_s``), never past the request's
    deadline ``ends_by`` (:data:`OUT_OF_TIME` when that is what ended it: no failure of the
    replica's), and its outcome feeds outlier ejection (:func:`_eject_on`), latency sweeps
    and probation included."""
    key = flow.routed.decision.replica
    ep = state.registry.endpoint(key)
    rid = flow.routed.request.request_id
    if ep is None:
        return None, "gone"
    prefill_body = with_patch(body, _PREFILL_PATCH + caps)
    head = request_head(
        path,
        ReplicaUrl.parse(ep.base_url).netloc.encode(),
        client_headers,
        # the client's request id on both legs, as vLLM's toy proxy does (older NIXL
        # connectors pair the legs by it); the load tracker keeps the leg as ``<id>#p``
        flow.request.request_id.encode("latin-1"),
        ep.dp_rank,
        len(prefill_body),
    )
    loop = forwarder.event_loop()
    ejections = forwarder.ejections
    now = loop.time()
    expect = forwarder.expected_first_byte(
        key, now, flow.request.prompt_tokens, flow.routed.decision.usable_tokens, False, 1
    )  # (one token: what the leg decodes)
    at = min(now + forwarder.deadline(expect), ends_by)
    token = asyncio.timeout_at(at)
    ejections.sent(key, token, now, expect)
    upstream: Exchange | None = None
    try:
        async with token:
            upstream = await forwarder.client.pool(ep.base_url).send(
                head, prefill_body, at - now, ends_by - now
            )
            payload = upstream.body()
            if payload is None:
                payload = await upstream.read_all()
    except ConnectFailed as exc:
        state.fleet.connect_failed(key, loop.time(), connected=exc.connected)
        return _eject_on(forwarder, key, "connect_error", token)
    except (TimeoutError, UpstreamTimeout) as exc:  # no answer by the deadline
        if upstream is not None:
            upstream.abort()
        if isinstance(exc, TotalTimeout) or token.when() == ends_by:
            # the request's time ran out, not the replica's first-byte deadline (as the
            # forwarder judges an attempt)
            ejections.dropped(key, token, loop.time())
            return None, OUT_OF_TIME
        return _eject_on(forwarder, key, "timeout", token)
    except UpstreamError:
        if upstream is None:
            return _eject_on(forwarder, key, "error", token)
        upstream.abort()
        return _eject_on(forwarder, key, "broken", token)
    except BaseException:  # the client left: the attempt is neither a success nor a failure
        if upstream is not None:
            upstream.abort()
        ejections.dropped(key, token, loop.time())
        raise
    upstream.release()
    state.load.first_token(rid)
    if upstream.status >= 400:
        cause = "http_429" if upstream.status == 429 else f"http_{upstream.status // 100}xx"
        # a 429 / 5xx with Retry-After ejects its replica that long at once, as for requests
        pause = retry_after_s(upstream.header(b"retry-after"))
        return _eject_on(forwarder, key, cause, token, pause)
    try:
        answer = json.loads(payload)
    except (ValueError, RecursionError):
        return _eject_on(forwarder, key, "bad_answer", token)
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict):
        return _eject_on(forwarder, key, "no_transfer_params", token)
    _eject_on(forwarder, key, "", token)
    return params, ""


OUT_OF_TIME = "out_of_time"
"""The prefill leg's cause when the request's deadline (``server.request_timeout_s`` from its
dispatch) ended it: the request answers 504, with no decode leg and no fallback."""


# prefill-leg causes (``_prefill``) that are the replica's failures, as outlier ejection
# counts them (router/core/outliers.py FAILURE_KINDS); the others (a 4xx, an answer without
# transfer params: a replica serving without a KV connector) say nothing of its health
_FAILURE_KIND = {
    "connect_error": "connect",
    "timeout": "timeout",
    "error": "broken",
    "broken": "broken",
    "bad_answer": "broken",  # a 200 whose body is no JSON: no engine answers so
    "http_429": "http_429",
    "http_5xx": "http_5xx",
}


# prefill-leg causes after which the prefill replica holds nothing of the prompt (it refused
# the connection or answered an error status: RouterState.withdraw); after a timeout or a
# broken answer it may have prefilled it, and an answer without transfer params was a
# prefill
_NOT_TAKEN = frozenset({"connect_error", "http_429", "http_4xx", "http_5xx"})


def _eject_on(
    forwarder: Forwarder,
    key: ReplicaKey,
    cause: str,
    token: object,
    retry_after: float | None = None,
) -> tuple[None, str]:
    """Feed a prefill leg's outcome (its attempt ``token``, ``Ejections.sent``) to outlier
    ejection as the forwarder feeds an attempt's: a replica failing every prefill leg is
    ejected like one failing requests (else every disaggregated request would fall back to
    a local prefill, unseen but for ``kvrouter_pd_prefill_fallbacks``); any answer (an
    error status but 429 / 5xx, one without transfer params; not a body that is no JSON)
    ends its failure run;
    ``retry_after``: a failed answer's ``Retry-After`` seconds. Returns (None, ``cause``)."""
    now = forwarder.event_loop().time()
    if not cause or (kind := _FAILURE_KIND.get(cause)) is None:
        forwarder.ejections.answered(key, token, now)
    else:
        forwarder.ejections.failed(key, kind, now, token, retry_after)
    return None, cause


def _pick_decode(
    state: RouterState,
    md: ModelDisagg,
    request: RouteRequest,
    prefill_key: ReplicaKey,
    cause: str,
    now: float,
) -> DecodePick:
    """The decode replica once the prefill leg ended with ``cause`` ('' when it answered
    transfer params). A leg that failed its replica (``_FAILURE_KIND``: refused, hung,
    broken, 429, 5xx) leaves that replica out of the pick when another one can decode, as
    the forwarder never retries an attempt on the replica that failed it: a ``both``
    prefill replica, which no transfer separates from itself, would otherwise take the
    local prefill it just failed. Replicas whose time out of rotation ended during the
    leg are readmitted first, as every routing step does (``RouterState.decide``): the
    housekeeping's readmission comes only once a second. Raises KVRouterError when no
    replica can take it."""
    state.fleet.restore_health(now)
    engine = state.engines[request.model]
    keys = state.registry.keys_for(request.model)
    if cause in _FAILURE_KIND:
        others = [k for k in keys if k != prefill_key]
        try:
            return md.pd.pick_decode(engine, request, prefill_key, others, now, state.rng)
        except KVRouterError:
            pass  # the failed replica is the only one left: it is tried again
    return md.pd.pick_decode(engine, request, prefill_key, keys, now, state.rng)


async def serve(
    state: RouterState,
    forwarder: Forwarder,
    sink: Sink,
    flow: PdFlow,
    path: bytes,
    client_headers: Iterable[tuple[bytes, bytes]],
    body: bytes,
    *,
    stream: bool,
    strip_usage: bool = False,
    prefill_caps: bytes = b"",
) -> None:
    """Serve a disaggregated request (module doc); ``body`` is what the client's request
    goes upstream as (the router's usage patch included); ``prefill_caps``: see
    :func:`prefill_caps`."""
    headers = list(client_headers)
    md = flow.model
    leg_id = flow.routed.request.request_id
    started = forwarder.event_loop().time()  # its TTFT includes the prefill leg
    # both legs share the request's time upstream (server.request_timeout_s)
    ends_by = started + state.settings.server.request_timeout_s
    request = flow.request
    model = request.model
    try:
        params, cause = await _prefill(
            state, forwarder, flow, path, headers, body, prefill_caps, ends_by
        )
    except asyncio.CancelledError:
        # the client left during the prefill leg: its one outcome (the decode leg, which
        # counts it otherwise, is never sent)
        state.metrics.model(model).outcome(flow.routed.decision.replica, "cancelled").inc()
        client = flow.routed._replace(request=request)  # offered load (the client's request)
        forwarder.record_cancelled(client, started, stream, endpoint_of(path))
        raise
    finally:
        state.load.complete(leg_id)
    engine = state.engines[model]
    now = forwarder.event_loop().time()
    prefill_key = flow.routed.decision.replica
    if cause == OUT_OF_TIME:  # the prefill leg spent the request's time: no decode leg
        state.metrics.model(model).outcome(prefill_key, "timeout").inc()
        client = flow.routed._replace(request=request)  # offered load (the client's request)
        forwarder.record_failed(client, started, 504, stream, endpoint_of(path))
        retry = [(b"Retry-After", str(state.settings.server.retry_after_s).encode())]
        message = f"replica {prefill_key} did not answer the prefill leg in the request's time"
        await send_error(sink, 504, message, code="timeout", headers=retry)
        return
    if cause in _NOT_TAKEN:  # the prefill replica holds nothing of the prompt: the decode
        # pick (a ``both`` replica's hit, its transfer) must not credit it with the leg
        state.withdraw(model, flow.routed.dispatch)
    try:
        pick = _pick_decode(state, md, request, prefill_key, cause, now)
    except KVRouterError as exc:  # no decode replica left: answered, counted and recorded
        state.metrics.model(model).outcome(None, "rejected").inc()
        reply = reply_for(exc, state.fleet.retry_after_s(model, now))
        if refused_load(exc):  # a miss of its SLO, and offered load (the client's request)
            client = flow.routed._replace(request=request)
            forwarder.record_failed(client, started, reply.status, stream, endpoint_of(path))
        if params is not None:  # no decode replica will pull the prefill's blocks: freed
            # (before the answer is written: a client leaving during it cancels the rest)
            _start_release(state, forwarder, md, request, prefill_key, headers, params)
        extra = [(k.encode(), v.encode()) for k, v in reply.headers]  # Retry-After
        await send_error(sink, reply.status, reply.message, code=reply.code, headers=extra)
        return
    exact = flow.routed.prompt.exact
    ttl = state.ttl_for(model, exact)
    if params is None:
        md.count(md.fallbacks, cause)
        # prefilled where it is decoded: recorded as a local request is (its load with its
        # own hit there; speculative entries and the session's hint: the replica holds it)
        dispatch = engine.dispatched(request, pick.decision, now, ttl, exact=exact)
        decode_body = body
    else:
        dispatch = md.pd.dispatched_decode(engine, request, pick.decision, now, ttl, exact)
        member = json.dumps(params, separators=(",", ":")).encode()
        decode_body = with_patch(body, b',"kv_transfer_params":' + member)
    decision = pick.decision
    if params is not None:  # the request's hit is the prefill replica's (feedback, headers)
        first = flow.routed.decision
        decision = decision._replace(usable_tokens=first.usable_tokens, kv_tokens=first.kv_tokens)
    leg = flow.routed
    routed = Routed(
        request,
        decision,
        leg.prompt,
        0.0,
        0.0,
        0,
        service_class=leg.service_class,  # the request's class (Admission.classed)
        ttft_factor=leg.ttft_factor,
        dispatch=dispatch,
    )
    carried = Carried()
    try:
        await forwarder.forward(
            sink,
            path,
            headers,
            decode_body,
            routed,
            stream=stream,
            strip_usage=strip_usage,
            # the transfer params are good for one decode replica: vLLM releases the
            # prefill's blocks once the first one to get them pulled them, failed or refused
            # the request (connector request_finished); another one would read freed blocks
            retry_body=body,
            since=started,
            # the decode replica computes none of the prompt it pulls: its first byte is
            # not predicted as a prefill of it (deadline, latency sample), as its load is not
            transfer_s=None if params is None else pick.transfer_s,
            carried=carried,
            ends_by=ends_by,  # what the prefill leg left of the request's time
        )
    finally:
        if params is not None and carried.served is not None:
            _count_pull(state, md, request, prefill_key, pick, carried.served)
        if params is not None and not carried.sent:
            # no decode replica got the transfer params (the client left before the decode
            # leg was written, or every decode replica refused its connection): none will
            # pull the prefill's blocks or hand them back, so the router does
            _start_release(state, forwarder, md, request, prefill_key, headers, params)


def _count_pull(
    state: RouterState,
    md: ModelDisagg,
    request: RouteRequest,
    prefill_key: ReplicaKey,
    pick: DecodePick,
    served: ReplicaKey,
) -> None:
    """Count the transfer ``served``, the decode replica that got the transfer params and
    answered, pulled: the pick's bytes over its link, or, for a retry after the pick
    refused the connection, the whole prompt over the link to ``served``. A decode replica
    that got them and failed (timed out, broke, answered 5xx) is not counted: one refused
    before its engine pulled nothing (vLLM's ``_with_kv_transfer_rejection_cleanup``),
    one cut off later may have (an aborted pull still ends), which the router cannot
    tell."""
    if served == pick.decision.replica:
        link, nbytes = pick.link, pick.transfer_bytes
    else:
        engine = state.engines[request.model]
        keys = state.registry.keys_for(request.model)
        link, nbytes = md.pd.retry_transfer(engine, request, prefill_key, served, keys)
    md.count(md.bytes_by_link, link.value, nbytes)


def _start_release(
    state: RouterState,
    forwarder: Forwarder,
    md: ModelDisagg,
    request: RouteRequest,
    prefill_key: ReplicaKey,
    headers: list[tuple[bytes, bytes]],
    params: dict[str, Any],
) -> None:
    """Release the blocks the prefill replica holds for a decode leg never sent, through a
    decode-capable replica (router/service/pd_release.py), in the background: the client
    has its answer. Counted by outcome (``released`` / ``unreleased``)."""
    _, dec, _ = md.pd.pools(state.registry.keys_for(request.model))
    keys = pd_release.targets(state, dec, prefill_key)
    rid = request.request_id + "#release"

    async def run() -> None:
        ok = await pd_release.release(state, forwarder, request.model, keys, headers, rid, params)
        md.count(md.releases, "released" if ok else "unreleased")

    task = asyncio.get_running_loop().create_task(run())
    md.releasing.add(task)  # held until done
    task.add_done_callback(md.releasing.discard)


async def releases(app: web.Application) -> AsyncIterator[None]:
    """(cleanup context) Releases still running when the router stops are awaited, each
    bounded by a few connect timeouts: the blocks they hand back are freed, and no task is
    destroyed pending. Before the upstream client closes (contexts end in reverse order)."""
    yield
    running = [t for md in app[STATE].disagg.values() for t in md.releasing]
    if running:
        await asyncio.gather(*running, return_exceptions=True)
