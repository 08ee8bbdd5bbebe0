"""The engines' load metrics as the engines declare them, read by the router's scrape.

The engines' stat loggers need their whole package (torch, configs) to run, so each page here
is built with ``prometheus_client`` from exactly what the released wheels declare: the metric
names, types, label names and ``multiprocess_mode``, and how the engine sets each value
(cited below as ``path:line`` inside the wheel). The router reads these pages with
:func:`router.publisher.scrape.parse_engine_metrics` (publisher sidecar and direct-mode
scrape alike).

Wheels (``pip download <engine>==<version> --no-deps``):

* vLLM 0.34.0: ``vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl`` (sha256
  ``79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2``),
  ``vllm/v1/metrics/loggers.py``. vLLM 0.16.0
  (``vllm-0.16.0-cp38-abi3-manylinux_2_31_x86_64.whl``, sha256
  ``f066b2a2f8597a4a3ada8fbbfd122b59086864b2260ca42dc81bf9fb57af0c42``) declares the same
  names and labels (``loggers.py:413,432,442,478,501,512``).
* SGLang 0.5.23: ``sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl`` (sha256
  ``00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937``),
  ``sglang/srt/observability/metrics_collector.py``. SGLang 0.5.10
  (``sglang-0.5.10-py3-none-any.whl``, sha256
  ``ac8855a5d57dac8831fee526bca5212f1ae451f378e2ab08b3baecbc4deb4076``) declares the same
  (``observability/metrics_collector.py:189,201,243,804-816``, labels in
  ``observability/scheduler_metrics_mixin.py:133-143``).

Not read: SGLang's prefix-cache figures (``sglang:cache_hit_rate`` gauge; the tokenizer's
``sglang:prompt_tokens_total`` / ``sglang:cached_tokens_total`` counters, not per DP rank).
"""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from router.publisher.scrape import ScrapedLoad, parse_engine_metrics


def _vllm_034_page(per_engine: dict[int, tuple[int, int, int, float, int, int]]) -> str:
    """vLLM 0.34.0's ``PrometheusStatLogger`` page for the engines (DP ranks) given:
    ``engine -> (running, waiting, deferred, kv_cache_usage, prefix queries, prefix hits)``.

    * labels ``["model_name", "engine"]``, engine = the DP rank (``loggers.py:499-505``)
    * ``vllm:num_requests_running`` gauge, mostrecent (``:527-531``), set to
      ``num_running_reqs`` (``:1147``)
    * ``vllm:num_requests_waiting`` gauge (``:537-541``), set to waiting + deferred
      (``:1150-1154``); ``vllm:num_requests_waiting_by_reason`` splits it (``:547-557``)
    * ``vllm:kv_cache_usage_perc`` gauge, "1 means 100 percent usage" (``:619-623``), set to
      ``SchedulerStats.kv_cache_usage`` (``:1165``), ``BlockPool.get_usage()`` in [0, 1]
      (``vllm/v1/core/block_pool.py:912-923``)
    * ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` counters in tokens
      (``:661-678``); no ``vllm:gpu_cache_usage_perc`` any more
    """
    reg = CollectorRegistry()
    labelnames = ["model_name", "engine"]
    running = Gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        labelnames,
        registry=reg,
        multiprocess_mode="mostrecent",
    )
    waiting = Gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        labelnames,
        registry=reg,
        multiprocess_mode="mostrecent",
    )
    by_reason = Gauge(
        "vllm:num_requests_waiting_by_reason",
        "Number of waiting requests by reason.",
        [*labelnames, "reason"],
        registry=reg,
        multiprocess_mode="mostrecent",
    )
    usage = Gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        labelnames,
        registry=reg,
        multiprocess_mode="mostrecent",
    )
    queries = Counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        labelnames,
        registry=reg,
    )
    hits = Counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        labelnames,
        registry=reg,
    )
    for idx, (run, wait, deferred, kv, q, h) in per_engine.items():
        lv = ["m", str(idx)]
        running.labels(*lv).set(run)
        waiting.labels(*lv).set(wait + deferred)
        by_reason.labels(*lv, "capacity").set(wait)
        by_reason.labels(*lv, "deferred").set(deferred)
        usage.labels(*lv).set(kv)
        queries.labels(*lv).inc(q)
        hits.labels(*lv).inc(h)
    return generate_latest(reg).decode()


