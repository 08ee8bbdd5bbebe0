"""Lock-free labelled counters and histograms for the per-request hot path.

prometheus-client's ``Counter`` and ``Histogram`` take a lock on every ``inc`` / ``observe``
(they may be shared between threads), and a routed request updates about fifteen of them.
The router's request metrics are only
touched by the event-loop thread (HTTP handlers, gRPC servicers and the ``/metrics``
page's collection all run on it; worker threads only tokenize), so these families keep plain
numbers instead and are exported through the registry's collector interface: ``collect``
copies the numbers (on the loop) and returns them as a
:class:`~router.service.exposition.Deferred` family, whose samples are made in the thread
that writes the page (router/service/exposition.py).

The exposition is the one prometheus-client gives its own classes (``_total`` for counters;
``_bucket{le=...}``, ``_count`` and ``_sum`` for histograms) minus the ``_created`` series.
The API is the subset the router uses: ``labels(*values)`` (or by keyword), ``remove``
(and ``remove_where``, dropping every child with one label's value), and
``inc`` / ``observe`` on a child. Do not touch them from another thread.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from itertools import pairwise

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from router.service.exposition import Deferred, rows


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds  # ascending upper bounds, +Inf excluded
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; last: +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bucket i counts values v with bounds[i-1] < v <= bounds[i] ("le" semantics)
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class _Family(Collector):
    """A labelled family registered with a prometheus-client registry."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        registry.register(self)

    def _key(self, values: tuple[object, ...], kw: dict[str, object]) -> tuple[str, ...]:
        if kw:
            if values or set(kw) != set(self.labelnames):
                raise ValueError(f"{self.name}: labels are {', '.join(self.labelnames)}")
            values = tuple(kw[n] for n in self.labelnames)
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected {len(self.labelnames)} label values")
        return tuple(str(v) for v in values)

    def remove(self, *values: object) -> None:
        """Drop a child (KeyError if it does not exist, as prometheus-client does)."""
        del self._children[self._key(values, {})]

    def remove_where(self, label: str, value: object) -> None:
        """Drop every child whose label ``label`` is ``value`` (e.g. a replica that left)."""
        at = self.labelnames.index(label)
        text = str(value)
        for key in [k for k in self._children if k[at] == text]:
            del self._children[key]

    def describe(self) -> Iterable[Metric]:
        return [self._metric()]

    def _metric(self) -> Metric:
        raise NotImplementedError


class LoopCounter(_Family):
    def labels(self, *values: object, **kw: object) -> CounterChild:
        key = self._key(values, kw)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = CounterChild()
        return child  # type: ignore[return-value]

    def _metric(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterable[Metric]:
        # on the loop: the values copied; their samples are made where the page is written
        copied = [(key, child.value) for key, child in self._children.items()]  # type: ignore[attr-defined]
        return [rows("counter", self.name, self.documentation, self.labelnames, lambda: copied)]


class LoopHistogram(_Family):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        buckets: Sequence[float],
    ) -> None:
        bounds = tuple(float(b) for b in buckets if b != float("inf"))
        if any(a >= b for a, b in pairwise(bounds)):
            raise ValueError(f"{name}: bucket bounds must be strictly ascending")
        self.bounds = bounds
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, *values: object, **kw: object) -> HistogramChild:
        key = self._key(values, kw)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = HistogramChild(self.bounds)
        return child  # type: ignore[return-value]

    def _metric(self) -> Metric:
        return Metric(self.name, self.documentation, "histogram")

    def collect(self) -> Iterable[Metric]:
        # samples added by hand, as prometheus-client's own Histogram exposes them: with a
        # negative bucket bound (kvrouter_prediction_error_tokens) _count but no _sum
        # (OpenMetrics: a sum only for non-negative observations); HistogramMetricFamily
        # would leave out _count too
        # (on the loop: the counts copied; their samples are made where the page is written)
        copied = [
            (key, list(child.counts), child.sum)  # type: ignore[attr-defined]
            for key, child in self._children.items()
        ]
        name, labelnames, bounds = self.name, self.labelnames, self.bounds

        def samples() -> Iterator[Sample]:
            with_sum = not bounds or bounds[0] >= 0
            les = [floatToGoString(b) for b in bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
            for key, counts, total_sum in copied:
                labels = dict(zip(labelnames, key, strict=True))
                total = 0
                for le, n in zip(les, counts, strict=True):
                    total += n
                    yield Sample(f"{name}_bucket", {**labels, "le": le}, float(total))
                yield Sample(f"{name}_count", labels, float(total))
                if with_sum:
                    yield Sample(f"{name}_sum", labels, total_sum)

        return [Deferred(name, self.documentation, "histogram", samples)]
