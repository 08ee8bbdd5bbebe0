"""``/metrics`` at fleet scale: the page is built off the event loop.

The page grows with the fleet (a few series per replica key); building its samples and
text on the event loop held every in-flight stream for as long on each scrape, and several
Prometheus servers scrape it every 15 s. On the loop a scrape only
copies what the page reports; the samples and the text are made in a worker thread, and so
is the merge of several worker processes' pages. Real HTTP on loopback; where the work runs
is checked by thread, never by timing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from router.service import worker_metrics
from router.service.app import STATE
from router.service.config import build_settings
from router.service.worker_metrics import all_workers_page, families, merge
from tests.backends import Backend, start_router

REPLICAS = 40
MODELS = ("m0", "m1")


@dataclass
class Router:
    url: str
    app: Any
    loop_thread: int

    async def scrape(self) -> str:
        async with aiohttp.ClientSession() as http, http.get(self.url + "/metrics") as r:
            assert r.status == 200
            return await r.text()


@pytest.fixture
async def fleet() -> AsyncIterator[Router]:
    backend = await Backend("b", list(MODELS)).start()
    replicas = [
        {"url": backend.url, "model": MODELS[i % 2], "name": f"r{i:03d}"} for i in range(REPLICAS)
    ]
    settings = build_settings(
        {"replicas": replicas, "models": {m: {"policy": "round_robin"} for m in MODELS}}
    )
    runner, url = await start_router(settings)
    try:
        async with aiohttp.ClientSession() as http:
            for i in range(REPLICAS):  # round robin: every replica gets one request
                body = {"model": MODELS[i % 2], "prompt": f"hello {i}", "max_tokens": 2}
                async with http.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
        yield Router(url, runner.app, threading.get_ident())
    finally:
        await runner.cleanup()
        await backend.stop()


class _Probe(Metric):
    """A family that records the thread reading its samples (the text's formatting)."""

    def __init__(self, readers: list[int]) -> None:
        super().__init__("kvrouter_test_probe", "Probe", "gauge")
        self._readers = readers

    @property
    def samples(self) -> list[Sample]:
        self._readers.append(threading.get_ident())
        return [Sample("kvrouter_test_probe", {}, 1.0)]

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        pass


class _ProbeCollector(Collector):
    def __init__(self) -> None:
        self.readers: list[int] = []

    def collect(self) -> Iterable[Metric]:
        return [_Probe(self.readers)]


async def test_the_page_text_is_formatted_off_the_event_loop(fleet: Router) -> None:
    probe = _ProbeCollector()
    fleet.app[STATE].metrics.registry.register(probe)
    page = await fleet.scrape()
    assert "kvrouter_test_probe 1.0" in page
    assert probe.readers
    assert fleet.loop_thread not in probe.readers


async def test_no_replica_sample_is_built_on_the_event_loop(
    fleet: Router, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-replica series (the page's bulk) are copied on the loop and made into samples
    in the scrape's thread."""
    built: list[tuple[int, str, dict[str, str]]] = []
    make = Sample.__new__

    def recording(cls: type, name: str, labels: dict[str, str], *args: Any, **kw: Any) -> Any:
        built.append((threading.get_ident(), name, labels))
        return make(cls, name, labels, *args, **kw)

    monkeypatch.setattr(Sample, "__new__", recording)
    page = await fleet.scrape()
    for name in (
        "kvrouter_requests_total",
        "kvrouter_replica_prompt_tokens_total",
        "kvrouter_replica_up",
        "kvrouter_replica_info",
    ):
        assert page.count(f"{name}{{") >= REPLICAS, name
    per_replica = [(t, n) for t, n, labels in built if labels.get("replica")]
    assert len(per_replica) >= 6 * REPLICAS
    on_loop = [n for t, n in per_replica if t == fleet.loop_thread]
    assert on_loop == []


async def test_the_workers_pages_are_merged_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads: list[int] = []

    def recording(pages: Iterable[tuple[str, str]]) -> str:
        threads.append(threading.get_ident())
        return merge(pages)

    monkeypatch.setattr(worker_metrics, "merge", recording)
    page = b"# HELP g G.\n# TYPE g gauge\ng 1.0\n"
    out = await all_workers_page(0, page, [], 2, 0)
    assert b'g{worker="0"} 1.0' in out
    assert threads and threading.get_ident() not in threads
    await asyncio.sleep(0)


def test_merge_keeps_label_values_holding_unicode_line_breaks() -> None:
    """The text format escapes only ``\\``, ``"`` and ``\\n`` in label values: a replica or
    model name holding U+2028, U+0085 or a file separator stays on its sample's line, and
    the merge must not cut the line there (Prometheus would reject the whole page)."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    names = ["a\u2028b", "c\x85d", "e\x1cf", 'q"uote\\back\nnl']
    reg = CollectorRegistry()
    gauge = Gauge("kvrouter_x", "X.", ["replica"], registry=reg)
    for name in names:
        gauge.labels(name).set(1)
    page = generate_latest(reg).decode()
    assert [len(s) for _, _, s in families(page)] == [len(names)]
    out = merge([("0", page), ("1", page)])
    samples = [s.labels for f in text_string_to_metric_families(out) for s in f.samples]
    assert samples == [{"worker": w, "replica": n} for w in "01" for n in names]
