"""The request-latency histograms vLLM exports, kept by the mock replica.

vLLM measures from a request's arrival at its API server: time to first token, end to end,
time spent waiting for admission, and each request's time per output token
(``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``,
``vllm:request_queue_time_seconds``, ``vllm:request_time_per_output_token_seconds``). The
mock measures the same on the wall clock of its handler, so what it reports includes its
own delays (parsing, its event loop's lag behind the engine model on a busy machine), as a
real engine's figures include its frontend's. Dashboards and schedulers that read these
from vLLM read them from the mock; ``kvrouter bench live`` compares them with what its
client saw, which splits a TTFT into the engines' share and the path's (router and HTTP).

Bucket bounds: vLLM 0.34's defaults (``vllm/v1/metrics/buckets.py``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import HistogramMetricFamily

from router.core.slo import tpot_s

REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip


@dataclass(slots=True)
class Histogram:
    """Observations counted into ``bounds`` (upper bounds, increasing; +Inf is implied)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, the last one +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError("histogram bounds must be increasing")
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs as Prometheus exposes them, ``+Inf`` last."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


@dataclass(slots=True)
class RequestLatency:
    """The four per-request histograms of one replica."""

    ttft: Histogram = field(default_factory=lambda: Histogram(TIME_TO_FIRST_TOKEN_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(INTER_TOKEN_LATENCY_BUCKETS))

    def observe(self, ttft_s: float, e2e_s: float, queue_s: float, output_tokens: int) -> None:
        """A finished request: seconds from its arrival to its first and last token, its
        wait for admission, and how many tokens it produced (TPOT needs at least two)."""
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        self.queue.observe(queue_s)
        tpot = tpot_s(e2e_s, ttft_s, output_tokens)  # the SLO's (and vLLM's) TPOT
        if tpot is not None:
            self.tpot.observe(max(tpot, 0.0))

    def families(
        self, labels: Sequence[str], values: Sequence[str]
    ) -> Iterator[HistogramMetricFamily]:
        for name, doc, hist in (
            (
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                self.ttft,
            ),
            (
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                self.e2e,
            ),
            (
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                self.queue,
            ),
            (
                "vllm:request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                self.tpot,
            ),
        ):
            family = HistogramMetricFamily(name, doc, labels=list(labels))
            family.add_metric(list(values), hist.cumulative(), sum_value=hist.total)
            yield family
