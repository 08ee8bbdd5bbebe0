"""What runs beside the requests while the router runs, each as a ``cleanup_ctx`` of the
application object (started in order before the port opens, stopped in reverse): the
upstream client and the forwarder, housekeeping, active health probes, the engines' metrics
scrape, the Redis index follower, direct ZMQ events and the live-traffic recorder.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.core.types import ReplicaKey
from router.service.engine_sources import REPORT_STALE_INTERVALS
from router.service.keys import DIRECT_EVENTS, FORWARDER, INDEX_SYNC, SESSION, SETTINGS, STATE
from router.service.proxy import Forwarder
from router.service.render import EngineRenderer, render_targets
from router.service.settings import HEALTH_TIMEOUT_INTERVALS, ZMQ_AUTO, ReplicaSettings
from router.service.upstream import Client, Timeouts

if TYPE_CHECKING:
    from router.core.index import PrefixIndex
    from router.events.direct import DirectEvents
    from router.events.endpoints import EndpointSpec
    from router.store.sync import IndexSync

_log = logging.getLogger("kvrouter.service")


async def upstream_session(app: web.Application) -> AsyncIterator[None]:
    s = app[SETTINGS].server
    client = Client(
        Timeouts(s.connect_timeout_s, s.first_byte_timeout_s, s.request_timeout_s),
        s.pool_per_replica,
    )
    app[FORWARDER] = Forwarder(app[STATE], client)
    # side traffic (/v1/models, health probes) keeps aiohttp's client
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit_per_host=8, keepalive_timeout=60),
        skip_auto_headers=("User-Agent",),
    )
    app[SESSION] = session
    state = app[STATE]
    render_session = None
    if any(m.render == "engine" for m in app[SETTINGS].models.values()):
        render_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit_per_host=64, keepalive_timeout=60),
            skip_auto_headers=("User-Agent",),
        )
        state.renderer = EngineRenderer(
            app[SETTINGS].models,
            partial(render_targets, state),
            state.metrics.render_requests,
            render_session,
        )
    tasks = [asyncio.create_task(_housekeeping(app))]
    if s.outlier_detection:
        tasks.append(asyncio.create_task(_outlier_sweep(app)))
    if s.health_interval_s > 0:
        tasks.append(
            asyncio.create_task(
                _probe_health(app, session, s.health_interval_s, s.health_timeout_s)
            )
        )
    yield
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await session.close()
    if render_session is not None:
        state.renderer = None
        await render_session.close()
    client.close()


async def _housekeeping(app: web.Application, every: float = 1.0) -> None:
    """Expire speculative index entries and engine load reports older than
    ``REPORT_STALE_INTERVALS`` scrape intervals (LoadTracker.forget_stale_reports), readmit
    replicas whose unhealthy cooldown ended (without waiting for traffic; an active probe
    re-marks them if still down), check the models' state layouts against their
    configuration (router.service.layout), and compact the index now and then."""
    state = app[STATE]
    loop = asyncio.get_running_loop()
    stale_s = REPORT_STALE_INTERVALS * state.settings.server.engine_metrics_interval_s
    compacting: asyncio.Task[None] | None = None
    try:
        while True:
            await asyncio.sleep(every)
            state.index.expire(loop.time())
            for key in state.load.forget_stale_reports(loop.time(), stale_s):
                _log.warning(
                    "no engine load report from %s for %.0f s: dropped its last", key, stale_s
                )
            state.fleet.restore_health(loop.time())
            state.layouts.check()
            if (compacting is None or compacting.done()) and state.index.garbage_ratio() > 0.5:
                compacting = asyncio.create_task(_compact(state.index))
    finally:
        if compacting is not None:
            compacting.cancel()


async def _compact(index: PrefixIndex) -> None:
    """Compact the index a chunk at a time (``PrefixIndex.compaction``), serving requests
    and events between chunks: the whole of a large index at once holds the loop for
    seconds. The only compaction of a serving router's index."""
    for _ in index.compaction():
        await asyncio.sleep(0)


async def _outlier_sweep(app: web.Application, every: float = 0.25) -> None:
    """First-byte latency outliers (router/service/ejection.py), four times a second."""
    ejections = app[FORWARDER].ejections
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(every)
        ejections.sweep(loop.time())


# replicas' /health probed at once: a sweep of a 900-replica fleet takes about one timeout
# even when some hang, instead of one timeout per hanging replica
HEALTH_PROBES_AT_ONCE = 64


