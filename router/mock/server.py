"""The mock replica's HTTP side: an OpenAI-compatible server over the engine model.

``create_app(settings)`` builds the aiohttp application; its ``cleanup_ctx`` starts the
engine driver and the KV-event publisher (vLLM wire format over ZMQ). Endpoints:
``POST /v1/chat/completions`` and ``/v1/completions`` (streaming or not, ``n`` > 1 and
completion batches as vLLM serves them: router/mock/multi.py; the answers' bodies and
chunks for one sequence and several: router/mock/openai_answer.py; every field of
vLLM 0.34's answers, ``usage`` with ``prompt_tokens_details.cached_tokens``,
``stream_options.include_usage`` and ``continuous_usage_stats``, the filler's logprobs,
prompt logprobs and ``echo`` when asked (router/mock/logprobs.py), vLLM's error types and
statuses; for a hybrid profile
``prompt_tokens_details.kv_hit_tokens`` too, a mock-only field: the KV-only hit before the
hybrid-state rule), ``GET /metrics`` (vLLM gauge names), ``GET /health`` and ``/ping``
(503 once the engine model has failed, as vLLM's dead engine answers),
``GET /version``, ``GET /load`` (the requests in flight), ``GET /v1/models`` (with
``max_model_len``), the Anthropic Messages API:
``POST /v1/messages`` (streaming or not, in vLLM's format: router/mock/anthropic.py) and
``/v1/messages/count_tokens``, the OpenAI Responses API: ``POST /v1/responses`` (streaming
or not), ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``
(router/mock/responses.py), and vLLM's prompt preparation: ``POST /tokenize``,
``/detokenize``, ``/v1/chat/completions/render``, ``/v1/completions/render``,
``/v1/messages/render``, ``/v1/responses/render`` (router/mock/preprocess.py),
and ``GET`` / ``POST /admin/fault``: the fault mode (router/mock/faults.py).
Bodies up to ``max_body_mb`` (vLLM itself has no cap).

Prefill/decode disaggregation: vLLM's ``kv_transfer_params`` protocol, either role, with the
KV and recurrent-state pull timed by the link between the two replicas' sites
(router/mock/pd.py).

Prompts are tokenized by a ``MockTokenizer`` (router/mock/request.py reads a request as the
engine sees it) and hashed exactly as the router hashes them
(``root_hash(model, cache_salt)``, the router's block size, an image's identifier keyed into
the block its placeholders start in: router/mock/images.py), so hits are real; the answer is
filler text, one word per token, timed by the engine model (TTFT, inter-token gaps). Should
the engine model raise, the requests in flight and every later one get HTTP 500 naming the
error (``EngineFailed``), never an answer that does not come.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from router import jsonload
from router.core.errors import BadRequest
from router.core.types import IndexEvent, ReplicaKey
from router.events.discovery import SOURCES_PATH
from router.events.zmq_pub import KVEventPublisher
from router.mock import anthropic, pd
from router.mock import logprobs as lp
from router.mock import openai_answer as oa
from router.mock import request as rq
from router.mock import responses as resp
from router.mock.driver import EngineDriver, EngineFailed
from router.mock.faults import FaultMode
from router.mock.faults import install as install_faults
from router.mock.images import DEFAULT_IMAGE_TOKENS, byte_settings
from router.mock.kv_events import EngineEventEncoder
from router.mock.latency import RequestLatency
from router.mock.preprocess import ModelNotServed, handlers, not_served
from router.mock.preprocess import error_response as _error
from router.mock.tokenizer import ByteTokenizer, MockTokenizer, RouterTokenizer
from router.service.model_card import model_card
from router.tokenize.multimodal import ImageSettings
from router.tokenize.responses import stores

log = logging.getLogger(__name__)

VLLM_VERSION = "0.34.0"  # the release whose HTTP surface the mock serves


@dataclass(slots=True, frozen=True)
class MockSettings:
    """``profile``: a ``sim/profiles`` name or TOML path. ``engine_block_size`` must divide
    or be a multiple of ``block_size`` (the router's). ``zmq_endpoint`` empty: no events."""

    model: str = "mock-model"
    replica: str = "mock-0"
    profile: str = "dense-70b"
    block_size: int = 64
    engine_block_size: int = 16
    kv_blocks: int | None = None
    cpu_blocks: int | None = None
    zmq_endpoint: str = ""
    replay_endpoint: str = ""
    encoding: str = "vllm"
    topic: str = ""
    tokenizer_dir: str | None = None
    bpe_file: str | None = None
    # placeholder tokens an image part expands to: fixed:N or qwen2_vl (router/mock/images.py)
    image_tokens: str = DEFAULT_IMAGE_TOKENS
    # with tokenizer_dir: the router's [models.NAME.images] placeholder / token (both, or
    # no images served)
    image_placeholder: str = ""
    image_token: str = ""
    default_max_tokens: int = 16
    # the context length (/v1/models, /tokenize): longer prompts, or more output, are refused
    max_model_len: int = 1_048_576
    max_body_mb: float = 1024.0  # vLLM has no body cap; aiohttp's default is 1 MiB
    time_scale: float = 1.0  # wall seconds per modelled second (router.mock.driver)
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy: fcfs or priority
    rack: str = ""  # where it runs: times the KV pulls of disaggregated requests
    region: str = ""
    fault: str = "none"  # router/mock/faults.py: how the completion endpoints misbehave
    fault_rate: float = 1.0
    fault_retry_after_s: int = 1
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class MockCounters:
    requests: int = 0
    prompt_tokens: int = 0
    # prompt tokens of requests that looked the prefix cache up (vLLM counts no other)
    queried_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    rejected: int = 0
    bad_requests: int = 0
    kv_event_batches: int = 0
    prefill_legs: int = 0  # disaggregated requests prefilled here for another replica
    decode_legs: int = 0  # disaggregated requests decoded here (KV pulled from elsewhere)
    pulled_bytes: float = 0.0
    # the engine model's own TTFT summed over finished requests (model time in wall seconds):
    # against vllm:time_to_first_token_seconds, the mock's lag behind its model
    model_ttft_s: float = 0.0
    in_flight: int = 0  # requests on the generating routes not yet answered (vLLM's /load)


@dataclass(slots=True)
class MockState:
    settings: MockSettings
    driver: EngineDriver
    encoder: EngineEventEncoder
    tokenizer: MockTokenizer
    publisher: KVEventPublisher | None
    counters: MockCounters = field(default_factory=MockCounters)
    latency: RequestLatency = field(default_factory=RequestLatency)
    ids: Any = field(default_factory=lambda: itertools.count(1))
    responses: resp.ResponseStore = field(default_factory=resp.ResponseStore)


STATE = web.AppKey("mock_state", MockState)


class _Collector:
    def __init__(self, state: MockState) -> None:
        self.state = state

    def collect(self) -> Iterable[Metric]:
        s = self.state
        report = s.driver.report()
        labels = ["model_name", "engine"]
        lv = [s.settings.model, "0"]
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch", report.running),
            ("vllm:num_requests_waiting", "Requests waiting", report.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full)", report.kv_usage),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage (older name)", report.kv_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(lv, float(value))
            yield g
        c = s.counters
        for name, doc, value in (
            ("vllm:prompt_tokens", "Prompt tokens processed", c.prompt_tokens),
            ("vllm:generation_tokens", "Tokens generated", c.generation_tokens),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up", c.queried_tokens),
            ("vllm:prefix_cache_hits", "Prompt tokens found cached", c.cached_tokens),
            ("vllm:request_success", "Requests finished", c.requests),
            ("vllm:num_preemptions", "Requests preempted", s.driver.model.preemptions),
            ("kvrouter_mock_kv_event_batches", "KV event batches published", c.kv_event_batches),
            (
                "kvrouter_mock_pd_prefill_legs",
                "Prefill legs served for remote decode",
                c.prefill_legs,
            ),
            ("kvrouter_mock_pd_decode_legs", "Decode legs with remote prefill", c.decode_legs),
            (
                "kvrouter_mock_model_ttft_seconds",
                "The engine model's TTFT summed over finished requests",
                c.model_ttft_s,
            ),
            (
                "kvrouter_mock_pd_pulled_bytes",
                "KV and state bytes pulled (modelled)",
                c.pulled_bytes,
            ),
        ):
            m = CounterMetricFamily(name, doc, labels=labels)
            m.add_metric(lv, float(value))
            yield m
        yield from s.latency.families(labels, lv)


async def _read(request: web.Request) -> tuple[MockState, dict[str, Any]]:
    """The request's body, a JSON object naming the model served."""
    state = request.app[STATE]
    try:
        body = await request.json(loads=jsonload.loads)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    error = not_served(body.get("model"), state.settings.model)
    if error is not None:
        raise error
    return state, body


async def _outputs(state: MockState, req: Any) -> AsyncIterator[Any]:
    queue = state.driver.submit(req)
    done = False
    try:
        while True:
            out = await queue.get()
            if isinstance(out, EngineFailed):
                done = True
                raise out
            yield out
            if type(out).__name__ in ("Finished", "Rejected"):
                done = True
                return
    finally:
        if not done:
            state.driver.cancel(req.request_id)


async def _handle(request: web.Request, kind: str) -> web.StreamResponse:
    """Serve a completion of ``kind``: ``chat``, ``completion``, or ``messages`` (the
    Anthropic Messages API: a chat whose answer is written as vLLM writes Anthropic's,
    router/mock/anthropic.py)."""
    clock = asyncio.get_running_loop().time
    arrived = clock()  # vLLM's latency histograms start at the request's arrival
    chat = kind != "completion"
    messages = kind == "messages"
    responses = kind == "responses"
    fail = anthropic.error if messages else _error
    from router.mock import multi  # it serves several sequences (it imports MockState)

    try:
        state, body = await _read(request)
        many = multi.prepare(state, body, kind)  # None: one sequence of one prompt
        req: Any = None
        prompt_ids: list[int] = []
        if many is None:
            req, prompt_ids = rq.engine_request(state, body, kind)
        stream = body.get("stream", False)
        opts = {} if messages or responses else body.get("stream_options") or {}
        if not isinstance(stream, bool) or not isinstance(opts, dict):
            raise BadRequest("'stream' must be a boolean and 'stream_options' an object")
        if opts and not stream:  # vLLM's words (validate_stream_options)
            raise BadRequest("Stream options can only be defined when `stream=True`.")
    except resp.UnknownResponse as exc:
        return resp.not_found(str(exc))
    except ModelNotServed as exc:
        request.app[STATE].counters.bad_requests += 1
        return fail(404, str(exc)) if messages else _error(404, str(exc), param="model")
    except BadRequest as exc:
        request.app[STATE].counters.bad_requests += 1
        return fail(400, str(exc))
    answer_id = rq.answer_id(request, body, kind)
    if many is not None:
        return await multi.serve(request, many, answer_id, stream, opts, arrived)
    params = pd.transfer_params(body)
    prefill_leg = pd.is_prefill_leg(params)
    if params is not None and pd.is_decode_leg(params):
        req = await _pull(state, req, params)
    created = int(time.time())
    model = state.settings.model
    cached = 0
    kv_hit = 0
    produced = 0
    finish_reason = "length"
    response: web.StreamResponse | None = None

    openai_api = not (messages or responses)
    with_logprobs = openai_api and lp.asks_logprobs(body, chat)
    decode = state.tokenizer.decode
    prompt_logprobs = lp.prompt_entries(prompt_ids, decode) if not req.reads_cache else None
    echo = ""  # the text echoed before the answer's (vLLM's ``echo``)
    if openai_api and lp.echoes(body):
        echo = lp.chat_echo(body) if chat else lp.completion_echo(body, prompt_ids, decode)
    oai = oa.Answer(
        answer_id,
        chat,
        created,
        model,
        decode,
        with_logprobs=with_logprobs,
        # completions' logprobs with echo list the prompt's tokens first
        echo_logprobs=with_logprobs and not chat and lp.echoes(body),
        # vLLM's continuous_usage_stats: every chunk carries the usage so far
        continuous=bool(opts.get("include_usage") and opts.get("continuous_usage_stats")),
    )
    # the one choice's chunks: its first names chat's role, after the echo
    seq = oa.ChoiceStream(oai, 0, prompt_ids, echo, role=chat)

    words: list[str] = []
    rids = (answer_id, f"msg_{uuid.uuid4().hex}")
    writer = resp.EventWriter(rids)
    first_at = finished_at = arrived
    queued_s = model_ttft_s = 0.0
    submitted = state.driver.now()  # model time: the engine gets the request at once
    if responses and stream:  # vLLM opens the stream before the engine's first output
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        opened = resp.response(body, rids, model, None, "in_progress", None, req.max_output_tokens)
        await response.write(writer.opening(opened))
    try:
        async for out in _outputs(state, req):
            name = type(out).__name__
            if name == "Rejected":
                state.counters.rejected += 1
                reason = f"request cannot be served: {out.reason}"
                if response is not None:  # an opened stream ends with its error event
                    error = writer.event(
                        "error", code="BadRequestError", message=reason, param=None
                    )
                    await response.write(error)
                    await response.write_eof()
                    return response
                return fail(400, reason)
            if response is None and stream:
                response = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await response.prepare(request)
            if name == "FirstToken":  # carries the first output token
                first_at = clock()
                queued_s = out.queued_s * state.driver.time_scale
                model_ttft_s = (out.time - submitted) * state.driver.time_scale
                cached = out.cached_tokens
                kv_hit = out.kv_hit_tokens
                produced = 1
                if response is not None and messages:
                    first = anthropic.usage(req.prompt_tokens, cached, 0)
                    start = anthropic.start_events(answer_id, model, first)
                    await response.write(start + anthropic.text_event(oa.word(0)))
                elif response is not None and responses:
                    await response.write(writer.first_output() + writer.delta(oa.word(0)))
                    words.append(oa.word(0))
                elif response is not None:
                    await response.write(seq.tokens([oa.word(0)], produced, cached))
                else:
                    words.append(oa.word(0))
            elif name == "TokensEmitted":
                new = [oa.word(produced + i) for i in range(out.count)]
                produced += out.count
                if response is not None and responses:
                    await response.write(writer.delta("".join(new)))
                    words.extend(new)
                elif response is not None:
                    await response.write(
                        anthropic.text_event("".join(new))
                        if messages
                        else seq.tokens(new, produced)
                    )
                else:
                    words.extend(new)
            elif name == "Finished":
                finished_at = clock()
                cached = out.cached_tokens
                produced = out.output_tokens
                finish_reason = "length" if produced >= req.max_output_tokens else "stop"
    except EngineFailed as exc:
        if response is not None:
            raise  # the stream breaks off: the client sees an incomplete answer
        return fail(500, str(exc))
    if params is not None and pd.is_decode_leg(params):  # the hit was the prefill replica's
        cached, kv_hit = pd.remote_hit(params, cached, kv_hit)
    c = state.counters
    c.requests += 1
    c.prompt_tokens += req.prompt_tokens
    if req.reads_cache:
        c.queried_tokens += req.prompt_tokens
    c.cached_tokens += cached
    c.generation_tokens += produced
    state.latency.observe(first_at - arrived, finished_at - arrived, queued_s, produced)
    c.model_ttft_s += model_ttft_s
    hybrid = state.driver.model.hybrid
    ebs = state.settings.engine_block_size
    # chat's created_cache_tokens: the prompt's full engine blocks it computed (vLLM's
    # PrefillStats.num_cache_creation_tokens)
    made = max(0, req.prompt_tokens // ebs * ebs - cached) if chat else None
    usage = oa.usage(req.prompt_tokens, cached, produced, kv_hit if hybrid else None, made)
    # a prefill leg's answer names its blocks for the decode leg, on every API (vLLM's)
    transfer: dict[str, Any] | None = None
    if prefill_leg:
        c.prefill_legs += 1
        s = state.settings
        blocks = [range(-(-req.prompt_tokens // s.block_size))]
        if state.driver.model.hybrid:
            blocks.append(range(1))  # the recurrent state's group: its running-state slot
        transfer = pd.answer_params(
            s.replica,
            req.request_id,
            request.url.host or "",
            request.url.port or 0,
            pd.Site(s.region, s.rack),
            blocks,
            req.prompt_tokens,
            cached,
            kv_hit,
        )
    if responses:
        status = "incomplete" if finish_reason == "length" else "completed"
        used = resp.usage(req.prompt_tokens, cached, produced)
        text = "".join(words)
        answer = resp.response(body, rids, model, text, status, used, req.max_output_tokens)
        answer |= {"kv_transfer_params": transfer, "ec_transfer_params": None}
        if stores(body):
            history = resp.chat_body(state.responses, body)["messages"]
            state.responses.put(rids[0], resp.Stored(history, answer))
        if response is not None:
            await response.write(writer.end(answer))
            await response.write_eof()
            return response
        return web.json_response(answer)
    if messages:
        final = anthropic.usage(req.prompt_tokens, cached, produced)
        if response is not None:
            await response.write(anthropic.end_events(finish_reason, final))
            await response.write_eof()
            return response
        text = "".join(words)
        answer = anthropic.answer(answer_id, model, text, finish_reason, final)
        if transfer is not None:  # vLLM dumps the answer without its None fields
            answer["kv_transfer_params"] = transfer
        return web.json_response(answer)
    if response is not None:
        await response.write(seq.finish(finish_reason, produced))
        return await oa.end_stream(response, oai, usage if opts.get("include_usage") else None)
    text = echo + "".join(words)
    one = oai.choice(0, text, oai.logprobs(prompt_ids, words), finish_reason, prompt_logprobs)
    return web.json_response(oai.body([one], usage, prompt_logprobs, transfer))


async def _pull(state: MockState, req: Any, params: Mapping[str, Any]) -> Any:
    """A decode leg: wait out the pull of what this replica lacks, then admit the request
    as remote-prefilled (router/mock/pd.py)."""
    model = state.driver.model
    held = 0
    for h in req.block_hashes:
        if not model.has_block(h):
            break
        held += 1
    missing = max(req.prompt_tokens - held * state.settings.block_size, 0)
    profile = model.profile
    sizes = pd.TransferSizes(profile.kv_bytes_per_token, profile.state_bytes)
    s = state.settings
    moved = pd.pull(params, pd.Site(s.region, s.rack), s.replica, missing, sizes, model.hybrid)
    state.counters.decode_legs += 1
    state.counters.pulled_bytes += moved.nbytes
    if moved.seconds > 0:
        await asyncio.sleep(moved.seconds * state.driver.time_scale)
    return replace(req, remote_prefilled=True)


async def _tracked(request: web.Request, kind: str) -> web.StreamResponse:
    """``_handle``, counted in flight until answered (vLLM's ``load_aware_call``)."""
    counters = request.app[STATE].counters
    counters.in_flight += 1
    try:
        return await _handle(request, kind)
    finally:
        counters.in_flight -= 1


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _tracked(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _tracked(request, "completion")


async def messages(request: web.Request) -> web.StreamResponse:
    return await _tracked(request, "messages")


async def responses(request: web.Request) -> web.StreamResponse:
    return await _tracked(request, "responses")


async def get_response(request: web.Request) -> web.StreamResponse:
    """vLLM's ``GET /v1/responses/{id}`` (a stored response, else 404)."""
    response_id = request.match_info["response_id"]
    found = request.app[STATE].responses.get(response_id)
    if found is None:
        return resp.not_found(response_id)
    return web.json_response(found.response)


async def cancel_response(request: web.Request) -> web.StreamResponse:
    """vLLM's ``POST /v1/responses/{id}/cancel``: only background responses can be
    cancelled; the mock runs none, so a stored response answers vLLM's 400."""
    response_id = request.match_info["response_id"]
    if request.app[STATE].responses.get(response_id) is None:
        return resp.not_found(response_id)
    return _error(
        400, "Cannot cancel a synchronous response.", "invalid_request_error", "response_id"
    )


async def metrics(request: web.Request) -> web.Response:
    registry = CollectorRegistry()
    registry.register(_Collector(request.app[STATE]))
    return web.Response(body=generate_latest(registry), content_type="text/plain")


async def health(request: web.Request) -> web.Response:
    """vLLM's ``/health`` (and ``/ping``): 200 with no body, 503 once the engine is dead."""
    return web.Response(status=503 if request.app[STATE].driver.failure else 200)


async def load(request: web.Request) -> web.Response:
    """vLLM's ``GET /load`` as ``--enable-server-load-tracking`` answers it: the requests
    in flight on the generating routes."""
    return web.json_response({"server_load": request.app[STATE].counters.in_flight})


async def version(request: web.Request) -> web.Response:
    """vLLM's ``GET /version``: the vLLM release the mock answers as."""
    return web.json_response({"version": VLLM_VERSION})


async def models(request: web.Request) -> web.Response:
    """vLLM's ``ModelList``: one ``ModelCard`` with ``max_model_len`` and a permission."""
    s = request.app[STATE].settings
    # "vllm": vLLM's ModelCard default
    card = model_card(
        s.model, created=int(time.time()), owned_by="vllm", max_model_len=s.max_model_len
    )
    return web.json_response({"object": "list", "data": [card]})


def _tokenizer(settings: MockSettings) -> MockTokenizer:
    if settings.tokenizer_dir:
        images = None
        if settings.image_placeholder or settings.image_token:
            images = ImageSettings(
                settings.image_placeholder, settings.image_token, settings.image_tokens
            )
        return RouterTokenizer.from_dir(
            settings.model, settings.block_size, settings.tokenizer_dir, settings.bpe_file, images
        )
    return ByteTokenizer(byte_settings(settings.image_tokens), settings.model)


async def kv_event_sources(request: web.Request) -> web.Response:
    """vLLM 0.34's ``GET /kv_event_sources``: the resolved publisher configuration per
    data-parallel rank (one rank here), ``{}`` when events are off."""
    s = request.app[STATE].settings
    if not s.zmq_endpoint:
        return web.json_response({})
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": s.zmq_endpoint,
        "replay_endpoint": s.replay_endpoint or None,
        "buffer_steps": 10_000,
        "hwm": 100_000,
        "max_queue_size": 100_000,
        "topic": s.topic,
    }
    return web.json_response({"0": config})


def create_app(settings: MockSettings) -> web.Application:
    """The mock replica application (see the module docstring)."""
    from sim.engine import EngineModel
    from sim.profiles import load_profile

    if settings.scheduling_policy not in ("fcfs", "priority"):
        raise ValueError(
            f"--scheduling-policy must be fcfs or priority, got {settings.scheduling_policy!r}"
        )
    if not (math.isfinite(settings.time_scale) and settings.time_scale > 0):
        raise ValueError(f"--time-scale must be > 0 and finite, got {settings.time_scale}")

    fault = FaultMode.parse(settings.fault, settings.fault_rate, settings.fault_retry_after_s)
    profile = load_profile(settings.profile)
    tokenizer = _tokenizer(settings)
    encoder = EngineEventEncoder(
        settings.block_size,
        settings.engine_block_size,
        # SGLang (the map layout) names the salt in the event, vLLM in the block's keys
        salt_field="cache_salt" if settings.encoding == "map" else "extra_keys",
        sliding_window=profile.sliding_window_tokens,
    )
    app = web.Application(client_max_size=int(settings.max_body_mb * 2**20))

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        model = EngineModel(
            profile,
            ReplicaKey(settings.replica),
            settings.block_size,
            kv_blocks=settings.kv_blocks,
            cpu_blocks=settings.cpu_blocks,
            publish_window_blocks=True,
            engine_block_size=settings.engine_block_size,
            scheduling=settings.scheduling_policy,
        )
        publisher = None
        outbox: asyncio.Queue[list[IndexEvent]] = asyncio.Queue()
        if settings.zmq_endpoint:
            publisher = KVEventPublisher(
                settings.zmq_endpoint,
                settings.replay_endpoint or None,
                topic=settings.topic,
                encoding=settings.encoding,  # type: ignore[arg-type]
            )
            publisher.start()
        driver = EngineDriver(
            model, outbox.put_nowait if publisher else None, time_scale=settings.time_scale
        )
        state = MockState(settings, driver, encoder, tokenizer, publisher)
        app[STATE] = state

        async def pump_events() -> None:
            assert publisher is not None
            while True:
                events = await outbox.get()
                engine_events = encoder.convert(events)
                if engine_events:
                    await publisher.publish(engine_events, 0)
                    state.counters.kv_event_batches += 1

        await driver.start()
        pump = asyncio.create_task(pump_events()) if publisher else None
        yield
        if pump is not None:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
        await driver.stop()
        if publisher is not None:
            await publisher.close()

    app.cleanup_ctx.append(lifecycle)
    install_faults(app, fault)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)  # vLLM's (SageMaker's) ping: /health's answer
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/load", load)
    app.router.add_get("/v1/models", models)
    app.router.add_get(SOURCES_PATH, kv_event_sources)
    prep = handlers(
        lambda request: request.app[STATE].tokenizer, settings.max_model_len, settings.model
    )
    for path, handler in prep.items():
        app.router.add_post(path, handler)
    return app
