"""Engine load from a Prometheus ``/metrics`` page (vLLM, SGLang, the mock replica).

Recognised gauges (first match wins), per data-parallel rank (label ``engine``, ``dp_rank``
or ``data_parallel_rank``; rank 0 without one):

* running: ``vllm:num_requests_running``, ``sglang:num_running_reqs``
* waiting: ``vllm:num_requests_waiting``, ``sglang:num_queue_reqs``
* KV usage (0-1): ``vllm:kv_cache_usage_perc``, ``vllm:gpu_cache_usage_perc``,
  ``sglang:token_usage``

and, when the engine has them, its cumulative prefix-cache counters in tokens (vLLM v1:
``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``, earlier ``vllm:gpu_prefix_cache_*``),
which the router exports per replica beside its own predicted hits (docs/metrics.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
RANK_LABELS = ("engine", "dp_rank", "data_parallel_rank")


@dataclass(slots=True, frozen=True)
class ScrapedLoad:
    running: int
    waiting: int
    kv_usage: float
    prefix_cache_queries: float | None = None  # cumulative prompt tokens looked up
    prefix_cache_hits: float | None = None  # cumulative prompt tokens found cached


def parse_engine_metrics(text: str) -> dict[int, ScrapedLoad]:
    """Load per dp rank; raises ValueError when the page is not Prometheus text or carries
    none of the gauges above."""
    values: dict[str, dict[int, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in RUNNING + WAITING + USAGE + QUERIES + HITS:
                    rank = 0
                    for label in RANK_LABELS:
                        if label in sample.labels and sample.labels[label].isdigit():
                            rank = int(sample.labels[label])
                            break
                    per = values.setdefault(sample.name, {})
                    per[rank] = per.get(rank, 0.0) + float(sample.value)
    except Exception as exc:  # the parser raises assorted errors on junk
        raise ValueError(f"not a Prometheus metrics page: {exc}") from None

    def pick(names: tuple[str, ...]) -> dict[int, float]:
        for name in names:
            if name in values:
                return values[name]
        return {}

    running, waiting, usage = pick(RUNNING), pick(WAITING), pick(USAGE)
    queries, hits = pick(QUERIES), pick(HITS)
    ranks = set(running) | set(waiting) | set(usage)
    if not ranks:
        raise ValueError("no engine load gauges (running/waiting/kv usage) on the page")
    return {
        r: ScrapedLoad(
            int(running.get(r, 0)),
            int(waiting.get(r, 0)),
            min(max(usage.get(r, 0.0), 0.0), 1.0),
            queries.get(r),
            hits.get(r),
        )
        for r in sorted(ranks)
    }
