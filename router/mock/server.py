"""The mock replica's HTTP side: an OpenAI-compatible server over the engine model.

``create_app(settings)`` builds the aiohttp application (:class:`MockSettings`, and what the
replica holds while it runs: router/mock/state.py); its ``cleanup_ctx`` starts the engine
driver and the KV-event publisher (vLLM wire format over ZMQ). Endpoints: the generating
routes ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/messages`` and
``/v1/responses`` (router/mock/generation.py), ``GET /metrics`` (vLLM gauge names),
``GET /health`` and ``/ping`` (503 once the engine model has failed, as vLLM's dead engine
answers), ``GET /version``, ``GET /load`` (the requests in flight), ``GET /v1/models`` (with
``max_model_len``), the Anthropic Messages API's ``/v1/messages/count_tokens``, the OpenAI
Responses API's ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``
(router/mock/responses.py), and vLLM's prompt preparation: ``POST /tokenize``,
``/detokenize``, ``/v1/chat/completions/render``, ``/v1/completions/render``,
``/v1/messages/render``, ``/v1/responses/render`` (router/mock/preprocess.py),
and ``GET`` / ``POST /admin/fault``: the fault mode (router/mock/faults.py).
Bodies up to ``max_body_mb`` (vLLM itself has no cap).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Iterable

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from router.core.types import IndexEvent, ReplicaKey
from router.events.discovery import SOURCES_PATH
from router.mock import responses as resp
from router.mock.driver import EngineDriver
from router.mock.faults import FaultMode
from router.mock.faults import install as install_faults
from router.mock.generation import chat_completions, completions, messages, responses
from router.mock.images import byte_settings
from router.mock.kv_events import EngineEventEncoder
from router.mock.preprocess import error_response as _error
from router.mock.preprocess import handlers
from router.mock.state import STATE, VLLM_VERSION, MockState
from router.mock.state import MockSettings as MockSettings  # with create_app: the entry point
from router.mock.tokenizer import ByteTokenizer, MockTokenizer, RouterTokenizer
from router.service.model_card import model_card
from router.tokenize.multimodal import ImageSettings

log = logging.getLogger(__name__)


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
        if settings.zmq_endpoint:  # (ZMQ loads only in a replica that publishes)
            from router.events.zmq_pub import KVEventPublisher

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
