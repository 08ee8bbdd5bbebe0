"""Admin endpoints, behind ``server.admin_token`` (``Authorization: Bearer TOKEN`` or
``X-Admin-Token``). Without a configured token they answer 403.

* ``GET /admin/pd``: per model with prefill/decode disaggregation, its settings, pools,
  decisions by reason, prefill fallbacks and transfer bytes by link (docs/pd.md).
* ``GET /admin/replicas``: every replica key with URL, model, rack, region, role, health,
  draining flag, load (in flight, queued prefill tokens, decoding) and index size;
  ``?workers=all`` combines every worker's view (:func:`combine_rows`).
* ``POST /admin/replicas/{name}/drain`` and ``.../undrain``: stop / resume routing new
  requests to a replica (all its DP ranks, or one with ``name#dpN``); in-flight requests finish.
* ``GET /admin/decisions?limit=N``: the most recent routing decisions, newest first;
  ``?workers=all`` merges every worker's (each decision with its ``worker_pid``).

With several worker processes (router/service/workers.py) ``GET`` answers are the answering
worker's (they carry its ``worker_pid`` and the number of ``workers``) unless
``?workers=all`` (replicas, decisions) asks every worker through its control socket (a
``workers`` value other than ``this`` / ``all`` is a 400); a drain / undrain is applied
by the worker that received it and then by every other worker. The answer says how many
workers applied it (``workers_applied``); a worker that could not be reached makes it a 502
(``workers_unreachable``) naming the workers that failed. The gRPC Admin service's Drain /
Undrain forward the same way and fail with UNAVAILABLE when a worker was not reached.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
from typing import Any

from aiohttp import web

from router.service.ejection import Ejections
from router.service.errors import ErrorReply, error_body
from router.service.http_types import HttpRequest, Reply
from router.service.keys import FORWARDER, STATE, WORKERS
from router.service.peers import peer_call
from router.service.routes import Handler, Routes, error
from router.service.state import RouterState
from router.service.workers import Workers, ask_peers, forward_to_peers, worker_info

DECISIONS_PATH = "/internal/decisions"  # a worker's own decisions, on its control socket


def authorised(req: HttpRequest, token: str | None) -> Reply | None:
    """None when ``req`` carries the admin token, else the refusal (403 without a token)."""
    if not token:
        text = "admin endpoints are disabled: set server.admin_token"
        return error(ErrorReply(403, text, "admin_disabled"))
    # either header carries it: an Authorization holding a client's API key (a gateway's)
    # does not hide an X-Admin-Token beside it; both are compared, in constant time
    auth = req.header("Authorization")
    bearer = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    # the header's bytes as sent (read as latin-1) against the token's UTF-8: a non-ASCII
    # token matches as a client sends it
    expected = token.encode()
    header_ok = hmac.compare_digest(req.header("X-Admin-Token").encode("latin-1"), expected)
    bearer_ok = hmac.compare_digest(bearer.encode("latin-1"), expected)
    if not (header_ok or bearer_ok):
        return error(ErrorReply(401, "missing or wrong admin token", "unauthorized"))
    return None


def apply_drain(state: RouterState, name: str, draining: bool, group: Workers | None) -> Reply:
    """Drain / undrain ``name`` in this worker's state (404 if it knows no such replica)."""
    keys = state.registry.find(name)
    if not keys:
        return error(ErrorReply(404, f"no replica named {name!r}", "replica_not_found"))
    if state.registry.get(name) is not None:  # the whole replica: its later ranks too
        state.fleet.set_replica_draining(name, draining)
    else:
        for key in keys:
            state.fleet.set_draining(key, draining)
    return Reply.json(
        {
            "replicas": [str(k) for k in keys],
            "draining": draining,
            **worker_info(group),
            "workers_applied": 1,
        }
    )


def _ratio(counters: tuple[float, float] | None) -> float | None:
    """hits / queries of the engine's cumulative prefix-cache counters (since it started)."""
    if counters is None or counters[0] <= 0:
        return None
    return round(counters[1] / counters[0], 4)


