"""Engine reports reaching the router: publishers' load samples (through the Redis store) and
the router's own scrape of replicas configured with ``metrics_url``.

Both feed :class:`EngineFeed`: the load tracker gets the engine's running / waiting / KV usage
(used by policies such as ``ours``), and the router keeps the engine's cumulative prefix-cache
counters per replica for ``kvrouter_engine_prefix_cache_{queries,hits}_tokens_total`` (the
replica's real hit rate, beside the router's ``kvrouter_replica_predicted_hit_tokens_total``).
Reports for replica keys the router does not route to are ignored. Membership: the configured
replicas, plus (``server.discover_replicas``, on by default with Redis) the replicas publishers
register in the store.

A replica reported by both (``metrics_url`` configured and a publisher in Redis) is followed
through one of them at a time, the publisher's while its reports come
(router/service/engine_sources.py), so neither the load view nor the exported counters
interleave two sources.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence

import aiohttp

from router.core.types import ReplicaKey
from router.publisher.scrape import MissingGauges, fetch_page, parse_engine_metrics
from router.service.engine_sources import PUBLISHER
from router.service.settings import ReplicaSettings
from router.service.state import RouterState
from router.store.base import LoadSample, ReplicaInfo
from router.store.sync_listener import LoadTrackerListener
from router.tasks import running

_log = logging.getLogger(__name__)
_MISSING = MissingGauges(_log)  # for callers of scrape_once without their own


class EngineFeed(LoadTrackerListener):
    """IndexSync listener (and the scrape's sink) for the router's registry of replicas.

    With ``discover`` the replicas publishers register (and deregister, or whose lease
    expires) join and leave the registry (``Fleet.add_discovered``); without it
    membership stays with the configuration. ``source``: what feeds it, :data:`PUBLISHER`
    (the store's load samples) or :data:`SCRAPE` (the router's scrape); a key's reports are
    taken from one source at a time (``Fleet.engine_sources``)."""

    def __init__(
        self, state: RouterState, *, discover: bool = False, source: str = PUBLISHER
    ) -> None:
        super().__init__(state.load)
        self.state = state
        self.discover = discover
        self.source = source

    def replica_up(self, info: ReplicaInfo) -> None:
        if self.discover:
            self.state.fleet.add_discovered(info)
        self.state.layouts.registered(info)  # what its publisher learned of the state layout

    def replica_down(self, replica: str, keys: Sequence[ReplicaKey]) -> None:
        if self.discover:
            self.state.fleet.remove_discovered(replica)
        self.state.layouts.unregistered(replica)

    def load(self, key: ReplicaKey, sample: LoadSample, now: float) -> None:
        fleet = self.state.fleet
        if self.state.registry.endpoint(key) is None:
            return
        if not fleet.engine_sources.accept(key, self.source, now):
            return  # the key's publisher reports it: the scrape is not used (warned once)
        super().load(key, sample, now)
        queries, hits = sample.prefix_cache_queries, sample.prefix_cache_hits
        if queries is not None and hits is not None:
            shown = fleet.engine_prefix_cache.get(key)
            if (
                shown is None
                or (queries >= shown[0] and hits >= shown[1])
                or not fleet.engine_sources.keeps_counters(key, now)
            ):
                fleet.engine_prefix_cache[key] = (queries, hits)
            # else: read before the other source's last, just replaced: not a reset
        else:  # the engine stopped exporting them: do not keep exporting a frozen value
            fleet.engine_prefix_cache.pop(key, None)


async def scrape_once(
    session: aiohttp.ClientSession,
    rep: ReplicaSettings,
    feed: EngineFeed,
    now: float,
    missing: MissingGauges | None = None,
    page_model: str | None = None,
) -> int:
    """Scrape one replica's page into ``feed``; returns the number of ranks reported. Raises
    ``aiohttp.ClientError`` / ``TimeoutError`` / ``ValueError`` (refused or not a metrics
    page). The page is bounded (``MAX_PAGE_BYTES``) and parsed off the event loop. Load
    gauges the page lacks are logged through ``missing`` (once per change). ``page_model``:
    the model whose series are the replica's on a page of several (default ``rep.model``;
    a LoRA adapter's base model: vLLM labels adapters' requests with the served model's
    name)."""
    assert rep.metrics_url
    text = await fetch_page(session, rep.metrics_url)
    loads = await asyncio.get_running_loop().run_in_executor(
        None, parse_engine_metrics, text, page_model or rep.model
    )
    (missing or _MISSING).check(rep.name, loads)
    (missing or _MISSING).check_ranks(rep.name, loads, range(rep.dp_ranks))
    reported = 0
    wall = time.time()
    for rank, load in loads.items():
        if rank >= rep.dp_ranks:
            continue
        sample = LoadSample(
            load.running,
            load.waiting,
            load.kv_usage,
            wall,
            load.prefix_cache_queries,
            load.prefix_cache_hits,
        )
        feed.load(ReplicaKey(rep.name, rank), sample, now)
        reported += 1
    return reported


async def scrape_loop(
    replicas: Sequence[ReplicaSettings],
    feed: EngineFeed,
    every_s: float,
    page_models: Mapping[str, str] | None = None,
) -> None:
    """Scrape every replica with ``metrics_url`` each ``every_s`` seconds, concurrently; a
    failing page is logged once per failure streak and retried next round. ``page_models``:
    replica name -> the model whose series it reads (``scrape_once``'s ``page_model``)."""
    models = page_models or {}
    loop = asyncio.get_running_loop()
    failing: set[str] = set()
    missing = MissingGauges(_log)
    timeout = aiohttp.ClientTimeout(total=max(0.5, min(every_s, 5.0)))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            now = loop.time()
            results = await asyncio.gather(
                *(
                    scrape_once(session, rep, feed, now, missing, models.get(rep.name))
                    for rep in replicas
                ),
                return_exceptions=True,
            )
            for rep, result in zip(replicas, results, strict=True):
                # (a CancelledError here is one scrape's, not this loop's: this loop's own
                # cancellation raises out of the gather / sleep)
                if isinstance(result, BaseException):
                    if rep.name not in failing:
                        failing.add(rep.name)
                        reason = str(result) or repr(result)  # TimeoutError() has no text
                        _log.warning("engine metrics of %s: %s", rep.name, reason)
                else:
                    failing.discard(rep.name)
            await asyncio.sleep(every_s)


@contextlib.asynccontextmanager
async def scraping(
    replicas: Sequence[ReplicaSettings],
    feed: EngineFeed,
    every_s: float,
    page_models: Mapping[str, str] | None = None,
) -> AsyncIterator[None]:
    """Run :func:`scrape_loop` for the duration of the block."""
    async with running(scrape_loop(replicas, feed, every_s, page_models)):
        yield
