"""Which source a replica key's engine reports are taken from, when two report it.

An engine's load (running, waiting, KV usage) and its cumulative prefix-cache counters reach
the router from its publisher sidecar (load samples through the Redis store,
router/store/sync.py) or from the router's own scrape of ``[[replicas]] metrics_url``
(router/service/engines.py). A replica configured with ``metrics_url`` whose publisher also
reports it has both; interleaved, the two make the load view flip between two samples and
the exported copies of the engine's counters (``kvrouter_engine_prefix_cache_*``) step back
whenever a sample read earlier lands after one read later (a counter reset to Prometheus: a
spike in every ``rate``).

The rule, per replica key (:meth:`EngineSources.accept`): the publisher's reports win while
they come, i.e. while its last one is at most ``stale_s`` old (the age past which the router
drops a report that stopped coming, router/service/background.py ``_housekeeping``); the
router's scrape is used otherwise, so a replica whose publisher stopped is followed again
by the scrape. A scrape dropped for a replica its publisher reports is logged once per
replica name, as a warning naming it.

When the source of a key changes, the new source's first samples may have been read before
the last one of the old (the publisher's travel through Redis), so for ``stale_s`` after a
change, counters lower than the exported ones are taken as that lag and not exported
(:meth:`EngineSources.keeps_counters`); a decrease from the same source as the exported
values, or one that lasts past ``stale_s``, is the engine's own reset and is exported.

Only the event-loop thread calls it; times are the event loop's clock, passed in.
"""

from __future__ import annotations

import logging

from router.core.types import ReplicaKey

_log = logging.getLogger(__name__)

PUBLISHER = "publisher"
"""A publisher sidecar's load sample, through the Redis store."""
SCRAPE = "scrape"
"""The router's own scrape of ``[[replicas]] metrics_url``."""

REPORT_STALE_INTERVALS = 10
"""An engine load report older than this many ``server.engine_metrics_interval_s`` is
dropped (direct scrapes and the publishers' reports alike; the publishers' default interval
is 1 s), and a publisher's reports older than that no longer win over the scrape."""


class EngineSources:
    """The source each replica key's engine reports are taken from (module docstring).
    ``stale_s``: how long a publisher's report keeps the key the publisher's."""

    __slots__ = ("_publisher_at", "_source", "_switched_at", "_warned", "stale_s")

    def __init__(self, stale_s: float) -> None:
        self.stale_s = stale_s
        self._publisher_at: dict[ReplicaKey, float] = {}
        self._source: dict[ReplicaKey, str] = {}  # the source of the key's last report taken
        self._switched_at: dict[ReplicaKey, float] = {}  # when that source took over
        self._warned: set[str] = set()  # replica names warned about both sources

    def accept(self, key: ReplicaKey, source: str, now: float) -> bool:
        """Whether a report of ``key`` from ``source`` (:data:`PUBLISHER`, :data:`SCRAPE`)
        arriving at ``now`` is taken: a publisher's always; a scrape's unless the key's
        publisher reported within ``stale_s`` (warned once per replica name)."""
        if source == SCRAPE:
            at = self._publisher_at.get(key)
            if at is not None and now - at <= self.stale_s:
                if key.replica not in self._warned:
                    self._warned.add(key.replica)
                    _log.warning(
                        "replica %s: its publisher reports its engine's load through Redis and "
                        "the router scrapes its metrics_url too; the publisher's reports are "
                        "used while they come (remove metrics_url from its [[replicas]] entry)",
                        key.replica,
                    )
                return False
        else:
            self._publisher_at[key] = now
        last = self._source.get(key)
        if last != source:
            self._source[key] = source
            if last is not None:
                self._switched_at[key] = now
        return True

    def keeps_counters(self, key: ReplicaKey, now: float) -> bool:
        """Whether counters of ``key`` lower than the exported ones, in a report just
        accepted at ``now``, are kept out of the export: its source changed within
        ``stale_s`` (the new source's sample may be older than the old one's last)."""
        at = self._switched_at.get(key)
        return at is not None and now - at <= self.stale_s

    def forget(self, key: ReplicaKey) -> None:
        """``key`` left the fleet: a replica that comes back under it starts afresh."""
        self._publisher_at.pop(key, None)
        self._source.pop(key, None)
        self._switched_at.pop(key, None)
