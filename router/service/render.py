"""Prompts rendered by the engine: token ids from vLLM's render endpoints instead of the
router's own tokenizer and chat template.

Some models cannot be rendered outside the engine: Kimi-K3 ships no Jinja template (vLLM
renders it in Python and tokenizes structural markers and user text apart), DeepSeek V4 and
Mistral have their own renderers, and a template the router reads differently from the
engine gives hashes no replica holds. With ``render = "engine"`` on a model the router asks
an engine how it will run each request: ``POST /v1/chat/completions/render`` (or
``/v1/completions/render``) with the request's body plus ``"return_mm_kwargs": false``, and
hashes the ``token_ids`` it answers, keying blocks with the ``features`` (multimodal item
hashes and placeholder offsets) as the engine keys them. Those ids are final: the engine
already applied the template, ``truncate_prompt_tokens`` and special tokens.

Where: ``render_url`` when set (a render-only vLLM, say), else the model's healthy
replicas in turn (every vLLM API server serves the render routes). A request the engine
refuses (400, 422) is refused with the engine's message: the replica would refuse it too.
Anything else (no answer within ``render_timeout_s``, a 5xx, a 404 from an engine without
the routes) is tried once more on another target, and the target that failed is not asked
again for ``COOLDOWN_S``; with no target left the router's own processing stands in
(counted in ``kvrouter_render_requests_total{outcome="fallback"}``; the prompt is marked
provisional and not memoised), so an outage of the renderers degrades routing, never
requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import aiohttp
import numpy as np
import orjson

from router import jsonload
from router.core.errors import BadRequest
from router.core.hashing import MmItem, as_u32_array
from router.service.settings import ModelSettings
from router.tokenize.pipeline import ProcessedPrompt, PromptProcessor

_log = logging.getLogger("kvrouter.render")

PATHS = {"chat": "/v1/chat/completions/render", "completion": "/v1/completions/render"}
# the engine judged the request itself: its answer stands
_REFUSED = frozenset({400, 413, 422})
_MAX_ATTEMPTS = 2
# answers this large (a long prompt's ids) are decoded on a worker thread
THREAD_MIN_ANSWER = 256 * 1024
# how long a target that failed is not asked (the request that found it failing waited)
COOLDOWN_S = 5.0


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


class RenderFailed(Exception):
    """No usable answer from a render target (the caller tries another, then falls back)."""


def parse_rendered(kind: str, payload: Any) -> list[tuple[np.ndarray, list[MmItem]]]:
    """The prompts of a render answer: a chat answer is one ``{"token_ids", "features"}``
    object, a completion answer a list of them (one per prompt of a batch). Raises
    RenderFailed for anything else."""
    entries = payload if kind == "completion" else [payload]
    if not isinstance(entries, list) or not entries:
        raise RenderFailed("the render answer is not a list of prompts")
    out = []
    for entry in entries:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("token_ids"), list):
            raise RenderFailed("a rendered prompt has no token_ids")
        try:
            ids = as_u32_array(entry["token_ids"])
        except ValueError as exc:
            raise RenderFailed(f"rendered token_ids: {exc}") from None
        out.append((ids, _mm_items(entry.get("features"))))
    return out


def decode_answer(kind: str, raw: bytes) -> list[tuple[np.ndarray, list[MmItem]]]:
    """:func:`parse_rendered` of a render answer's body."""
    try:
        payload = jsonload.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise RenderFailed("malformed: the answer is not JSON") from None
    return parse_rendered(kind, payload)


def _routing_view(
    processor: PromptProcessor, kind: str, raw: bytes, body: Mapping[str, Any], t0: float
) -> ProcessedPrompt:
    return processor.engine_rendered(decode_answer(kind, raw), body, time.perf_counter() - t0)


def _mm_items(features: Any) -> list[MmItem]:
    """Multimodal items of ``features`` (``mm_hashes`` / ``mm_placeholders`` per modality,
    parallel lists), by placeholder offset."""
    if features is None:
        return []
    if not isinstance(features, Mapping):
        raise RenderFailed("rendered features are not an object")
    hashes, places = features.get("mm_hashes") or {}, features.get("mm_placeholders") or {}
    if not isinstance(hashes, Mapping) or not isinstance(places, Mapping):
        raise RenderFailed("rendered features: mm_hashes / mm_placeholders are not objects")
    items = []
    for modality, idents in hashes.items():
        ranges = places.get(modality)
        if (
            not isinstance(idents, list)
            or not isinstance(ranges, list)
            or len(idents) != len(ranges)
        ):
            raise RenderFailed(f"rendered features: {modality} hashes and placeholders differ")
        for ident, where in zip(idents, ranges, strict=True):
            offset = where.get("offset") if isinstance(where, Mapping) else None
            if not isinstance(ident, str) or type(offset) is not int or offset < 0:
                raise RenderFailed(f"rendered features: a malformed {modality} item")
            items.append(MmItem(offset, ident))
    return sorted(items, key=lambda item: item.start)


