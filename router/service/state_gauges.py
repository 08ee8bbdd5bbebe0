"""The gauges of a router that mirror its live state (in-flight per replica, index size,
tokenizer mode, incremental-cache size, each model's recurrent-state layout), computed when
``/metrics`` is scraped from a :class:`StateSnapshot` (router/service/snapshot.py builds
it), never per request. Part of router.service.metrics ``Metrics``; docs/metrics.md lists
them."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.service.exposition import rows
from router.service.layout import MISMATCH_FIELDS, LayoutReport


@dataclass(slots=True, frozen=True)
class ReplicaGauge:
    replica: str
    model: str
    in_flight: int
    queued_prefill_tokens: int
    healthy: bool
    draining: bool
    rack: str = ""
    region: str = ""
    # the routing engine's cache turnover meter (router/core/turnover.py)
    cache_horizon_s: float = math.inf
    eviction_risk: float = 0.0


@dataclass(slots=True, frozen=True)
class StateSnapshot:
    """What the scrape-time collector reads (built by the app on each scrape)."""

    replicas: tuple[ReplicaGauge, ...]
    index_entries: dict[str, int]
    index_replicas: int
    tokenizer_modes: dict[str, str]
    prompt_cache_bytes: dict[str, int]
    event_lag_s: dict[str, float]
    # replica -> (model, engine's cumulative prefix-cache queries, hits), in prompt tokens
    engine_prefix_cache: dict[str, tuple[str, float, float]] = field(default_factory=dict)
    # body memo (router/service/body_memo.py): hits, misses, bytes held
    body_memo: tuple[int, int, int] = (0, 0, 0)
    # each model's recurrent-state layout and config/engine mismatches (router.service.layout)
    layouts: tuple[LayoutReport, ...] = ()


class StateCollector(Collector):
    """The gauges that mirror live state, made from a snapshot taken when ``/metrics`` is
    scraped (``snapshot``: router/service/snapshot.py)."""

    def __init__(self, snapshot: Callable[[], StateSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        # on the loop: the snapshot (copies of the live state); the samples of the families
        # with one per replica are made from it where the page is written
        # (router/service/exposition.py)
        s = self._snapshot()
        reps = s.replicas
        pair = ("replica", "model")
        inflight = rows(
            "gauge",
            "kvrouter_in_flight_requests",
            "Requests this router sent to the replica and not finished",
            pair,
            lambda: (((r.replica, r.model), r.in_flight) for r in reps),
        )
        queued = rows(
            "gauge",
            "kvrouter_queued_prefill_tokens",
            "Prompt tokens sent to the replica still awaiting their first output token",
            pair,
            lambda: (((r.replica, r.model), r.queued_prefill_tokens) for r in reps),
        )
        up = rows(
            "gauge",
            "kvrouter_replica_up",
            "1 if the replica is healthy and not draining",
            pair,
            lambda: (((r.replica, r.model), float(r.healthy and not r.draining)) for r in reps),
        )
        info = rows(
            "gauge",
            "kvrouter_replica_info",
            "1 per replica key, with its rack and region (join on replica for per-rack sums)",
            ("replica", "model", "rack", "region"),
            lambda: (((r.replica, r.model, r.rack, r.region), 1.0) for r in reps),
        )
        horizon = rows(
            "gauge",
            "kvrouter_cache_horizon_seconds",
            "How long an unused block lasts in the replica's cache at its current turnover "
            "(+Inf while it evicts nothing)",
            pair,
            lambda: (((r.replica, r.model), r.cache_horizon_s) for r in reps),
        )
        risk = rows(
            "gauge",
            "kvrouter_cache_eviction_risk",
            "Chance of reuse a new block placed there evicts beyond the fleet's calmest cache",
            pair,
            lambda: (((r.replica, r.model), r.eviction_risk) for r in reps),
        )
        entries = GaugeMetricFamily(
            "kvrouter_index_entries",
            "(block, replica) entries in the prefix index",
            labels=["kind"],
        )
        for kind, n in s.index_entries.items():
            entries.add_metric([kind], n)
        replicas = GaugeMetricFamily(
            "kvrouter_index_replicas", "Replicas known to the prefix index"
        )
        replicas.add_metric([], s.index_replicas)
        mode = GaugeMetricFamily(
            "kvrouter_tokenizer_mode",
            "1 for the model's prompt processing mode (exact, approximate, or engine: "
            "rendered by the engines)",
            labels=["model", "mode"],
        )
        for model, m in s.tokenizer_modes.items():
            mode.add_metric([model, m], 1)
        cache = GaugeMetricFamily(
            "kvrouter_prompt_cache_bytes",
            "Bytes held by the incremental tokenization cache",
            labels=["model"],
        )
        for model, n in s.prompt_cache_bytes.items():
            cache.add_metric([model], n)
        lags = s.event_lag_s
        lag = rows(
            "gauge",
            "kvrouter_index_event_lag_seconds",
            "Age of the newest index event applied for the replica when it was applied",
            ("replica",),
            lambda: (((replica,), v) for replica, v in lags.items()),
        )
        engine = s.engine_prefix_cache
        queries = rows(
            "counter",
            "kvrouter_engine_prefix_cache_queries_tokens",
            "The replica's own count of prompt tokens looked up in its prefix cache (all "
            "routers' traffic; vllm:prefix_cache_queries)",
            pair,
            lambda: (((replica, model), q) for replica, (model, q, _) in engine.items()),
        )
        hits = rows(
            "counter",
            "kvrouter_engine_prefix_cache_hits_tokens",
            "The replica's own count of prompt tokens found in its prefix cache "
            "(vllm:prefix_cache_hits)",
            pair,
            lambda: (((replica, model), h) for replica, (model, _, h) in engine.items()),
        )
        memo_hits, memo_misses, memo_bytes = s.body_memo
        memo_lookups = CounterMetricFamily(
            "kvrouter_body_memo_lookups",
            "Request bodies looked up in the exact-repeat memo, by result (a hit skips prompt "
            "processing)",
            labels=["result"],
        )
        memo_lookups.add_metric(["hit"], memo_hits)
        memo_lookups.add_metric(["miss"], memo_misses)
        memo_size = GaugeMetricFamily(
            "kvrouter_body_memo_bytes", "Bytes held by the exact-repeat body memo"
        )
        memo_size.add_metric([], memo_bytes)
        yield from (inflight, queued, up, entries, replicas, mode, cache, lag, queries, hits)
        yield from (info, horizon, risk)
        yield from (memo_lookups, memo_size)
        yield from layout_metrics(s.layouts)


def layout_metrics(layouts: Iterable[LayoutReport]) -> Iterable[Metric]:
    hybrid = GaugeMetricFamily(
        "kvrouter_model_hybrid",
        "1 if the router applies the hybrid-state rule to the model; source: config, engine "
        "(its events), registry (publishers), model_config (config.json) or none",
        labels=["model", "source"],
    )
    interval = GaugeMetricFamily(
        "kvrouter_model_state_interval_blocks",
        "The engines' recurrent-state checkpoint grid the router assumes, in router blocks "
        "(0: none known, only prompt ends are speculated)",
        labels=["model", "source"],
    )
    alignment = GaugeMetricFamily(
        "kvrouter_model_engine_block_blocks",
        "The engine block (cache-hit alignment) the router assumes, in router blocks: "
        "speculated blocks and checkpoints stop at its multiples (source: config, engine, "
        "registry or none)",
        labels=["model", "source"],
    )
    lookahead = GaugeMetricFamily(
        "kvrouter_model_lookahead_tokens",
        "The tokens after each block the engines' block hashes cover (vLLM's lookahead "
        "hashes: EAGLE / MTP engines that give back no block of a hit; source: engine, "
        "registry or none)",
        labels=["model", "source"],
    )
    eagle_drop = GaugeMetricFamily(
        "kvrouter_model_eagle_block_drop",
        "1 if the router predicts that the engines give back the last engine block of every "
        "hit ([models.NAME] eagle, and no lookahead hashes seen)",
        labels=["model"],
    )
    mismatch = GaugeMetricFamily(
        "kvrouter_model_layout_mismatch",
        "1 while the model's configuration contradicts what its engines publish (field: "
        "hybrid, state_interval_blocks, block_size, engine_block_size); the router logs each "
        "one",
        labels=["model", "field"],
    )
    for r in layouts:
        hybrid.add_metric([r.model, r.hybrid_source], float(r.hybrid))
        interval.add_metric([r.model, r.interval_source], float(r.interval_blocks))
        alignment.add_metric([r.model, r.alignment_source], float(r.alignment_blocks))
        lookahead.add_metric([r.model, r.lookahead_source], float(r.lookahead_tokens))
        eagle_drop.add_metric([r.model], float(r.drops_eagle_block))
        for name in MISMATCH_FIELDS:
            mismatch.add_metric([r.model, name], float(name in r.mismatches))
    yield from (hybrid, interval, alignment, lookahead, eagle_drop, mismatch)
