"""Prompts rendered by the engine: token ids from vLLM's render endpoints instead of the
router's own tokenizer and chat template.

Some models cannot be rendered outside the engine: Kimi-K3 ships no Jinja template (vLLM
renders it in Python and tokenizes structural markers and user text apart), DeepSeek V4 and
Mistral have their own renderers, and a template the router reads differently from the
engine gives hashes no replica holds. With ``render = "engine"`` on a model the router asks
an engine how it will run each request: ``POST /v1/chat/completions/render`` (or
``/v1/completions/render``, ``/v1/messages/render`` for the Anthropic Messages API,
``/v1/responses/render`` for the OpenAI Responses API) with
the request's body plus ``"return_mm_kwargs": false`` (identical bodies rendering at once
share one render), and
hashes the ``token_ids`` it answers, keying blocks with the ``features`` (multimodal item
hashes and placeholder offsets) as the engine keys them. Those ids are final: the engine
already applied the template, ``truncate_prompt_tokens`` and special tokens.

Where: ``render_url`` when set (a render-only vLLM, say), else the model's healthy
replicas in turn (every vLLM API server serves the render routes). A request the engine
refuses (400, 422) is refused with the engine's message: the replica would refuse it too.
Anything else is tried once more on another target. A target that is failing itself (no
answer within ``render_timeout_s``, a 5xx, a 404 of a missing route, a 401 / 403 of
credentials it does not take: ``render_api_key``) rests for ``COOLDOWN_S``: the requests
waiting on it stop waiting, later ones skip it. A 404 for the
model (the target serves it under another name) or an unreadable answer only moves on. With
no target left, or for a body the render endpoints refuse though the replica serves it
(beam search, prompt embeddings), the router's own processing stands in (counted in
``kvrouter_render_requests_total{outcome="fallback"}``): the prompt is marked provisional
(not memoised) and approximate, so an outage of the renderers degrades routing, never
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import aiohttp

from router.core.errors import BadRequest
from router.service.render_answer import (
    RenderFailed,
    decode_answer,
    dumps,
    error_message,
    is_unknown_model,
    renderable,
)
from router.service.settings import ModelSettings
from router.tokenize.keying import ProcessedPrompt
from router.tokenize.pipeline import PromptProcessor

_log = logging.getLogger("kvrouter.render")

PATHS = {
    "chat": "/v1/chat/completions/render",
    "completion": "/v1/completions/render",
    # the Anthropic Messages API: vLLM converts the body as /v1/messages does, then renders
    # it as a chat (scale_out/render/serving.py ``render_messages_request``)
    "messages": "/v1/messages/render",
    # the OpenAI Responses API: vLLM renders it as /v1/responses would (scale_out/render/
    # serving.py ``render_responses_request``; no ``previous_response_id`` there)
    "responses": "/v1/responses/render",
}
# the engine judged the request itself: its answer stands
_REFUSED = frozenset({400, 422})
# the router's credentials (``render_api_key``) refused
_UNAUTHORIZED = frozenset({401, 403})
_MAX_ATTEMPTS = 2
# answers (a long prompt's ids) and request bodies this large are (de)coded off the loop
THREAD_MIN_BYTES = 256 * 1024
MAX_ANSWER_BYTES = 256 * 2**20
# how long a target that failed is not asked
COOLDOWN_S = 5.0
# a render problem is logged at most this often per (model, target or reason)
_LOG_EVERY_S = 60.0
_MAX_TRACKED = 1024


def render_targets(state: Any, model: str) -> list[str]:
    """Base URLs of the replicas of ``model`` that may render (one per replica, not per DP
    rank; those in an unhealthy cooldown left out unless that leaves none), in a stable
    order. ``state``: the RouterState."""
    registry, unhealthy = state.registry, state.fleet.unhealthy_until
    urls: dict[str, bool] = {}
    for key in registry.keys_for(model):
        endpoint = registry.endpoint(key)
        if endpoint is not None:
            urls[endpoint.base_url] = urls.get(endpoint.base_url, False) or key not in unhealthy
    healthy = [url for url, ok in urls.items() if ok]
    return healthy or list(urls)


@dataclass(slots=True)
class _Target:
    """What the renderer remembers of one render target."""

    resting_until: float = 0.0
    rested_at: float = float("-inf")  # when its last rest began
    # set when it fails: the requests waiting on it stop waiting
    failed: asyncio.Event = field(default_factory=asyncio.Event)


class EngineRenderer:
    """Renders the prompts of the models with ``render = "engine"`` (module docstring).

    ``targets(model)`` lists the base URLs that may render for a model, in a stable order;
    the renderer starts each request at the next one (round robin)."""

    def __init__(
        self,
        models: Mapping[str, ModelSettings],
        targets: Any,
        counter: Any,
        session: aiohttp.ClientSession,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._models = {n: m for n, m in models.items() if m.render == "engine"}
        self._targets = targets
        self._counter = counter  # LoopCounter labelled (model, outcome)
        self._session = session
        self._clock = clock
        self._cursor: dict[str, int] = {}
        self._logged: dict[tuple[str, str], float] = {}
        self._state: dict[str, _Target] = {}
        # renders under way, by (model, kind, request payload)
        self._rendering: dict[tuple[str, str, bytes], asyncio.Future[ProcessedPrompt | None]] = {}

    def serves(self, model: str) -> bool:
        return model in self._models

    async def prompt(
        self,
        model: str,
        kind: str,
        body: Mapping[str, Any],
        processor: PromptProcessor,
        *,
        offload: bool = False,
    ) -> ProcessedPrompt | None:
        """The routing view of ``body`` as the engine renders it; None when no target
        answered usably (the caller processes the prompt itself). Raises BadRequest with the
        engine's message when the engine refuses the request. ``offload``: a large body,
        encoded off the event loop."""
        settings = self._models[model]
        if not renderable(kind, body):
            self._fallback(model, "unrenderable", "the render endpoints refuse it")
            return None
        targets = [settings.render_url] if settings.render_url else self._targets(model)
        start = self._cursor.get(model, 0)
        self._cursor[model] = start + 1
        now = self._clock()
        order = [targets[(start + i) % len(targets)] for i in range(len(targets))]
        order = [t for t in order if self._target(t, now).resting_until <= now]
        if not order:
            reason = "resting" if targets else "no_target"
            self._fallback(model, reason, "no render target to ask")
            return None
        request = {**body, "return_mm_kwargs": False}
        if offload:
            payload = await asyncio.get_running_loop().run_in_executor(None, dumps, request)
        else:
            payload = dumps(request)
        # identical bodies rendering at once (parallel sampling sent as separate requests,
        # before the body memo holds the first) share one render
        key = (model, kind, payload)
        shared = self._rendering.get(key)
        if shared is None:
            shared = asyncio.ensure_future(
                self._render(model, kind, body, processor, order, payload)
            )
            self._rendering[key] = shared
            shared.add_done_callback(partial(self._rendered, key))
        try:
            prompt = await asyncio.shield(shared)  # one client leaving stops no other's
        except BadRequest:
            self._counter.labels(model, "refused").inc()
            raise
        if prompt is None:
            self._fallback(model, "failed", "no render target answered")
            return None
        self._counter.labels(model, "ok").inc()
        return prompt

    def _rendered(self, key: tuple[str, str, bytes], done: asyncio.Future[Any]) -> None:
        if self._rendering.get(key) is done:
            del self._rendering[key]
        if not done.cancelled():
            done.exception()  # (retrieved: its waiters may all have left)

    async def _render(
        self,
        model: str,
        kind: str,
        body: Mapping[str, Any],
        processor: PromptProcessor,
        order: list[str],
        payload: bytes,
    ) -> ProcessedPrompt | None:
        """:meth:`prompt`'s render: the first usable answer of at most ``_MAX_ATTEMPTS`` of
        ``order``; None when none answered usably."""
        settings = self._models[model]
        headers = {"Content-Type": "application/json"}
        if settings.render_api_key:
            headers["Authorization"] = f"Bearer {settings.render_api_key}"
        for base in order[:_MAX_ATTEMPTS]:
            t0 = time.perf_counter()
            started = self._clock()
            target = self._target(base, started)
            try:
                raw = await self._ask(target, base + PATHS[kind], payload, headers, settings)
                finish = partial(_routing_view, processor, kind, raw, body, t0)
                if len(raw) >= THREAD_MIN_BYTES:  # a long prompt's ids: off the event loop
                    prompt = await asyncio.get_running_loop().run_in_executor(None, finish)
                else:
                    prompt = finish()
            except RenderFailed as exc:
                if exc.rest and started >= target.rested_at:
                    self._rest(target, self._clock())
                self._log(model, base, str(exc))
                continue
            if started >= target.rested_at:  # not a late answer from before a failure
                target.resting_until = 0.0
            return prompt
        return None

    def _target(self, base: str, now: float) -> _Target:
        found = self._state.get(base)
        if found is None:
            if len(self._state) >= _MAX_TRACKED:  # targets come and go with the fleet
                for url in [u for u, t in self._state.items() if t.resting_until <= now]:
                    del self._state[url]
            found = self._state[base] = _Target()
        elif found.failed.is_set() and found.resting_until <= now:
            found.failed = asyncio.Event()  # rested: ask it again
        return found

    def _rest(self, target: _Target, now: float) -> None:
        target.resting_until = now + COOLDOWN_S
        target.rested_at = now
        target.failed.set()

    async def _ask(
        self,
        target: _Target,
        url: str,
        payload: bytes,
        headers: Mapping[str, str],
        settings: ModelSettings,
    ) -> bytes:
        """:meth:`_post`, given up when another request finds the target failing."""
        post = asyncio.ensure_future(self._post(url, payload, headers, settings))
        failed = asyncio.ensure_future(target.failed.wait())
        try:
            await asyncio.wait({post, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            if not post.done():
                post.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await post
        if post.cancelled():
            raise RenderFailed(f"{url}: another request found it failing", rest=False)
        return post.result()

    async def _post(
        self, url: str, payload: bytes, headers: Mapping[str, str], settings: ModelSettings
    ) -> bytes:
        """The answer's body; raises BadRequest (the engine refused the request) or
        RenderFailed."""
        # no total: waiting for a pooled connection is the router's own queue, not the
        # target's failure
        timeout = aiohttp.ClientTimeout(
            sock_connect=settings.render_timeout_s, sock_read=settings.render_timeout_s
        )
        try:
            async with asyncio.timeout(settings.render_timeout_s * 4):
                async with self._session.post(
                    url, data=payload, headers=headers, timeout=timeout
                ) as resp:
                    status = resp.status
                    raw = await _read_capped(resp)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise RenderFailed(f"{url}: {str(exc) or type(exc).__name__}", rest=True) from None
        if status in _REFUSED:
            raise BadRequest(error_message(status, raw))
        if status == 404 and is_unknown_model(raw):
            message = f"{url}: does not serve the model ({error_message(status, raw)})"
            raise RenderFailed(message, rest=False)
        if status in _UNAUTHORIZED:  # the same for every request: the target rests
            message = f"{url}: HTTP {status}: {error_message(status, raw)} (render_api_key?)"
            raise RenderFailed(message, rest=True)
        if status != 200:
            message = f"{url}: HTTP {status}: {error_message(status, raw)}"
            raise RenderFailed(message, rest=status >= 500 or status == 404)
        return raw

    def _fallback(self, model: str, reason: str, message: str) -> None:
        self._counter.labels(model, "fallback").inc()
        self._log(model, reason, message)

    def _log(self, model: str, key: str, message: str) -> None:
        """Log a render problem, at most every ``_LOG_EVERY_S`` per (model, key)."""
        now = self._clock()
        if now - self._logged.get((model, key), float("-inf")) < _LOG_EVERY_S:
            return
        if len(self._logged) >= _MAX_TRACKED:
            self._logged.clear()
        self._logged[(model, key)] = now
        _log.warning("model %s: engine render: %s (the router's own rendering stands in)",
                     model, message)  # fmt: skip


async def _read_capped(resp: aiohttp.ClientResponse) -> bytes:
    if resp.content_length is not None and resp.content_length > MAX_ANSWER_BYTES:
        raise RenderFailed(f"an answer of {resp.content_length} bytes", rest=False)
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(1 << 20):
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise RenderFailed(f"an answer over {MAX_ANSWER_BYTES} bytes", rest=False)
        chunks.append(chunk)
    return b"".join(chunks)


def _routing_view(
    processor: PromptProcessor, kind: str, raw: bytes, body: Mapping[str, Any], t0: float
) -> ProcessedPrompt:
    return processor.engine_rendered(decode_answer(kind, raw), body, time.perf_counter() - t0)
