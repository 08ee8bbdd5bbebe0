"""The routers of a simulated fleet (sim/cluster.py): each a ``RoutingEngine`` of
``router.core``, the code the service runs, with its own prefix index, load view and
admission queue, configured as a live router configures itself for these engines; and what
they know of the fleet when they route (:class:`FleetView`: engine load reports and the
load the other routers share, each as fresh as its interval lets it be)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from router.core.admission import AdmissionQueue
from router.core.index import PrefixIndex
from router.core.load import LoadTracker, summed_load
from router.core.policies import make_policy
from router.core.routing import RoutingEngine
from router.core.routing_settings import RoutingSettings
from router.core.types import ReplicaKey
from sim.cluster_config import ClusterConfig
from sim.engine import EngineModel


class SimRouter:
    """One router: its routing engine, its random stream and its admission queue (None:
    no admission), and the state of its admission pump (router/service/admission.py
    ``_pump``): whether it runs (a look is due), the generation of its due look, and
    whether a finish woke it."""

    __slots__ = ("admission", "engine", "rng", "tick", "ticking", "woken")

    def __init__(
        self, engine: RoutingEngine, rng: random.Random, admission: AdmissionQueue | None
    ) -> None:
        self.engine = engine
        self.rng = rng
        self.admission = admission
        self.ticking = False
        self.tick = 0
        self.woken = False


def routing_settings(config: ClusterConfig) -> RoutingSettings:
    """The routing settings a live router runs with in front of ``config``'s engines.

    The layout is what a live router learns from these engines' events (router/service/
    layout.py): hybrid (a sliding-window model too: its checkpoints sit where its window
    is cached, router/events/window.py), with a grid only where the engine checkpoints on
    one; a checkpoint at every block (a window, ``every_block``) or where prefill steps end
    shows none (state_layout.CheckpointGrid), and the router then speculates prompt-end
    checkpoints alone (tests/test_hybrid_prediction.py)."""
    p = config.profile
    window = p.window_blocks(config.block_size) > 0
    grid = p.hybrid and p.checkpoint == "every_n"
    return RoutingSettings(
        block_size=config.block_size,
        hybrid=p.hybrid or window,
        state_interval_blocks=(
            max(1, p.checkpoint_interval_tokens // config.block_size) if grid else 0
        ),
        speculative_ttl_s=config.speculative_ttl_s,
        busy=config.busy,
        reuse_window_s=config.reuse_window_s,
        # EAGLE / MTP engines give back a block of every hit: the router is told, as the
        # service is for such engines ([models.NAME] eagle)
        eagle=p.eagle,
    )


def make_routers(
    config: ClusterConfig,
    keys: Sequence[ReplicaKey],
    policy: str,
    params: Mapping[str, Any] | None,
) -> list[SimRouter]:
    """``config.routers`` routers (at least one) running ``policy`` over ``keys``, each with
    an empty index and load view of its own and a random stream seeded from the run's."""
    settings = routing_settings(config)
    routers = []
    for r in range(max(1, config.routers)):
        index = PrefixIndex()
        load = LoadTracker()
        for k in keys:
            index.add_replica(k)
            load.add_replica(k)
        engine = RoutingEngine(index, load, make_policy(policy, params), settings)
        queue = (
            AdmissionQueue(config.admission, config.slo) if config.admission is not None else None
        )
        routers.append(SimRouter(engine, random.Random(config.seed * 1000 + r), queue))
    return routers


class FleetView:
    """What the routers know of the fleet when one routes at ``now`` (:meth:`observe`):
    the engines' load reports, read at most every ``report_interval_s``, and, with several
    routers and ``share_load_s``, the sum of the others' own load at most that often (read
    when a router looks, not pushed on a schedule)."""

    def __init__(
        self,
        config: ClusterConfig,
        engines: Sequence[EngineModel],
        keys: Sequence[ReplicaKey],
        routers: Sequence[SimRouter],
    ) -> None:
        self.config = config
        self.engines = engines
        self.keys = keys
        self.routers = routers
        self._report_at = [float("-inf")] * len(engines)
        self._shared_at = float("-inf")

    def observe(self, now: float) -> None:
        self._refresh_reports(now)
        self._share_load(now)

    def _refresh_reports(self, now: float) -> None:
        interval = self.config.report_interval_s
        report_at = self._report_at
        for i, eng in enumerate(self.engines):
            if now - report_at[i] >= interval:
                report_at[i] = now
                report = eng.report(now)
                for router in self.routers:
                    router.engine.load.engine_report(self.keys[i], report)

    def _share_load(self, now: float) -> None:
        """Every ``share_load_s``: each router takes the sum of the others' own load."""
        interval = self.config.share_load_s
        if interval is None or len(self.routers) < 2 or now - self._shared_at < interval:
            return
        self._shared_at = now
        trackers = [r.engine.load for r in self.routers]
        for key in self.keys:
            own = [t.own(key) for t in trackers]
            for i, t in enumerate(trackers):
                t.set_peer_load(key, summed_load(o for j, o in enumerate(own) if j != i))
