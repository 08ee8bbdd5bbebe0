"""The fleet as the router sees it: which replicas exist (configured, or registered by
publishers), whether each is healthy, which are drained, and what their engines last
reported about their prefix caches. :class:`~router.service.state.RouterState` routes over
it; every change of membership is mirrored into the load tracker and the index.

Only the event-loop thread calls it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Sequence

from router.core.disagg import Role
from router.core.index import PrefixIndex
from router.core.load import LoadTracker
from router.core.types import ReplicaKey
from router.service.engine_sources import REPORT_STALE_INTERVALS, EngineSources
from router.service.registry import ReplicaRegistry
from router.service.replica_url import ReplicaUrl
from router.service.settings import ReplicaSettings, Settings
from router.store.base import ReplicaInfo

_log = logging.getLogger("router.service.state")


RETRY_AFTER_MAX_S = 60
"""The longest ``Retry-After`` a refusal for want of replicas gives (the openai SDK follows
one of up to 60 s)."""


class Fleet:
    """``models`` are the configured models (a registration for another one is refused);
    ``forget`` is called for each key of a replica that left, with its model, and then
    each of ``on_forget`` (the key's other owners: outlier ejection) with the key."""

    def __init__(
        self,
        settings: Settings,
        load: LoadTracker,
        index: PrefixIndex,
        models: Collection[str],
        forget: Callable[[str, ReplicaKey], None],
    ) -> None:
        self.settings = settings
        self.load = load
        self.index = index
        self.registry = ReplicaRegistry(settings.replicas)
        self._models = models
        self._forget = forget
        self.on_forget: list[Callable[[ReplicaKey], None]] = []
        self._static_names = frozenset(r.name for r in settings.replicas)
        self.drained: set[ReplicaKey] = set()  # see set_draining
        self.drained_replicas: set[str] = set()  # drained whole: see set_replica_draining
        self.unhealthy_until: dict[ReplicaKey, float] = {}
        # the engines' own cumulative prefix-cache counters (queried, hit prompt tokens) per
        # replica key, from publishers' load samples or the router's own scrape
        self.engine_prefix_cache: dict[ReplicaKey, tuple[float, float]] = {}
        # which of the two a key's reports are taken from (the publisher's while they come)
        self.engine_sources = EngineSources(
            REPORT_STALE_INTERVALS * settings.server.engine_metrics_interval_s
        )
        for ep in self.registry.endpoints():
            load.add_replica(ep.key)
            index.add_replica(ep.key)

    # ------------------------------------------------------------------ discovery

    def add_discovered(self, info: ReplicaInfo) -> bool:
        """Route to a replica a publisher registered (``server.discover_replicas``); a
        re-registration updates it (one at another address or for another model starts
        afresh, as if the old one had left). Statically configured names are left alone. Returns
        whether the replica is now routable; a registration that is refused also withdraws
        an earlier one of the same name (its old address must not stay routable)."""
        if info.replica in self._static_names:
            return False
        ranks = tuple(info.dp_ranks)
        problem: str | None = None
        address: tuple[str, int] | None = None  # None: the URL is refused (``problem``)
        try:  # the same URL rule as configured replicas (router/service/replica_url.py)
            address = ReplicaUrl.parse(info.url).address
        except ValueError as exc:
            problem = str(exc)
        if address is not None:
            owner = next(
                (
                    r.name
                    for r in self.registry.replicas()
                    if ReplicaUrl.parse(r.url).address == address
                ),
                None,
            )
            if info.model not in self._models:
                problem = (
                    f"model {info.model!r} is not configured (add "
                    f"[models.{info.model or 'NAME'}] to route to it)"
                )
            elif ranks != tuple(range(len(ranks))):
                problem = f"dp ranks {ranks} are not 0..N-1"
            elif owner is not None and owner != info.replica:
                problem = (
                    f"{info.url} is already routed to as {owner!r} (give a configured replica "
                    "the publisher's replica name, or set server.discover_replicas = false)"
                )
        if problem is not None:
            _log.warning("not routing to registered replica %s: %s", info.replica, problem)
            self.remove_discovered(info.replica)
            return False
        model = self.settings.model(info.model)  # configured: its engine exists since start-up
        if info.block_size != model.routing.block_size:
            _log.warning(
                "replica %s publishes %d-token blocks, the router hashes model %s in %d-token "
                "blocks: its cache will not match (publisher --block-size)",
                info.replica,
                info.block_size,
                info.model,
                model.routing.block_size,
            )
        old = self.registry.find(info.replica)
        previous = self.registry.get(info.replica)
        settings = ReplicaSettings(
            url=info.url,
            model=info.model,
            name=info.replica,
            rack=info.rack or None,
            region=info.region or None,
            dp_ranks=len(ranks),
            # read as a configured role is (any case, "" for both): the disaggregator looks
            # roles up by their canonical names (router/service/disagg.py)
            role=Role.parse(info.role).value,
        )
        if settings == previous:
            # the same registration again (a re-bootstrap after a Redis outage re-announces
            # the whole fleet): the model's key tuple, and the routing caches keyed by it,
            # stay as they are
            return True
        self.registry.upsert(settings)
        new = self.registry.find(info.replica)
        # the name registered for another engine (another address or model) before its old
        # registration expired: none of the old one's requests in flight, health or counters
        # are the new one's (as if the old one had left first)
        moved = previous is not None and (
            previous.model != settings.model or ReplicaUrl.parse(previous.url).address != address
        )
        self._forget_keys(old if moved else [k for k in old if k not in new], previous)
        for key in new:
            self.load.add_replica(key)
            self.index.add_replica(key)
            if key in self.drained or key.replica in self.drained_replicas:
                self.set_draining(key, True)
        return True

    def is_static(self, name: str) -> bool:
        """Configured in ``[[replicas]]`` (not discovered from the registry)."""
        return name in self._static_names

    def remove_discovered(self, name: str) -> None:
        """Stop routing to a registered replica (deregistered, or its lease expired)."""
        if name in self._static_names:
            return
        previous = self.registry.get(name)
        self._forget_keys(self.registry.remove(name), previous)

    def _forget_keys(self, keys: Sequence[ReplicaKey], previous: ReplicaSettings | None) -> None:
        for key in keys:
            self.load.remove_replica(key)
            self.engine_prefix_cache.pop(key, None)
            self.engine_sources.forget(key)
            self.unhealthy_until.pop(key, None)
            if previous is not None:
                self._forget(previous.model, key)
            for hook in self.on_forget:
                hook(key)

    # ------------------------------------------------------------------ health and drains

    def set_draining(self, key: ReplicaKey, draining: bool) -> None:
        """Admin drain / undrain, remembered across a discovered replica leaving and coming
        back (a publisher restart during a rolling update must not undo a drain)."""
        self.load.set_draining(key, draining)
        if draining:
            self.drained.add(key)
        else:
            self.drained.discard(key)
            self.drained_replicas.discard(key.replica)

    def set_replica_draining(self, name: str, draining: bool) -> None:
        """Drain / undrain every rank of replica ``name``, and (draining) the ranks a
        discovered replica registers later too; undraining one rank of it ends that."""
        if draining:
            self.drained_replicas.add(name)
        else:
            self.drained_replicas.discard(name)
        for key in self.registry.find(name):
            self.set_draining(key, draining)

    def restore_health(self, now: float) -> None:
        """Readmit the replicas whose unhealthy cooldown has ended."""
        if not self.unhealthy_until:
            return
        for key, until in list(self.unhealthy_until.items()):
            if now >= until:
                del self.unhealthy_until[key]
                self.load.set_health(key, True)

    def retry_after_s(self, model: str, now: float) -> int:
        """The ``Retry-After`` of a request of ``model`` refused for want of a replica: the
        configured ``server.retry_after_s``; when every replica of the model is held out of
        rotation until a known time (ejected, cooling down after failures), the whole
        seconds until the first comes back, up to ``RETRY_AFTER_MAX_S`` (a client told 1 s
        would spend its retries in the same refusal)."""
        base = self.settings.server.retry_after_s
        keys = self.registry.keys_for(model)
        ends = [self.unhealthy_until.get(k, math.nan) for k in keys]
        if not ends or not all(math.isfinite(e) for e in ends):
            return base  # one is out for another reason (down, draining, on probation)
        return max(base, min(math.ceil(min(ends) - now), RETRY_AFTER_MAX_S))

    def connect_failed(self, key: ReplicaKey, now: float, *, connected: bool) -> None:
        """A connection to ``key`` failed: taken and dropped unanswered (``connected``), that
        rank leaves rotation (one request must not take a whole replica out); refused
        (nothing listens), every DP rank of the replica does (they share its URL)."""
        if connected:
            self.mark_unhealthy(key, now)
            return
        for other in self.registry.find(key.replica):
            self.mark_unhealthy(other, now)

    def mark_unhealthy(self, key: ReplicaKey, now: float) -> None:
        """Take ``key`` out of rotation for ``server.unhealthy_cooldown_s``, or longer when
        it is out longer already (an ejection, a probation attempt: router/service/ejection.py;
        a failed probe or a dropped connection must not readmit it early)."""
        if self.registry.endpoint(key) is None:
            return  # removed meanwhile (a discovered replica left): nothing to mark
        until = now + self.settings.server.unhealthy_cooldown_s
        self.unhealthy_until[key] = max(self.unhealthy_until.get(key, until), until)
        self.load.set_health(key, False)
