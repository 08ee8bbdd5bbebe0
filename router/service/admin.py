"""Admin endpoints, behind ``server.admin_token`` (``Authorization: Bearer TOKEN`` or
``X-Admin-Token``). Without a configured token they answer 403.

* ``GET /admin/replicas``: every replica key with URL, model, rack, region, health,
  draining flag, load (in flight, queued prefill tokens, decoding) and index size.
* ``POST /admin/replicas/{name}/drain`` and ``.../undrain``: stop / resume routing new
  requests to a replica (all its DP ranks, or one with ``name#dpN``); in-flight requests finish.
* ``GET /admin/decisions?limit=N``: the most recent routing decisions, newest first.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from aiohttp import web

from router.service.errors import error_response


def _authorised(request: web.Request, token: str | None) -> web.Response | None:
    if not token:
        return error_response(
            403, "admin endpoints are disabled: set server.admin_token", code="admin_disabled"
        )
    given = request.headers.get("X-Admin-Token", "")
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    if not hmac.compare_digest(given.encode(), token.encode()):
        return error_response(401, "missing or wrong admin token", code="unauthorized")
    return None


def _ratio(counters: tuple[float, float] | None) -> float | None:
    """hits / queries of the engine's cumulative prefix-cache counters (since it started)."""
    if counters is None or counters[0] <= 0:
        return None
    return round(counters[1] / counters[0], 4)


def add_routes(app: web.Application, state_key: web.AppKey[Any]) -> None:
    def guarded(handler: Any) -> Any:
        async def wrapper(request: web.Request) -> web.StreamResponse:
            state = request.app[state_key]
            denied = _authorised(request, state.settings.server.admin_token)
            if denied is not None:
                return denied
            return await handler(request, state)  # type: ignore[no-any-return]

        return wrapper

    async def replicas(request: web.Request, state: Any) -> web.Response:
        now = asyncio.get_running_loop().time()
        out = []
        for ep in state.registry.endpoints():
            v = state.load.view(ep.key, now)
            kv, st = state.index.replica_size(ep.key)
            out.append(
                {
                    "replica": str(ep.key),
                    "name": ep.key.replica,
                    "dp_rank": ep.key.dp_rank,
                    "url": ep.base_url,
                    "model": ep.model,
                    "rack": ep.rack,
                    "region": ep.region,
                    "healthy": v.healthy,
                    "draining": v.draining,
                    "in_flight": v.in_flight,
                    "prefilling": v.prefilling,
                    "queued_prefill_tokens": v.queued_prefill_tokens,
                    "decoding": v.decoding,
                    "index_kv_blocks": kv,
                    "index_state_blocks": st,
                    "source": "static" if state.is_static(ep.key.replica) else "discovered",
                    # the engine's own report (publisher or metrics_url), when there is one
                    "engine": None
                    if v.engine is None
                    else {
                        "running": v.engine.running,
                        "waiting": v.engine.waiting,
                        "kv_usage": v.engine.kv_usage,
                        "age_s": round(v.engine_age_s, 3),
                    },
                    "engine_prefix_cache_hit_ratio": _ratio(state.engine_prefix_cache.get(ep.key)),
                }
            )
        return web.json_response({"replicas": out})

    def drain_handler(draining: bool) -> Any:
        async def handler(request: web.Request, state: Any) -> web.Response:
            name = request.match_info["name"]
            keys = state.registry.find(name)
            if not keys:
                return error_response(404, f"no replica named {name!r}", code="replica_not_found")
            for key in keys:
                state.set_draining(key, draining)
            return web.json_response({"replicas": [str(k) for k in keys], "draining": draining})

        return handler

    async def decisions(request: web.Request, state: Any) -> web.Response:
        try:
            limit = int(request.query.get("limit", "50"))
        except ValueError:
            return error_response(400, "limit must be an integer", param="limit")
        return web.json_response({"decisions": state.recent_decisions(limit)})

    app.router.add_get("/admin/replicas", guarded(replicas))
    app.router.add_post("/admin/replicas/{name}/drain", guarded(drain_handler(True)))
    app.router.add_post("/admin/replicas/{name}/undrain", guarded(drain_handler(False)))
    app.router.add_get("/admin/decisions", guarded(decisions))
