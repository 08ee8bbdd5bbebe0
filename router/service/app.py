"""The aiohttp application: OpenAI-compatible endpoints in front of the replicas.

``create_app(settings)`` wires the state (:class:`RouterState`), the upstream session and the
routes. Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``GET /ready``, ``GET /metrics`` and the admin routes of
:mod:`router.service.admin`.

The router validates only what it needs (model, messages / prompt, stream flag, a few
types); the body is forwarded untouched. Errors are OpenAI-style JSON (router.service.errors).
Hooks for parts built elsewhere: ``STATE`` and ``INDEX`` app keys, and
``Settings.background`` context factories run under ``cleanup_ctx``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from router.core.errors import BadRequest, KVRouterError
from router.core.index import PrefixIndex
from router.service import admin
from router.service.config import Settings
from router.service.errors import error_response, from_exception
from router.service.proxy import Forwarder
from router.service.state import RouterState
from router.tokenize.pipeline import ProcessedPrompt

STATE = web.AppKey("kvrouter_state", RouterState)
INDEX = web.AppKey("kvrouter_index", PrefixIndex)
FORWARDER = web.AppKey("kvrouter_forwarder", Forwarder)
SETTINGS = web.AppKey("kvrouter_settings", Settings)

# Bodies larger than this are tokenized on a worker thread, off the event loop.
THREAD_MIN_BODY = 128 * 1024


async def _read_json(request: web.Request) -> tuple[bytes, dict[str, Any]]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise _TooLarge(exc.text or "request body too large") from None
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return raw, body


class _TooLarge(Exception):
    pass


def _field_types(body: dict[str, Any]) -> tuple[str, bool]:
    model = body.get("model")
    if model is None:
        raise BadRequest("'model' is a required property")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise BadRequest("'stream' must be a boolean")
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise BadRequest(f"'{key}' must be a non-negative integer")
    return model, bool(stream)


async def _handle(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE]
    s = state.settings.server
    loop = asyncio.get_running_loop()
    model = ""
    try:
        raw, body = await _read_json(request)
        model, _ = _field_types(body)
        processor = state.processor(model)
        fn = processor.chat if kind == "chat" else processor.completion
        if len(raw) >= THREAD_MIN_BODY:
            prompt: ProcessedPrompt = await loop.run_in_executor(None, fn, body)
        else:
            prompt = fn(body)
        state.check_context(model, prompt)
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        session = body.get("user") if isinstance(body.get("user"), str) else None
        max_out = body.get("max_completion_tokens") or body.get("max_tokens")
        routed = state.route(
            model, prompt, rid, loop.time(), session_id=session, max_output_tokens=max_out
        )
    except _TooLarge:
        return error_response(
            413,
            f"request body exceeds the {s.max_body_mb:g} MB limit (server.max_body_mb)",
            code="request_too_large",
        )
    except KVRouterError as exc:
        state.metrics.requests.labels(model, "", "rejected").inc()
        return from_exception(exc, s.retry_after_s)
    m = state.metrics
    m.decision.labels("tokenize").observe(prompt.tokenize_s)
    m.decision.labels("hash").observe(prompt.hash_s)
    m.decision.labels("lookup").observe(routed.lookup_s)
    m.decision.labels("score").observe(routed.score_s)
    m.prompt_tokens.labels(model).inc(routed.request.prompt_tokens)
    m.prompt_tokens_hist.labels(model).observe(routed.request.prompt_tokens)
    m.predicted_hit_tokens.labels(model).inc(routed.decision.usable_tokens)
    m.predicted_hit_ratio.labels(model).observe(
        routed.decision.usable_tokens / routed.request.prompt_tokens
    )
    if not prompt.exact:
        m.approximate.labels(model).inc()
    if prompt.reused_tokens:
        m.prompt_cache_reused.labels(model).inc(prompt.reused_tokens)
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    return await request.app[FORWARDER].forward(request, path, raw, routed)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "completion")


async def models(request: web.Request) -> web.Response:
    """Union of the replicas' ``/v1/models`` (configured names added if a replica is silent)."""
    state = request.app[STATE]
    session = request.app[FORWARDER].session
    timeout = aiohttp.ClientTimeout(total=2.0)

    async def fetch(url: str) -> list[dict[str, Any]]:
        try:
            async with session.get(url + "/v1/models", timeout=timeout) as resp:
                if resp.status != 200:
                    return []
                data = await resp.json(content_type=None)
                items = data.get("data") if isinstance(data, dict) else None
                return [d for d in items or [] if isinstance(d, dict) and "id" in d]
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return []

    urls = sorted({ep.base_url for ep in state.registry.endpoints()})
    found: dict[str, dict[str, Any]] = {}
    for items in await asyncio.gather(*(fetch(u) for u in urls)):
        for item in items:
            found.setdefault(str(item["id"]), item)
    for name in state.registry.models():
        found.setdefault(
            name, {"id": name, "object": "model", "created": 0, "owned_by": "kvrouter"}
        )
    return web.json_response({"object": "list", "data": [found[k] for k in sorted(found)]})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """200 when every model has an available replica; says which models are approximate."""
    state = request.app[STATE]
    now = asyncio.get_running_loop().time()
    state.restore_health(now)
    out: dict[str, Any] = {}
    ok = bool(state.registry.models())
    for name in state.registry.models():
        keys = state.registry.keys_for(name)
        up = [k for k in keys if (v := state.load.view(k, now)).healthy and not v.draining]
        proc = state.processors[name]
        out[name] = {
            "replicas": len(keys),
            "available": len(up),
            "prompt_mode": "exact" if proc.exact else "approximate",
        }
        if not proc.exact:
            out[name]["note"] = (
                "no tokenizer/chat template configured: prompts are hashed as text chunks and "
                "routing uses the router's own speculative entries only"
            )
        ok = ok and bool(up)
    return web.json_response({"ready": ok, "models": out}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


async def _not_found(request: web.Request) -> web.Response:
    return error_response(404, f"no route for {request.method} {request.path}", code="not_found")


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Turn aiohttp's HTTP errors (404, 405, 413 on early reads) into OpenAI-style bodies."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 413:
            return error_response(413, "request body too large", code="request_too_large")
        return error_response(exc.status, exc.reason or "error", code=f"http_{exc.status}")


async def _upstream_session(app: web.Application) -> AsyncIterator[None]:
    s = app[SETTINGS].server
    connector = aiohttp.TCPConnector(
        limit=0, limit_per_host=s.pool_per_replica, keepalive_timeout=60, ttl_dns_cache=300
    )
    session = aiohttp.ClientSession(
        connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
    )
    app[FORWARDER] = Forwarder(app[STATE], session)
    tasks = [asyncio.create_task(_housekeeping(app))]
    if s.health_interval_s > 0:
        tasks.append(asyncio.create_task(_probe_health(app, session, s.health_interval_s)))
    yield
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await session.close()


async def _housekeeping(app: web.Application, every: float = 1.0) -> None:
    """Expire speculative index entries and compact the index now and then."""
    state = app[STATE]
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(every)
        state.index.expire(loop.time())
        if state.index.garbage_ratio() > 0.5:
            state.index.compact()


async def _probe_health(app: web.Application, session: aiohttp.ClientSession, every: float) -> None:
    state = app[STATE]
    timeout = aiohttp.ClientTimeout(total=max(every, 1.0))
    while True:
        for ep in state.registry.endpoints():
            try:
                async with session.get(ep.base_url + "/health", timeout=timeout) as resp:
                    ok = resp.status == 200
            except (TimeoutError, aiohttp.ClientError):
                ok = False
            if ok and ep.key not in state.unhealthy_until:
                state.load.set_health(ep.key, True)
            elif not ok:
                state.mark_unhealthy(ep.key, asyncio.get_running_loop().time())
        await asyncio.sleep(every)


def create_app(settings: Settings, state: RouterState | None = None) -> web.Application:
    """The router app. ``state`` may be passed in (tests, embedding); else built here."""
    state = state or RouterState(settings)
    app = web.Application(
        client_max_size=int(settings.server.max_body_mb * 2**20), middlewares=[_errors]
    )
    app[SETTINGS] = settings
    app[STATE] = state
    app[INDEX] = state.index
    app.cleanup_ctx.append(_upstream_session)
    for factory in settings.background:
        app.cleanup_ctx.append(factory)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    admin.add_routes(app, STATE)
    return app