def replica_rows(state: RouterState, ejections: Ejections | None = None) -> list[dict[str, Any]]:
    """``GET /admin/replicas``'s rows: every replica key as this worker sees it. The load
    fields are the requests this worker sent (so ``combine_rows`` can sum them);
    ``peers_in_flight`` is what the other workers (load_share.py) and the other pods'
    members (pod_exchange.py) last reported, which this worker's routing counts too."""
    now = asyncio.get_running_loop().time()
    engine_cache = state.fleet.engine_prefix_cache
    out = []
    for ep in state.registry.endpoints():
        v = state.load.view(ep.key, now)
        own = state.load.own(ep.key)
        phantom = ejections.detector.penalty(ep.key, now) if ejections is not None else 0
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
                "role": ep.role,
                "healthy": v.healthy,
                "draining": v.draining,
                "in_flight": own.prefilling + own.decoding,
                "prefilling": own.prefilling,
                "queued_prefill_tokens": own.queued_prefill_tokens,
                "decoding": own.decoding,
                "peers_in_flight": v.in_flight - own.prefilling - own.decoding - phantom,
                "index_kv_blocks": kv,
                "index_state_blocks": st,
                "source": "static" if state.fleet.is_static(ep.key.replica) else "discovered",
                # the engine's own report (publisher or metrics_url), when there is one
                "engine": None
                if v.engine is None
                else {
                    "running": v.engine.running,
                    "waiting": v.engine.waiting,
                    "kv_usage": v.engine.kv_usage,
                    "age_s": round(v.engine_age_s, 3),
                },
                "engine_prefix_cache_hit_ratio": _ratio(engine_cache.get(ep.key)),
                # outlier detection: failure run, and why / how long ejected
                "outlier": ejections.status(ep.key, now) if ejections is not None else None,
            }
        )
    return out


_SUMMED = ("in_flight", "prefilling", "queued_prefill_tokens", "decoding")