def _dumps(body: Mapping[str, Any]) -> bytes:
    """``body`` as JSON (orjson; the standard library for what it refuses, such as integers
    beyond 64 bits, which a parsed body may hold)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body).encode()


def _error_message(status: int, raw: bytes) -> str:
    """The message of an engine's error body (OpenAI-style, FastAPI ``detail``, or text)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        body = None
    if isinstance(body, Mapping):
        error = body.get("error")
        for found in (
            error.get("message") if isinstance(error, Mapping) else error,
            body.get("message"),
            body.get("detail"),
        ):
            if isinstance(found, str) and found:
                return found
    text = raw[:500].decode("utf-8", "replace").strip()
    return text or f"the engine refused the request (HTTP {status})"


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
        self._warned: set[tuple[str, str]] = set()
        # target -> when it may be asked again: one that failed is skipped for a while, so
        # a hung renderer costs one request its timeout, not every request
        self._resting: dict[str, float] = {}

    def serves(self, model: str) -> bool:
        return model in self._models

    async def prompt(
        self, model: str, kind: str, body: Mapping[str, Any], processor: PromptProcessor
    ) -> ProcessedPrompt | None:
        """The routing view of ``body`` as the engine renders it; None when no target
        answered usably (the caller processes the prompt itself). Raises BadRequest with the
        engine's message when the engine refuses the request."""
        settings = self._models[model]
        targets = [settings.render_url] if settings.render_url else self._targets(model)
        if not targets:
            self._fallback(model, "no_target", "no replica to render on")
            return None
        start = self._cursor.get(model, 0)
        self._cursor[model] = start + 1
        now = self._clock()
        order = [targets[(start + i) % len(targets)] for i in range(len(targets))]
        order = [t for t in order if self._resting.get(t, 0.0) <= now][:_MAX_ATTEMPTS]
        if not order:
            self._fallback(model, "resting", "every render target failed within a cooldown")
            return None
        payload = _dumps({**body, "return_mm_kwargs": False})
        headers = {"Content-Type": "application/json"}
        if settings.render_api_key:
            headers["Authorization"] = f"Bearer {settings.render_api_key}"
        reason = "error"
        for base in order:
            t0 = time.perf_counter()
            try:
                raw = await self._post(base + PATHS[kind], payload, headers, settings)
                finish = partial(_routing_view, processor, kind, raw, body, t0)
                if len(raw) >= THREAD_MIN_ANSWER:  # a long prompt's ids: off the event loop
                    prompt = await asyncio.get_running_loop().run_in_executor(None, finish)
                else:
                    prompt = finish()
            except RenderFailed as exc:
                reason = str(exc).split(":", 1)[0]
                self._resting[base] = self._clock() + COOLDOWN_S
                self._warn(model, base, str(exc))
                continue
            except BadRequest:
                self._counter.labels(model, "refused").inc()
                raise
            self._resting.pop(base, None)
            self._counter.labels(model, "ok").inc()
            return prompt
        self._fallback(model, reason, f"no render target answered for {model}")
        return None

    async def _post(
        self, url: str, payload: bytes, headers: Mapping[str, str], settings: ModelSettings
    ) -> bytes:
        """The answer's body; raises BadRequest (the engine refused the request) or
        RenderFailed."""
        timeout = aiohttp.ClientTimeout(total=settings.render_timeout_s)
        try:
            async with self._session.post(
                url, data=payload, headers=headers, timeout=timeout
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise RenderFailed(f"unreachable: {url}: {exc or type(exc).__name__}") from None
        if status in _REFUSED:
            raise BadRequest(_error_message(status, raw))
        if status != 200:
            raise RenderFailed(f"http_{status}: {url}: {_error_message(status, raw)}")
        return raw

    def _fallback(self, model: str, reason: str, message: str) -> None:
        self._counter.labels(model, "fallback").inc()
        self._warn(model, reason, message)

    def _warn(self, model: str, key: str, message: str) -> None:
        """Log a render problem once per (model, target or reason)."""
        if (model, key) not in self._warned:
            self._warned.add((model, key))
            _log.warning("model %s: engine render: %s (the router's own rendering stands in)",
                         model, message)  # fmt: skip