def test_vllm_034_page_is_read_per_engine_rank() -> None:
    page = _vllm_034_page(
        {0: (4, 2, 1, 0.5, 1000, 640), 1: (0, 0, 0, 0.0, 0, 0), 2: (7, 0, 3, 0.875, 10, 0)}
    )
    assert parse_engine_metrics(page) == {
        0: ScrapedLoad(4, 3, 0.5, 1000.0, 640.0),
        1: ScrapedLoad(0, 0, 0.0, 0.0, 0.0),
        2: ScrapedLoad(7, 3, 0.875, 10.0, 0.0),
    }


def _sglang_0523_page(
    schedulers: list[dict[str, object]],
    *,
    priority: bool = False,
) -> str:
    """SGLang 0.5.23's ``SchedulerMetricsCollector`` page, one scheduler per entry of
    ``schedulers`` (its rank labels and ``running``, ``queued``, ``usage``; with ``priority``
    also ``by_priority``: ``{"running": {prio: n}, "queued": {prio: n}}``).

    * labels ``model_name, engine_type, tp_rank, pp_rank, moe_ep_rank``, then ``priority``
      (value ``""``) with ``--enable-priority-scheduling``, then ``dp_rank`` when the
      scheduler has one (``metrics_collector.py:1382-1392``); with DP attention ``dp_rank`` is
      the attention-DP rank (``managers/data_parallel_controller.py:716-722``), the rank its
      KV events carry (``disaggregation/kv_events.py:44-62``)
    * every scheduler with ``attn_tp_rank == 0`` and ``attn_cp_rank == 0`` logs, whatever its
      ``pp_rank`` (``metrics_collector.py:1361-1367``); with
      ``--enable-metrics-for-all-schedulers`` every TP rank does
    * ``sglang:num_running_reqs`` / ``sglang:num_queue_reqs`` gauges, mostrecent
      (``:364-375``), set by ``_log_gauge_queue_count`` (``:1417-1429``): the total under the
      scheduler's labels (``priority=""``) and, with priority scheduling, one series per
      priority (``priority="<int>"``) beside it
    * ``sglang:token_usage`` gauge (``:404-409``, set at ``:1656``): a fraction, the fullest
      pool's usage (``managers/scheduler_components/pool_stats_observer.py:155,236-239``)
    """
    reg = CollectorRegistry()
    base = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]
    labelnames = base + (["priority"] if priority else []) + ["dp_rank"]
    running = Gauge(
        "sglang:num_running_reqs",
        "The number of running requests.",
        labelnames,
        registry=reg,
        multiprocess_mode="mostrecent",
    )
    queued = Gauge(
        "sglang:num_queue_reqs",
        "The number of requests in the waiting queue.",
        labelnames,
        registry=reg,
        multiprocess_mode="mostrecent",
    )
    usage = Gauge(
        "sglang:token_usage",
        "The token usage.",
        labelnames,
        registry=reg,
        multiprocess_mode="mostrecent",
    )
    for s in schedulers:
        labels = {
            "model_name": "m",
            "engine_type": "unified",
            "tp_rank": s.get("tp_rank", 0),
            "pp_rank": s.get("pp_rank", 0),
            "moe_ep_rank": 0,
        }
        if priority:
            labels["priority"] = ""
        labels["dp_rank"] = s.get("dp_rank", 0)
        for gauge, key in ((running, "running"), (queued, "queued")):
            gauge.labels(**labels).set(s[key])  # type: ignore[arg-type]
            for prio, n in s.get("by_priority", {}).get(key, {}).items():  # type: ignore[attr-defined]
                gauge.labels(**{**labels, "priority": str(prio)}).set(n)
        usage.labels(**labels).set(s["usage"])  # type: ignore[arg-type]
    return generate_latest(reg).decode()


def test_sglang_priority_breakdown_is_not_added_to_the_total() -> None:
    """With ``--enable-priority-scheduling`` the page carries each queue's total
    (``priority=""``) and its split by priority: the load is the total, not twice it."""
    page = _sglang_0523_page(
        [
            {
                "dp_rank": 0,
                "running": 5,
                "queued": 3,
                "usage": 0.5,
                "by_priority": {"running": {0: 2, 1: 3}, "queued": {0: 3}},
            },
            {
                "dp_rank": 1,
                "running": 1,
                "queued": 0,
                "usage": 0.25,
                "by_priority": {"running": {1: 1}, "queued": {}},
            },
        ],
        priority=True,
    )
    assert parse_engine_metrics(page) == {0: ScrapedLoad(5, 3, 0.5), 1: ScrapedLoad(1, 0, 0.25)}


