"""Admin endpoints, behind ``server.admin_token`` (``Authorization: Bearer TOKEN`` or
``X-Admin-Token``). Without a configured token they answer 403.

* ``GET /admin/replicas``: every replica key with URL, model, rack, region, health,
  draining flag, load (in flight, queued prefill tokens, decoding) and index size;
  ``?workers=all`` combines every worker's view (:func:`combine_rows`).
* ``POST /admin/replicas/{name}/drain`` and ``.../undrain``: stop / resume routing new
  requests to a replica (all its DP ranks, or one with ``name#dpN``); in-flight requests finish.
* ``GET /admin/decisions?limit=N``: the most recent routing decisions, newest first.

Several worker processes (``server.workers = N > 1``, :func:`router.service.cli._serve_workers`)
each have their own state. ``GET`` answers are the answering worker's (they carry its
``worker_pid`` and the number of ``workers``) unless ``?workers=all`` asks every worker
through its control socket; a drain / undrain is applied by the worker that
received it and then by every other worker, through each worker's control socket
``<dir>/worker-<pid>.sock`` in the directory the parent created (mode 0700) before forking
(:class:`Workers`, :func:`join_workers`). The answer says how many workers applied it
(``workers_applied``); a worker that could not be reached makes it a 502
(``workers_unreachable``) naming the workers that failed. The gRPC Admin service's Drain /
Undrain forward the same way (:func:`forward_to_peers`, router/rpc/servicers.py) and fail
with UNAVAILABLE when a worker was not reached.

The control socket serves only the internal apply endpoints, never the public app, so there
is no "already forwarded" header a client could forge on the public port. Its trust boundary
is the file system (only the router's user can enter the directory, the socket is 0600); the
admin token travels with the forwarded request and is checked again, so a control socket
reached some other way (a loosened directory mode, root tools) still needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

from aiohttp import web

from router.service.errors import error_body, error_response
from router.service.load_share import load_sharing_ctx, own_load
from router.service.peers import peer_call
from router.service.worker_metrics import INDEX_HEADER

T = TypeVar("T")
PIDS_FILE = "workers"  # the parent's list of worker pids, one a line, in the control directory


@dataclass(frozen=True, slots=True)
class Workers:
    """The worker processes of one ``kvrouter serve``: the control directory and how many."""

    directory: str
    count: int

    def socket(self, pid: int) -> str:
        return os.path.join(self.directory, f"worker-{pid}.sock")

    def peers(self) -> tuple[list[int], int]:
        """(pids of the other workers, how many others are not known by pid). The parent
        writes the pid list once every worker is forked; before that (or if it could not)
        the control sockets present name the peers and the rest are unknown."""
        me = os.getpid()
        try:
            with open(os.path.join(self.directory, PIDS_FILE)) as f:
                pids = [int(line) for line in f if line.strip()]
        except (OSError, ValueError):
            pids = []
        if len(pids) != self.count:
            pids = []
            for entry in os.listdir(self.directory):
                if entry.startswith("worker-") and entry.endswith(".sock"):
                    try:
                        pids.append(int(entry[7:-5]))
                    except ValueError:
                        continue
            if me not in pids:
                pids.append(me)
        others = sorted(p for p in pids if p != me)
        return others, max(self.count - 1 - len(others), 0)


WORKERS = web.AppKey("kvrouter_workers", Workers)
WORKER_INDEX = web.AppKey("kvrouter_worker_index", int)  # 0 .. count-1, in fork order


def _worker_info(app: web.Application) -> dict[str, int]:
    group = app.get(WORKERS)
    return {"worker_pid": os.getpid(), "workers": group.count if group is not None else 1}


def join_workers(
    app: web.Application, group: Workers, state_key: web.AppKey[Any], index: int = 0
) -> None:
    """Make ``app`` (not started yet) worker ``index`` of ``group``: its drains reach every
    worker, and while it runs it answers the other workers' forwarded drains, and their
    requests for its own metrics page (router/service/worker_metrics.py) and its own load
    (router/service/load_share.py), on its control socket; it takes theirs every
    ``server.load_share_interval_s``."""
    app[WORKERS] = group
    app[WORKER_INDEX] = index

    async def control(app: web.Application) -> AsyncIterator[None]:
        internal = web.Application()
        token = app[state_key].settings.server.admin_token

        def apply(draining: bool) -> Any:
            async def handler(request: web.Request) -> web.Response:
                denied = _authorised(request, token)
                if denied is not None:
                    return denied
                return _apply(app[state_key], request.match_info["name"], draining, app)

            return handler

        async def own_metrics(request: web.Request) -> web.Response:
            # the control socket's file permissions are the boundary, as for /metrics
            return web.Response(
                body=app[state_key].metrics.render(),
                headers={"Content-Type": "text/plain; version=0.0.4", INDEX_HEADER: str(index)},
            )

        async def own_replicas(request: web.Request) -> web.Response:
            denied = _authorised(request, token)
            if denied is not None:
                return denied
            return web.json_response({"replicas": replica_rows(app[state_key])})

        async def own_load_of_worker(request: web.Request) -> web.Response:
            # what this worker has in flight, for the others' load sharing (load_share.py)
            return web.json_response(own_load(app[state_key].load))

        internal.router.add_get("/internal/metrics", own_metrics)
        internal.router.add_get("/internal/replicas", own_replicas)
        internal.router.add_get("/internal/load", own_load_of_worker)
        internal.router.add_post("/internal/replicas/{name}/drain", apply(True))
        internal.router.add_post("/internal/replicas/{name}/undrain", apply(False))
        runner = web.AppRunner(internal, access_log=None)
        await runner.setup()
        path = group.socket(os.getpid())
        await web.UnixSite(runner, path).start()
        os.chmod(path, 0o600)
        try:
            yield
        finally:
            await runner.cleanup()
            with contextlib.suppress(OSError):
                os.unlink(path)

    app.cleanup_ctx.append(control)
    interval = app[state_key].settings.server.load_share_interval_s
    if group.count > 1 and interval > 0:
        known: list[str] = []

        def sockets() -> list[str]:
            # every round asks peers(), a file read, only until every worker is known: the
            # parent forks its workers once and does not replace them
            if known:
                return known
            pids, unknown = group.peers()
            current = [group.socket(pid) for pid in pids]
            if not unknown:
                known.extend(current)
            return current

        app.cleanup_ctx.append(load_sharing_ctx(state_key, sockets, interval))


def _apply(state: Any, name: str, draining: bool, app: web.Application) -> web.Response:
    """Drain / undrain ``name`` in this worker's state (404 if it knows no such replica)."""
    keys = state.registry.find(name)
    if not keys:
        return error_response(404, f"no replica named {name!r}", code="replica_not_found")
    for key in keys:
        state.set_draining(key, draining)
    return web.json_response(
        {
            "replicas": [str(k) for k in keys],
            "draining": draining,
            **_worker_info(app),
            "workers_applied": 1,
        }
    )


