"""Engine load from a Prometheus ``/metrics`` page (vLLM, SGLang, the mock replica).

Recognised gauges (first match wins), per data-parallel rank (label ``engine``, ``dp_rank``
or ``data_parallel_rank``; rank 0 without one; of several series of one rank, which differ
in other labels such as SGLang's ``pp_rank`` / ``tp_rank`` / ``priority``, the largest), of
the replica's model only when the page carries several (label ``model_name``;
:func:`parse_engine_metrics`):

* running: ``vllm:num_requests_running``, ``sglang:num_running_reqs``
* waiting: ``vllm:num_requests_waiting``, ``sglang:num_queue_reqs``
* KV usage (0-1): ``vllm:kv_cache_usage_perc``, ``vllm:gpu_cache_usage_perc``,
  ``sglang:token_usage``

and, when the engine has them, its cumulative prefix-cache counters in tokens (vLLM v1:
``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``, earlier ``vllm:gpu_prefix_cache_*``),
which the router exports per replica beside its own predicted hits (docs/metrics.md).

A page with none of the load gauges is refused (ValueError: no report, as for a replica
without a scraped page). A figure the page lacks for a rank (an engine version that renamed
or dropped its gauge) is taken as 0, the value the policies use without an engine report
(waiting: only the router's own queue counts; KV usage: no KV-pressure term), and named in
``ScrapedLoad.missing``, which :class:`MissingGauges` logs once per change. A value that is
no figure (NaN, infinite, a negative count) is taken as 0 too, for its rank alone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
RANK_LABELS = ("engine", "dp_rank", "data_parallel_rank")
# An engine's page is tens of KB; anything far larger is refused before it is parsed.
MAX_PAGE_BYTES = 4 * 2**20


async def fetch_page(session: aiohttp.ClientSession, url: str) -> str:
    """The text of a metrics page, at most ``MAX_PAGE_BYTES`` after decompression (asked
    for uncompressed); raises ValueError when larger, not HTTP 200 or cut short (a last
    line without its line feed; a body shorter than its framing raises
    ``aiohttp.ClientPayloadError``)."""
    async with session.get(url, headers={"Accept-Encoding": "identity"}) as resp:
        if resp.status != 200:
            raise ValueError(f"HTTP {resp.status}")
        if (resp.content_length or 0) > MAX_PAGE_BYTES:
            raise ValueError(f"page of {resp.content_length} bytes is over {MAX_PAGE_BYTES}")
        parts: list[bytes] = []
        size = 0
        while chunk := await resp.content.read(65536):  # b"" at the end of the body
            size += len(chunk)
            if size > MAX_PAGE_BYTES:
                raise ValueError(f"page is over {MAX_PAGE_BYTES} bytes")
            parts.append(chunk)
        page = b"".join(parts)
        # the exposition format ends every line with a line feed, the last one too: a page
        # without one was cut short (a body delimited by the connection's close alone, which
        # the client cannot tell from a whole one), its last figure maybe a digit short
        if page and not page.endswith(b"\n"):
            raise ValueError("page cut short (its last line has no line feed)")
        return page.decode("utf-8", "replace")


@dataclass(slots=True, frozen=True)
class ScrapedLoad:
    running: int
    waiting: int
    kv_usage: float
    prefix_cache_queries: float | None = None  # cumulative prompt tokens looked up
    prefix_cache_hits: float | None = None  # cumulative prompt tokens found cached
    # the load figures ("running", "waiting", "kv_usage") the page has no series for at
    # this rank: taken as 0 above
    missing: tuple[str, ...] = ()


FIGURES = {"running": RUNNING, "waiting": WAITING, "kv_usage": USAGE}


class MissingGauges:
    """Logs a warning when the load figures a source's page lacks change (once, not every
    scrape), naming the metrics looked for; and when they are all back."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self._last: dict[str, tuple[str, ...]] = {}
        self._ranks: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def check_ranks(self, source: str, found: Iterable[int], ranks: Iterable[int]) -> None:
        """Log (once per change) the engine ranks the page reports that the replica does not
        have (their load is not read: e.g. vLLM's external data-parallel load balancing
        labels each node's engines by their global rank) and the replica's ranks the page
        does not report (they keep no engine report)."""
        have, want = set(found), set(ranks)
        state = (tuple(sorted(have - want)), tuple(sorted(want - have)))
        if state == self._ranks.get(source, ((), ())):
            return
        self._ranks[source] = state
        extra, absent = state
        if extra or absent:
            self.log.warning(
                "engine metrics of %s: engine ranks %s on the page are not the replica's "
                "(its ranks: %s); ranks %s not on the page: their load is not read",
                source,
                list(extra),
                sorted(want),
                list(absent),
            )

    def check(self, source: str, loads: dict[int, ScrapedLoad]) -> tuple[str, ...]:
        """The figures missing at any rank of ``loads`` (logged if they changed)."""
        missing = tuple(f for f in FIGURES if any(f in load.missing for load in loads.values()))
        if missing != self._last.get(source, ()):
            if missing:
                self.log.warning(
                    "engine metrics of %s: no %s on the page; taken as 0, as without an "
                    "engine report, until it appears",
                    source,
                    "; no ".join(f"{f} ({' / '.join(FIGURES[f])})" for f in missing),
                )
            else:
                self.log.info("engine metrics of %s: all load gauges are back", source)
            self._last[source] = missing
        return missing


