"""Prefill/decode disaggregation in the simulator: which replica plays which role, where it
sits, the prefill legs of a run and their move to a decode replica, and the run's transfer
figures. The decision itself is router/core/disagg.py's, the same code the service runs;
sim/cluster.py routes the arrivals, runs the engines and moves what :class:`PrefillLegs`
says between them.

Roles (``--pd``, ``--prefill-share F``): in each rack the first ``round(F x replicas of the
rack)`` replicas (at least one when F > 0) are ``prefill``; the others are ``decode`` under
``always`` and ``both`` under ``auto`` (so ``auto`` can keep a request local); under ``off``
every replica is ``both`` and nothing is disaggregated.

With ``pd`` ``always`` or ``auto`` every arrival goes through
``router.core.disagg.Disaggregator.plan``: a local request runs as any request; a
disaggregated one runs its prefill leg (``max_output_tokens`` 1) on the prefill replica,
then, when that leg finishes, the decode replica is picked (``pick_decode``) and the request
reaches it at once, carrying the transfer time of its KV and state over the link between the
two (``remote_prefilled``, ``pull_s``: the decode engine pulls it when it admits the request,
as vLLM's NIXL connector does; no prefill compute there). A prefill leg the engine rejects
falls back to a local prefill on the decode replica. TTFT is the decode replica's first
token. A request stays local where the service keeps it local, by the same rule
(``router.core.disagg.keep_local_reason`` of its endpoint, ``n`` and prompts): ``n`` > 1, a
Messages or Responses API request, a completions batch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from router.core.disagg import (
    Disaggregator,
    Link,
    PdKnobs,
    PdPlan,
    Role,
    Site,
    TransferSizes,
    keep_local_reason,
)
from router.core.errors import NoReplicaAvailable
from router.core.routing import Dispatch, RoutingEngine
from router.core.types import ReplicaKey, RouteRequest
from sim.cluster_config import ClusterConfig
from sim.engine import EngineRequest
from sim.workload import SimRequest


def sites_of(keys: Sequence[ReplicaKey]) -> dict[ReplicaKey, Site]:
    """Sites from the simulator's replica names ``reg{g}-rack{k}-r{i}``."""
    out = {}
    for k in keys:
        region, rack, _ = k.replica.split("-", 2)
        out[k] = Site(region, f"{region}-{rack}")
    return out


def roles_of(
    keys: Sequence[ReplicaKey], sites: dict[ReplicaKey, Site], mode: str, share: float
) -> dict[ReplicaKey, Role]:
    """Roles by rack (module doc)."""
    if mode == "off" or share <= 0:
        return dict.fromkeys(keys, Role.BOTH)
    rest = Role.DECODE if mode == "always" else Role.BOTH
    by_rack: dict[Site, list[ReplicaKey]] = {}
    for k in keys:
        by_rack.setdefault(sites[k], []).append(k)
    out: dict[ReplicaKey, Role] = {}
    for members in by_rack.values():
        n = min(len(members) - 1, max(1, round(share * len(members))))
        if n <= 0:  # a rack of one: it does both
            out.update(dict.fromkeys(members, Role.BOTH))
            continue
        for i, k in enumerate(members):
            out[k] = Role.PREFILL if i < n else rest
    return out


@dataclass(slots=True)
class PdStats:
    """Counts of one run: requests disaggregated, bytes moved by link, prefill fallbacks.
    ``transfers``: the disaggregated requests whose prefill leg ended and moved its bytes (a
    fallback moves none); ``transfer_ms_mean`` is over them."""

    requests: int = 0
    remote: int = 0
    fallbacks: int = 0
    transfers: int = 0
    bytes_total: float = 0.0
    bytes_cross_rack: float = 0.0
    transfer_s: float = 0.0

    def moved(self, link: Link, nbytes: float, seconds: float) -> None:
        self.transfers += 1
        self.bytes_total += nbytes
        if link in (Link.NETWORK, Link.REGION):
            self.bytes_cross_rack += nbytes
        self.transfer_s += seconds

    def summary(self) -> dict[str, object]:
        return {
            "pd_share": round(self.remote / self.requests, 5) if self.requests else 0.0,
            "cross_rack_transfer_share": (
                round(self.bytes_cross_rack / self.bytes_total, 5) if self.bytes_total else 0.0
            ),
            "transfer_gb": round(self.bytes_total / 1e9, 3),
            "transfer_ms_mean": (
                round(1000 * self.transfer_s / self.transfers, 3) if self.transfers else 0.0
            ),
            "pd_fallbacks": self.fallbacks,
        }


@dataclass(slots=True, frozen=True)
class Handoff:
    """Where a disaggregated request goes once its prefill leg ended: ``engine_request``
    reaches ``replica`` at ``at`` (the leg's end; its ``pull_s`` is the transfer of its KV
    and state, which the decode engine starts when it admits it; a rejected leg's request is
    prefilled there); ``dispatch`` is what routing it there guessed."""

    request: SimRequest
    replica: ReplicaKey
    engine_request: EngineRequest
    dispatch: Dispatch
    at: float


