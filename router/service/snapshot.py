"""The live state as the metrics page reports it (:class:`~router.service.metrics.
StateSnapshot`), gathered when ``/metrics`` is scraped, never per request."""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING

from router.service.state_gauges import ReplicaGauge, StateSnapshot

if TYPE_CHECKING:
    from router.service.state import RouterState


def state_snapshot(state: RouterState) -> StateSnapshot:
    """What the metrics page reports about the live state, gathered at scrape time."""
    now = _loop_time()
    gauges = []
    for ep in state.registry.endpoints():
        v = state.load.view(ep.key, now)
        # this process's own requests: the routing view adds the other workers' and pods'
        # (and outlier penalties), which every process would export again
        own = state.load.own(ep.key)
        engine = state.engines.get(ep.model)
        turnover = engine.turnover if engine is not None else None
        gauges.append(
            ReplicaGauge(
                str(ep.key),
                ep.model,
                own.prefilling + own.decoding,
                own.queued_prefill_tokens,
                v.healthy,
                v.draining,
                ep.rack or "",
                ep.region or "",
                turnover.horizon_s(ep.key) if turnover is not None else math.inf,
                turnover.risk(ep.key) if turnover is not None else 0.0,
            )
        )
    stats = state.index.stats()
    return StateSnapshot(
        replicas=tuple(gauges),
        index_entries={
            "kv": stats.kv_entries,
            "state": stats.state_entries,
            "speculative": stats.speculative_entries,
        },
        index_replicas=stats.replicas,
        tokenizer_modes={
            m: (
                "engine"
                if state.settings.model(m).render == "engine"
                else "exact"
                if p.exact
                else "approximate"
            )
            for m, p in state.processors.items()
        },
        prompt_cache_bytes={
            m: p.tokenizer.stats().bytes
            for m, p in state.processors.items()
            if p.tokenizer is not None
        },
        event_lag_s=dict(state.event_lag_s),
        body_memo=(state.body_memo.hits, state.body_memo.misses, state.body_memo.size_bytes),
        layouts=tuple(state.layouts.reports()),
        engine_prefix_cache={
            str(key): (endpoint.model, queries, hits)
            for key, (queries, hits) in state.fleet.engine_prefix_cache.items()
            if (endpoint := state.registry.endpoint(key)) is not None
        },
    )


def _loop_time() -> float:
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()
