"""How saturated this router process is: the lag of its event loop.

Every request's routing, proxying and streaming runs on the process's one event loop; when the
loop has more work than it can do, every callback waits, and the wait is what a client sees
added to TTFT and ITL. A timer asks to wake every ``PROBE_S`` and records how late it woke.
``kvrouter_event_loop_lag_seconds`` is the largest lateness of the last ``WINDOW`` probes (about
a second): near 0 on an idle or comfortably loaded router, growing with saturation long before
CPU use reaches 100 % of a core can say so (a process uses one core at most). It is the
signal the shipped HorizontalPodAutoscaler scales router pods on (deploy/k8s, docs/pods.md).
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import AsyncIterator, Iterable

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.service.keys import STATE
from router.tasks import running

PROBE_S = 0.05
WINDOW = 20


class LoopLag(Collector):
    """The probes' lateness (seconds), the last ``WINDOW`` of them."""

    def __init__(self) -> None:
        self.late: deque[float] = deque([0.0], maxlen=WINDOW)

    async def probe(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + PROBE_S
            await asyncio.sleep(PROBE_S)
            self.late.append(max(loop.time() - asked, 0.0))

    def lag(self) -> float:
        return max(self.late)

    def collect(self) -> Iterable[Metric]:
        g = GaugeMetricFamily(
            "kvrouter_event_loop_lag_seconds",
            "How late the event loop ran a timer, the largest of the last second: the "
            "router's saturation (the HPA's signal)",
        )
        g.add_metric([], self.lag())
        yield g


async def loop_lag(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: probe the loop while the app runs, export the gauge."""
    lag = LoopLag()
    registry = app[STATE].metrics.registry
    registry.register(lag)
    try:
        async with running(lag.probe(), name=f"loop-lag-{os.getpid()}"):
            yield
    finally:
        registry.unregister(lag)
