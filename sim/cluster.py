"""A simulated fleet: N engine models behind one or several routers, driven by the event core.

Each router instance owns a ``RoutingEngine`` from ``router.core`` (the same code the service
runs) with its own in-flight load view and its own local copy of the prefix index. Engines'
index events reach every router's index ``event_lag_s`` after they happen (the shared Redis
index and its propagation lag); engine load reports reach them at most every
``report_interval_s`` (read lazily when a router routes). Requests are spread over the routers
round robin, so several routers can pile onto one replica before they see each other's load.

Replicas carry region and rack labels (``reg{g}-rack{k}-r{i}``), spread evenly.

Disaggregated serving (``pd`` ``always`` or ``auto``: prefill legs and their move to a
decode replica) is sim/pd.py's :class:`~sim.pd.PrefillLegs`; requests that run as several
engine requests (``n`` > 1 sequences, a completions batch's rows) are sim/fanout.py's. A
run's settings and result (``ClusterConfig``, ``RunResult``, importable from here too) are
sim/cluster_config.py's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

from router.core.admission import (
    ADMIT,
    DEFAULT,
    FLEX,
    PRIORITY,
    SHED,
    TICK_S,
    Assessment,
    Ticket,
    assess,
    class_ttft_factor,
    engine_priority,
    predictor_for,
    restrict,
    takes_engine_priority,
)
from router.core.errors import NoReplicaAvailable
from router.core.policies import uses_prefix_index
from router.core.routing import Dispatch, RoutingEngine
from router.core.types import Decision, EventBatch, RouteRequest
from sim.cluster_config import ClusterConfig, RunResult, class_and_tenant, policy_params_for
from sim.engine import EngineModel, EngineRequest, Finished, FirstToken, Rejected
from sim.events import ARRIVAL, DELIVER, ENGINE, TICK, TRANSFER, EventQueue
from sim.fanout import CompletionBatches, SampledRequests
from sim.metrics import RequestRecord, answers, summarize
from sim.pd import PdStats, PrefillLegs
from sim.routers import FleetView, SimRouter, make_routers
from sim.workload import SimRequest, Workload, scale_arrivals

__all__ = ["ClusterConfig", "Progress", "RunResult", "Simulation"]

Progress = Callable[[int, int], None]


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
        params = policy_params_for(policy, policy_params, p, config.slo)
        self.routers = make_routers(config, self.keys, policy, params)
        self._predictor = predictor_for(self.routers[0].engine.policy, p.cost)
        # classes weigh decodes differently only under admission (as in the service)
        adm = config.admission
        self._weights = adm.decode_weight if adm is not None else (1.0, 1.0, 1.0)
        # Policies that ignore the prefix index (round robin, random, least loaded): the
        # engines' KV events are not applied to it, as a peer's simulator does not run an
        # indexer for them either, unless something else reads its matches, as it does in
        # the service (which feeds every model's index): admission's TTFT predictions, the
        # P/D plan and decode pick, a queued-prefill busy threshold (the load booked is
        # the prompt beyond the decision's match)
        self._feed_index = (
            any(uses_prefix_index(r.engine.policy) for r in self.routers)
            or config.admission is not None
            or config.pd != "off"
            or config.busy.max_queued_prefill_tokens is not None
        )
        self._slot = {k: i for i, k in enumerate(self.keys)}
        self._queue = EventQueue()
        self._gen = [0] * len(self.engines)
        self._wake_at: list[float | None] = [None] * len(self.engines)
        self._view = FleetView(config, self.engines, self.keys, self.routers)
        self._records: dict[str, RequestRecord] = {}
        self._router_of: dict[str, SimRouter] = {}
        # what each request (or prefill leg) sent to an engine was guessed to leave there,
        # until the engine takes it (its first token) or rejects it (withdrawn)
        self._dispatches: dict[str, Dispatch] = {}
        self._children: dict[str, list[SimRequest]] = {}
        self._order: list[SimRequest] = []
        self._next_router = 0
        self._series: list[list[tuple[float, int]]] = [[] for _ in self.engines]
        self.pd = PrefillLegs(config, self.keys) if config.pd != "off" else None
        self.pd_stats = self.pd.stats if self.pd is not None else PdStats()
        self._sampled = SampledRequests()
        self._batches = CompletionBatches()
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
        for r in requests:
            if self._batches.joins_first(r):  # arrives with its batch's first request
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
            elif prio == TICK:
                router, g = payload
                if g == router.tick:
                    self._look(router, t)
                    self._wake_pumps(t)
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
            for rec in answers(self._records[r.request_id] for r in self._order)
            if not rec.rejected and rec.first == rec.first and rec.stream
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
        self._view.observe(now)
        rows = [req, *self._batches.others(req.request_id)]
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
                self._sampled.arrived(row)
            record = RequestRecord(row.request_id, now, row.prompt_tokens, -1)
            record.samples = row.samples
            record.klass = klass
            record.stream = row.stream
            if len(rows) > 1:
                record.batch = req.request_id
            self._records[row.request_id] = record
            if row is not req:
                self._order.append(row)
        record = self._records[req.request_id]
        if self.pd is not None:  # disaggregated serving decides without admission
            try:
                plan = self.pd.plan(engine, req, rr, len(rows), now, router.rng)
            except NoReplicaAvailable:
                self._refuse(req.request_id, now)
                return
            self._router_of[req.request_id] = router
            if plan.prefill is None:
                assert plan.local is not None
                # as admission's own: no class weight nor engine priority (the service's)
                self._dispatch(router, req, rr, plan.local, now, None)
                return
            leg = self.pd.start_leg(req, rr, plan.prefill.replica)
            self._dispatches[leg.request_id] = engine.dispatched(leg, plan.prefill, now)
            i = self._slot[plan.prefill.replica]
            record.replica = i
            record.sent = now
            self._submit(
                i, EngineRequest(leg.request_id, req.block_hashes, req.prompt_tokens, 1), now
            )
            return
        queue = router.admission
        if queue is not None and len(queue):  # judged after the late are shed (the service's)
            for t in queue.expire(now):
                self._shed(str(t.key), now)
        try:
            candidates = engine.candidates(rr, self.keys, now)
        except NoReplicaAvailable:  # every replica busy, reject_when_all_busy: the 429
            self._refuse(req.request_id, now)
            return
        if queue is None:
            self._commit(router, req, rr, candidates, now, klass)
            return
        a = assess(self._predictor, rr, candidates, now)
        # size 0: a simulated request has no body, so ``max_queue_mb`` never binds here (the
        # service's bound on held bodies; ``max_queue`` does: docs/admission.md)
        ticket = queue.ticket(req.request_id, klass, tenant, rr.prompt_tokens, now, (req, rr))
        verdict = queue.judge(ticket, a, now)
        if verdict.action == ADMIT:
            assert verdict.allowed is not None
            allowed = restrict(candidates, verdict.allowed)
            self._commit(router, req, rr, allowed, now, klass, (ticket, a))
        elif verdict.action == SHED:
            self._shed(req.request_id, now)
        else:
            if verdict.displaced is not None:  # held in a full queue, in a worse class's place
                self._shed(str(verdict.displaced.key), now)
            if not router.ticking:  # the pump starts: its first look a tick later
                self._tick_at(router, now + TICK_S)

    def _commit(
        self,
        router: SimRouter,
        req: SimRequest,
        rr: RouteRequest,
        candidates: Any,
        now: float,
        klass: int = DEFAULT,
        admitted: tuple[Ticket, Assessment] | None = None,
    ) -> Decision:
        """Route among ``candidates`` and send the request to the chosen engine;
        ``admitted``: its admission ticket and assessment, recorded as dispatched (its
        tenant's charge, its decode-stall allowance) before it reaches the engine, as the
        service's commit records it before forwarding: an engine may end it at once (a
        refusal), and its end must find the allowance to release."""
        decision = router.engine.choose(rr, candidates, now, router.rng)
        if admitted is not None and router.admission is not None:
            ticket, a = admitted
            uncached = rr.prompt_tokens - decision.usable_tokens
            router.admission.dispatched(ticket, a, decision.replica, uncached, req.output_tokens)
        return self._dispatch(router, req, rr, decision, now, klass)

    def _dispatch(
        self,
        router: SimRouter,
        req: SimRequest,
        rr: RouteRequest,
        decision: Decision,
        now: float,
        klass: int | None = DEFAULT,
    ) -> Decision:
        """Send the request to the engine ``decision`` chose; ``klass`` None: routed
        without admission (a disaggregated model's, as the service routes it: no class
        decode weight, no engine priority). A batch's first request takes the batch's
        others along (its load booked once, under its id, as the service books a batch), or
        none of them when the engine cannot take one (sim/fanout.py)."""
        weight = 1.0 if klass is None else self._weights[klass]
        self._dispatches[req.request_id] = router.engine.dispatched(
            rr, decision, now, class_weight=weight
        )
        i = self._slot[decision.replica]
        priority = 0  # the class's, where the service sends it (not to vLLM's Messages API)
        if self._engine_priority and klass is not None and takes_engine_priority(req.endpoint):
            priority = engine_priority(klass)
        rows = (req, *self._batches.others(req.request_id))
        self._batches.dispatched(rows)
        ereqs = []
        for sent in rows:
            rec = self._records[sent.request_id]
            rec.replica = i
            rec.sent = now
            self._router_of[sent.request_id] = router
            ereqs.append(
                EngineRequest(
                    sent.request_id,
                    sent.block_hashes,
                    sent.prompt_tokens,
                    sent.output_tokens,
                    sent.output_block_hashes,
                    priority=priority,
                )
            )
        if len(ereqs) > 1:  # a batch is one request to vLLM: refused whole, before any runs
            refused = next(filter(None, map(self.engines[i].refusal, ereqs)), None)
            if refused is not None:
                self._outputs(i, now, [Rejected(e.request_id, now, refused) for e in ereqs])
                return decision
        for ereq in ereqs:
            self._submit(i, ereq, now)
        return decision

    def _submit(self, i: int, ereq: EngineRequest, now: float) -> None:
        eng = self.engines[i]
        eng.submit(ereq, now)
        for seq in self._sampled.other_sequences(ereq):  # behind it in the queue (sim/fanout.py)
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
        for row in self._batches.others(request_id):  # a batch is answered as one
            self._records[row.request_id].rejected = True
            self._follow_ups(row.request_id, now)

    def _tick_at(self, router: SimRouter, at: float) -> None:
        router.ticking = True
        router.tick += 1
        self._queue.push(at, TICK, (router, router.tick))

    def _look(self, router: SimRouter, now: float) -> None:
        """One look of ``router``'s admission pump, as the service's pump task looks
        (router/service/admission.py): :meth:`_pump`, then the next look ``TICK_S`` later
        while anything is held (a finish wakes it sooner: :meth:`_wake_pumps`); with
        nothing held the pump stops until a request is held again."""
        router.woken = False
        self._pump(router, now)
        queue = router.admission
        if queue is not None and len(queue):
            self._tick_at(router, now + TICK_S)
        else:
            router.ticking = False
            router.tick += 1

    def _wake_pumps(self, now: float) -> None:
        """Look at once at the held requests of the routers a finish woke (outside a look:
        a finish during one wakes its pump again once it is over)."""
        if self._pumping:
            return
        while woken := [r for r in self.routers if r.woken]:
            for router in woken:
                self._look(router, now)

    def _pump(self, router: SimRouter, now: float) -> None:
        """Shed the held requests that can no longer make it; dispatch those that fit."""
        queue = router.admission
        if queue is None or not len(queue) or self._pumping:
            return
        self._pumping = True  # dispatching advances engines, whose events pump again
        try:
            for t in queue.expire(now):
                self._shed(str(t.key), now)
            engine = router.engine
            self._view.observe(now)
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
                self._commit(router, req, rr, restrict(cands, allowed), now, t.klass, (t, a))
        finally:
            self._pumping = False

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
            self._wake_pumps(now)
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
        pd = self.pd
        sampled = self._sampled
        transport = self.config.transport_s
        for out in outputs:
            kind = type(out)
            if pd is not None and pd.is_leg(out.request_id):
                self._prefill_leg(out, now)
                continue
            if sampled:  # a sampled request's sequences end as one (sim/fanout.py)
                own, finished = sampled.output(out)
                if finished is not None:  # engine i ran all its sequences
                    self._outputs(i, finished.time, [finished])
                if not own:
                    continue
            if kind is FirstToken:
                rec = records[out.request_id]
                rec.first = out.time + transport
                if pd is None or not pd.hit_from_leg(out.request_id):
                    rec.cached = out.cached_tokens
                    rec.kv_hit = out.kv_hit_tokens
                    rec.queued = out.queued_s
                flight = self._batches.flight(out.request_id)
                if rec.stream:  # else the router sees it at the whole answer (its end)
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

    def _ended(self, router: SimRouter, request_id: str, now: float, rejected: bool) -> None:
        """``request_id`` finished (or the engine rejected it) at ``now``: its flight ends,
        and its admission ticket and closed-loop turns with it; a batch's row ends the
        batch's flight when it is the last of its rows to end (sim/fanout.py)."""
        ended = self._batches.ended(request_id)
        if ended is None:
            return
        flight, rows = ended
        if rejected:  # what its dispatch guessed goes, unless one of its rows answered
            self._withdraw(router.engine, flight)
        else:
            self._dispatches.pop(flight, None)
        router.engine.load.complete(flight)
        if router.admission is not None:
            router.admission.finished(flight)
            if len(router.admission):  # held requests may fit now: the pump wakes
                router.woken = True
        for row in rows:
            self._follow_ups(row, now)

    def _prefill_leg(self, out: Any, now: float) -> None:
        """An output of a prefill leg: its hit is the request's; when it ends the request
        moves to its decode replica (sim/pd.py)."""
        assert self.pd is not None
        leg_id = out.request_id
        req = self.pd.request_of(leg_id)
        router = self._router_of[req.request_id]
        if type(out) is FirstToken:
            rec = self._records[req.request_id]
            rec.cached = out.cached_tokens
            rec.kv_hit = out.kv_hit_tokens
            rec.queued = out.queued_s
            router.engine.load.first_token(leg_id)
            self._dispatches.pop(leg_id, None)
            return
        if type(out) not in (Finished, Rejected):
            return
        leg_dispatch = self._dispatches.pop(leg_id, None)
        rejected = type(out) is Rejected
        # the decode pick reads engine reports no older than the service's scrape keeps
        # them, and the other routers' load as shared by then, however long ago the last
        # request arrived
        self._view.observe(now)
        try:
            to = self.pd.leg_ended(leg_id, rejected, router.engine, leg_dispatch, now, router.rng)
        except NoReplicaAvailable:  # no decode replica left: answered with the error
            self._router_of.pop(req.request_id)
            self._refuse(req.request_id, now)
            return
        j = self._slot[to.replica]
        self._records[req.request_id].replica = j
        self._dispatches[req.request_id] = to.dispatch
        self._queue.push(to.at, TRANSFER, (j, to.engine_request))

    def _withdraw(self, engine: RoutingEngine, request_id: str) -> None:
        """The engine rejected ``request_id``: what its dispatch guessed there goes (the
        service's RouterState.withdraw for a replica that refused a request)."""
        dispatch = self._dispatches.pop(request_id, None)
        if dispatch is not None:
            engine.withdraw(dispatch)

    def _follow_ups(self, request_id: str, now: float) -> None:
        for child in self._children.pop(request_id, ()):
            self._queue.push(self._arrival_time(now + child.delay_s), ARRIVAL, child)
