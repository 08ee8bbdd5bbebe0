"""The typed keys of the router's application object (``web.Application``, the container
of the process's parts and of their start / stop contexts; it serves no HTTP itself).

A module of its own that imports only the types it names, so every part may read the keys
without importing :mod:`router.service.app` (which imports them all)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from router.core.index import PrefixIndex
from router.service.gate import Gate
from router.service.proxy import Forwarder
from router.service.report_relay import ReportRelay
from router.service.routes import Routes
from router.service.settings import Settings
from router.service.state import RouterState
from router.service.stopping import Stopping
from router.service.workers import Workers

if TYPE_CHECKING:  # (imports redis / zmq: only when configured)
    from router.events.direct import DirectEvents
    from router.store.sync import IndexSync

SETTINGS = web.AppKey("kvrouter_settings", Settings)
STATE = web.AppKey("kvrouter_state", RouterState)
INDEX = web.AppKey("kvrouter_index", PrefixIndex)
FORWARDER = web.AppKey("kvrouter_forwarder", Forwarder)
# the client keys and per-key limits of this process: the public port's front door and the
# gRPC Router service check and count with this one object (router/service/gate.py)
GATE = web.AppKey("kvrouter_gate", Gate)
# side traffic (/v1/models of the replicas, health probes)
SESSION = web.AppKey("kvrouter_session", aiohttp.ClientSession)
# the public port's routes besides the two hot endpoints (router.service.routes)
ROUTES = web.AppKey("kvrouter_routes", Routes)
# the Redis index follower (router.store.sync.IndexSync) when server.redis_url is set
INDEX_SYNC: web.AppKey[IndexSync] = web.AppKey("kvrouter_index_sync")
# the replicas' KV-event subscriptions (router.events.direct) when any replica has ``zmq``
DIRECT_EVENTS: web.AppKey[DirectEvents] = web.AppKey("kvrouter_direct_events")
# with several worker processes (server.workers > 1): the group and this worker's index
WORKERS = web.AppKey("kvrouter_workers", Workers)
WORKER_INDEX = web.AppKey("kvrouter_worker_index", int)  # 0 .. count-1, in fork order
# the process's stop: set when the SIGTERM drain begins (router/service/stopping.py)
STOPPING = web.AppKey("kvrouter_stopping", Stopping)
GRPC_PORT = web.AppKey("kvrouter_grpc_port", int)
GRPC_SERVER = web.AppKey("kvrouter_grpc_server", object)
# with several workers: how the control socket reaches this worker's gRPC Reports
REPORT_RELAY = web.AppKey("kvrouter_report_relay", ReportRelay)