class PrefillLegs:
    """A run's disaggregated serving (module doc): each arrival's plan, the prefill legs
    running, the decode replica each request moves to when its leg ends, and the run's
    figures (``stats``). A leg is a ``RouteRequest`` of its own id
    (``Disaggregator.prefill_request``), booked in the router's load until it ends."""

    __slots__ = ("_from_prefill", "_legs", "keys", "planner", "stats")

    def __init__(self, config: ClusterConfig, keys: tuple[ReplicaKey, ...]) -> None:
        p = config.profile
        sites = sites_of(keys)
        # the run's mode and TPOT target, whatever ``pd_params`` say (as the service takes the
        # model's TPOT target: PdSetup.from_mapping)
        knobs = PdKnobs(
            **{
                **dict(config.pd_params or {}),
                "mode": config.pd,
                "tpot_target_s": config.slo.tpot_s,
            }
        )
        self.planner = Disaggregator(
            knobs,
            p.cost,
            roles=roles_of(keys, sites, config.pd, config.prefill_share),
            sites=sites,
            link=config.link,
            sizes=TransferSizes(p.kv_bytes_per_token, p.state_bytes),
        )
        self.keys = keys
        self.stats = PdStats()
        # prefill leg id -> (its request, the request's RouteRequest, the prefill replica)
        self._legs: dict[str, tuple[SimRequest, RouteRequest, ReplicaKey]] = {}
        self._from_prefill: set[str] = set()  # requests whose hit their prefill leg reported

    def plan(
        self,
        engine: RoutingEngine,
        req: SimRequest,
        rr: RouteRequest,
        prompts: int,
        now: float,
        rng: random.Random,
    ) -> PdPlan:
        """Plan ``req`` (routed as ``rr``, ``prompts`` prompts sent together); raises
        NoReplicaAvailable as ``Disaggregator.plan`` does."""
        # the service keeps what vLLM's protocol cannot carry local (its keep_local)
        keep = keep_local_reason(req.endpoint, req.samples, prompts)
        plan = self.planner.plan(engine, rr, self.keys, now, rng, keep_local=keep)
        self.stats.requests += 1
        return plan

    def start_leg(self, req: SimRequest, rr: RouteRequest, replica: ReplicaKey) -> RouteRequest:
        """``req``'s prefill leg, sent to ``replica``: the RouteRequest to book it as; its
        engine request is the leg's id, the request's prompt and one output token."""
        self.stats.remote += 1
        leg = self.planner.prefill_request(rr)
        self._legs[leg.request_id] = (req, rr, replica)
        self._from_prefill.add(req.request_id)
        return leg

    def is_leg(self, request_id: str) -> bool:
        return request_id in self._legs

    def request_of(self, leg_id: str) -> SimRequest:
        return self._legs[leg_id][0]

    def hit_from_leg(self, request_id: str) -> bool:
        """True when ``request_id``'s hit figures are its prefill leg's (not its decode's)."""
        return request_id in self._from_prefill

    def leg_ended(
        self,
        leg_id: str,
        rejected: bool,
        engine: RoutingEngine,
        leg_dispatch: Dispatch | None,
        now: float,
        rng: random.Random,
    ) -> Handoff:
        """The prefill leg ``leg_id`` finished (or its engine rejected it) at ``now``: its
        flight in ``engine``'s load ends (a rejected one's ``leg_dispatch`` is withdrawn:
        the prefill engine holds nothing of it) and the decode replica is picked. Raises
        NoReplicaAvailable when no decode replica is left (the request is answered with the
        error)."""
        req, rr, prefill = self._legs.pop(leg_id)
        engine.load.complete(leg_id)
        if rejected and leg_dispatch is not None:
            engine.withdraw(leg_dispatch)
        try:
            pick = self.planner.pick_decode(engine, rr, prefill, self.keys, now, rng)
        except NoReplicaAvailable:
            self._from_prefill.discard(req.request_id)
            raise
        ereq = EngineRequest(
            req.request_id,
            req.block_hashes,
            req.prompt_tokens,
            req.output_tokens,
            req.output_block_hashes,
            remote_prefilled=not rejected,
            pull_s=0.0 if rejected else pick.transfer_s,
        )
        replica = pick.decision.replica
        if rejected:
            self.stats.fallbacks += 1
            self._from_prefill.discard(req.request_id)
            # prefilled where it is decoded: recorded as a local request is (its load with its
            # own hit there; speculative entries and the session's hint), as the service does
            return Handoff(req, replica, ereq, engine.dispatched(rr, pick.decision, now), now)
        dispatch = self.planner.dispatched_decode(engine, rr, pick.decision, now)
        self.stats.moved(pick.link, pick.transfer_bytes, pick.transfer_s)
        return Handoff(req, replica, ereq, dispatch, now)