async def _forward(group: Workers, pid: int, name: str, draining: bool, auth: str) -> bool | str:
    """Send the drain / undrain to worker ``pid``; True when it applied it, else why not."""
    action = "drain" if draining else "undrain"
    path = f"/internal/replicas/{quote(name, safe='')}/{action}"
    got = await peer_call(group.socket(pid), "POST", path, auth=auth)
    if isinstance(got, str):
        return got
    return True if got.status == 200 else got.why_not()


async def ask_peers(
    group: Workers, ask: Callable[[int], Awaitable[T | str]]
) -> tuple[list[T], list[dict[str, Any]]]:
    """``ask(pid)`` of every other worker of ``group`` at once: the answers, and the workers
    that gave none as ``{"pid", "reason"}`` (an answer that is a string is the reason; pid
    None for a worker not known by pid)."""
    peers, unknown = group.peers()
    got = await asyncio.gather(*(ask(pid) for pid in peers))
    answers = [g for g in got if not isinstance(g, str)]
    failed: list[dict[str, Any]] = [
        {"pid": pid, "reason": g} for pid, g in zip(peers, got, strict=True) if isinstance(g, str)
    ]
    failed += [{"pid": None, "reason": "not started or not known"} for _ in range(unknown)]
    return answers, failed


@dataclass(frozen=True, slots=True)
class FanOut:
    """What forwarding a drain / undrain to the other workers gave: ``workers`` in all
    (this one included, which applied it before forwarding), ``failed`` the ones that did not
    apply it (``{"pid", "reason"}``, pid None for a worker not known by pid)."""

    workers: int
    failed: list[dict[str, Any]]

    @property
    def applied(self) -> int:
        return self.workers - len(self.failed)

    def message(self, name: str, draining: bool) -> str:
        action = "drain" if draining else "undrain"
        missed = "; ".join(
            f"worker {f['pid'] if f['pid'] is not None else '?'} ({f['reason']})"
            for f in self.failed
        )
        return (
            f"{action} of {name!r} applied on {self.applied} of {self.workers} "
            f"workers; not reached: {missed}. Retry it: draining is idempotent"
        )


