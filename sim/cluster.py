"""A simulated fleet: N engine models behind one or several routers, driven by the event core.

Each router instance owns a ``RoutingEngine`` from ``router.core`` (the same code the service
runs) with its own in-flight load view and its own local copy of the prefix index. Engines'
index events reach every router's index ``event_lag_s`` after they happen (the shared Redis
index and its propagation lag); engine load reports reach them at most every
``report_interval_s`` (read lazily when a router routes). Requests are spread over the routers
round robin, so several routers can pile onto one replica before they see each other's load.

Replicas carry region and rack labels (``reg{g}-rack{k}-r{i}``), spread evenly.

With ``pd`` ``always`` or ``auto`` (sim/pd.py: roles by rack) every arrival goes through
``router.core.disagg.Disaggregator.plan``: a local request runs as above; a disaggregated one
runs its prefill leg (``max_output_tokens`` 1) on the prefill replica, then, when that leg
finishes, the decode replica is picked (``pick_decode``) and the request reaches it after the
transfer time of its KV and state over the link between the two (``remote_prefilled``: no
prefill compute there). A prefill leg the engine rejects falls back to a local prefill on the
decode replica. TTFT is the decode replica's first token.

A request sampling ``n`` > 1 sequences (``SimRequest.samples``) is routed as one (its
``n`` counted in the router's load, as the service counts it; never disaggregated, as the
service keeps it local: ``keep_local`` ``parallel_sampling``) and runs as vLLM v1 runs it:
one engine request per sequence (``sim.engine.sampled``, as the mock replica submits them),
all on the replica it went to, queued together. The first prefills the prompt; the others
hit the blocks it computed before they were admitted and decode alongside it. (The engine
model caches a block at the end of the step that computed it, vLLM as it allocates it:
sequences admitted in the same step as the first prefill the prompt again here, where
vLLM's hit them.) The request's first token is the first sequence's, its finish the last
sequence's.

Under ``pd`` a request stays local where the service keeps it local, by the same rule
(``router.core.disagg.keep_local_reason`` of its endpoint, ``n`` and prompts): ``n`` > 1,
a Messages or Responses API request, a completions batch.

The requests of one completions batch (``SimRequest.batch``: a recording's rows of one
batch) are one request to the service: they arrive with the batch's first request (in
workload order; the others' own arrival and ``after`` are not used), are routed once as the
router routes a batch (the longest prompt's blocks, the first of the longest, every prompt's
tokens counted, ``prompts`` = the batch's size) and all run on that replica, each an engine
request of its own prompt. The batch's load is booked as the service books it, one flight
of all its prompts (``LoadTracker.dispatch`` ``prompts``: each prompt's sequences, every
prompt's tokens) under its first request's id: it starts decoding at the first token of any
of its rows and ends when the last of them ends (the service's answer ends with its last
sequence), and so does its admission ticket; a closed-loop turn tied to any of its rows
follows the whole batch's end, as the live replay's turn follows the batch's one answer. A
refusal or a shed refuses all of them.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from router.core.admission import (
    ADMIT,
    DEFAULT,
    FLEX,
    PRIORITY,
    SHED,
    AdmissionQueue,
    AdmissionSettings,
    Assessment,
    Ticket,
    assess,
    class_ttft_factor,
    engine_priority,
    predictor_for,
    restrict,
)
from router.core.disagg import (
    Disaggregator,
    LinkModel,
    PdKnobs,
    TransferSizes,
    keep_local_reason,
)
from router.core.errors import NoReplicaAvailable
from router.core.index import PrefixIndex
from router.core.load import LoadTracker, summed_load
from router.core.policies import make_policy, uses_prefix_index
from router.core.routing import BusyThresholds, Dispatch, RoutingEngine, RoutingSettings
from router.core.slo import SloTargets
from router.core.turnover import REUSE_WINDOW_S
from router.core.types import Decision, EventBatch, ReplicaKey, RouteRequest
from sim.engine import EngineModel, EngineRequest, Finished, FirstToken, Rejected
from sim.engine import sampled as engine_sequences
from sim.events import ARRIVAL, DELIVER, ENGINE, TRANSFER, EventQueue
from sim.metrics import RequestRecord, summarize
from sim.pd import PdStats, roles_of, sites_of
from sim.profiles import EngineProfile
from sim.workload import SimRequest, Workload, scale_arrivals

Progress = Callable[[int, int], None]


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

    def capacity_blocks(self) -> int:
        """The cluster's total GPU KV capacity, in blocks."""
        per = self.kv_blocks or self.profile.scaled(self.block_size).kv_blocks
        return per * self.replicas

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
    return out


