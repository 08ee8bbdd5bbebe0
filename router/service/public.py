"""The public port's routes besides the two hot endpoints: ``GET /v1/models`` (and
``/v1/models/{id}``, the id may hold slashes: ``meta-llama/Llama-3.1-8B``), ``/health``
(and vLLM's ``/ping``), ``/ready`` and ``/metrics`` (the admin routes are
router.service.admin's). Each answers a whole :class:`~router.service.http_types.Reply`;
the front door (router.service.handling) has checked the request before."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
from aiohttp import web

from router.core.types import ReplicaKey
from router.service.errors import ErrorReply
from router.service.http_types import HttpRequest, Reply
from router.service.keys import SESSION, STATE, STOPPING, WORKER_INDEX, WORKERS
from router.service.model_card import model_card
from router.service.routes import Routes, error
from router.service.state import RouterState
from router.service.worker_metrics import all_workers_page

_PROMETHEUS = b"text/plain; version=0.0.4"


def add_routes(routes: Routes, app: web.Application) -> None:
    async def models(req: HttpRequest, _: str) -> Reply:
        return await models_reply(app[STATE], app[SESSION])

    async def model(req: HttpRequest, name: str) -> Reply:
        listed = await models_reply(app[STATE], app[SESSION])
        for item in json.loads(listed.body)["data"]:
            if item.get("id") == name:
                return Reply.json(item)
        return error(ErrorReply(404, f"The model '{name}' does not exist", "model_not_found"))

    async def health(req: HttpRequest, _: str) -> Reply:
        return Reply.json({"status": "ok"})

    async def ready(req: HttpRequest, _: str) -> Reply:
        return ready_reply(app[STATE], stopping=app[STOPPING].started)

    async def metrics(req: HttpRequest, _: str) -> Reply:
        """This process's metrics; with several workers, every worker's, labelled ``worker``
        (router/service/worker_metrics.py)."""
        body = await app[STATE].metrics.page()
        group = app.get(WORKERS)
        if group is not None and group.count > 1:
            peers, _unknown = group.peers()
            sockets = [group.socket(p) for p in peers]
            body = await all_workers_page(
                app[WORKER_INDEX], body, sockets, group.count, group.restarts()
            )
        return Reply.text(body, _PROMETHEUS)

    routes.get("/v1/models", models)
    routes.get("/v1/models/{id:path}", model)
    routes.get("/health", health)
    routes.get("/ping", health)  # vLLM's (SageMaker's) name for it, GET and POST
    routes.post("/ping", health)
    routes.get("/ready", ready)
    routes.get("/metrics", metrics)


async def models_reply(state: RouterState, session: aiohttp.ClientSession) -> Reply:
    """The models the router routes: configured (or served by a configured replica) and with
    at least one replica, i.e. every model a request may name without a 404. Each entry is
    vLLM's ``ModelCard``: the first replica's own ``/v1/models`` entry for it (its metadata
    passes through), the fields it lacks (null ``max_model_len`` included) filled in from
    the router's card (``model_card``; ``max_model_len`` the model's ``context_length``, null
    when the router knows none), or the router's card if no replica reports it. Other ids
    the replicas report (LoRA adapters, say) are left out: the router answers 404 for them."""
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
    created = int(time.time())
    data = []
    for name in routed:
        own = model_card(
            name,
            created=created,
            owned_by="kvrouter",
            max_model_len=state.settings.model(name).context_length,
        )
        card = {**own, **found.get(name, {})}
        if card["max_model_len"] is None:
            card["max_model_len"] = own["max_model_len"]
        data.append(card)
    return Reply.json({"object": "list", "data": data})


def routable(state: RouterState, model: str) -> bool:
    """A request naming ``model`` is routed (not answered 404): what ``state.processor``
    accepts."""
    return model in state.processors and bool(state.registry.keys_for(model))


def _available(state: RouterState, name: str, now: float) -> list[ReplicaKey]:
    keys = state.registry.keys_for(name)
    return [k for k in keys if (v := state.load.view(k, now)).healthy and not v.draining]


def is_ready(state: RouterState, now: float) -> bool:
    """What ``/ready`` answers 200 for: a model with an available replica (healthy, not
    draining); the gRPC health service follows it too. Not every model: the pods' readiness
    decides whether a load balancer sends them anything, and one model whose replicas are
    all down (or drained for maintenance) must not take the others' router out with it."""
    state.fleet.restore_health(now)
    return any(_available(state, name, now) for name in state.registry.models())


def ready_reply(state: RouterState, *, stopping: bool = False) -> Reply:
    """200 when a model has an available replica (:func:`is_ready`) and the process is not
    stopping (a SIGTERM drain); says per model how many replicas are available and which
    models are approximate."""
    now = asyncio.get_running_loop().time()
    state.fleet.restore_health(now)
    out: dict[str, Any] = {}
    ok = False
    for name in state.registry.models():
        keys = state.registry.keys_for(name)
        up = _available(state, name, now)
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
        ok = ok or bool(up)
    ok = ok and not stopping
    body: dict[str, Any] = {"ready": ok, "models": out}
    if stopping:
        body["stopping"] = True
    return Reply.json(body, status=200 if ok else 503)