def test_sglang_pipeline_stages_and_tp_ranks_report_one_rank_once() -> None:
    """Pipeline stages (and, with ``--enable-metrics-for-all-schedulers``, TP ranks) of one
    DP rank each export the rank's queues under their own ``pp_rank`` / ``tp_rank``: the
    rank's load is those figures once (its fullest stage's KV pool), not their sum."""
    page = _sglang_0523_page(
        [
            {"dp_rank": 0, "pp_rank": 0, "running": 3, "queued": 2, "usage": 0.4},
            {"dp_rank": 0, "pp_rank": 1, "running": 3, "queued": 2, "usage": 0.7},
            {"dp_rank": 1, "tp_rank": 0, "running": 1, "queued": 0, "usage": 0.2},
            {"dp_rank": 1, "tp_rank": 1, "running": 1, "queued": 0, "usage": 0.2},
        ]
    )
    assert parse_engine_metrics(page) == {0: ScrapedLoad(3, 2, 0.7), 1: ScrapedLoad(1, 0, 0.2)}


def test_a_load_gauge_the_page_lacks_is_named_not_silently_zero() -> None:
    """An engine version without one of the gauges (renamed or dropped): its figure is 0,
    the policies' value without an engine report, and named in ``missing``; a full page
    misses nothing."""
    full = _vllm_034_page({0: (4, 2, 0, 0.5, 0, 0), 1: (1, 0, 0, 0.25, 0, 0)})
    assert all(load.missing == () for load in parse_engine_metrics(full).values())
    renamed = full.replace("vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_ratio")
    assert parse_engine_metrics(renamed) == {
        0: ScrapedLoad(4, 2, 0.0, 0.0, 0.0, ("kv_usage",)),
        1: ScrapedLoad(1, 0, 0.0, 0.0, 0.0, ("kv_usage",)),
    }
    no_queue = _sglang_0523_page([{"running": 2, "queued": 1, "usage": 0.5}])
    no_queue = no_queue.replace("sglang:num_queue_reqs", "sglang:num_waiting_reqs")
    assert parse_engine_metrics(no_queue) == {0: ScrapedLoad(2, 0, 0.5, missing=("waiting",))}