def combine_rows(views: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every worker's rows (``views``, one list a worker) as one row a replica key: the
    load each worker sent summed; ``healthy`` / ``draining`` true only where every worker
    that knows the key says so, with ``healthy_workers`` / ``draining_workers`` /
    ``workers_known`` counting them; index sizes the largest view; the freshest engine
    report; ``outlier`` of a worker that ejected the replica, if one did (each worker has
    its own detector). Keys in the order workers first list them."""
    merged: dict[str, dict[str, Any]] = {}
    for rows in views:
        for row in rows:
            m = merged.get(row["replica"])
            if m is None:
                m = merged[row["replica"]] = {
                    **row,
                    "healthy_workers": 0,
                    "draining_workers": 0,
                    "workers_known": 0,
                    **{k: 0 for k in _SUMMED},
                }
            m["workers_known"] += 1
            m["healthy_workers"] += bool(row["healthy"])
            m["draining_workers"] += bool(row["draining"])
            for k in _SUMMED:
                m[k] += row[k]
            for k in ("index_kv_blocks", "index_state_blocks"):
                m[k] = max(m[k], row[k])
            if (row.get("outlier") or {}).get("ejected") and not (m.get("outlier") or {}).get(
                "ejected"
            ):
                m["outlier"] = row["outlier"]  # any worker's ejection shows
            engine = row["engine"]
            if engine is not None and (
                m["engine"] is None or engine["age_s"] < m["engine"]["age_s"]
            ):
                m["engine"] = engine
                m["engine_prefix_cache_hit_ratio"] = row["engine_prefix_cache_hit_ratio"]
    for m in merged.values():
        m.pop("peers_in_flight", None)  # one worker's view of the others: the sum says it all
        m["healthy"] = m["healthy_workers"] == m["workers_known"]
        m["draining"] = m["draining_workers"] == m["workers_known"]
    return list(merged.values())


def own_decisions(state: RouterState, limit: int) -> list[dict[str, Any]]:
    """This worker's last ``limit`` decisions, newest first, each with its ``worker_pid``
    (``GET /admin/decisions?workers=all`` merges every worker's)."""
    pid = os.getpid()
    return [{**d, "worker_pid": pid} for d in state.recent_decisions(limit)]


async def _peer_list(
    group: Workers, pid: int, path: str, field: str, auth: str
) -> list[dict[str, Any]] | str:
    """The list ``field`` of worker ``pid``'s answer to ``GET path`` on its control socket
    (its replica rows, its decisions), or why it did not answer."""
    got = await peer_call(group.socket(pid), "GET", path, auth=auth)
    if isinstance(got, str):
        return got
    if got.status != 200:
        return got.why_not()
    try:
        items = json.loads(got.body)[field]
    except (ValueError, KeyError, TypeError) as exc:
        return f"broken answer: {type(exc).__name__}"
    if not isinstance(items, list):
        return f"broken answer: {field} is not a list"
    return items


def decisions_limit(req: HttpRequest) -> int | Reply:
    """``?limit=``: how many decisions (default 50); the refusal for a non-integer."""
    try:
        return int(req.query().get("limit", "50"))
    except ValueError:
        return error(ErrorReply(400, "limit must be an integer", param="limit"))


def _scope(req: HttpRequest) -> str | Reply:
    """``?workers=``: ``this`` (the default: the answering worker's view) or ``all``; the
    refusal for anything else."""
    scope = req.query().get("workers", "this")
    if scope not in ("this", "all"):
        return error(ErrorReply(400, "workers must be 'this' or 'all'", param="workers"))
    return scope


def _all_workers(group: Workers, answered: int, failed: list[dict[str, Any]]) -> dict[str, Any]:
    """The fields of an answer that asked every worker (``?workers=all``)."""
    return {
        "workers": group.count,
        "workers_answered": answered,
        "workers_failed": failed,
        "worker_pid": os.getpid(),
    }


def add_routes(routes: Routes, app: web.Application) -> None:
    def guarded(handler: Handler) -> Handler:
        async def wrapper(req: HttpRequest, param: str) -> Reply:
            denied = authorised(req, app[STATE].settings.server.admin_token)
            if denied is not None:
                return denied
            return await handler(req, param)

        return wrapper

    async def replicas(req: HttpRequest, _: str) -> Reply:
        state = app[STATE]
        scope = _scope(req)
        if isinstance(scope, Reply):
            return scope
        forwarder = app.get(FORWARDER)
        rows = replica_rows(state, forwarder.ejections if forwarder is not None else None)
        group = app.get(WORKERS)
        if scope == "this" or group is None or group.count <= 1:
            return Reply.json({"replicas": rows, **worker_info(group)})
        auth = f"Bearer {state.settings.server.admin_token or ''}"
        others, failed = await ask_peers(
            group, lambda pid: _peer_list(group, pid, "/internal/replicas", "replicas", auth)
        )
        views = [rows, *others]
        return Reply.json(
            {"replicas": combine_rows(views), **_all_workers(group, len(views), failed)}
        )

    def drain_handler(draining: bool) -> Handler:
        async def handler(req: HttpRequest, name: str) -> Reply:
            state = app[STATE]
            group = app.get(WORKERS)
            local = apply_drain(state, name, draining, group)
            if local.status != 200 or group is None or group.count <= 1:
                return local
            fan = await forward_to_peers(group, name, draining, state.settings.server.admin_token)
            out: dict[str, Any] = {
                "replicas": [str(k) for k in state.registry.find(name)],
                "draining": draining,
                "workers": fan.workers,
                "workers_applied": fan.applied,
                "worker_pid": os.getpid(),
            }
            if not fan.failed:
                return Reply.json(out)
            message = fan.message(name, draining)
            body = json.loads(error_body(502, message, code="workers_unreachable"))
            return Reply.json({**body, **out, "workers_failed": fan.failed}, status=502)

        return handler

    async def decisions(req: HttpRequest, _: str) -> Reply:
        limit = decisions_limit(req)
        if isinstance(limit, Reply):
            return limit
        scope = _scope(req)
        if isinstance(scope, Reply):
            return scope
        state = app[STATE]
        group = app.get(WORKERS)
        if scope == "this" or group is None or group.count <= 1:
            return Reply.json({"decisions": state.recent_decisions(limit), **worker_info(group)})
        auth = f"Bearer {state.settings.server.admin_token or ''}"
        path = f"{DECISIONS_PATH}?limit={limit}"
        others, failed = await ask_peers(
            group, lambda pid: _peer_list(group, pid, path, "decisions", auth)
        )
        merged = [d for view in (own_decisions(state, limit), *others) for d in view]
        merged.sort(key=lambda d: d.get("at", 0.0), reverse=True)  # newest first, all workers
        return Reply.json(
            {"decisions": merged[: max(limit, 0)], **_all_workers(group, 1 + len(others), failed)}
        )

    routes.get("/admin/replicas", guarded(replicas))
    routes.post("/admin/replicas/{name}/drain", guarded(drain_handler(True)))
    routes.post("/admin/replicas/{name}/undrain", guarded(drain_handler(False)))
    routes.get("/admin/decisions", guarded(decisions))

    async def pd(req: HttpRequest, _: str) -> Reply:
        from router.service.pd_metrics import admin_view

        return Reply.json({"models": admin_view(app[STATE]), **worker_info(app.get(WORKERS))})

    routes.get("/admin/pd", guarded(pd))