def unit_fraction(value: float) -> float:
    """``value`` clamped to [0, 1]; NaN (an engine with nothing to report yet) is 0."""
    return min(max(value, 0.0), 1.0) if not math.isnan(value) else 0.0


def request_count(value: float) -> int:
    """A running / waiting gauge as a count: NaN, infinite or negative (no count an engine
    can have) is 0, as a missing gauge; a fraction is truncated."""
    return int(value) if math.isfinite(value) and value > 0 else 0


def parse_engine_metrics(text: str, model: str | None = None) -> dict[int, ScrapedLoad]:
    """Load per dp rank of the replica serving ``model``; raises ValueError when the page is
    not Prometheus text or carries none of the gauges above (for that model).

    A page can carry several models' series (``model_name``): two engines sharing vLLM's
    ``PROMETHEUS_MULTIPROC_DIR``, a page gathered from several engines. Only ``model``'s
    are read (and series without ``model_name``); a page naming one model only is that
    model's under another name (vLLM labels with the first ``--served-model-name``); a page
    naming several models, none of them ``model``, is refused rather than read as one."""
    # metric name -> model_name label ("" without one) -> rank -> value
    values: dict[str, dict[str, dict[int, float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in RUNNING + WAITING + USAGE + QUERIES + HITS:
                    rank = 0
                    for label in RANK_LABELS:
                        if label in sample.labels and sample.labels[label].isdigit():
                            rank = int(sample.labels[label])
                            break
                    # Several series of one rank are copies of its figures, not parts to
                    # add up: SGLang's pipeline stages (``pp_rank``) and, with metrics
                    # for all schedulers, TP ranks (``tp_rank``) each export the rank's
                    # queues, and with priority scheduling the total (``priority=""``)
                    # sits beside its split by priority. The largest is the rank's (its
                    # fullest stage's KV pool); a NaN only where there is nothing else.
                    by_model = values.setdefault(sample.name, {})
                    per = by_model.setdefault(sample.labels.get("model_name", ""), {})
                    value, prev = float(sample.value), per.get(rank)
                    if prev is None or math.isnan(prev) or value > prev:
                        per[rank] = value
    except Exception as exc:  # the parser raises assorted errors on junk
        raise ValueError(f"not a Prometheus metrics page: {exc}") from None

    named = {m for by_model in values.values() for m in by_model if m}
    read: set[str]
    if model and model in named:
        read = {model, ""}
    elif not model or len(named) <= 1:
        read = named | {""}
    else:
        raise ValueError(
            f"no engine load gauges for model {model!r} on the page (it has "
            f"{', '.join(repr(m) for m in sorted(named))})"
        )

    def pick(names: tuple[str, ...]) -> dict[int, float]:
        for name in names:
            if name in values:
                merged: dict[int, float] = {}
                for m, per in values[name].items():
                    if m not in read:
                        continue
                    for r, v in per.items():
                        prev = merged.get(r)
                        if prev is None or math.isnan(prev) or v > prev:
                            merged[r] = v
                if merged:
                    return merged
        return {}

    def counter(names: tuple[str, ...]) -> dict[int, float]:
        # cumulative counts: a NaN, infinite or negative value is not a count
        return {r: v for r, v in pick(names).items() if math.isfinite(v) and v >= 0}

    running, waiting, usage = pick(RUNNING), pick(WAITING), pick(USAGE)
    queries, hits = counter(QUERIES), counter(HITS)
    ranks = set(running) | set(waiting) | set(usage)
    if not ranks:
        raise ValueError("no engine load gauges (running/waiting/kv usage) on the page")
    figures = {"running": running, "waiting": waiting, "kv_usage": usage}
    return {
        r: ScrapedLoad(
            request_count(running.get(r, 0.0)),
            request_count(waiting.get(r, 0.0)),
            unit_fraction(usage.get(r, 0.0)),
            queries.get(r),
            hits.get(r),
            tuple(name for name, per in figures.items() if r not in per),
        )
        for r in sorted(ranks)
    }