async def forward_to_peers(
    group: Workers | None, name: str, draining: bool, admin_token: str | None
) -> FanOut:
    """Send a drain / undrain of ``name`` (a replica name or ``name#dpN``), already applied
    in this worker, to every other worker of ``group`` through their control sockets; the
    admin token goes along (checked again there). With no group (one process) there is
    nothing to forward. Used by the HTTP admin endpoints and the gRPC Admin service."""
    if group is None or group.count <= 1:
        return FanOut(1, [])
    auth = f"Bearer {admin_token or ''}"
    _, failed = await ask_peers(group, lambda pid: _forward(group, pid, name, draining, auth))
    return FanOut(group.count, failed)


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


def replica_rows(state: Any) -> list[dict[str, Any]]:
    """``GET /admin/replicas``'s rows: every replica key as this worker sees it. The load
    fields are the requests this worker sent (so ``combine_rows`` can sum them);
    ``peers_in_flight`` is what the other workers last reported (load_share.py), which this
    worker's routing counts too."""
    now = asyncio.get_running_loop().time()
    out = []
    for ep in state.registry.endpoints():
        v = state.load.view(ep.key, now)
        own = state.load.own(ep.key)
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
                "in_flight": own.prefilling + own.decoding,
                "prefilling": own.prefilling,
                "queued_prefill_tokens": own.queued_prefill_tokens,
                "decoding": own.decoding,
                "peers_in_flight": v.in_flight - own.prefilling - own.decoding,
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
    return out


_SUMMED = ("in_flight", "prefilling", "queued_prefill_tokens", "decoding")


def combine_rows(views: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every worker's rows (``views``, one list a worker) as one row a replica key: the
    load each worker sent summed; ``healthy`` / ``draining`` true only where every worker
    that knows the key says so, with ``healthy_workers`` / ``draining_workers`` /
    ``workers_known`` counting them; index sizes the largest view; the freshest engine
    report. Keys in the order workers first list them."""
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


async def _peer_rows(group: Workers, pid: int, auth: str) -> list[dict[str, Any]] | str:
    """Worker ``pid``'s replica rows, or why it did not answer."""
    got = await peer_call(group.socket(pid), "GET", "/internal/replicas", auth=auth)
    if isinstance(got, str):
        return got
    if got.status != 200:
        return got.why_not()
    try:
        rows: list[dict[str, Any]] = json.loads(got.body)["replicas"]
    except (ValueError, KeyError, TypeError) as exc:
        return f"broken answer: {type(exc).__name__}"
    return rows


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
        scope = request.query.get("workers", "this")
        if scope not in ("this", "all"):
            return error_response(400, "workers must be 'this' or 'all'", param="workers")
        rows = replica_rows(state)
        group = request.app.get(WORKERS)
        if scope == "this" or group is None or group.count <= 1:
            return web.json_response({"replicas": rows, **_worker_info(request.app)})
        auth = f"Bearer {state.settings.server.admin_token or ''}"
        others, failed = await ask_peers(group, lambda pid: _peer_rows(group, pid, auth))
        views = [rows, *others]
        return web.json_response(
            {
                "replicas": combine_rows(views),
                "workers": group.count,
                "workers_answered": len(views),
                "workers_failed": failed,
                "worker_pid": os.getpid(),
            }
        )

    def drain_handler(draining: bool) -> Any:
        async def handler(request: web.Request, state: Any) -> web.Response:
            name = request.match_info["name"]
            local = _apply(state, name, draining, request.app)
            group = request.app.get(WORKERS)
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
                return web.json_response(out)
            message = fan.message(name, draining)
            body = json.loads(error_body(502, message, code="workers_unreachable"))
            return web.json_response({**body, **out, "workers_failed": fan.failed}, status=502)

        return handler

    async def decisions(request: web.Request, state: Any) -> web.Response:
        try:
            limit = int(request.query.get("limit", "50"))
        except ValueError:
            return error_response(400, "limit must be an integer", param="limit")
        return web.json_response(
            {"decisions": state.recent_decisions(limit), **_worker_info(request.app)}
        )

    app.router.add_get("/admin/replicas", guarded(replicas))
    app.router.add_post("/admin/replicas/{name}/drain", guarded(drain_handler(True)))
    app.router.add_post("/admin/replicas/{name}/undrain", guarded(drain_handler(False)))
    app.router.add_get("/admin/decisions", guarded(decisions))