class _Router:
    __slots__ = ("admission", "engine", "rng")

    def __init__(
        self, engine: RoutingEngine, rng: random.Random, admission: AdmissionQueue | None
    ) -> None:
        self.engine = engine
        self.rng = rng
        self.admission = admission


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


class Simulation:
    """One run of one policy over one workload. ``run()`` may be called once."""

    def __init__(
        self,
        workload: Workload,
        config: ClusterConfig,
        policy: str,
        policy_params: Mapping[str, Any] | None = None,
        *,
        speedup: float = 1.0,
        progress: Progress | None = None,
    ) -> None:
        if workload.block_size != config.block_size:
            raise ValueError("workload hashed at a different block size than the cluster")
        self.workload = workload
        self.config = config
        self.policy_name = policy
        self.speedup = speedup
        self.progress = progress
        p = config.profile
        self.keys = tuple(config.replica_keys())  # one tuple: routing caches where each sits
        # engines scheduling by priority, requests carrying their class (as the service does)
        self._engine_priority = config.admission is not None and config.admission.engine_priority
        self.engines = [
            EngineModel(
                p,
                k,
                config.block_size,
                kv_blocks=config.kv_blocks,
                cpu_blocks=config.cpu_blocks,
                emit_tokens=False,
                scheduling="priority" if self._engine_priority else "fcfs",
            )
            for k in self.keys
        ]
        # a sliding-window model is routed as a hybrid one whose checkpoints sit on every block
        # its window is cached at (router/events/window.py)
        window = p.window_blocks(config.block_size) > 0
        settings = RoutingSettings(
            block_size=config.block_size,
            hybrid=p.hybrid or window,
            state_interval_blocks=(
                max(1, p.checkpoint_interval_tokens // config.block_size)
                if p.hybrid
                else 1
                if window
                else 0
            ),
            speculative_ttl_s=config.speculative_ttl_s,
            busy=config.busy,
            reuse_window_s=config.reuse_window_s,
            # EAGLE / MTP engines give back a block of every hit: the router is told, as
            # the service is for such engines ([models.NAME] eagle)
            eagle=p.eagle,
        )
        params = policy_params_for(policy, policy_params, p, config.slo)
        self.routers = []
        for r in range(max(1, config.routers)):
            index = PrefixIndex()
            load = LoadTracker()
            for k in self.keys:
                index.add_replica(k)
                load.add_replica(k)
            engine = RoutingEngine(index, load, make_policy(policy, params), settings)
            queue = (
                AdmissionQueue(config.admission, config.slo)
                if config.admission is not None
                else None
            )
            self.routers.append(_Router(engine, random.Random(config.seed * 1000 + r), queue))
        self._predictor = predictor_for(self.routers[0].engine.policy, p.cost)
        # classes weigh decodes differently only under admission (as in the service)
        adm = config.admission
        self._weights = adm.decode_weight if adm is not None else (1.0, 1.0, 1.0)
        # Policies that ignore the prefix index (round robin, random, least loaded): the
        # engines' KV events are not applied to it, as a peer's simulator does not run an
        # indexer for them either. Nothing the simulation reports reads the index.
        self._feed_index = any(uses_prefix_index(r.engine.policy) for r in self.routers)
        self._slot = {k: i for i, k in enumerate(self.keys)}
        self._queue = EventQueue()
        self._gen = [0] * len(self.engines)
        self._wake_at: list[float | None] = [None] * len(self.engines)
        self._report_at = [float("-inf")] * len(self.engines)
        self._shared_at = float("-inf")
        self._records: dict[str, RequestRecord] = {}
        self._router_of: dict[str, _Router] = {}
        # what each request (or prefill leg) sent to an engine was guessed to leave there,
        # until the engine takes it (its first token) or rejects it (withdrawn)
        self._dispatches: dict[str, Dispatch] = {}
        self._children: dict[str, list[SimRequest]] = {}
        self._order: list[SimRequest] = []
        self._next_router = 0
        self._series: list[list[tuple[float, int]]] = [[] for _ in self.engines]
        self._done = 0
        self.pd_stats = PdStats()
        self.pd: Disaggregator | None = None
        if config.pd != "off":
            sites = sites_of(self.keys)
            # the run's mode and TPOT target, whatever ``pd_params`` say (as the service
            # takes the model's TPOT target: PdSetup.from_mapping)
            knobs = PdKnobs(
                **{
                    **dict(config.pd_params or {}),
                    "mode": config.pd,
                    "tpot_target_s": config.slo.tpot_s,
                }
            )
            self.pd = Disaggregator(
                knobs,
                p.cost,
                roles=roles_of(self.keys, sites, config.pd, config.prefill_share),
                sites=sites,
                link=config.link,
                sizes=TransferSizes(p.kv_bytes_per_token, p.state_bytes),
            )
        # prefill leg id -> (request, its RouteRequest, prefill engine slot)
        self._legs: dict[str, tuple[SimRequest, RouteRequest, int]] = {}
        self._from_prefill: set[str] = set()  # requests whose hit their prefill leg reported
        # ``n`` > 1: request id -> (its request, engine ids of its sequences not finished),
        # and each extra sequence's engine id -> its request's id
        self._sampled: dict[str, tuple[SimRequest, set[str]]] = {}
        self._sample_of: dict[str, str] = {}
        self._held_finish: dict[str, Any] = {}  # a request's own Finished, held for the others
        # a completions batch: its first request's id -> the batch's other requests
        self._batch_of: dict[str, list[SimRequest]] = {}
        # a dispatched batch's rows: row id -> its first request's id (the flight booked),
        # and that id -> the rows not ended yet
        self._flight_of: dict[str, str] = {}
        self._batch_left: dict[str, set[str]] = {}
        self._shed_count = 0
        self._pumping = False
        self._jitter = random.Random(config.seed + 0x5EED) if config.arrival_jitter_s > 0 else None

    def _arrival_time(self, t: float) -> float:
        """When an arrival due at ``t`` reaches the router (``arrival_jitter_s``)."""
        if self._jitter is None:
            return t
        return t + self._jitter.uniform(0.0, self.config.arrival_jitter_s)

    # ------------------------------------------------------------------ running

    def run(self) -> RunResult:
        requests = scale_arrivals(self.workload.requests, self.speedup)
        q = self._queue
        leaders: dict[str, str] = {}  # batch -> its first request's id
        for r in requests:
            if r.batch is not None:
                leader = leaders.setdefault(r.batch, r.request_id)
                if leader != r.request_id:  # arrives with its batch's first request
                    self._batch_of.setdefault(leader, []).append(r)
                    continue
            if r.after is None:
                q.push(self._arrival_time(r.arrival_s), ARRIVAL, r)
            else:
                self._children.setdefault(r.after, []).append(r)
        total = len(requests)
        progress = self.progress
        pop = q.pop
        engines = self.engines
        gen = self._gen
        while q:
            t, prio, payload = pop()
            if prio == ENGINE:
                i, g = payload
                if g != gen[i]:
                    continue
                self._wake_at[i] = None
                self._after_engine(i, t, engines[i].advance(t))
            elif prio == ARRIVAL:
                self._arrive(payload, t)
                if progress is not None and not len(self._order) & 127:
                    progress(len(self._order), total)
            elif prio == TRANSFER:
                self._submit(payload[0], payload[1], t)
            else:
                for router in self.routers:
                    router.engine.index.apply(payload)
        for router in self.routers:  # nothing held is left unanswered
            if router.admission is not None:
                for late in router.admission.expire(float("inf")):
                    self._records[str(late.key)].rejected = True
                    self._shed_count += 1
        if progress is not None:
            progress(total, total)
        summary = summarize(
            (self._records[r.request_id] for r in self._order),
            [e.busy_s for e in engines],
            [str(k) for k in self.keys],
            self.config.slo,
            [class_ttft_factor(self.config.admission, k) for k in (PRIORITY, DEFAULT, FLEX)],
        )
        summary = {"policy": self.policy_name, **summary, **self.pd_stats.summary()}
        summary["admission"] = "slo" if self.config.admission is not None else "off"
        summary["shed"] = self._shed_count
        summary["preemptions"] = sum(e.preemptions for e in engines)
        ttft = [
            rec.first - rec.arrival
            for rec in self._records.values()
            if not rec.rejected and rec.first == rec.first
        ]
        return RunResult(
            self.policy_name,
            summary,
            ttft,
            [r.request_id for r in self._order],
            self._series,
            [str(k) for k in self.keys],
        )

    # ------------------------------------------------------------------ handlers

    def _arrive(self, req: SimRequest, now: float) -> None:
        router = self.routers[self._next_router]
        self._next_router = (self._next_router + 1) % len(self.routers)
        self._order.append(req)
        engine = router.engine
        self._refresh_reports(engine, now)
        self._share_load(now)
        rows = [req, *self._batch_of.get(req.request_id, ())]
        # a batch is routed as the service routes it: by its longest prompt's blocks (the
        # first of the longest), every prompt's tokens counted
        longest = max(rows, key=lambda r: r.prompt_tokens)
        rr = RouteRequest(
            req.request_id,
            self.workload.model,
            sum(r.prompt_tokens for r in rows),
            longest.block_hashes,
            self.config.block_size,
            req.session_id,
            req.output_tokens,
            samples=req.samples,
            prompts=len(rows),
        )
        klass, tenant = class_and_tenant(req, self.config)
        for row in rows:
            if row.samples > 1:
                self._sampled[row.request_id] = (row, {row.request_id})
            record = RequestRecord(row.request_id, now, row.prompt_tokens, -1)
            record.samples = row.samples
            record.klass = klass
            self._records[row.request_id] = record
            if row is not req:
                self._order.append(row)
        record = self._records[req.request_id]
        if self.pd is not None:  # disaggregated serving decides without admission
            try:
                # the service keeps what vLLM's protocol cannot carry local (its keep_local)
                keep = keep_local_reason(req.endpoint, req.samples, len(rows))
                plan = self.pd.plan(engine, rr, self.keys, now, router.rng, keep_local=keep)
            except NoReplicaAvailable:
                self._refuse(req.request_id, now)
                return
            self._router_of[req.request_id] = router
            self.pd_stats.requests += 1
            if plan.prefill is None:
                assert plan.local is not None
                # as admission's own: no class weight nor engine priority (the service's)
                self._dispatch(router, req, rr, plan.local, now, None)
                return
            self.pd_stats.remote += 1
            leg = self.pd.prefill_request(rr)
            self._dispatches[leg.request_id] = engine.dispatched(leg, plan.prefill, now)
            i = self._slot[plan.prefill.replica]
            record.replica = i
            record.sent = now
            self._legs[leg.request_id] = (req, rr, i)
            self._from_prefill.add(req.request_id)
            self._submit(
                i, EngineRequest(leg.request_id, req.block_hashes, req.prompt_tokens, 1), now
            )
            return
        queue = router.admission
        if queue is not None:
            self._pump(router, now)
        try:
            candidates = engine.candidates(rr, self.keys, now)
        except NoReplicaAvailable:  # every replica busy, reject_when_all_busy: the 429
            self._refuse(req.request_id, now)
            return
        if queue is None:
            self._commit(router, req, rr, candidates, now, klass)
            return
        a = assess(self._predictor, rr, candidates, now)
        ticket = queue.ticket(req.request_id, klass, tenant, rr.prompt_tokens, now, (req, rr))
        verdict = queue.judge(ticket, a, now)
        if verdict.action == ADMIT:
            assert verdict.allowed is not None
            d = self._commit(router, req, rr, restrict(candidates, verdict.allowed), now, klass)
            uncached = rr.prompt_tokens - d.usable_tokens
            queue.dispatched(ticket, a, d.replica, uncached, req.output_tokens)
        elif verdict.action == SHED:
            self._shed(req.request_id, now)

    def _commit(
        self,
        router: _Router,
        req: SimRequest,
        rr: RouteRequest,
        candidates: Any,
        now: float,
        klass: int = DEFAULT,
    ) -> Decision:
        """Route among ``candidates`` and send the request to the chosen engine."""
        decision = router.engine.choose(rr, candidates, now, router.rng)
        return self._dispatch(router, req, rr, decision, now, klass)

    def _dispatch(
        self,
        router: _Router,
        req: SimRequest,
        rr: RouteRequest,
        decision: Decision,
        now: float,
        klass: int | None = DEFAULT,
    ) -> Decision:
        """Send the request to the engine ``decision`` chose; ``klass`` None: routed
        without admission (a disaggregated model's, as the service routes it: no class
        decode weight, no engine priority). A batch's first request takes the batch's
        others along (its load booked once, under its id, as the service books a batch)."""
        weight = 1.0 if klass is None else self._weights[klass]
        self._dispatches[req.request_id] = router.engine.dispatched(
            rr, decision, now, class_weight=weight
        )
        i = self._slot[decision.replica]
        priority = engine_priority(klass) if self._engine_priority and klass is not None else 0
        rows = (req, *self._batch_of.get(req.request_id, ()))
        if len(rows) > 1:
            self._batch_left[req.request_id] = {r.request_id for r in rows}
            for row in rows:
                self._flight_of[row.request_id] = req.request_id
        for sent in rows:
            rec = self._records[sent.request_id]
            rec.replica = i
            rec.sent = now
            self._router_of[sent.request_id] = router
            ereq = EngineRequest(
                sent.request_id,
                sent.block_hashes,
                sent.prompt_tokens,
                sent.output_tokens,
                sent.output_block_hashes,
                priority=priority,
            )
            self._submit(i, ereq, now)
        return decision

    def _submit(self, i: int, ereq: EngineRequest, now: float) -> None:
        eng = self.engines[i]
        eng.submit(ereq, now)
        sampled = self._sampled.get(ereq.request_id)
        if sampled is not None:  # its other sequences, behind it in the queue (module doc)
            for seq in engine_sequences(ereq, sampled[0].samples)[1:]:
                self._sample_of[seq.request_id] = ereq.request_id
                sampled[1].add(seq.request_id)
                eng.submit(seq, now)
        if self.config.record_load:
            self._series[i].append((now, eng.pending()))
        self._after_engine(i, now, eng.advance(now))

    def _shed(self, request_id: str, now: float) -> None:
        self._shed_count += 1
        self._refuse(request_id, now)

    def _refuse(self, request_id: str, now: float) -> None:
        """The router answers ``request_id`` with an error, sending it nowhere (an admission
        shed; no replica to take it, as the service's 429 / 503): a miss, and its session
        goes on."""
        self._records[request_id].rejected = True
        self._follow_ups(request_id, now)
        for row in self._batch_of.get(request_id, ()):  # a batch is answered as one
            self._records[row.request_id].rejected = True
            self._follow_ups(row.request_id, now)

    def _pump(self, router: _Router, now: float) -> None:
        """Shed the held requests that can no longer make it; dispatch those that fit."""
        queue = router.admission
        if queue is None or not len(queue) or self._pumping:
            return
        self._pumping = True  # dispatching advances engines, whose events pump again
        try:
            for t in queue.expire(now):
                self._shed(str(t.key), now)
            engine = router.engine
            self._refresh_reports(engine, now)
            seen: dict[object, tuple[Any, Assessment]] = {}

            def held(t: Ticket) -> Assessment | None:
                rr = t.payload[1]
                try:
                    cands = engine.candidates(rr, self.keys, now)
                except NoReplicaAvailable:
                    return None
                a = assess(self._predictor, rr, cands, now)
                seen[t.key] = (cands, a)
                return a

            while len(queue):
                got = queue.ready(now, held)
                if got is None:
                    break
                t, allowed = got
                req, rr = t.payload
                cands, a = seen[t.key]
                d = self._commit(router, req, rr, restrict(cands, allowed), now, t.klass)
                uncached = rr.prompt_tokens - d.usable_tokens
                queue.dispatched(t, a, d.replica, uncached, req.output_tokens)
        finally:
            self._pumping = False

    def _refresh_reports(self, engine: RoutingEngine, now: float) -> None:
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

    def _after_engine(self, i: int, now: float, outputs: list[Any]) -> None:
        eng = self.engines[i]
        events = eng.take_index_events()
        if events and self._feed_index:
            batch = EventBatch(self.keys[i], tuple(events))
            lag = self.config.event_lag_s
            if lag > 0:
                self._queue.push(now + lag, DELIVER, batch)
            else:
                for router in self.routers:
                    router.engine.index.apply(batch)
        self._outputs(i, now, outputs)
        if outputs and self.config.admission is not None:
            for router in self.routers:
                self._pump(router, now)
        nt = eng.next_time()
        if nt != self._wake_at[i]:
            self._gen[i] += 1
            self._wake_at[i] = nt
            if nt is not None:
                self._queue.push(nt, ENGINE, (i, self._gen[i]))

    def _outputs(self, i: int, now: float, outputs: list[Any]) -> None:
        """Book engine ``i``'s outputs: first tokens, finishes, rejections."""
        eng = self.engines[i]
        records = self._records
        legs = self._legs
        transport = self.config.transport_s
        for out in outputs:
            kind = type(out)
            if legs and out.request_id in legs:
                self._prefill_leg(out, now)
                continue
            if self._sampled and not self._sequence_output(i, out):
                continue
            if kind is FirstToken:
                rec = records[out.request_id]
                rec.first = out.time + transport
                if out.request_id not in self._from_prefill:
                    rec.cached = out.cached_tokens
                    rec.kv_hit = out.kv_hit_tokens
                    rec.queued = out.queued_s
                flight = self._flight_of.get(out.request_id, out.request_id)
                self._router_of[out.request_id].engine.load.first_token(flight)
                self._dispatches.pop(flight, None)
            elif kind is Finished:
                rec = records[out.request_id]
                rec.finish = out.time + transport
                rec.output = out.output_tokens
                router = self._router_of.pop(out.request_id)
                self._ended(router, out.request_id, out.time + transport, False)
                if self.config.record_load:
                    self._series[i].append((out.time, eng.pending()))
            elif kind is Rejected:
                rec = records[out.request_id]
                rec.rejected = True
                router = self._router_of.pop(out.request_id)
                self._ended(router, out.request_id, out.time + transport, True)

    def _ended(self, router: _Router, request_id: str, now: float, rejected: bool) -> None:
        """``request_id`` finished (or the engine rejected it) at ``now``: its flight ends,
        and its admission ticket and closed-loop turns with it; a batch's row ends the
        batch's flight when it is the last of its rows to end (module doc)."""
        flight = self._flight_of.pop(request_id, request_id)
        rows: tuple[str, ...] = (request_id,)
        if flight in self._batch_left:
            left = self._batch_left[flight]
            left.discard(request_id)
            if left:
                return
            del self._batch_left[flight]
            batch = self._batch_of.get(flight, ())
            rows = (flight, *(r.request_id for r in batch))
        if rejected:  # what its dispatch guessed goes, unless one of its rows answered
            self._withdraw(router.engine, flight)
        else:
            self._dispatches.pop(flight, None)
        router.engine.load.complete(flight)
        if router.admission is not None:
            router.admission.finished(flight)
        for row in rows:
            self._follow_ups(row, now)

    def _sequence_output(self, i: int, out: Any) -> bool:
        """Book an output of a request sampling ``n`` sequences (module doc); True when it
        is the request's to handle as any request's: its own sequence's first token or
        rejection, or the end of its last sequence (one Finished, at the latest end)."""
        sid: str = out.request_id
        kind = type(out)
        rid = self._sample_of.get(sid)
        if rid is None:  # a request's own sequence
            rid = sid
        elif kind is Finished or kind is Rejected:
            del self._sample_of[sid]
        entry = self._sampled.get(rid)
        if entry is None:
            return rid == sid
        running = entry[1]
        if kind is FirstToken:
            return rid == sid
        if kind is Rejected and rid == sid:  # none ran (the others are as large)
            del self._sampled[rid]
            self._held_finish.pop(rid, None)
            return True
        if kind is not Finished and kind is not Rejected:
            return False
        running.discard(sid)
        held = self._held_finish.pop(rid, None)
        if kind is Finished:
            if held is None:
                held = Finished(rid, out.time, out.prompt_tokens, out.cached_tokens, 0)
            if rid == sid:  # the request's own figures, at the latest end of any sequence
                held = Finished(
                    rid, max(out.time, held.time), out.prompt_tokens, out.cached_tokens,
                    out.output_tokens,
                )  # fmt: skip
            elif out.time > held.time:
                held = Finished(
                    rid, out.time, held.prompt_tokens, held.cached_tokens, held.output_tokens
                )
        if running:
            if held is not None:
                self._held_finish[rid] = held
            return False
        del self._sampled[rid]
        if held is not None:
            self._outputs(i, held.time, [held])  # engine i ran all its sequences
        return False

    def _prefill_leg(self, out: Any, now: float) -> None:
        """An output of a prefill leg: its hit is the request's; when it ends the decode
        replica is picked and the request moves there (a rejected leg: local prefill)."""
        leg_id = out.request_id
        req, rr, i = self._legs[leg_id]
        engine = self._router_of[req.request_id].engine
        if type(out) is FirstToken:
            rec = self._records[req.request_id]
            rec.cached = out.cached_tokens
            rec.kv_hit = out.kv_hit_tokens
            rec.queued = out.queued_s
            engine.load.first_token(leg_id)
            self._dispatches.pop(leg_id, None)
            return
        if type(out) not in (Finished, Rejected):
            return
        del self._legs[leg_id]
        engine.load.complete(leg_id)
        fallback = type(out) is Rejected
        if fallback:  # the prefill engine holds nothing of it
            self._withdraw(engine, leg_id)
        else:
            self._dispatches.pop(leg_id, None)
        assert self.pd is not None
        rng = self._router_of[req.request_id].rng
        try:
            pick = self.pd.pick_decode(engine, rr, self.keys[i], self.keys, now, rng)
        except NoReplicaAvailable:  # no decode replica left: answered with the error
            self._router_of.pop(req.request_id)
            self._from_prefill.discard(req.request_id)
            self._refuse(req.request_id, now)
            return
        j = self._slot[pick.decision.replica]
        self._records[req.request_id].replica = j
        ereq = EngineRequest(
            req.request_id,
            req.block_hashes,
            req.prompt_tokens,
            req.output_tokens,
            req.output_block_hashes,
            remote_prefilled=not fallback,
        )
        if fallback:
            self.pd_stats.fallbacks += 1
            self._from_prefill.discard(req.request_id)
            # prefilled where it is decoded: recorded as a local request is (its load with its
            # own hit there; speculative entries and the session's hint), as the service does
            self._dispatches[req.request_id] = engine.dispatched(rr, pick.decision, now)
            self._queue.push(now, TRANSFER, (j, ereq))
            return
        self._dispatches[req.request_id] = self.pd.dispatched_decode(engine, rr, pick, now)
        self.pd_stats.moved(pick.link, pick.transfer_bytes, pick.transfer_s)
        self._queue.push(now + pick.transfer_s, TRANSFER, (j, ereq))

    def _withdraw(self, engine: RoutingEngine, request_id: str) -> None:
        """The engine rejected ``request_id``: what its dispatch guessed there goes (the
        service's RouterState.withdraw for a replica that refused a request)."""
        dispatch = self._dispatches.pop(request_id, None)
        if dispatch is not None:
            engine.withdraw(dispatch)

    def _follow_ups(self, request_id: str, now: float) -> None:
        for child in self._children.pop(request_id, ()):
            self._queue.push(self._arrival_time(now + child.delay_s), ARRIVAL, child)
