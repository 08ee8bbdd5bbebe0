"""What a simulated cluster run (sim/cluster.py ``Simulation``) is given and gives back:
:class:`ClusterConfig` (the fleet, its routers, disaggregation, admission), the settings a
run derives from it (``ours``' parameters: :func:`policy_params_for`; each request's service
class and tenant: :func:`class_and_tenant`) and :class:`RunResult`.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.core.admission import DEFAULT, FLEX, PRIORITY, AdmissionSettings
from router.core.disagg import LinkModel
from router.core.routing_settings import BusyThresholds
from router.core.slo import SloTargets
from router.core.turnover import REUSE_WINDOW_S
from router.core.types import ReplicaKey
from sim.profiles import EngineProfile
from sim.workload import SimRequest


@dataclass(slots=True, frozen=True)
class ClusterConfig:
    """Fleet and router settings of a run (profile figures can be overridden here)."""

    profile: EngineProfile
    replicas: int = 8
    block_size: int = 64
    kv_blocks: int | None = None
    cpu_blocks: int | None = None
    routers: int = 1
    regions: int = 1
    racks: int = 1
    event_lag_s: float = 0.0
    # what the HTTP path (client -> router -> engine and the first byte back) adds to every
    # request as its client sees it: TTFT and E2E start this much before the engine's
    # times, and a session's next turn leaves this much after the engine finished
    transport_s: float = 0.0
    # each arrival (a trace's request, a session's next turn) reaches the router up to this
    # much later than its time, uniformly, drawn from ``seed``: the live client's and the
    # network's scheduling noise. 0: a workload has one run. A closed loop turns a
    # millisecond into another schedule, so one run is one sample of what a live run shows
    # (``kvrouter bench live`` predicts with the median over several seeds)
    arrival_jitter_s: float = 0.0
    # engines' own load reports reach routers this often: 1 s, as in production (the
    # publisher's load_interval_s, the router's engine_metrics_interval_s)
    report_interval_s: float = 1.0
    speculative_ttl_s: float | None = None  # None: the service's default (RoutingSettings)
    reuse_window_s: float = REUSE_WINDOW_S  # RoutingSettings.reuse_window_s
    # None: each router knows only the requests it sent; a number: every that many seconds
    # each router takes the others' own in-flight load (LoadTracker.set_peer_load), as the
    # service's worker processes exchange it (server.load_share_interval_s)
    share_load_s: float | None = None
    busy: BusyThresholds = field(default_factory=BusyThresholds)
    slo: SloTargets = field(default_factory=SloTargets)
    seed: int = 0
    record_load: bool = False
    # prefill/decode disaggregation (sim/pd.py): off | always | auto, the prefill share of
    # each rack, PdKnobs overrides, the link model
    pd: str = "off"
    prefill_share: float = 0.25
    pd_params: Mapping[str, Any] | None = None
    link: LinkModel = field(default_factory=LinkModel)
    # SLO-aware admission (router/core/admission.py; None: off), the shares of requests in
    # the priority and flex classes (the rest: default) and the number of tenants; a
    # session's requests share a class and a tenant
    admission: AdmissionSettings | None = None
    priority_share: float = 0.0
    flex_share: float = 0.0
    tenants: int = 1

    def replica_blocks(self) -> tuple[int, int]:
        """One replica's GPU and host-tier blocks, as the engine model sizes them: the
        config's, else the profile's scaled to the block size."""
        p = self.profile.scaled(self.block_size)
        gpu = p.kv_blocks if self.kv_blocks is None else self.kv_blocks
        host = p.cpu_blocks if self.cpu_blocks is None else self.cpu_blocks
        return gpu, host

    def capacity_blocks(self) -> int:
        """The cluster's total KV capacity, in blocks: every replica's GPU blocks and its
        host tier's (``cpu_blocks``), which its engine keeps evicted blocks in and reuses
        (sim/block_cache.py)."""
        return sum(self.replica_blocks()) * self.replicas

    def replica_keys(self) -> list[ReplicaKey]:
        per_region = max(1, -(-self.replicas // self.regions))
        per_rack = max(1, -(-per_region // self.racks))
        keys = []
        for i in range(self.replicas):
            g, k = divmod(i, per_region)
            keys.append(ReplicaKey(f"reg{g}-rack{k // per_rack}-r{i}"))
        return keys


@dataclass(slots=True)
class RunResult:
    policy: str
    summary: dict[str, Any]
    ttft_s: list[float]
    arrival_ids: list[str]
    load_series: list[list[tuple[float, int]]]
    replica_names: list[str]


def policy_params_for(
    name: str,
    params: Mapping[str, Any] | None,
    profile: EngineProfile,
    slo: SloTargets | None = None,
) -> dict[str, Any]:
    """``ours`` predicts TTFT with the fleet's cost model and prices decode stalls against the
    run's TPOT target, unless given others."""
    out = dict(params or {})
    if name == "ours":
        if "cost" not in out:
            from dataclasses import asdict

            out["cost"] = asdict(profile.cost)
        if slo is not None:
            out.setdefault("tpot_target_s", slo.tpot_s)
            out.setdefault("ttft_tiers", slo.tiers)
    return out


def _unit(text: str, salt: int) -> float:
    """A stable number in [0, 1) for ``text`` (class and tenant draws, reproducible)."""
    return zlib.crc32(f"{salt}:{text}".encode()) / 2**32


def class_and_tenant(req: SimRequest, config: ClusterConfig) -> tuple[int, str]:
    """A request's service class (by ``priority_share`` / ``flex_share``) and tenant, drawn
    per session (per request without one) from the run's seed."""
    who = req.session_id or req.request_id
    u = _unit(who, config.seed)
    if u < config.priority_share:
        klass = PRIORITY
    elif u < config.priority_share + config.flex_share:
        klass = FLEX
    else:
        klass = DEFAULT
    tenants = max(1, config.tenants)
    tenant = f"t{int(_unit(who, config.seed + 7919) * tenants)}" if tenants > 1 else "t0"
    return klass, tenant
