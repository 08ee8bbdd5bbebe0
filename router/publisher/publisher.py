"""The publisher sidecar: one engine's KV events and load -> the shared store.

Life cycle (``start``):
1. resume the stored sequence numbers (at least from the wall clock in microseconds, so a
   restarted publisher numbers above its predecessor even when the store kept no seq),
   register the replica (info + lease), and write an empty full state (the publisher does
   not know the engine's cache yet; engines cannot dump it) -- the ZMQ replay buffer then
   refills what the engine still remembers; with the store down, the flush loop does this
   once it answers;
2. follow the engine endpoints (``EngineIngest``: decode, re-block, per-rank state); with
   ``ask_sources`` (``--zmq auto``), ask the engine where it publishes every
   ``discovery.SOURCES_RECHECK_S`` and follow other endpoints it names
   (``follow_endpoints``: the old engine's blocks are forgotten);
3. flush batched changes every ``flush_interval_s`` or ``max_batch_events`` block events;
4. heartbeat every ``heartbeat_s``: a missing lease (expired, or Redis lost its data) means
   register again and republish the full state; a failed write also forces a full republish;
   so does a stored ``seq`` other than the writer's, checked after each heartbeat between two
   flushes and by every flush against the seq it replaces (Redis restored from an older
   snapshot keeps the lease and loses later writes); and so does a stream shard count stored
   in the store other than the one it follows (``IndexStore.settle_shards``, also read at
   every registration: the count is the prefix's, docs/redis.md);
5. scrape the engine's ``/metrics`` every ``load_interval_s`` and publish load per rank.

Store outages are logged and retried; input problems are counted (``stats``/metrics) and
skipped. ``stop`` flushes and, by default, deregisters so routers drop the replica at once.

One writer per replica: the last publisher to register a replica name owns its lease. A
publisher whose heartbeat finds the lease held by another owner (``LeaseTaken``) stands
down: it stops following the engine, writes nothing more and, on stop, neither flushes nor
deletes its successor's state (``superseded``). Between the takeover and that heartbeat it
cannot write either: every state write and load sample is fenced by its lease (the store
checks the owner in the same atomic step and refuses, ``LeaseTaken``: it stands down then);
a write that finds the lease gone (it stalled past the lease, ``LeaseLost``) registers
again first. Only a publisher's first registration takes the lease from another owner:
registering again (a lost lease, a failed write, a seq mismatch, a learned layout) finds a
lease held by another owner and stands down the same way, so a superseded publisher whose
seq check runs before its heartbeat notices never takes the replica back from its
successor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from router.core.state_layout import CheckpointGrid
from router.core.types import IndexEvent, ReplicaKey
from router.events.endpoints import EndpointSpec
from router.events.ingest import EngineIngest, SubscriberGroup
from router.events.subscriber import DEFAULT_MAX_BACKLOG_BYTES
from router.publisher.scrape import (
    MissingGauges,
    ScrapedLoad,
    fetch_page,
    parse_engine_metrics,
)
from router.store.base import (
    IndexStore,
    LeaseLost,
    LeaseTaken,
    LoadSample,
    ReplicaInfo,
    SeqMismatch,
)
from router.store.writer import StoreWriter
from router.tasks import stop_all

log = logging.getLogger(__name__)


def _raise_if_cancelled(exc: BaseException) -> None:
    """Re-raise a cancellation that a client library turned into an error: redis-py can
    answer a cancel that lands mid-command with a connection error, and a loop that logged
    it would go on until ``stop`` cancelled it again (``stop_all``); this ends it at once.
    A cancel swallowed whole (the command returns) only that re-cancel ends."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from exc


@dataclass(slots=True, frozen=True)
class PublisherSettings:
    info: ReplicaInfo
    endpoints: tuple[EndpointSpec, ...]
    engine_metrics_url: str | None = None
    lease_ttl_s: float = 10.0
    heartbeat_s: float = 2.0
    load_interval_s: float = 1.0
    flush_interval_s: float = 0.02
    max_batch_events: int = 8192
    deregister_on_stop: bool = True
    owner: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # ``endpoints`` were asked of the engine at ``info.url`` (``--zmq auto``): the replica is
    # registered with the ranks they name (not ``info.dp_ranks``); the engine is asked
    # again now and then, and followed where it moves (router.events.discovery ``watch``)
    ask_sources: bool = False
    # ``info.model`` is a LoRA adapter the engine serves on this base model
    # (``--lora-base``): no block stored without it is published as its (EngineIngest)
    lora_base: str | None = None
    # live batches each subscription buffers (``--max-event-backlog-mb``): beyond it they are
    # dropped and refilled from the engine's replay socket, or lost (router/events/backlog.py)
    max_backlog_bytes: int = DEFAULT_MAX_BACKLOG_BYTES


