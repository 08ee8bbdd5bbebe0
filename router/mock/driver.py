"""``EngineDriver``: the simulator's engine model on the asyncio loop clock.

One task owns the model. ``submit`` queues a request and returns a queue of its outputs
(``FirstToken``, ``TokensEmitted``, ``Finished`` or ``Rejected``); the task sleeps until the
model's ``next_time()`` or a new submission, calls ``advance(now)``, routes outputs to their
queues, and hands the index events the model recorded to ``on_index_events`` (the mock turns
them into vLLM-format KV events). Model time runs on the loop's monotonic clock, scaled by
``time_scale`` (wall seconds per modelled second: 1.0 keeps the profile's timing, 0.05 runs
the same schedule 20 times faster, for tests where the modelled durations are not the point).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from router.core.load import EngineReport
from router.core.types import IndexEvent

if TYPE_CHECKING:
    from sim.engine import EngineModel, EngineOutput, EngineRequest

log = logging.getLogger(__name__)


class EngineFailed(RuntimeError):
    """The engine model raised: the requests on it and every later one fail with this,
    instead of waiting for outputs that will never come."""


class EngineDriver:
    def __init__(
        self,
        model: EngineModel,
        on_index_events: Callable[[list[IndexEvent]], None] | None = None,
        *,
        time_scale: float = 1.0,
    ) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.model = model
        self.time_scale = time_scale
        self.on_index_events = on_index_events or (lambda events: None)
        self._queues: dict[str, asyncio.Queue[EngineOutput | EngineFailed]] = {}
        self.failure: EngineFailed | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.loop = asyncio.get_running_loop()
        self._origin = self.loop.time()

    def now(self) -> float:
        """Model time: the loop's clock since the driver started, over ``time_scale``."""
        return self._origin + (self.loop.time() - self._origin) / self.time_scale

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="mock-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def submit(
        self,
        request: EngineRequest,
        queue: asyncio.Queue[EngineOutput | EngineFailed] | None = None,
    ) -> asyncio.Queue[EngineOutput | EngineFailed]:
        """Queue ``request`` (a ``sim.engine.EngineRequest``) now; raises ValueError as the
        model does (duplicate id, bad sizes), ``EngineFailed`` once the model has failed. The
        queue (a new one, else ``queue``: requests sharing one get their outputs in the
        model's order) gets the request's outputs, or the ``EngineFailed`` that ends them."""
        if self.failure is not None:
            raise self.failure
        if queue is None:
            queue = asyncio.Queue()
        self.model.submit(request, self.now())
        self._queues[request.request_id] = queue
        self._wake.set()
        return queue

    def cancel(self, request_id: str) -> None:
        if self._queues.pop(request_id, None) is not None:
            self.model.cancel(request_id, self.now())
            self._wake.set()

    def report(self) -> EngineReport:
        report: EngineReport = self.model.report(self.now())
        return report

    def _pump(self) -> None:
        for out in self.model.advance(self.now()):
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
                if type(out).__name__ in ("Finished", "Rejected"):
                    self._queues.pop(out.request_id, None)
        events = self.model.take_index_events()
        if events:
            self.on_index_events(events)

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as exc:
            log.exception("mock engine model failed; failing its %d requests", len(self._queues))
            self.failure = EngineFailed(f"engine model failed: {type(exc).__name__}: {exc}")
            for queue in self._queues.values():
                queue.put_nowait(self.failure)
            self._queues.clear()

    async def _loop(self) -> None:
        while True:
            self._pump()
            nxt = self.model.next_time()
            self._wake.clear()
            timeout = None if nxt is None else max(0.0, (nxt - self.now()) * self.time_scale)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
