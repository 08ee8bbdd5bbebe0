"""SLO-aware admission at the front door: the core queue (router/core/admission.py) on the
event loop, per model with ``[models.NAME.admission] enabled = true``.

A request is judged before it is committed to a replica (:meth:`RouterState.decide`, then
:meth:`RouterState.commit` among the replicas that fit): admitted at once, held, or shed with
:class:`Overloaded` (HTTP 429 with ``Retry-After``, gRPC RESOURCE_EXHAUSTED). A held request
waits on a future; one pump task per model runs while anything is held, every ``TICK_S``
(router/core/admission.py) and whenever a request finishes: it sheds the held requests that
can no longer meet their deadline and commits those that fit, best first (the simulator's
pump keeps the same cadence). A new request is judged after the late ones are shed:
requests that will be refused anyway neither fill the queue nor count as work ahead of it.
A client that goes away cancels its handler, which takes its request out of the queue (or,
if it was committed at that very moment, completes it in the load model and takes back
what was guessed of it: speculative index entries, session hint): nothing is answered
twice or leaked.

Service class: OpenAI's ``service_tier`` in the body (``priority``, ``default``, ``flex``,
``auto``); when ``server.priority_keys`` names any, a key not listed there cannot ask for
priority (it gets its key's class); ``server.flex_keys`` makes a key's requests flex unless
they ask otherwise. Tenant (fairness): the API key presented (hashed), one tenant for requests
without one.

Per process: with ``server.workers`` > 1 each worker judges with its own queue and its own
view of the load (peer load included); pods do not share queue pressure (docs/service.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from router.core.admission import (
    ADMIT,
    CLASS_NAMES,
    DEFAULT,
    FLEX,
    HOLD,
    PRIORITY,
    SHED,
    SHED_REASONS,
    TICK_S,
    AdmissionQueue,
    Assessment,
    Ticket,
    assess,
    class_ttft_factor,
    engine_priority,
    parse_service_tier,
    predictor_for,
    restrict,
)
from router.core.errors import KVRouterError, NoReplicaAvailable, Overloaded, ShuttingDown
from router.core.policies import Ours
from router.core.types import ReplicaKey
from router.service.body_memo import Admitted
from router.service.gate import presented_key, tenant_of
from router.service.request_identity import request_id_of, session_of, unique_in_flight
from router.service.state import Pending, Routed, RouterState
from router.tokenize.keying import ProcessedPrompt

# kvrouter_admission_decisions_total's action for a request that would be held while the
# router stops: answered 503 at once (ShuttingDown), neither held nor shed
STOPPING = "stopping"


def _keys(text: str | None) -> frozenset[str]:
    return frozenset(k.strip() for k in (text or "").split(",") if k.strip())


@dataclass(slots=True)
class _Model:
    name: str
    queue: AdmissionQueue
    predictor: Ours
    waiters: dict[str, asyncio.Future[Routed]] = field(default_factory=dict)
    pump: asyncio.Task[None] | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Admission:
    """The front door's admission for every model of ``state`` (module docstring)."""

    def __init__(self, state: RouterState) -> None:
        self.state = state
        server = state.settings.server
        self._priority_keys = _keys(server.priority_keys)
        self._flex_keys = _keys(server.flex_keys)
        self._models: dict[str, _Model | None] = {}
        self.stopping = False  # (:meth:`stop`)
        self._factors: dict[str, tuple[float, ...]] = {}  # each class's, by model (classed)
        m = state.metrics
        self.decisions = m.admission_decisions
        self.shed = m.admission_shed
        self.wait = m.admission_wait
        self.depth = m.admission_held
        state.fleet.on_forget.append(self.forget)

    def forget(self, key: ReplicaKey) -> None:
        """``key`` left the fleet: its decode-stall clock and the allowances of its requests
        go with it (they left the load model too; a replica registered again under its
        name starts clean)."""
        for m in self._models.values():
            if m is not None:
                m.queue.stall.forget(key)

    # ------------------------------------------------------------------ per request

    def enabled(self, model: str) -> bool:
        return self._model(model) is not None

    def taken(self, request_id: str) -> bool:
        """Whether ``request_id`` is taken here (any model): a request held under it (in no
        load record yet), or one dispatched whose allowance :meth:`finished` has not
        released yet (out of the load model while its error is written). For
        request_identity.py ``unique_in_flight``."""
        return any(
            m is not None and (request_id in m.waiters or request_id in m.queue.stall)
            for m in self._models.values()
        )

    def _model(self, name: str) -> _Model | None:
        if name in self._models:
            return self._models[name]
        settings = self.state.settings.model(name).admission
        engine = self.state.engines.get(name)
        if engine is None:  # not routed (yet): decided once it is
            return None
        m = None
        if settings is not None:
            queue = AdmissionQueue(settings, self.state.slos[name])
            cost = getattr(engine.policy, "cost", None)
            m = _Model(name, queue, predictor_for(engine.policy, cost))
        self._models[name] = m
        return m

    def service_class(self, body_tier: object, headers: Iterable[tuple[bytes, bytes]]) -> int:
        """The class a request gets (module docstring); BadRequest for a bad tier."""
        key = presented_key(headers)
        own = (
            PRIORITY if key in self._priority_keys else FLEX if key in self._flex_keys else DEFAULT
        )
        asked = parse_service_tier(body_tier, own)
        if asked == PRIORITY and self._priority_keys and own != PRIORITY:
            return own  # only listed keys may ask for priority (any key may ask for default)
        return asked

    def classed(
        self, routed: Routed, body_tier: object, headers: Iterable[tuple[bytes, bytes]]
    ) -> Routed:
        """``routed`` (routed without admission: it is off for its model, or the request
        bypasses it) with its request's class and that class's TTFT factor, which the SLO
        metric judges it by: a class's SLO does not depend on whether admission is on
        (router.core.admission ``class_ttft_factor``), as the simulator judges it."""
        klass = self.service_class(body_tier, headers)
        model = routed.request.model
        factors = self._factors.get(model)
        if factors is None:  # (once a model: its settings do not change)
            settings = self.state.settings.model(model).admission
            factors = tuple(class_ttft_factor(settings, k) for k in range(len(CLASS_NAMES)))
            self._factors[model] = factors
        return routed._replace(service_class=CLASS_NAMES[klass], ttft_factor=factors[klass])

    @staticmethod
    def tenant(headers: Iterable[tuple[bytes, bytes]]) -> str:
        return tenant_of(headers)

    def priority_patch(self, admitted: Admitted, headers: list[tuple[bytes, bytes]]) -> bytes:
        """The body member giving the engine the request's class as vLLM's ``priority``
        (``engine_priority`` set for its model), else b"" (the body goes as it came)."""
        settings = self.state.settings.model(admitted.model).admission
        if settings is None or not settings.engine_priority:
            return b""
        klass = self.service_class(admitted.service_tier, headers)
        return b',"priority":%d' % engine_priority(klass)

    async def route_admitted(
        self,
        admitted: Admitted,
        headers: list[tuple[bytes, bytes]],
        clock: Callable[[], float],
        size: int,
    ) -> Routed:
        """:meth:`route` for a checked body of the front door (router/service/handling.py),
        ``size`` bytes: class from its ``service_tier`` and the API key, tenant from the
        key."""
        return await self.route(
            admitted.model,
            admitted.prompt,
            request_id_of(headers),  # (made unique there)
            clock(),
            klass=self.service_class(admitted.service_tier, headers),
            tenant=self.tenant(headers),
            session_id=session_of(headers, admitted.session_id),
            max_output_tokens=admitted.max_output_tokens,
            size=size,
        )

    async def route(
        self,
        model: str,
        prompt: ProcessedPrompt,
        request_id: str,
        now: float,
        *,
        klass: int,
        tenant: str,
        session_id: str | None,
        max_output_tokens: int | None,
        size: int = 0,
        replicas: Sequence[ReplicaKey] | None = None,
    ) -> Routed:
        """Judge and route one request (the model must be enabled); raises Overloaded.
        ``request_id``: routed under another when a request in flight or held (of any
        model) has it (request_identity.py ``unique_in_flight``). ``size``: the bytes it
        keeps while held (its body: ``max_queue_mb``); ``replicas``: the ones it may go to
        (a gRPC Pick's ``candidates``; None: all of the model's), judged among them while
        it is held too."""
        m = self._model(model)
        assert m is not None
        state = self.state
        # not an id in flight or held, by any model (a gRPC Pick's id is checked against
        # its own book and the load, not against the requests other models hold)
        request_id = unique_in_flight(state, request_id)
        pending = state.decide(
            model,
            prompt,
            request_id,
            now,
            session_id=session_id,
            max_output_tokens=max_output_tokens,
            replicas=replicas,
        )
        queue = m.queue
        if len(queue):  # judged against the held requests that may still go (as the sim is)
            self._expire(m, now)
        a = assess(m.predictor, pending.request, pending.candidates, now)
        prompt_tokens = pending.request.prompt_tokens
        ticket = queue.ticket(request_id, klass, tenant, prompt_tokens, now, pending, size)
        verdict = queue.judge(ticket, a, now)
        name = CLASS_NAMES[klass]
        held_while_stopping = verdict.action == HOLD and self.stopping
        self.decisions.labels(
            model, name, STOPPING if held_while_stopping else verdict.action
        ).inc()
        if verdict.action == ADMIT:
            assert verdict.allowed is not None
            self.wait.labels(model, name).observe(0.0)
            return self._commit(m, ticket, pending, a, verdict.allowed, now)
        if verdict.action == SHED:
            raise self._shed(m, ticket, verdict.reason, verdict.retry_after_s)
        if verdict.displaced is not None:  # a full queue: it took a worse class's place
            self._refuse(m, verdict.displaced, verdict.reason, verdict.retry_after_s)
        if held_while_stopping:  # nothing is held while the process stops (:meth:`stop`)
            queue.cancel(request_id)
            raise ShuttingDown()
        fut: asyncio.Future[Routed] = asyncio.get_running_loop().create_future()
        m.waiters[request_id] = fut
        self._gauge(m)
        self._start(m)
        try:
            return await fut
        except asyncio.CancelledError:  # the client left
            m.waiters.pop(request_id, None)
            committed = fut.done() and not fut.cancelled() and fut.exception() is None
            if queue.cancel(request_id) is None and committed:  # sent as it left: not sent
                routed = fut.result()
                state.load.complete(request_id)
                uncached = routed.request.prompt_tokens - routed.decision.usable_tokens
                self.unserved(model, tenant, uncached)  # nor charged to its tenant
                self.finished(model, request_id)  # (held ones may fit its replica now)
                state.withdraw(model, routed.dispatch)  # its replica never saw it
            self._gauge(m)
            raise

    def retried(self, routed: Routed, key: ReplicaKey) -> None:
        """A routed request is retried on ``key`` (router/service/proxy.py, through
        :meth:`RouterState.retried`): its decode-stall allowance moves there with its full
        prompt's prefill (no hit is predicted on a retry)."""
        request = routed.request
        m = self._models.get(request.model)
        if m is None:
            return
        prefill = float(m.predictor.cost.prefill_s(request.prompt_tokens))
        m.queue.retried(request.request_id, key, prefill)

    def unserved(self, model: str, tenant: str, uncached_tokens: int) -> None:
        """A request this admission dispatched, charged to ``tenant`` for its
        ``uncached_tokens``, never reached its replica: its client left as it was committed,
        or a gRPC Pick's caller never got its answer. The charge is taken back
        (AdmissionQueue.unserved)."""
        m = self._models.get(model)
        if m is not None:
            m.queue.unserved(tenant, uncached_tokens)

    def finished(self, model: str, request_id: str) -> None:
        """A routed request is over (answered, failed or cancelled): its allowance is no
        longer tracked, and held requests may fit now."""
        m = self._models.get(model)
        if m is None:
            return
        m.queue.finished(request_id)
        if len(m.queue):
            m.wake.set()

    def stop(self, now: float) -> None:
        """The process stops (SIGTERM, ``Running.cleanup``): the held requests that fit a
        replica now are dispatched, the others answered at once with :class:`ShuttingDown`
        (503 with ``Retry-After``, gRPC UNAVAILABLE) for their clients to retry on another
        router, and from now on none is held. A hold may outlast the drain (``max_hold_s``
        over ``server.shutdown_timeout_s``): its connection would be closed unanswered."""
        self.stopping = True
        for m in self._models.values():
            if m is None or not len(m.queue):
                continue
            self._step(m, now)
            for t in m.queue.order(now):
                m.queue.cancel(t.key)
                fut = m.waiters.pop(str(t.key), None)
                if fut is not None and not fut.done():
                    fut.set_exception(ShuttingDown())
            self._gauge(m)

    # ------------------------------------------------------------------ the queue

    def _commit(
        self,
        m: _Model,
        ticket: Ticket,
        pending: Pending,
        a: Assessment,
        allowed: object,
        now: float,
    ) -> Routed:
        queue = m.queue
        weight = queue.settings.decode_weight[ticket.klass]
        routed = self.state.commit(
            pending,
            restrict(pending.candidates, allowed),  # type: ignore[arg-type]
            now,
            class_weight=weight,
        )
        d = routed.decision
        req = routed.request
        queue.dispatched(
            ticket, a, d.replica, req.prompt_tokens - d.usable_tokens, req.max_output_tokens
        )
        return routed._replace(
            service_class=CLASS_NAMES[ticket.klass],
            ttft_factor=class_ttft_factor(queue.settings, ticket.klass),
            class_weight=weight,
        )

    def _shed(self, m: _Model, ticket: Ticket, reason: str, retry_after_s: float) -> Overloaded:
        name = CLASS_NAMES[ticket.klass]
        self.shed.labels(m.name, reason, name).inc()
        what = (
            f"this {name}-class request cannot meet its time-to-first-token target now"
            if reason == SHED_REASONS[0]
            else f"the admission queue has no place for this {name}-class request"
        )
        return Overloaded(
            f"the router is overloaded: {what}; retry later",
            reason,
            name,
            retry_after_s,
        )

    def _expire(self, m: _Model, now: float) -> None:
        """Shed the held requests that can no longer meet their deadline or were held
        ``max_hold_s`` (AdmissionQueue.expire)."""
        late = m.queue.expire(now)
        for t in late:
            self._refuse(m, t, SHED_REASONS[0], 1.0)
        if late:
            self._gauge(m)

    def _refuse(self, m: _Model, t: Ticket, reason: str, retry_after_s: float) -> None:
        """Shed ``t``, a request taken out of the queue: its handler answers 429."""
        fut = m.waiters.pop(str(t.key), None)
        if fut is not None and not fut.done():
            fut.set_exception(self._shed(m, t, reason, retry_after_s))

    def _gauge(self, m: _Model) -> None:
        for k, name in enumerate(CLASS_NAMES):
            self.depth.labels(m.name, name).set(m.queue.depth(k))

    def _start(self, m: _Model) -> None:
        if m.pump is None or m.pump.done():
            m.pump = asyncio.get_running_loop().create_task(self._pump(m))

    async def _pump(self, m: _Model) -> None:
        loop = asyncio.get_running_loop()
        queue = m.queue
        while len(queue):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(m.wake.wait(), TICK_S)
            m.wake.clear()
            self._step(m, loop.time())
            self._gauge(m)

    def _step(self, m: _Model, now: float) -> None:
        """Shed the late, commit what fits (best first); a held request no replica can take
        now (every one unhealthy or draining: not merely busy, which waiting may cure) is
        answered at once as a new one would be."""
        queue = m.queue
        self._expire(m, now)
        seen: dict[object, tuple[Pending, Assessment]] = {}
        unroutable: dict[object, KVRouterError] = {}

        def held(t: Ticket) -> Assessment | None:
            old: Pending = t.payload
            try:
                pending = self.state.decide(
                    m.name,
                    old.prompt,
                    old.request.request_id,
                    now,
                    session_id=old.request.session_id,
                    max_output_tokens=old.request.max_output_tokens,
                    replicas=old.replicas,
                )
            except KVRouterError as exc:
                if not (isinstance(exc, NoReplicaAvailable) and exc.busy):  # busy: it waits
                    unroutable[t.key] = exc
                return None
            a = assess(m.predictor, pending.request, pending.candidates, now)
            seen[t.key] = (pending, a)
            return a

        while len(queue):
            got = queue.ready(now, held)
            if got is None:
                break
            t, allowed = got
            fut = m.waiters.pop(str(t.key), None)
            if fut is None or fut.done():  # its client left meanwhile
                continue
            pending, a = seen[t.key]
            try:
                routed = self._commit(m, t, pending, a, allowed, now)
            except NoReplicaAvailable as exc:
                fut.set_exception(exc)
                continue
            self.wait.labels(m.name, CLASS_NAMES[t.klass]).observe(now - t.arrived)
            fut.set_result(routed)
        for key, error in unroutable.items():
            queue.cancel(key)
            fut = m.waiters.pop(str(key), None)
            if fut is not None and not fut.done():
                fut.set_exception(error)
