"""The aiohttp application: OpenAI-compatible endpoints in front of the replicas.

``create_app(settings)`` wires the state (:class:`RouterState`), the upstream session and the
routes. Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``GET /ready``, ``GET /metrics`` and the admin routes of
:mod:`router.service.admin`.

The two hot endpoints are served by :mod:`router.service.handling` (shared with the fast
server of :mod:`router.service.fast_server`). Errors are OpenAI-style JSON
(router.service.errors).
Hooks for parts built elsewhere: ``STATE`` and ``INDEX`` app keys, and
``Settings.background`` context factories run under ``cleanup_ctx``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from router.core.index import PrefixIndex
from router.core.types import ReplicaKey
from router.service import admin, security
from router.service.config import Settings
from router.service.errors import error_response
from router.service.handling import CHAT_PATH, COMPLETIONS_PATH, handle, too_large
from router.service.proxy import Forwarder
from router.service.state import RouterState
from router.service.upstream import Client, Timeouts
from router.service.worker_metrics import all_workers_page

STATE = web.AppKey("kvrouter_state", RouterState)
INDEX = web.AppKey("kvrouter_index", PrefixIndex)
FORWARDER = web.AppKey("kvrouter_forwarder", Forwarder)
SETTINGS = web.AppKey("kvrouter_settings", Settings)
SESSION = web.AppKey("kvrouter_session", aiohttp.ClientSession)
# the Redis index follower (router.store.sync.IndexSync) when server.redis_url is set
INDEX_SYNC: web.AppKey[Any] = web.AppKey("kvrouter_index_sync")

_log = logging.getLogger("kvrouter.service")


class AiohttpSink:
    """:class:`~router.service.proxy.Sink` over an aiohttp request; ``response`` is what the
    handler returns."""

    __slots__ = ("request", "response")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    @staticmethod
    def _headers(headers: list[tuple[bytes, bytes]]) -> CIMultiDict[str]:
        return CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in headers)

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.response = web.Response(status=status, body=body, headers=self._headers(headers))

    async def start(
        self, status: int, headers: list[tuple[bytes, bytes]], data: bytes = b"", end: bool = False
    ) -> None:
        resp = web.StreamResponse(status=status, headers=self._headers(headers))
        self.response = resp
        await resp.prepare(self.request)
        if end:
            await resp.write_eof(data)
        elif data:
            await resp.write(data)

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)  # ClientConnectionResetError is a ConnectionResetError

    async def end(self, data: bytes = b"") -> None:
        assert self.response is not None
        await self.response.write_eof(data)


async def _hot(request: web.Request, path: bytes) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return too_large(state).response()
    sink = AiohttpSink(request)
    await handle(state, request.app[FORWARDER], sink, path, raw, list(request.raw_headers))
    assert sink.response is not None
    return sink.response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _hot(request, CHAT_PATH)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _hot(request, COMPLETIONS_PATH)


async def models(request: web.Request) -> web.Response:
    """The models the router routes: configured (or served by a configured replica) and with
    at least one replica, i.e. every model a request may name without a 404. Each entry is
    the first replica's own ``/v1/models`` entry for it (metadata such as ``max_model_len``
    passes through), or a plain one if no replica reports it. Other ids the replicas report
    (LoRA adapters, say) are left out: the router answers 404 for them."""
    state = request.app[STATE]
    session = request.app[SESSION]
    timeout = aiohttp.ClientTimeout(total=2.0)
    routed = sorted(m for m in state.registry.models() if routable(state, m))

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

    urls = sorted(
        {
            ep.base_url
            for m in routed
            for key in state.registry.keys_for(m)
            if (ep := state.registry.endpoint(key)) is not None
        }
    )
    found: dict[str, dict[str, Any]] = {}
    for items in await asyncio.gather(*(fetch(u) for u in urls)):
        for item in items:
            found.setdefault(str(item["id"]), item)
    data = [
        found.get(name) or {"id": name, "object": "model", "created": 0, "owned_by": "kvrouter"}
        for name in routed
    ]
    return web.json_response({"object": "list", "data": data})


def routable(state: RouterState, model: str) -> bool:
    """A request naming ``model`` is routed (not answered 404): what ``state.processor``
    accepts."""
    return model in state.processors and bool(state.registry.keys_for(model))


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
            # the chat template is message-local: long conversations render and tokenize
            # only their new messages (router.tokenize.local_template)
            "incremental_render": proc.template is not None
            and proc.template.local_for(None) is not None,
        }
        if not proc.exact:
            out[name]["note"] = (
                "no tokenizer/chat template configured: prompts are hashed as text chunks and "
                "routing uses the router's own speculative entries only"
            )
        ok = ok and bool(up)
    return web.json_response({"ready": ok, "models": out}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    """This process's metrics; with several workers, every worker's, labelled ``worker``
    (router/service/worker_metrics.py)."""
    body = request.app[STATE].metrics.render()
    group = request.app.get(admin.WORKERS)
    if group is not None and group.count > 1:
        peers, _ = group.peers()
        body = await all_workers_page(
            request.app[admin.WORKER_INDEX], body, [group.socket(p) for p in peers], group.count
        )
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


async def _not_found(request: web.Request) -> web.Response:
    return error_response(404, f"no route for {request.method} {request.path}", code="not_found")


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Turn aiohttp's HTTP errors (404, 405, 413 on early reads) into OpenAI-style bodies,
    and anything unexpected (a bug) into an OpenAI-style 500, logged with its traceback
    (aiohttp itself would answer a plain-text 500)."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 413:
            return error_response(413, "request body too large", code="request_too_large")
        return error_response(exc.status, exc.reason or "error", code=f"http_{exc.status}")
    except ConnectionResetError:
        raise  # the client left (aiohttp's ClientConnectionResetError is one): nobody to answer
    except Exception:
        if request.writer.output_size > 0:
            raise  # part of an answer went out already: aiohttp logs it and closes
        _log.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(500, "internal error in the router", code="internal_error")


async def _upstream_session(app: web.Application) -> AsyncIterator[None]:
    s = app[SETTINGS].server
    client = Client(
        Timeouts(s.connect_timeout_s, s.first_byte_timeout_s, s.request_timeout_s),
        s.pool_per_replica,
    )
    app[FORWARDER] = Forwarder(app[STATE], client)
    # side traffic (/v1/models, health probes) keeps aiohttp's client
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit_per_host=8, keepalive_timeout=60),
        skip_auto_headers=("User-Agent",),
    )
    app[SESSION] = session
    tasks = [asyncio.create_task(_housekeeping(app))]
    if s.health_interval_s > 0:
        tasks.append(asyncio.create_task(_probe_health(app, session, s.health_interval_s)))
    yield
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await session.close()
    client.close()


async def _housekeeping(app: web.Application, every: float = 1.0) -> None:
    """Expire speculative index entries, readmit replicas whose unhealthy cooldown ended
    (without waiting for traffic; an active probe re-marks them if still down), check the
    models' state layouts against their configuration (router.service.layout), and compact
    the index now and then."""
    state = app[STATE]
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(every)
        state.index.expire(loop.time())
        state.restore_health(loop.time())
        state.layouts.check()
        if state.index.garbage_ratio() > 0.5:
            state.index.compact()


# replicas' /health probed at once: a sweep of a 900-replica fleet takes about one timeout
# even when some hang, instead of one timeout per hanging replica
HEALTH_PROBES_AT_ONCE = 64


async def _probe_health(app: web.Application, session: aiohttp.ClientSession, every: float) -> None:
    """Every ``every`` seconds, GET each replica's ``/health`` (once per URL: all DP ranks of
    a replica share it) and mark its keys healthy or unhealthy."""
    state = app[STATE]
    timeout = aiohttp.ClientTimeout(total=max(every, 1.0))
    limit = asyncio.Semaphore(HEALTH_PROBES_AT_ONCE)

    async def probe(url: str) -> bool:
        async with limit:
            try:
                async with session.get(url + "/health", timeout=timeout) as resp:
                    return resp.status == 200
            except (TimeoutError, aiohttp.ClientError):
                return False

    while True:
        by_url: dict[str, list[ReplicaKey]] = {}
        for ep in state.registry.endpoints():
            by_url.setdefault(ep.base_url, []).append(ep.key)
        results = await asyncio.gather(*(probe(url) for url in by_url))
        now = asyncio.get_running_loop().time()
        for keys, ok in zip(by_url.values(), results, strict=True):
            for key in keys:
                if state.registry.endpoint(key) is None:
                    continue  # removed while probed (a discovered replica left)
                if ok and key not in state.unhealthy_until:
                    state.load.set_health(key, True)
                elif not ok:
                    state.mark_unhealthy(key, now)
        await asyncio.sleep(every)


async def _engine_metrics(app: web.Application) -> AsyncIterator[None]:
    """Replicas with ``metrics_url``: the router scrapes their Prometheus pages itself
    (router.service.engines)."""
    from router.service.engines import EngineFeed, scraping

    settings = app[SETTINGS]
    targets = [rep for rep in settings.replicas if rep.metrics_url]
    async with scraping(targets, EngineFeed(app[STATE]), settings.server.engine_metrics_interval_s):
        yield


async def _redis_index(app: web.Application) -> AsyncIterator[None]:
    """With ``server.redis_url``: bootstrap the local index from Redis and follow it
    (router.store.sync.IndexSync). Start-up does not wait for Redis; while it is away the
    router serves from its last known index and load (docs/operations.md)."""
    from router.store.redis_store import RedisStore
    from router.store.schema import KeySchema
    from router.store.sync import IndexSync

    s = app[SETTINGS].server
    store = RedisStore.from_url(
        s.redis_url or "",
        KeySchema(s.redis_key_prefix, s.redis_stream_shards),
        verify_master=bytes.fromhex(s.redis_signing_master) if s.redis_signing_master else None,
    )
    from router.service.engines import EngineFeed

    discover = s.discover_replicas is not False  # None: on with Redis
    sync = IndexSync(
        store,
        app[STATE].index,
        asyncio.get_running_loop().time,
        listener=EngineFeed(app[STATE], discover=discover),
        event_lag=app[STATE].event_lag_s,
    )
    app[INDEX_SYNC] = sync
    _log.info("shared index: following %s (key prefix %s)", s.redis_url, s.redis_key_prefix)
    await sync.start(wait=False)
    yield
    await sync.stop()
    await store.close()


async def _direct_events(app: web.Application) -> AsyncIterator[None]:
    """Replicas configured with ``zmq``: subscribe to their KV events and apply them to the
    local index directly (router.events.direct; single router, no Redis)."""
    from router.events.direct import DirectEvents
    from router.events.endpoints import engine_endpoints

    settings = app[SETTINGS]
    direct = DirectEvents(app[STATE].index, event_lag=app[STATE].event_lag_s)
    for rep in settings.replicas:
        if rep.zmq:
            block = settings.model(rep.model).routing.block_size
            # every dp rank of the engine: rank N publishes on the configured ports + N
            specs = engine_endpoints(
                [rep.zmq], [rep.zmq_replay] if rep.zmq_replay else [], range(rep.dp_ranks)
            )
            direct.add_replica(
                rep.name,
                rep.model,
                block,
                specs,
                on_checkpoint=app[STATE].layouts.observer(rep.model, block),
            )
    async with direct:
        yield


async def _recording(app: web.Application) -> AsyncIterator[None]:
    """With ``server.record_path``: append every completed request to a rotating trace
    (router.recorder), flushed every second and on shutdown."""
    from router.recorder import RecordSettings, TraceRecorder

    s = app[SETTINGS].server
    assert s.record_path is not None
    loop = asyncio.get_running_loop()
    recorder = TraceRecorder(
        RecordSettings(Path(s.record_path), int(s.record_max_mb * 2**20), max(s.record_backups, 0)),
        started_at=loop.time(),
    )
    state = app[STATE]
    state.recorder = recorder

    async def flush() -> None:
        while True:
            await asyncio.sleep(1.0)
            recorder.flush()

    task = asyncio.create_task(flush())
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    state.recorder = None
    recorder.close()


def create_app(settings: Settings, state: RouterState | None = None) -> web.Application:
    """The router app. ``state`` may be passed in (tests, embedding); else built here."""
    state = state or RouterState(settings)
    app = web.Application(
        client_max_size=int(settings.server.max_body_mb * 2**20),
        middlewares=[
            _errors,
            security.security_middleware(security.Limits.from_server(settings.server)),
        ],
    )
    app[SETTINGS] = settings
    app[STATE] = state
    app[INDEX] = state.index
    app.cleanup_ctx.append(_upstream_session)
    for factory in settings.background:
        app.cleanup_ctx.append(factory)
    if settings.server.redis_url:
        app.cleanup_ctx.append(_redis_index)
    if settings.server.record_path:
        app.cleanup_ctx.append(_recording)
    if any(rep.zmq for rep in settings.replicas):
        app.cleanup_ctx.append(_direct_events)
    if any(rep.metrics_url for rep in settings.replicas):
        app.cleanup_ctx.append(_engine_metrics)
    if settings.server.grpc_port is not None:
        from router.rpc.server import grpc_cleanup_ctx

        app.cleanup_ctx.append(grpc_cleanup_ctx)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    admin.add_routes(app, STATE)
    return app