async def _probe_health(
    app: web.Application, session: aiohttp.ClientSession, every: float, wait: float
) -> None:
    """Every ``every`` seconds (a sweep's start to the next one's), GET each replica's
    ``/health`` (once per URL: all DP ranks of a replica share it) and mark its keys healthy
    or unhealthy; a probe unanswered after ``wait`` seconds fails."""
    state = app[STATE]
    timeout = aiohttp.ClientTimeout(total=max(min(wait, every * HEALTH_TIMEOUT_INTERVALS), 0.05))
    loop = asyncio.get_running_loop()
    limit = asyncio.Semaphore(HEALTH_PROBES_AT_ONCE)

    async def probe(url: str) -> bool:
        """A timeout is retried once: a probe also times out when the router's own event
        loop was busy past ``wait`` (a megabyte prompt being parsed), and the replica must
        not pay for that."""
        async with limit:
            for _ in range(2):
                try:
                    async with session.get(url + "/health", timeout=timeout) as resp:
                        return resp.status == 200
                except TimeoutError:
                    continue
                except aiohttp.ClientError:
                    return False
            return False

    async def judge(url: str, keys: list[ReplicaKey]) -> None:
        """Probe one URL and apply its result at once (not after the sweep's slowest probe)."""
        ok = await probe(url)
        now = loop.time()
        for key in keys:
            if state.registry.endpoint(key) is None:
                continue  # removed while probed (a discovered replica left)
            if ok and key not in state.fleet.unhealthy_until:
                state.load.set_health(key, True)
            elif not ok:
                state.fleet.mark_unhealthy(key, now)

    while True:
        began = loop.time()
        by_url: dict[str, list[ReplicaKey]] = {}
        for ep in state.registry.endpoints():
            by_url.setdefault(ep.base_url, []).append(ep.key)
        await asyncio.gather(*(judge(url, keys) for url, keys in by_url.items()))
        await asyncio.sleep(max(every - (loop.time() - began), 0.0))


async def engine_metrics(app: web.Application) -> AsyncIterator[None]:
    """Replicas with ``metrics_url``: the router scrapes their Prometheus pages itself
    (router.service.engines)."""
    from router.service.engine_sources import SCRAPE
    from router.service.engines import EngineFeed, scraping

    settings = app[SETTINGS]
    targets = [rep for rep in settings.replicas if rep.metrics_url]
    feed = EngineFeed(app[STATE], source=SCRAPE)
    # a LoRA adapter's entry reads its base model's series (vLLM labels its requests so)
    bases = {rep.name: base for rep in targets if (base := settings.model(rep.model).lora_base)}
    async with scraping(targets, feed, settings.server.engine_metrics_interval_s, bases):
        yield


async def redis_index(app: web.Application) -> AsyncIterator[None]:
    """With ``server.redis_url``: bootstrap the local index from Redis and follow it
    (router.store.sync.IndexSync). Start-up does not wait for Redis; while it is away the
    router serves from its last known index and load (docs/operations.md)."""
    from router.store.redis_store import RedisStore
    from router.store.schema import KeySchema
    from router.store.sync import IndexSync

    s = app[SETTINGS].server
    store = RedisStore.from_url(
        s.redis_url or "",
        KeySchema(s.redis_key_prefix, s.redis_stream_shards),
        verify_master=bytes.fromhex(s.redis_signing_master) if s.redis_signing_master else None,
    )
    from router.service.engines import EngineFeed

    discover = s.discover_replicas is not False  # None: on with Redis
    sync = IndexSync(
        store,
        app[STATE].index,
        asyncio.get_running_loop().time,
        listener=EngineFeed(app[STATE], discover=discover),
        event_lag=app[STATE].event_lag_s,
        lost_store_grace_s=s.redis_lost_grace_s,
        # a publisher's sample older than the housekeeping keeps a report is not applied
        load_max_age_s=REPORT_STALE_INTERVALS * s.engine_metrics_interval_s,
    )
    app[INDEX_SYNC] = sync
    _log.info("shared index: following %s (key prefix %s)", s.redis_url, s.redis_key_prefix)
    registry = app[STATE].metrics.registry
    collector = _IndexSyncCollector(sync)
    registry.register(collector)
    await sync.start(wait=False)
    yield
    await sync.stop()
    await store.close()
    registry.unregister(collector)


class _IndexSyncCollector(Collector):
    """Whether the shared index follower reaches Redis (docs/metrics.md): while it does not,
    the router routes on its last known index and load, and only this says so."""

    def __init__(self, sync: IndexSync) -> None:
        self.sync = sync

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily(
            "kvrouter_index_sync_up",
            "1 while the shared index follower reaches Redis, 0 while it does not (the index "
            "serves its last known content)",
        )
        up.add_metric([], 1.0 if self.sync.up else 0.0)
        yield up
        shards = GaugeMetricFamily(
            "kvrouter_index_sync_shard_up",
            "1 while the follower reads this change-stream shard, 0 while it does not (its "
            "Redis Cluster node down: the other shards are read on)",
            labels=["stream"],
        )
        for stream in self.sync.streams():
            reading = self.sync.up and stream not in self.sync.shards_down
            shards.add_metric([stream], 1.0 if reading else 0.0)
        yield shards
        for name, text, field in _SYNC_COUNTERS:
            counter = CounterMetricFamily(name, text)
            counter.add_metric([], float(getattr(self.sync.stats, field)))
            yield counter


