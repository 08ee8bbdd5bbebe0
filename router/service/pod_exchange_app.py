"""The pods exchange in a running router process (router/service/pod_exchange.py): its
settings from ``[server]``, its Redis client and speculative-row share, its metrics, and its
start and clean stop with the app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Iterable

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.service.keys import SETTINGS, STATE, WORKERS
from router.service.peer_sum import PEER_SUM, peer_sum
from router.service.pod_exchange import BLOCK_MS, ExchangeSettings, PodExchange
from router.service.pod_share import PodShare
from router.tasks import running

_log = logging.getLogger(__name__)


class _ExchangeCollector(Collector):
    def __init__(self, exchange: PodExchange) -> None:
        self.exchange = exchange

    def collect(self) -> Iterable[Metric]:
        ex = self.exchange
        age = GaugeMetricFamily(
            "kvrouter_peer_view_age_seconds",
            "Age of the freshest load snapshot of another router pod (pods_exchange); a view "
            "older than pods_stale_s is dropped",
            labels=["peer"],
        )
        for pod, seconds in sorted(ex.views.ages(ex.clock()).items()):
            age.add_metric([pod], seconds)
        views = GaugeMetricFamily(
            "kvrouter_peer_views", "Members of other router pods whose load this one counts"
        )
        views.add_metric([], len(ex.views.views))
        c = ex.counters
        snaps = CounterMetricFamily(
            "kvrouter_pod_exchange_snapshots",
            "Load snapshots sent to / received from Redis (pods_exchange)",
            labels=["direction"],
        )
        snaps.add_metric(["sent"], c.sent)
        snaps.add_metric(["received"], c.received)
        nbytes = CounterMetricFamily(
            "kvrouter_pod_exchange_bytes",
            "Bytes of load snapshots sent to / received from Redis",
            labels=["direction"],
        )
        nbytes.add_metric(["sent"], c.bytes_sent)
        nbytes.add_metric(["received"], c.bytes_received)
        errors = CounterMetricFamily(
            "kvrouter_pod_exchange_errors", "Failed Redis calls of the pod load exchange"
        )
        errors.add_metric([], c.errors)
        up = GaugeMetricFamily(
            "kvrouter_pod_exchange_redis_up",
            "1 while the pods exchange's Redis calls succeed, 0 while Redis is unreachable or "
            "refuses its writes or its reads",
        )
        up.add_metric([], 0.0 if c.failing else 1.0)
        rejected = CounterMetricFamily(
            "kvrouter_pod_exchange_rejected",
            "Messages (or their shared rows) of other members ignored: too large or malformed",
        )
        rejected.add_metric([], c.rejected + (ex.share.counters.rejected if ex.share else 0))
        clashes = CounterMetricFamily(
            "kvrouter_pod_exchange_name_clashes",
            "Live members of another pod that uses this pod's name (each ignores the other)",
        )
        clashes.add_metric([], c.name_clashes)
        gaps = CounterMetricFamily(
            "kvrouter_pod_exchange_gaps",
            "Stream reads that found entries trimmed unread past the last one read (the "
            "reader fell behind by more than the stream keeps)",
        )
        gaps.add_metric([], c.gaps)
        yield from (age, views, snaps, nbytes, errors, up, rejected, clashes, gaps)
        if ex.share is not None:
            shared = CounterMetricFamily(
                "kvrouter_pod_exchange_shared",
                "Speculative entries / session bindings of other members applied here, those "
                "taken back since (withdrawn), and own dispatches or withdrawals dropped "
                "unsent (outbox full)",
                labels=["kind"],
            )
            shared.add_metric(["speculative"], ex.share.counters.applied_spec)
            shared.add_metric(["session"], ex.share.counters.applied_sessions)
            shared.add_metric(["withdrawn"], ex.share.counters.withdrawn)
            shared.add_metric(["dropped"], ex.share.outbox.dropped)
            yield shared


def pod_name(configured: str | None, port: int) -> str:
    """``server.pod_name``, else ``<hostname>:<port>`` (unique per pod, and per router
    process when several run on one host)."""
    return configured or f"{socket.gethostname()}:{port}"


def pod_exchange_ctx(app: web.Application) -> Callable[[web.Application], AsyncIterator[None]]:
    """A ``cleanup_ctx`` running this process's exchange while ``app`` (not started yet)
    runs; with ``server.redis_url`` and ``server.pods_exchange`` other than ``off``."""
    peer_sum(app)

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        from router.store.redis_store import connect

        s = app[SETTINGS].server
        state = app[STATE]
        settings = ExchangeSettings(
            s.pods_exchange,
            s.redis_key_prefix,
            pod_name(s.pod_name, s.port),
            s.pods_exchange_interval_s,
            s.pods_stale_s,
        )
        client = connect(s.redis_url or "", socket_timeout=max(2.0, 2 * BLOCK_MS / 1000))
        loop = asyncio.get_running_loop()
        share = PodShare(
            state.engines,
            lambda model, key: key in state.registry.keys_for(model),
            lambda model: max(state.speculative_ttl.get(model, (0.0, 0.0))),
        )
        share.attach()
        exchange = PodExchange(
            settings, client, state.load, app[PEER_SUM], loop.time, share, app.get(WORKERS)
        )
        collector = _ExchangeCollector(exchange)
        state.metrics.registry.register(collector)
        _log.info(
            "pod load exchange: %s as %s every %g s (stale after %g s)",
            settings.mode,
            exchange.member,
            settings.interval_s,
            settings.stale_s,
        )
        try:
            async with running(exchange.run(), name=f"pod-exchange-{os.getpid()}"):
                yield
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(exchange.leave(), 1.0)
        finally:
            state.metrics.registry.unregister(collector)
            with contextlib.suppress(Exception):
                await client.aclose()

    return ctx