async def test_direct_mode_logs_a_missing_gauge_once_and_its_return(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The router's scrape of ``metrics_url`` warns once (naming the metrics it looks for)
    while a gauge is missing, not every scrape, and says when it is back."""
    import aiohttp
    from aiohttp import web

    from router.publisher.scrape import MissingGauges
    from router.service.engines import scrape_once
    from router.service.settings import ReplicaSettings
    from tests.ports import free_port

    full = _vllm_034_page({0: (4, 2, 0, 0.5, 0, 0)})
    pages = [full.replace("vllm:kv_cache_usage_perc", "vllm:kv_usage")] * 2 + [full]

    async def page(_: web.Request) -> web.Response:
        return web.Response(text=pages.pop(0))

    class Feed:
        def __init__(self) -> None:
            self.samples: list[tuple[object, float]] = []

        def load(self, key: object, sample: object, now: float) -> None:
            self.samples.append((key, getattr(sample, "kv_usage")))  # noqa: B009

    app = web.Application()
    app.router.add_get("/metrics", page)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    rep = ReplicaSettings("http://x", "m", "r0", metrics_url=f"http://127.0.0.1:{port}/metrics")
    feed, missing = Feed(), MissingGauges(logging.getLogger("router.service.engines"))
    try:
        with caplog.at_level(logging.INFO, logger="router.service.engines"):
            async with aiohttp.ClientSession() as session:
                for _ in range(3):
                    await scrape_once(session, rep, feed, 0.0, missing)  # type: ignore[arg-type]
    finally:
        await runner.cleanup()
    assert [usage for _, usage in feed.samples] == [0.0, 0.0, 0.5]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert "no kv_usage (vllm:kv_cache_usage_perc" in warned[0].getMessage()
    assert "r0" in warned[0].getMessage()
    assert any("back" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


def test_engine_ranks_a_replica_does_not_have_are_named_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM's external data-parallel load balancing labels each node's engines by their
    global rank: a replica configured with ranks 0..3 whose page reports engines 4..7 got no
    load report at all, silently. The mismatch is logged (once per change), naming both."""
    from router.publisher.scrape import MissingGauges, parse_engine_metrics

    page = _vllm_034_page({r: (1, 0, 0, 0.1, 0, 0) for r in (4, 5, 6, 7)})
    loads = parse_engine_metrics(page)
    missing = MissingGauges(logging.getLogger("router.service.engines"))
    with caplog.at_level(logging.WARNING, logger="router.service.engines"):
        for _ in range(3):
            missing.check_ranks("r0", loads, range(4))
        missing.check_ranks("r0", {0: None, 1: None, 2: None, 3: None}, range(4))
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned
    assert "[4, 5, 6, 7]" in warned[0] and "[0, 1, 2, 3]" in warned[0] and "r0" in warned[0]


def _vllm_034_models_page(per_model: dict[str, dict[int, tuple[int, int, float, int, int]]]) -> str:
    """One page carrying several vLLM 0.34 servers' series, told apart by ``model_name``
    (each ``PrometheusStatLogger`` labels with its own ``served_model_name``,
    ``loggers.py:499-505``): what ``prometheus_client``'s ``MultiProcessCollector``
    (``vllm/v1/metrics/prometheus.py:47-50``) serves when two servers of different models
    share one ``PROMETHEUS_MULTIPROC_DIR`` (vLLM's warning at ``prometheus.py:31-35``), or
    a page gathered from several engines. ``model -> engine -> (running, waiting, usage,
    prefix queries, prefix hits)``."""
    reg = CollectorRegistry()
    labelnames = ["model_name", "engine"]
    running = Gauge("vllm:num_requests_running", "", labelnames, registry=reg)
    waiting = Gauge("vllm:num_requests_waiting", "", labelnames, registry=reg)
    usage = Gauge("vllm:kv_cache_usage_perc", "", labelnames, registry=reg)
    queries = Counter("vllm:prefix_cache_queries", "", labelnames, registry=reg)
    hits = Counter("vllm:prefix_cache_hits", "", labelnames, registry=reg)
    for model, engines in per_model.items():
        for idx, (run, wait, kv, q, h) in engines.items():
            lv = [model, str(idx)]
            running.labels(*lv).set(run)
            waiting.labels(*lv).set(wait)
            usage.labels(*lv).set(kv)
            queries.labels(*lv).inc(q)
            hits.labels(*lv).inc(h)
    return generate_latest(reg).decode()


class _Feed:
    def __init__(self) -> None:
        self.samples: dict[object, object] = {}

    def load(self, key: object, sample: object, now: float) -> None:
        self.samples[key] = sample


async def _scrape(page: str, model: str, dp_ranks: int = 1) -> dict[object, object]:
    """``page`` served on loopback, scraped once by the router for a replica of ``model``."""
    import aiohttp
    from aiohttp import web

    from router.service.engines import scrape_once
    from router.service.settings import ReplicaSettings
    from tests.ports import free_port

    async def serve(_: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/plain", charset="utf-8")

    app = web.Application()
    app.router.add_get("/metrics", serve)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    rep = ReplicaSettings(
        "http://x", model, "r0", dp_ranks=dp_ranks, metrics_url=f"http://127.0.0.1:{port}/metrics"
    )
    feed = _Feed()
    try:
        async with aiohttp.ClientSession() as session:
            await scrape_once(session, rep, feed, 0.0)  # type: ignore[arg-type]
    finally:
        await runner.cleanup()
    return feed.samples


async def test_a_page_with_several_models_reports_the_replicas_own() -> None:
    """A page carrying another model's series beside the replica's: each rank's load and
    prefix-cache counters are the replica's model's, not the larger of the two models'."""
    from router.core.types import ReplicaKey
    from router.store.base import LoadSample

    page = _vllm_034_models_page(
        {
            "kimi-k3": {0: (2, 0, 0.25, 100, 40), 1: (1, 1, 0.125, 50, 10)},
            "qwen3": {0: (9, 7, 0.875, 9000, 8000), 1: (8, 6, 0.75, 7000, 100)},
        }
    )
    samples = await _scrape(page, "kimi-k3", dp_ranks=2)
    got = {k: (s.running, s.waiting, s.kv_usage, s.prefix_cache_queries, s.prefix_cache_hits)
           for k, s in samples.items() if isinstance(s, LoadSample)}  # fmt: skip
    assert got == {
        ReplicaKey("r0", 0): (2, 0, 0.25, 100.0, 40.0),
        ReplicaKey("r0", 1): (1, 1, 0.125, 50.0, 10.0),
    }
    assert parse_engine_metrics(page, "qwen3")[1] == ScrapedLoad(8, 6, 0.75, 7000.0, 100.0)


async def test_a_served_model_alias_still_reads_the_engines_page() -> None:
    """vLLM labels its series with the first ``--served-model-name`` only
    (``vllm/config/model.py:2367-2378``): a replica configured under another alias of the
    one model the page names still gets its load."""
    from router.core.types import ReplicaKey

    page = _vllm_034_models_page({"kimi-k3": {0: (3, 1, 0.5, 10, 5)}})
    samples = await _scrape(page, "kimi")
    assert list(samples) == [ReplicaKey("r0", 0)]
    assert parse_engine_metrics(page, "kimi") == {0: ScrapedLoad(3, 1, 0.5, 10.0, 5.0)}


def test_a_page_of_other_models_only_is_refused() -> None:
    """Several models on the page, none of them the replica's: no load is read (the page is
    refused, as one without load gauges), rather than another model's."""
    page = _vllm_034_models_page(
        {"qwen3": {0: (9, 7, 0.875, 0, 0)}, "llama": {0: (1, 0, 0.125, 0, 0)}}
    )
    with pytest.raises(ValueError, match="kimi-k3"):
        parse_engine_metrics(page, "kimi-k3")


async def test_a_scrape_that_times_out_is_logged_by_its_kind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A timed-out scrape raises a ``TimeoutError`` without a message: the warning names
    the exception (its repr), not an empty reason."""
    import asyncio

    from aiohttp import web

    from router.service.engines import scraping
    from router.service.settings import ReplicaSettings
    from tests.ports import free_port
    from tests.waiting import eventually

    release = asyncio.Event()

    async def hang(_: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/metrics", hang)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    rep = ReplicaSettings("http://x", "m", "r0", metrics_url=f"http://127.0.0.1:{port}/metrics")

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    try:
        with caplog.at_level(logging.WARNING, logger="router.service.engines"):
            # every 0.05 s: the scrape's timeout is its floor, 0.5 s
            async with scraping([rep], _Feed(), 0.05):  # type: ignore[arg-type]
                await eventually(warned)
    finally:
        release.set()
        await runner.cleanup()
    assert len(warned()) == 1, warned()
    assert warned()[0].startswith("engine metrics of r0: ")
    assert "Timeout" in warned()[0], warned()


async def test_the_routers_scrape_of_an_adapters_entry_reads_its_base_models_series() -> None:
    """A ``[[replicas]]`` entry for LoRA adapter ``A`` (``[models.A] lora_base = "kimi-k3"``)
    scraping a page of several models: vLLM labels every series, adapters' requests included,
    with the served model's name (``loggers.py:499-505``), so the load is ``kimi-k3``'s
    (before, ``A`` was on none of them: the page was refused and the entry had no report)."""
    from aiohttp import web

    from router.core.types import ReplicaKey
    from router.service.engines import scraping
    from router.service.settings import ReplicaSettings
    from router.store.base import LoadSample
    from tests.ports import free_port
    from tests.waiting import eventually

    page = _vllm_034_models_page(
        {
            "kimi-k3": {0: (2, 0, 0.25, 100, 40)},
            "qwen3": {0: (9, 7, 0.875, 9000, 8000)},
        }
    )

    async def serve(_: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/plain", charset="utf-8")

    app = web.Application()
    app.router.add_get("/metrics", serve)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    rep = ReplicaSettings("http://x", "A", "r0", metrics_url=f"http://127.0.0.1:{port}/metrics")
    feed = _Feed()
    try:
        async with scraping([rep], feed, 0.05, page_models={"r0": "kimi-k3"}):  # type: ignore[arg-type]
            await eventually(lambda: ReplicaKey("r0", 0) in feed.samples)
    finally:
        await runner.cleanup()
    sample = feed.samples[ReplicaKey("r0", 0)]
    assert isinstance(sample, LoadSample)
    assert (sample.running, sample.waiting, sample.kv_usage) == (2, 0, 0.25)