# the follower's counters: (metric, help, SyncStats field)
_SYNC_COUNTERS = (
    ("kvrouter_index_sync_errors", "Failed turns of the shared index follower (retried)", "errors"),
    (
        "kvrouter_index_sync_unreadable_snapshots",
        "Snapshot reads of registered replica keys whose stored state did not parse (the "
        "key keeps its last known content and is read again after a backoff)",
        "unreadable",
    ),
    (
        "kvrouter_index_sync_dropped_entries",
        "Change-stream entries dropped: unreadable, unsigned or signed with a key other "
        "than their replica's (server.redis_signing_master), or naming a replica of "
        "another stream shard",
        "malformed",
    ),
    (
        "kvrouter_index_sync_key_resyncs",
        "Replica keys read whole from their stored snapshot: at bootstrap, after a gap, "
        "a reset, or an audit that found the index behind or ahead of the store",
        "resyncs",
    ),
    (
        "kvrouter_index_sync_stale_load_samples",
        "Load samples read from the change stream and not applied: older than the "
        "replica key's last, or than the age past which a report is dropped",
        "loads_stale",
    ),
)


async def direct_events(app: web.Application) -> AsyncIterator[None]:
    """Replicas configured with ``zmq``: subscribe to their KV events and apply them to the
    local index directly (router.events.direct; single router, no Redis)."""
    from router.events.direct import DirectEvents
    from router.events.endpoints import engine_endpoints

    settings = app[SETTINGS]
    direct = DirectEvents(
        app[STATE].index,
        event_lag=app[STATE].event_lag_s,
        max_backlog_bytes=max(1, int(settings.server.max_event_backlog_mb * 2**20)),
    )
    app[DIRECT_EVENTS] = direct
    asked = [rep for rep in settings.replicas if rep.zmq == ZMQ_AUTO]
    for rep in settings.replicas:
        if rep.zmq and rep.zmq != ZMQ_AUTO:
            block = settings.model(rep.model).routing.block_size
            # every dp rank of the engine: rank N publishes on the configured ports + N
            specs = engine_endpoints(
                [rep.zmq], [rep.zmq_replay] if rep.zmq_replay else [], range(rep.dp_ranks)
            )
            direct.add_replica(
                rep.name,
                rep.model,
                block,
                specs,
                on_checkpoint=app[STATE].layouts.observer(rep.model, block),
                on_facts=app[STATE].layouts.facts_observer(rep.model),
                adapter=settings.model(rep.model).lora_base is not None,
            )
    registry = app[STATE].metrics.registry
    collector = _EventCounters(direct)
    registry.register(collector)
    async with direct:
        tasks = [asyncio.create_task(_discover(app, direct, rep)) for rep in asked]
        for task in tasks:
            task.add_done_callback(_log_failure)
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    registry.unregister(collector)


class _EventCounters(Collector):
    """``kvrouter_events_blocks_not_indexed_total{replica, reason}`` of the engines this
    router follows directly (router.events.ingest ``not_indexed``; the publisher's metric of
    that name in Redis mode), ``kvrouter_events_backlog_dropped_batches_total{replica}``
    (``IngestStats.backlog_dropped``; the publisher's
    ``kvrouter_publisher_backlog_dropped_batches_total``), and the batches lost beyond
    replay and engine restarts found (``lost_batches``, ``restarts``; the publisher's
    ``kvrouter_publisher_lost_batches_total``, ``kvrouter_publisher_engine_restarts_total``)."""

    def __init__(self, direct: DirectEvents) -> None:
        self.direct = direct

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "kvrouter_events_blocks_not_indexed",
            "Engine blocks stored but not indexed, by replica and reason (docs/metrics.md)",
            labels=["replica", "reason"],
        )
        for replica, ingest in self.direct.ingests.items():
            for reason, n in ingest.not_indexed().items():
                family.add_metric([replica, reason], float(n))
        yield family
        dropped = CounterMetricFamily(
            "kvrouter_events_backlog_dropped_batches",
            "Live KV event batches dropped over server.max_event_backlog_mb, by replica "
            "(refilled from the engine's replay socket, or lost)",
            labels=["replica"],
        )
        for replica, ingest in self.direct.ingests.items():
            dropped.add_metric([replica], float(ingest.stats.backlog_dropped))
        yield dropped
        lost = CounterMetricFamily(
            "kvrouter_events_lost_batches",
            "KV event batches lost beyond the engine's replay, by replica: each loss clears "
            "the replica's entries of that source until its engine stores them again",
            labels=["replica"],
        )
        restarts = CounterMetricFamily(
            "kvrouter_events_engine_restarts",
            "Engine restarts found in a replica's KV event sequence (its entries cleared)",
            labels=["replica"],
        )
        for replica, ingest in self.direct.ingests.items():
            lost.add_metric([replica], float(ingest.stats.lost_batches))
            restarts.add_metric([replica], float(ingest.stats.restarts))
        yield lost
        yield restarts


