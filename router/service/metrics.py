"""Prometheus metrics of one router process (prefix ``kvrouter_``, seconds and tokens).

Each app owns a :class:`Metrics` with its own registry, so several apps can live in one
process (tests). Gauges that mirror state (in-flight per replica, index size, tokenizer mode,
incremental-cache size) are computed at scrape time by a collector reading the live objects.
See docs/metrics.md for the list.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from router import __version__
from router.compile import compiled_parts
from router.service.exposition import render, render_off_loop
from router.service.loop_metrics import LoopCounter, LoopHistogram
from router.service.state_gauges import StateCollector, StateSnapshot

_LATENCY = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# to 600 s: a 1M-token prefill (~80 s at the default cost model) and the longest default SLO
# target of the flex class (60 s x 4) stay in finite buckets
_TTFT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
_TOKENS = tuple(float(4**i) for i in range(2, 11))  # 16 .. 1M
_ERROR = tuple(sorted({-(4.0**i) for i in range(2, 11)} | {0.0} | {4.0**i for i in range(2, 11)}))
_WAIT = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_SHARE = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
_ERROR_RATIO = tuple(sorted({-x for x in _SHARE} | {0.0} | set(_SHARE)))


# Prompt-length tiers (label ``tier``): few values, so per-tier series stay cheap.
TIERS = ((4096, "lt4k"), (32768, "4k_32k"), (131072, "32k_128k"))
TIER_LAST = "ge128k"


def prompt_tier(tokens: int) -> str:
    for bound, name in TIERS:
        if tokens < bound:
            return name
    return TIER_LAST


# engine usage.prompt_tokens - router prompt_tokens
_DRIFT = (-1024.0, -64.0, -16.0, -4.0, -1.0, 0.0, 1.0, 4.0, 16.0, 64.0, 1024.0)


class Metrics:
    """All metric objects of one app."""

    def __init__(self, snapshot: Callable[[], StateSnapshot]) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = LoopCounter(
            "kvrouter_requests",
            "Requests by replica and outcome (ok, upstream_4xx, "
            "upstream_5xx, connect_error, timeout, cancelled, rejected; failed: reported "
            "FAILED over gRPC)",
            ["model", "replica", "outcome"],
            registry=r,
        )
        self.prompt_tokens = LoopCounter(
            "kvrouter_prompt_tokens",
            "Prompt tokens routed (estimated in approximate mode)",
            ["model"],
            registry=r,
        )
        self.predicted_hit_tokens = LoopCounter(
            "kvrouter_predicted_hit_tokens",
            "Usable cached prefix tokens predicted by the router",
            ["model"],
            registry=r,
        )
        self.replica_prompt_tokens = LoopCounter(
            "kvrouter_replica_prompt_tokens",
            "Prompt tokens this router sent to the replica (first choice of each request)",
            ["model", "replica"],
            registry=r,
        )
        self.replica_predicted_hit_tokens = LoopCounter(
            "kvrouter_replica_predicted_hit_tokens",
            "Usable cached prefix tokens the router predicted on the replica it picked",
            ["model", "replica"],
            registry=r,
        )
        self.engine_cached_tokens = LoopCounter(
            "kvrouter_engine_cached_tokens",
            "Cached prompt tokens reported by replicas (usage.prompt_tokens_details)",
            ["model"],
            registry=r,
        )
        self.engine_cached_prompt_tokens = LoopCounter(
            "kvrouter_engine_cached_prompt_tokens",
            "Prompt tokens of the requests whose cached tokens kvrouter_engine_cached_tokens "
            "counts (its hit rate's denominator)",
            ["model"],
            registry=r,
        )
        self.prediction_error = LoopHistogram(
            "kvrouter_prediction_error_tokens",
            "Predicted usable hit minus engine-reported cached tokens, per request",
            ["model"],
            buckets=_ERROR,
            registry=r,
        )
        self.tier_prompt_tokens = LoopCounter(
            "kvrouter_tier_prompt_tokens",
            "Prompt tokens routed, by prompt-length tier",
            ["model", "tier"],
            registry=r,
        )
        self.selected_usable_tokens = LoopCounter(
            "kvrouter_selected_usable_tokens",
            "Usable cached prefix tokens predicted on the replica picked, by prompt tier",
            ["model", "tier"],
            registry=r,
        )
        self.selected_kv_hit_tokens = LoopCounter(
            "kvrouter_selected_kv_hit_tokens",
            "KV-cached prefix tokens predicted on the replica picked (usable or not), by tier",
            ["model", "tier"],
            registry=r,
        )
        self.hybrid_loss_tokens = LoopCounter(
            "kvrouter_hybrid_loss_tokens",
            "KV hit minus usable hit on the replica picked: cached KV no recurrent-state "
            "checkpoint makes reusable, by tier",
            ["model", "tier"],
            registry=r,
        )
        self.fleet_best_usable_tokens = LoopCounter(
            "kvrouter_fleet_best_usable_tokens",
            "The longest usable hit any eligible replica offered, by tier",
            ["model", "tier"],
            registry=r,
        )
        self.engine_prompt_tokens_drift = LoopHistogram(
            "kvrouter_engine_prompt_tokens_drift",
            "Engine usage.prompt_tokens minus the router's prompt tokens (exact prompts)",
            ["model"],
            buckets=_DRIFT,
            registry=r,
        )
        self.engine_prompt_tokens_mismatch = LoopCounter(
            "kvrouter_engine_prompt_tokens_mismatch",
            "Requests whose engine usage.prompt_tokens differs from the router's count",
            ["model"],
            registry=r,
        )
        self.prediction_error_ratio = LoopHistogram(
            "kvrouter_prediction_error_ratio",
            "Predicted usable hit minus engine-reported cached tokens, over the prompt's "
            "tokens, per request",
            ["model"],
            buckets=_ERROR_RATIO,
            registry=r,
        )
        self.predicted_hit_ratio = LoopHistogram(
            "kvrouter_predicted_hit_ratio",
            "Predicted usable hit / prompt tokens per request",
            ["model"],
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0),
            registry=r,
        )
        self.decision = LoopHistogram(
            "kvrouter_decision_seconds",
            "Time to decide, by phase (tokenize, hash, lookup, score)",
            ["phase"],
            buckets=_LATENCY,
            registry=r,
        )
        self.ttft = LoopHistogram(
            "kvrouter_ttft_seconds",
            "Time to first byte of the response body, at the router",
            ["model"],
            buckets=_TTFT,
            registry=r,
        )
        self.itl = LoopHistogram(
            "kvrouter_itl_seconds",
            "Time between streamed chunks, at the router",
            ["model"],
            buckets=_ITL,
            registry=r,
        )
        self.slo_requests = LoopCounter(
            "kvrouter_slo_requests",
            "Requests by SLO tier of their prompt, service class and result: met, "
            "ttft_missed, tpot_missed, both_missed, failed (no whole answer: shed, refused, "
            "a replica's error; router.core.slo; TTFT and TPOT as the "
            "router saw them, a non-streamed answer's E2E against the TTFT target; a "
            "class's TTFT target is the tier's times its ttft_factor)",
            ["model", "tier", "result", "class"],
            registry=r,
        )
        # SLO-aware admission (router/service/admission.py)
        self.admission_held = Gauge(
            "kvrouter_admission_held",
            "Requests held by admission now (queue depth), by model and class",
            ["model", "class"],
            registry=r,
        )
        self.admission_shed = LoopCounter(
            "kvrouter_admission_shed",
            "Requests refused by SLO-aware admission, by reason (deadline: it could not "
            "meet its TTFT target; queue_full) and class; answered 429 with Retry-After",
            ["model", "reason", "class"],
            registry=r,
        )
        self.admission_decisions = LoopCounter(
            "kvrouter_admission_decisions",
            "Admission's first answer to each request, by class: admit, hold, shed",
            ["model", "class", "action"],
            registry=r,
        )
        self.admission_wait = LoopHistogram(
            "kvrouter_admission_wait_seconds",
            "Time a request spent held by admission before it was sent (0: at once)",
            ["model", "class"],
            buckets=_WAIT,
            registry=r,
        )
        self.retries = LoopCounter(
            "kvrouter_retries",
            "Requests re-sent to the next-best replica",
            ["model", "reason"],
            registry=r,
        )
        self.render_requests = LoopCounter(
            "kvrouter_render_requests",
            "Prompts of render = engine models sent to an engine's render endpoint, by "
            "outcome: ok, refused (the engine refused the request), fallback (no usable "
            "answer: the router rendered the prompt itself)",
            ["model", "outcome"],
            registry=r,
        )
        self.approximate = LoopCounter(
            "kvrouter_approximate_requests",
            "Requests routed in approximate mode (no tokenizer for the model)",
            ["model"],
            registry=r,
        )
        self.prompt_cache_reused = LoopCounter(
            "kvrouter_prompt_cache_reused_tokens",
            "Prompt tokens taken from the incremental tokenization cache",
            ["model"],
            registry=r,
        )
        self.prompt_tokens_hist = LoopHistogram(
            "kvrouter_request_prompt_tokens",
            "Prompt tokens per request",
            ["model"],
            buckets=_TOKENS,
            registry=r,
        )
        self.info = Gauge(
            "kvrouter_build_info",
            "Constant 1, labelled with the version and what of it runs compiled (make compile)",
            ["version", "compiled"],
            registry=r,
        )
        self.info.labels(__version__, compiled_parts()).set(1)
        r.register(StateCollector(snapshot))
        # bound children: no per-request ``labels()`` lookups on the hot path
        self.phase_tokenize = self.decision.labels("tokenize")
        self.phase_hash = self.decision.labels("hash")
        self.phase_lookup = self.decision.labels("lookup")
        self.phase_score = self.decision.labels("score")
        self._models: dict[str, ModelMetrics] = {}

    def model(self, name: str) -> ModelMetrics:
        """The metric children of one model (bound on first use; call it only with the names
        of configured models, labels are not free)."""
        found = self._models.get(name)
        if found is None:
            found = self._models[name] = ModelMetrics(self, name)
        return found

    def forget_replica(self, model: str, replica: object) -> None:
        """Drop a removed replica's labelled series (a discovered replica left): they would
        otherwise be exported, frozen, for ever."""
        mm = self._models.get(model)
        outcomes = mm.forget(replica) if mm is not None else []
        label = str(replica)
        for counter in (self.replica_prompt_tokens, self.replica_predicted_hit_tokens):
            with contextlib.suppress(KeyError):
                counter.remove(model, label)
        for outcome in outcomes:
            with contextlib.suppress(KeyError):
                self.requests.remove(model, label, outcome)

    def render(self) -> bytes:
        """The page, written on the calling thread (tests, tools)."""
        return render(self.registry)

    async def page(self) -> bytes:
        """The page as ``/metrics`` answers it: collected on the event loop, written in a
        worker thread (router/service/exposition.py)."""
        return await render_off_loop(self.registry)


class ModelMetrics:
    """Metric children bound to one model, and per (replica, outcome) / reason caches."""

    __slots__ = (
        "_m",
        "_outcomes",
        "_replicas",
        "_retries",
        "_slo",
        "approximate",
        "drift",
        "engine_cached_prompt_tokens",
        "engine_cached_tokens",
        "itl",
        "mismatch",
        "model",
        "predicted_hit_ratio",
        "predicted_hit_tokens",
        "prediction_error",
        "prediction_error_ratio",
        "prompt_cache_reused",
        "prompt_tokens",
        "prompt_tokens_hist",
        "tiers",
        "ttft",
    )

    def __init__(self, m: Metrics, model: str) -> None:
        self._m = m
        self.model = model
        self.prompt_tokens = m.prompt_tokens.labels(model)
        self.prompt_tokens_hist = m.prompt_tokens_hist.labels(model)
        self.predicted_hit_tokens = m.predicted_hit_tokens.labels(model)
        self.predicted_hit_ratio = m.predicted_hit_ratio.labels(model)
        self.engine_cached_tokens = m.engine_cached_tokens.labels(model)
        self.engine_cached_prompt_tokens = m.engine_cached_prompt_tokens.labels(model)
        self.drift = m.engine_prompt_tokens_drift.labels(model)
        self.mismatch = m.engine_prompt_tokens_mismatch.labels(model)
        # tier -> (prompt, selected usable, selected kv, hybrid loss, fleet best) children
        self.tiers = {
            tier: (
                m.tier_prompt_tokens.labels(model, tier),
                m.selected_usable_tokens.labels(model, tier),
                m.selected_kv_hit_tokens.labels(model, tier),
                m.hybrid_loss_tokens.labels(model, tier),
                m.fleet_best_usable_tokens.labels(model, tier),
            )
            for tier in [t for _, t in TIERS] + [TIER_LAST]
        }
        self.prediction_error = m.prediction_error.labels(model)
        self.prediction_error_ratio = m.prediction_error_ratio.labels(model)
        self.approximate = m.approximate.labels(model)
        self.prompt_cache_reused = m.prompt_cache_reused.labels(model)
        self.ttft = m.ttft.labels(model)
        self.itl = m.itl.labels(model)
        self._outcomes: dict[tuple[object, str], Any] = {}
        self._replicas: dict[object, tuple[Any, Any]] = {}
        self._retries: dict[str, Any] = {}
        self._slo: dict[tuple[str, str, str], Any] = {}

    def slo(self, tier: str, result: str, klass: str = "default") -> Any:
        """The ``kvrouter_slo_requests`` child of (SLO tier label, result, service class)."""
        key = (tier, result, klass)
        child = self._slo.get(key)
        if child is None:
            child = self._slo[key] = self._m.slo_requests.labels(self.model, tier, result, klass)
        return child

    def outcome(self, replica: object, outcome: str) -> Any:
        """The ``kvrouter_requests`` child of (replica, outcome)."""
        key = (replica, outcome)
        child = self._outcomes.get(key)
        if child is None:
            replica_label = "" if replica is None else str(replica)
            child = self._outcomes[key] = self._m.requests.labels(
                self.model, replica_label, outcome
            )
        return child

    def replica(self, replica: object) -> tuple[Any, Any]:
        """The (prompt tokens, predicted hit tokens) children of a picked replica."""
        found = self._replicas.get(replica)
        if found is None:
            label = str(replica)
            found = self._replicas[replica] = (
                self._m.replica_prompt_tokens.labels(self.model, label),
                self._m.replica_predicted_hit_tokens.labels(self.model, label),
            )
        return found

    def forget(self, replica: object) -> list[str]:
        """Drop the cached children of a removed replica; returns the outcomes it had."""
        self._replicas.pop(replica, None)
        gone = [k for k in self._outcomes if k[0] == replica]
        for key in gone:
            del self._outcomes[key]
        return [outcome for _, outcome in gone]

    def prediction(self, predicted: int, prompt_tokens: int, cached: int) -> None:
        """One request's prediction error: the usable hit predicted on the replica that
        answered minus the ``cached`` tokens its engine reported (engines always compute the
        prompt's last token: a whole-prompt hit is ``prompt_tokens - 1``), in tokens and
        over the prompt. The forwarder and gRPC Report both call it."""
        error = min(predicted, prompt_tokens - 1) - cached
        self.prediction_error.observe(error)
        self.prediction_error_ratio.observe(error / prompt_tokens)

    def retry(self, reason: str) -> Any:
        child = self._retries.get(reason)
        if child is None:
            child = self._retries[reason] = self._m.retries.labels(self.model, reason)
        return child