@dataclass(slots=True)
class PublisherStats:
    resets: int = 0
    lease_losses: int = 0
    store_errors: int = 0
    scrape_errors: int = 0
    loads_published: int = 0
    seq_mismatches: int = 0  # stored seq found other than the writer's: republished
    superseded: bool = False  # another publisher took this replica's lease: stood down


def _wall_us() -> int:
    """The wall clock in microseconds: where a new publisher, or a rank it starts writing,
    numbers its batches from (above any earlier writer's for the replica: docs/redis.md)."""
    return time.time_ns() // 1000


class Publisher:
    def __init__(self, settings: PublisherSettings, store: IndexStore) -> None:
        if settings.ask_sources:
            settings = _with_ranks(settings, settings.endpoints)
        self.settings = settings
        self.store = store
        info = settings.info
        self.writer = StoreWriter(store, info.replica_keys(), settings.owner, _wall_us)
        # the engine's recurrent-state layout, learned from its checkpoints and registered
        # with the replica (routers read it from the registry: router.service.layout)
        self.grid = CheckpointGrid(info.block_size)
        self.info = info  # as last registered
        self.ingest = EngineIngest(
            info.replica,
            info.model,
            info.block_size,
            self._sink,
            on_checkpoint=self._checkpoint,
            adapter=settings.lora_base is not None,
            max_backlog_bytes=settings.max_backlog_bytes,
        )
        self.subscribers = SubscriberGroup(self.ingest, settings.endpoints)
        self._retired_restarts = 0  # ``restarts`` of the subscriber groups replaced
        self.stats = PublisherStats()
        self._wake = asyncio.Event()
        self._check_seqs = False  # set by a heartbeat; done by the flush loop (no write then)
        # registered once: from then on it registers again only while the lease is free or
        # its own (a takeover by a second publisher is never undone by this one)
        self._registered = False
        self._tasks: list[asyncio.Task[None]] = []
        self._http: aiohttp.ClientSession | None = None

    def _checkpoint(self, end: int) -> None:
        grid = self.grid
        grid.observe_end(end)
        if grid.unaligned == 1:
            log.warning(
                "publisher: the engine's state checkpoint at token %d is not on a %d-token "
                "block boundary: such prefixes are never usable in the index (choose a "
                "--block-size dividing the engine's checkpoint positions)",
                end,
                grid.block_size,
            )

    def learned_info(self) -> ReplicaInfo:
        """The registration with what was learned about the engine's state layout (the
        configured ``state_interval_blocks`` wins over the learned grid)."""
        configured = self.settings.info
        return replace(
            configured,
            publishes_state=configured.publishes_state or self.grid.checkpoints > 0,
            state_interval_blocks=configured.state_interval_blocks or (self.grid.interval() or 0),
            state_alignment_blocks=self.grid.alignment() or 0,
            lookahead_tokens=self.ingest.facts.lookahead_tokens,
            names_groups=self.ingest.facts.names_groups,
        )

    async def _register_learned(self) -> None:
        """Register again when the learned layout changed (routers see a ReplicaUp)."""
        info = self.learned_info()
        if info == self.info:
            return
        s = self.settings
        await self.store.register(info, s.owner, s.lease_ttl_s, take_over=False)
        log.info(
            "publisher: %s publishes recurrent state: %s, checkpoint grid %d blocks, "
            "hashes %d lookahead tokens",
            info.replica,
            info.publishes_state,
            info.state_interval_blocks,
            info.lookahead_tokens,
        )
        self.info = info

    @property
    def subscriber_restarts(self) -> int:
        """Subscribers restarted after failing, those of endpoints no longer followed too."""
        return self._retired_restarts + self.subscribers.restarts

    async def follow_endpoints(self, endpoints: tuple[EndpointSpec, ...]) -> None:
        """Follow the engine at ``endpoints`` instead (it restarted publishing elsewhere,
        its cache new): the old subscribers stop, every rank's state is cleared as for an
        engine restart found by its seq (``EngineIngest.clear``: the store keeps none of
        the old engine's blocks), then the new subscribers start and the new engine's
        history refills it. With ``ask_sources``, ranks the endpoints no longer name are
        dropped from the registration and new ones added (registered again, republished
        in full)."""
        old = self.subscribers
        await old.stop()
        self._retired_restarts += old.restarts
        self.ingest.clear(spec.dp_rank for spec in old.specs)
        if self.settings.ask_sources:
            self.settings = _with_ranks(self.settings, endpoints)
            self.writer.set_keys(self.settings.info.replica_keys())
        # in place before it starts: whoever stops the publisher meanwhile stops it
        self.subscribers = SubscriberGroup(self.ingest, endpoints)
        await self.subscribers.start()

    async def _follow_sources(self) -> None:
        from router.events.discovery import watch

        info = self.settings.info
        try:
            await watch(info.url, info.replica, self.subscribers.specs, self.follow_endpoints)
        except Exception:
            log.exception("publisher: following %s's KV event endpoints failed", info.replica)

    def _sink(self, key: ReplicaKey, events: list[IndexEvent]) -> None:
        self.writer.add(key, events)
        if self.writer.pending_events >= self.settings.max_batch_events:
            self._wake.set()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Register and start following; a store that is down now is retried by the flush
        loop (the state is republished in full once it answers)."""
        try:
            await self._register_and_reset()
        except Exception as exc:
            self.stats.store_errors += 1
            self.writer.needs_reset = True
            log.warning("publisher: store unreachable at start (%s); will retry", exc)
        await self.subscribers.start()
        self._tasks = [
            asyncio.create_task(self._flush_loop(), name="publisher-flush"),
            asyncio.create_task(self._heartbeat_loop(), name="publisher-heartbeat"),
        ]
        if self.settings.engine_metrics_url:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))
            self._tasks.append(asyncio.create_task(self._load_loop(), name="publisher-load"))
        if self.settings.ask_sources:
            self._tasks.append(
                asyncio.create_task(self._follow_sources(), name="publisher-sources")
            )

    async def stop(self) -> None:
        # re-cancelled until they end: a cancel the Redis client swallows whole (the command
        # returns, the loop sleeps again) would otherwise keep stop waiting forever; the
        # subscribers after them (one may have replaced them)
        await stop_all(self._tasks)
        self._tasks = []
        await self.subscribers.stop()
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self.stats.superseded:
            return  # the successor owns the replica's keys now
        s = self.settings
        try:
            try:
                await self.writer.flush()
            except SeqMismatch:
                await self.writer.flush()  # the full republish it calls for
            except LeaseLost:
                pass  # nothing written; deregistering still deletes what it left
            if s.deregister_on_stop and not await self.store.deregister(s.info.replica, s.owner):
                log.warning("publisher stop: %s is owned by another publisher", s.info.replica)
        except Exception as exc:
            log.warning("publisher stop: could not flush/deregister: %s", exc)

    async def __aenter__(self) -> Publisher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _register_and_reset(self) -> None:
        s = self.settings
        if not self._registered:  # the first registration (also when the store was down at start)
            await self.writer.resume_seq(floor=_wall_us())
        await self.store.settle_shards()  # the stream its entries go to
        self.info = self.learned_info()
        await self.store.register(self.info, s.owner, s.lease_ttl_s, take_over=not self._registered)
        self._registered = True
        await self.writer.reset()
        self.stats.resets += 1

    # ------------------------------------------------------------------ loops

    async def _flush_loop(self) -> None:
        backoff = 0.05
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.flush_interval_s)
            self._wake.clear()
            try:
                if self.writer.needs_reset:
                    await self._register_and_reset()
                else:
                    await self.writer.flush()
                    await self._register_learned()
                    if self._check_seqs:
                        self._check_seqs = False
                        await self._check_stored_seqs()
                backoff = 0.05
            except asyncio.CancelledError:
                raise
            except LeaseLost as exc:  # a write found the lease gone: register again at once
                self.stats.lease_losses += 1
                log.warning("publisher: %s; registering again and republishing", exc)
                self._wake.set()
            except LeaseTaken as exc:  # found registering again, or by a fenced write
                log.error("publisher: %s; standing down (no more writes)", exc)
                await self._stand_down()
                return
            except SeqMismatch as exc:  # the writer needs a reset: republish at once
                self.stats.seq_mismatches += 1
                log.warning("publisher: %s; republishing", exc)
                self._wake.set()
            except Exception as exc:
                _raise_if_cancelled(exc)
                self.stats.store_errors += 1
                log.warning("publisher: store write failed (%s); will republish", exc)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 2.0)

    async def _check_stored_seqs(self) -> None:
        """Republish in full when the store's seq of a key is not the writer's: the store
        went back (restored from a snapshot taken before later writes) or another writer
        wrote it. Runs between two flushes, so no write of ours is in flight."""
        states = self.writer.states
        keys = list(states)
        stored = await self.store.stored_seqs(keys)
        if any(seq != states[k].seq for k, seq in zip(keys, stored, strict=True)):
            self.stats.seq_mismatches += 1
            log.warning("publisher: the store's seq differs from ours; republishing")
            self.writer.needs_reset = True
            self._wake.set()

    async def _heartbeat_loop(self) -> None:
        s = self.settings
        while True:
            await asyncio.sleep(s.heartbeat_s)
            try:
                if not await self.store.heartbeat(s.info.replica, s.owner, s.lease_ttl_s):
                    self.stats.lease_losses += 1
                    log.warning("publisher: lease of %s was gone; republishing", s.info.replica)
                    self.writer.needs_reset = True
                    self._wake.set()
                else:
                    self._check_seqs = True
                if await self.store.settle_shards():
                    # routers read the other count's streams now: register again and
                    # republish in full on this replica's new shard
                    self.writer.needs_reset = True
                    self._wake.set()
            except LeaseTaken as exc:
                if await self._taken(exc):
                    return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                _raise_if_cancelled(exc)
                self.stats.store_errors += 1
                self.writer.needs_reset = True
                log.warning("publisher: heartbeat failed: %s", exc)

    async def _taken(self, exc: LeaseTaken) -> bool:
        """Another publisher holds the lease: once this one has registered, a successor took
        the replica over and this one stands down (True: the loop ends). Before its first
        registration (the store was down at start) the holder is its predecessor, whose
        lease that registration takes over: nothing to do yet."""
        if not self._registered:
            return False
        log.error("publisher: %s; standing down (no more writes)", exc)
        await self._stand_down()
        return True

    async def _stand_down(self) -> None:
        """Stop every writing task but this one (a loop that returns after this)."""
        if self.stats.superseded:
            return  # the other loop found it first and is stopping this one
        self.stats.superseded = True
        me = asyncio.current_task()
        await stop_all([t for t in self._tasks if t is not me])
        await self.subscribers.stop()  # after the tasks: one may have replaced them

    async def _load_loop(self) -> None:
        """Scrape the engine's page and publish its load per rank, every ``load_interval_s``.
        A page that fails (unreachable, refused, cut short) counts in ``scrape_errors``; a
        sample the store does not take (Redis down) in ``store_errors``: the engine is fine."""
        s = self.settings  # (its ``info.dp_ranks`` may change: ``follow_endpoints``)
        assert self._http is not None and s.engine_metrics_url
        missing = MissingGauges(log)
        # an adapter's load is its engine's, whose series vLLM labels with the served
        # (base) model's name only: the base's series are read on a page of several models
        model = s.lora_base or s.info.model
        while True:
            try:
                text = await fetch_page(self._http, s.engine_metrics_url)
                loads = await asyncio.get_running_loop().run_in_executor(
                    None, parse_engine_metrics, text, model
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                _raise_if_cancelled(exc)
                self.stats.scrape_errors += 1
                log.warning("publisher: load scrape of the engine failed: %s", exc)
            else:
                try:
                    await self._publish_loads(loads, missing)
                except asyncio.CancelledError:
                    raise
                except LeaseTaken as exc:
                    if await self._taken(exc):
                        return
                except LeaseLost:  # not written; the flush loop registers again
                    self.writer.needs_reset = True
                    self._wake.set()
                except Exception as exc:
                    _raise_if_cancelled(exc)
                    self.stats.store_errors += 1
                    log.warning("publisher: load sample not written to the store: %s", exc)
            await asyncio.sleep(s.load_interval_s)

    async def _publish_loads(self, loads: dict[int, ScrapedLoad], missing: MissingGauges) -> None:
        s = self.settings
        missing.check(s.info.replica, loads)
        missing.check_ranks(s.info.replica, loads, s.info.dp_ranks)
        now = time.time()
        for rank, load in loads.items():
            if rank not in s.info.dp_ranks:
                continue
            sample = LoadSample(
                load.running,
                load.waiting,
                load.kv_usage,
                now,
                load.prefix_cache_queries,
                load.prefix_cache_hits,
            )
            await self.store.publish_load(ReplicaKey(s.info.replica, rank), sample, s.owner)
            self.stats.loads_published += 1


def _with_ranks(
    settings: PublisherSettings, endpoints: tuple[EndpointSpec, ...]
) -> PublisherSettings:
    """``settings`` following ``endpoints``, its replica registered with the ranks they name."""
    ranks = tuple(sorted({spec.dp_rank for spec in endpoints}))
    return replace(settings, info=replace(settings.info, dp_ranks=ranks), endpoints=endpoints)


class PublisherCollector:
    """Prometheus collector over a publisher's counters (read at scrape time)."""

    def __init__(self, publisher: Publisher) -> None:
        self.p = publisher

    def collect(self) -> Iterable[Metric]:
        p = self.p
        ing, st, w = p.ingest.stats, p.stats, p.writer
        counters = {
            "kvrouter_publisher_payloads": ("engine event payloads received", ing.payloads),
            "kvrouter_publisher_malformed_payloads": (
                "payloads that could not be decoded (skipped)",
                ing.malformed_payloads,
            ),
            "kvrouter_publisher_malformed_events": (
                "events skipped as malformed",
                ing.malformed_events,
            ),
            "kvrouter_publisher_lost_batches": (
                "event batches lost beyond replay",
                ing.lost_batches,
            ),
            "kvrouter_publisher_backlog_dropped_batches": (
                "live event batches dropped over --max-event-backlog-mb (refilled by replay, "
                "or counted in lost_batches)",
                ing.backlog_dropped,
            ),
            "kvrouter_publisher_foreign_rank_batches": (
                "batches naming a data-parallel rank not followed (filed under their "
                "endpoint's rank)",
                ing.foreign_rank_batches,
            ),
            "kvrouter_publisher_engine_restarts": (
                "engine restarts found in its event sequence (the replica's state cleared)",
                ing.restarts,
            ),
            "kvrouter_publisher_subscriber_restarts": (
                "KV event subscribers restarted after failing",
                p.subscriber_restarts,
            ),
            "kvrouter_publisher_block_events": ("canonical block events written", w.block_events),
            "kvrouter_publisher_flushes": ("store writes (batches or resets)", w.flushes),
            "kvrouter_publisher_resets": ("full-state republishes", st.resets),
            "kvrouter_publisher_seq_mismatches": (
                "stored seqs found other than the writer's (republished)",
                st.seq_mismatches,
            ),
            "kvrouter_publisher_store_errors": ("failed store operations", st.store_errors),
            "kvrouter_publisher_scrape_errors": ("failed engine load scrapes", st.scrape_errors),
        }
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(value))
            yield c
        skipped = CounterMetricFamily(
            "kvrouter_publisher_blocks_not_indexed",
            "Engine blocks stored but not indexed, by reason: ignored_group (a KV cache group "
            "kind that holds no prefix), unknown_window (a sliding-window store without its "
            "window size or off GPU), unknown_parent, unaligned_state (a checkpoint off the "
            "router's blocks), opaque (keys no request reproduces), unmapped_offload (placed by "
            "a hash never stored with tokens)",
            labels=["reason"],
        )
        for reason, n in p.ingest.not_indexed().items():
            skipped.add_metric([reason], float(n))
        yield skipped
        g = GaugeMetricFamily(
            "kvrouter_publisher_superseded",
            "1 when another publisher took this replica's lease and this one stood down",
        )
        g.add_metric([], 1.0 if st.superseded else 0.0)
        yield g
        g = GaugeMetricFamily(
            "kvrouter_publisher_cached_blocks",
            "blocks in the replica state",
            labels=["dp_rank", "kind"],
        )
        for key, state in w.states.items():
            g.add_metric([str(key.dp_rank), "kv"], float(state.kv.count))
            g.add_metric([str(key.dp_rank), "state"], float(state.state.count))
        yield g