def _log_failure(task: asyncio.Task[None]) -> None:
    """A discovery that ended by an error (not a cancel) is logged, not lost."""
    if not task.cancelled() and task.exception() is not None:
        _log.error("KV-event discovery failed", exc_info=task.exception())


async def _discover(app: web.Application, direct: DirectEvents, rep: ReplicaSettings) -> None:
    """A replica with ``zmq = "auto"``: ask it where it publishes until it answers
    (router.events.discovery ``ask``), then follow those endpoints; when it names other
    endpoints later (``discovery.watch``), forget what the old ones said and follow the new
    ones (``DirectEvents.unfollow``)."""
    from router.events.discovery import ask, watch

    async def moved(specs: tuple[EndpointSpec, ...]) -> None:
        await direct.unfollow(rep.name)
        await _follow(app, direct, rep, specs)

    specs = await ask(rep.url, rep.name)
    await _follow(app, direct, rep, specs)
    await watch(rep.url, rep.name, specs, moved)


async def _follow(
    app: web.Application, direct: DirectEvents, rep: ReplicaSettings, specs: Sequence[EndpointSpec]
) -> None:
    settings, state = app[SETTINGS], app[STATE]
    block = settings.model(rep.model).routing.block_size
    ranks = [s.dp_rank for s in specs]
    if ranks != list(range(rep.dp_ranks)):
        _log.warning(
            "replica %s: configured with %d dp ranks, publishes events for ranks %s",
            rep.name,
            rep.dp_ranks,
            ranks,
        )
    await direct.follow(
        rep.name,
        rep.model,
        block,
        specs,
        on_checkpoint=state.layouts.observer(rep.model, block),
        on_facts=state.layouts.facts_observer(rep.model),
        adapter=settings.model(rep.model).lora_base is not None,
    )
    _log.info(
        "replica %s: following its KV events at %s",
        rep.name,
        ", ".join(s.endpoint for s in specs),
    )


async def recording(app: web.Application) -> AsyncIterator[None]:
    """With ``server.record_path``: append every completed request to a rotating trace
    (router.recorder), flushed every second and on shutdown. A trace that cannot be opened
    at the start (an unwritable path, a full disk) is tried again each second, the router
    serving all along, as when a write fails later."""
    import time

    from router.recorder import RecordSettings, TraceRecorder, record_key

    s = app[SETTINGS].server
    assert s.record_path is not None
    loop = asyncio.get_running_loop()
    settings = RecordSettings(
        Path(s.record_path),
        int(s.record_max_mb * 2**20),
        max(s.record_backups, 0),
        key=record_key(s.record_key) if s.record_key is not None else None,
    )
    state = app[STATE]
    recorder: TraceRecorder | None = None
    failing = False

    def failed(exc: Exception, lost: int) -> None:
        nonlocal failing
        if not failing:
            _log.error("recording: cannot write the trace (%s); %d row(s) lost", exc, lost)
        failing = True

    def open_trace() -> TraceRecorder | None:
        """The recorder, opened now if it is not yet; None (logged) while it cannot be."""
        nonlocal recorder
        if recorder is None:
            try:
                recorder = TraceRecorder(
                    settings, started_at=loop.time(), wall_at_start=time.time()
                )
            except (OSError, ValueError) as exc:
                failed(exc, 0)
                return None
            state.recorder = recorder
        return recorder

    def flush_rows() -> None:
        """One flush; a failure (full disk, unwritable path) is logged when it starts and
        when it ends, and never stops the recording: the next second tries again."""
        nonlocal failing
        rec = open_trace()
        if rec is None:
            return
        pending = rec.pending
        try:
            rec.flush()
        except OSError as exc:
            failed(exc, pending)
            return
        if failing:
            _log.warning("recording: writing to %s again", s.record_path)
        failing = False

    async def flush() -> None:
        while True:
            await asyncio.sleep(1.0)
            flush_rows()

    open_trace()
    task = asyncio.create_task(flush())
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    state.recorder = None
    if recorder is not None:
        flush_rows()
        with contextlib.suppress(OSError):
            recorder.close()
