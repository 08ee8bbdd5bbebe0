"""The ``/metrics`` page, built off the event loop.

The page grows with the fleet, a few series per replica key (docs/metrics.md, "At fleet
scale"); building its samples and text on the event loop would hold every in-flight stream
for as long on each scrape. A scrape therefore has two halves. On the loop, the registry's
collectors are asked for their families (``registry.collect()``): each reads the live
objects, which only the event-loop thread writes, and those with a series per replica or per
labelled child copy what they report and return it as :class:`Deferred` families. In a
worker thread, the text is written (``generate_latest``), the deferred families' samples
made from those copies one at a time as it reads them. The page is the state of one moment,
the loop's half, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample


class Deferred(Metric):
    """A metric family whose samples ``samples()`` makes each time they are read, i.e. when
    the page is written, one at a time (a page's worth of samples never lives at once, so
    writing it leaves the garbage collector nothing to promote: a full collection pauses
    every thread). ``samples`` reads only what its collector copied on the loop, never a
    live object."""

    def __init__(
        self, name: str, documentation: str, typ: str, samples: Callable[[], Iterator[Sample]]
    ) -> None:
        self._samples = samples
        super().__init__(name, documentation, typ)

    @property
    def samples(self) -> list[Sample]:
        # an iterator in fact: generate_latest reads it once, in order
        return self._samples()  # type: ignore[return-value]

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        """(``Metric.__init__`` sets an empty list: the samples are ``samples()``'s.)"""


def rows(
    typ: str,
    name: str,
    documentation: str,
    labelnames: Sequence[str],
    values: Callable[[], Iterable[tuple[Sequence[str], float]]],
) -> Deferred:
    """A gauge or counter family of ``values()``' (label values, value) rows, its samples
    named as prometheus-client's ``GaugeMetricFamily`` / ``CounterMetricFamily`` name
    theirs (a counter's with ``_total``)."""
    sample_name = name + "_total" if typ == "counter" else name
    names = tuple(labelnames)

    def samples() -> Iterator[Sample]:
        for labels, value in values():
            yield Sample(sample_name, dict(zip(names, labels, strict=True)), value)

    return Deferred(name, documentation, typ, samples)


class _Collected(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def page_text(families: list[Metric]) -> bytes:
    """The exposition text (format 0.0.4) of collected families (any thread)."""
    return generate_latest(_Collected(families))


def render(registry: CollectorRegistry) -> bytes:
    """The whole page at once, on the calling thread (tests, tools)."""
    return page_text(list(registry.collect()))


async def render_off_loop(registry: CollectorRegistry) -> bytes:
    """The page: collected on the event loop, written in a worker thread."""
    families = list(registry.collect())
    return await asyncio.get_running_loop().run_in_executor(None, page_text, families)
