"""SLO-aware admission: a bounded queue in front of the fleet, service classes, fairness.

A request is *judged* before it is committed to a replica, with the routing policy's own TTFT
prediction (``ours``'s cost model: prefill after the usable cached prefix, the replica's
queue, interleaved decode; see router/core/policies.py ``Ours``) for each eligible replica:

* **admit** at once when some replica *fits* it: predicted TTFT within ``headroom`` of its
  class's TTFT budget (``ttft_factor`` x the SLO target of its prompt's tier), and not past
  its deadline (a replica with at most ``stall_backlog_s`` of queued prefill fits it within
  the deadline alone: idle capacity is not held back); and its prefill stays within the
  replica's *decode-stall headroom* for its class. The policy then picks among the
  replicas that fit.

  The stall headroom keeps the TPOT of the requests decoding on a replica
  (router/core/stall.py): every step that carries a prefill chunk stalls them, so each
  request may stand ``stall_share`` (of its class: a smaller share protects it more) x
  ``(tpot_target - decode step) x (output tokens - 1)`` seconds of prefill while it
  decodes; a replica's headroom is what its most constrained request has left. A class may
  admit a prefill that overdraws it by at most ``max_stall`` TPOT targets (priority:
  without limit). Every dispatched prefill (any class) is counted.
* **shed** at once (reason ``deadline``) when it cannot meet its budget even if it waits:
  the fleet's best predicted TTFT plus the prefill work held ahead of it (same or better
  class) spread over the eligible replicas exceeds the budget, or it would wait more than
  ``max_hold_s`` for a replica to fit it; or (``queue_full``) when the queue holds
  ``max_queue`` requests, or its held bodies (a ticket's ``size``) would pass
  ``max_queue_mb``, and none is of a worse class (else the one of the worst class held
  that would be served last is shed in its place, when that makes room: a full queue keeps
  its places for the better classes). A shed carries a ``retry_after_s`` hint.
* A request whose own predicted prefill on the best eligible replica (after that replica's
  usable cached prefix, nothing queued) is over its budget could never be admitted: a
  prompt too long for its class's target, a 1M-token one say. Its budget is that prefill
  plus its class's budget (:meth:`AdmissionQueue.within_reach`), so it is served when a
  replica can start it soon and held or shed (429, worth retrying) while the fleet is busy,
  never refused for good; its SLO is still judged against the class's target.
* else **hold** it. :meth:`AdmissionQueue.ready` hands back held requests that fit, best
  first: by class (priority, default, flex), then the tenant that has been served the fewest
  uncached prompt tokens (a virtual token counter: a tenant that comes back after idling is
  lifted to the lowest counter among the waiting tenants, so it cannot bank credit), then
  the least urgency ``slack / budget ** urgency_power`` (slack: time left to the deadline
  after the request's own predicted prefill); never one of a class while a held one of a
  better class does not fit. :meth:`AdmissionQueue.expire` sheds held
  requests whose slack ran out or that were held ``max_hold_s`` (never held to miss
  anyway, nor for long); :meth:`AdmissionQueue.cancel`
  removes one whose client left.

A new request is held, not admitted, while same-or-better-class requests wait, so it
cannot overtake them; ``ready`` then decides. Only ``headroom`` below 1 separates the
classes on the fleet: lower classes stop being admitted while replicas still have room for
priority traffic.

Pure: time is passed in (``now``, seconds on the caller's clock).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from router.core.errors import BadRequest
from router.core.load import EXPECTED_OUTPUT_TOKENS, CostModel
from router.core.policies import Candidate, CandidateColumns, Ours, Policy
from router.core.slo import SloTargets
from router.core.stall import StallLedger
from router.core.types import ReplicaKey, RouteRequest

PRIORITY = 0
DEFAULT = 1
FLEX = 2
CLASS_NAMES: tuple[str, str, str] = ("priority", "default", "flex")
"""Service classes, best first; a class is its index here."""

# OpenAI's ``service_tier`` values -> class ("auto" lets the provider choose: the caller's
# default here; "scale" (reserved capacity) and "fast" are served as priority)
_TIERS = {
    "auto": DEFAULT,
    "default": DEFAULT,
    "flex": FLEX,
    "priority": PRIORITY,
    "scale": PRIORITY,
    "fast": PRIORITY,
}

ADMIT = "admit"
HOLD = "hold"
SHED = "shed"
DEADLINE = "deadline"
QUEUE_FULL = "queue_full"
SHED_REASONS: tuple[str, str] = (DEADLINE, QUEUE_FULL)

TICK_S = 0.05
"""How often a router looks at its held requests (:meth:`AdmissionQueue.expire`, then
:meth:`AdmissionQueue.ready`) while any is held, besides whenever a request finishes; an
arrival only sheds the late ones first. The service's pump (router/service/admission.py)
and the simulator's (sim/cluster.py) keep this cadence. Each look re-routes up to ``scan``
held requests: not free."""


def class_of(name: str) -> int:
    """A class by name (``priority``, ``default``, ``flex``); ValueError for others."""
    try:
        return CLASS_NAMES.index(name)
    except ValueError:
        known = ", ".join(CLASS_NAMES)
        raise ValueError(f"unknown service class {name!r}; one of {known}") from None


def parse_service_tier(value: object, default: int = DEFAULT) -> int:
    """The class a request body's ``service_tier`` asks for (absent/None: ``default``);
    BadRequest for anything else than OpenAI's values."""
    if value is None:
        return default
    if isinstance(value, str):
        found = _TIERS.get(value)
        if found is not None:
            return default if value == "auto" else found
    raise BadRequest(f"'service_tier' must be one of {', '.join(sorted(_TIERS))}")


Triple = tuple[float, float, float]


def engine_priority(klass: int) -> int:
    """vLLM's request ``priority`` for a service class (lower first): priority -1, default
    0 (vLLM's default), flex 1."""
    return klass - DEFAULT


def takes_engine_priority(endpoint: str) -> bool:
    """Whether vLLM takes a request's ``priority`` through ``endpoint`` (``chat``,
    ``completion(s)``, ``responses``, ``messages``): not through the Anthropic Messages API,
    whose request has no such field; the service sends such a request without one and its
    engine schedules it as a default one (router/service/handling.py, sim/cluster.py)."""
    return endpoint != "messages"


@dataclass(slots=True, frozen=True)
class AdmissionSettings:
    """Per-class knobs (tuples indexed priority, default, flex) and the queue's bounds; see
    the module docstring for what each does."""

    headroom: Triple = (1.0, 0.5, 0.3)
    ttft_factor: Triple = (1.0, 1.0, 4.0)
    decode_weight: Triple = (10.0, 1.0, 1.0)
    max_stall: Triple = (math.inf, 3.0, 3.0)
    stall_backlog_s: float = 0.1
    stall_share: Triple = (0.1, 0.5, 0.5)
    urgency_power: float = 1.0
    max_queue: int = 1024
    # held requests' bodies (``Ticket.size``), MiB at most: each keeps its body while held
    max_queue_mb: float = 256.0
    max_hold_s: float = 0.5
    scan: int = 8  # held requests examined per ``ready`` call, best first
    # the engines run vLLM's ``--scheduling-policy priority``: each request carries its
    # class as vLLM's ``priority`` (:func:`engine_priority`), so an engine's queue serves
    # the priority class first
    engine_priority: bool = False

    def __post_init__(self) -> None:
        for name in ("headroom", "ttft_factor", "decode_weight", "max_stall", "stall_share"):
            value = getattr(self, name)
            if len(value) != 3 or any(not v > 0 for v in value):
                raise ValueError(f"admission {name} needs 3 positive values (one per class)")
            # only max_stall means something at inf (no limit); an infinite weight or
            # factor turns scores and urgencies NaN (0 x inf, inf - inf, inf / inf)
            if name != "max_stall" and not all(math.isfinite(v) for v in value):
                raise ValueError(f"admission {name} values must be finite")
            object.__setattr__(self, name, tuple(float(v) for v in value))
        if any(h > 1 for h in self.headroom):
            raise ValueError("admission headroom is a share of the TTFT budget: at most 1")
        if any(not 0 < v <= 1 for v in self.stall_share):
            raise ValueError("admission stall_share values must be in (0, 1]")
        for name in ("stall_backlog_s", "urgency_power", "max_hold_s", "max_queue_mb"):
            if not (math.isfinite(v := getattr(self, name)) and v >= 0):  # NaN: never expires
                raise ValueError(f"admission {name} must be a finite number >= 0, got {v}")
        if self.max_queue < 0 or self.scan < 1:
            raise ValueError("admission max_queue must be >= 0 and scan >= 1")


DEFAULT_SETTINGS = AdmissionSettings()


def class_ttft_factor(settings: AdmissionSettings | None, klass: int) -> float:
    """The factor of its tier's TTFT target a request of ``klass`` is promised and judged
    against (the SLO metric, the simulator's goodput, admission's budget): the model's
    admission settings', else the defaults' (flex 4x). A class's SLO is the same whether
    admission is on or off; only whether the router acts on it differs."""
    return (settings or DEFAULT_SETTINGS).ttft_factor[klass]


class Assessment(NamedTuple):
    """Predictions for a request on each candidate position (a list's index, or a column):
    TTFT if sent now, its own prefill, the replica's queue and decode step time (seconds);
    ``eligible`` marks the positions to consider, ``keys`` names their replicas."""

    ttft_s: np.ndarray
    prefill_s: np.ndarray
    queue_s: np.ndarray
    step_s: np.ndarray
    eligible: np.ndarray
    keys: Sequence[ReplicaKey]


def predictor_for(policy: Policy, cost: CostModel | None = None) -> Ours:
    """The TTFT model to judge with: the policy's own when it is ``ours``, else ``ours``'s
    formulas with ``cost`` (the engines' cost model)."""
    if isinstance(policy, Ours):
        return policy
    return Ours(cost=cost or CostModel())


def assess(
    predictor: Ours,
    request: RouteRequest,
    candidates: Sequence[Candidate] | CandidateColumns,
    now: float,
) -> Assessment:
    """Predictions for ``request`` on ``candidates`` (router.core.routing
    ``RoutingEngine.candidates``)."""
    cost = predictor.cost
    if isinstance(candidates, CandidateColumns):
        p, q, d = predictor.term_columns(request, candidates, now)[:3]
        prefill = np.asarray(p, dtype=float)
        queue = np.asarray(q, dtype=float)
        ttft = prefill + queue + np.asarray(d, dtype=float)
        load = candidates.load
        step = cost.step_overhead_s + np.asarray(
            cost.decode_step_s(load.decoding, load.decode_context_tokens), dtype=float
        )
        eligible = np.asarray(candidates.eligible, bool)
        return Assessment(ttft, prefill, queue, step, eligible, candidates.keys)
    rows = []
    for c in candidates:
        p, q, d = predictor.term_values(request, c)[:3]
        v = c.load
        step = cost.step_overhead_s + cost.decode_step_s(v.decoding, v.decode_context_tokens)
        rows.append((p, q, d, step))
    arr = np.asarray(rows, dtype=float).reshape(len(rows), 4)
    prefill, queue, decode, step = arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3]
    keys = [c.replica for c in candidates]
    return Assessment(
        prefill + queue + decode, prefill, queue, step, np.ones(len(rows), dtype=bool), keys
    )


def restrict(
    candidates: Sequence[Candidate] | CandidateColumns, allowed: np.ndarray
) -> list[Candidate] | CandidateColumns:
    """``candidates`` with only the ``allowed`` positions eligible."""
    if isinstance(candidates, CandidateColumns):
        return candidates._replace(eligible=np.asarray(candidates.eligible, bool) & allowed)
    return [c for c, ok in zip(candidates, allowed.tolist(), strict=True) if ok]


@dataclass(slots=True, frozen=True)
class Ticket:
    """A request as admission sees it. ``key``: unique among held requests; ``payload``:
    whatever the caller needs back from ``ready`` (not read here); ``size``: the bytes it
    keeps while held (its body), bounded by ``max_queue_mb``."""

    key: Hashable
    klass: int
    tenant: str
    prompt_tokens: int
    arrived: float
    budget_s: float
    payload: Any = None
    size: int = 0

    @property
    def deadline(self) -> float:
        return self.arrived + self.budget_s


class Verdict(NamedTuple):
    """``action``: ADMIT (``allowed``: the positions that fit), HOLD or SHED (``reason``,
    ``retry_after_s``: when trying again may succeed). A HOLD into a full queue names the
    held request it took the place of (``displaced``, out of the queue), which the caller
    refuses with ``reason`` (``queue_full``) and ``retry_after_s``."""

    action: str
    allowed: np.ndarray | None = None
    reason: str = ""
    retry_after_s: float = 0.0
    displaced: Ticket | None = None


@dataclass(slots=True)
class _Held:
    ticket: Ticket
    prefill_s: float  # its own best predicted prefill, at judgement
    seq: int


@dataclass(slots=True)
class AdmissionQueue:
    """The held requests of one model, and the tenants' counters (module docstring)."""

    settings: AdmissionSettings
    slo: SloTargets
    _held: dict[Hashable, _Held] = field(default_factory=dict)
    _work_s: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    _by_class: list[int] = field(default_factory=lambda: [0, 0, 0])
    _tenant_held: dict[str, int] = field(default_factory=dict)
    _tenant_work: dict[tuple[int, str], float] = field(default_factory=dict)
    _counter: dict[str, float] = field(default_factory=dict)
    stall: StallLedger = field(default_factory=StallLedger)
    _seq: int = 0
    held_bytes: int = 0  # the held requests' sizes
    _due: float = math.inf  # no held request is late before then (:meth:`expire`)

    # ------------------------------------------------------------------ figures

    def __len__(self) -> int:
        return len(self._held)

    def depth(self, klass: int) -> int:
        """Held requests of ``klass``."""
        return self._by_class[klass]

    def counter(self, tenant: str) -> float:
        """Uncached prompt tokens ``tenant`` was served (virtual: see the module doc)."""
        return self._counter.get(tenant, 0.0)

    def budget_s(self, klass: int, prompt_tokens: int) -> float:
        """The TTFT budget of a request of ``klass`` with that prompt."""
        return self.slo.ttft_budget_s(prompt_tokens, class_ttft_factor(self.settings, klass))

    def ticket(
        self,
        key: Hashable,
        klass: int,
        tenant: str,
        prompt_tokens: int,
        now: float,
        payload: Any = None,
        size: int = 0,
    ) -> Ticket:
        budget = self.budget_s(klass, prompt_tokens)
        return Ticket(key, klass, tenant, prompt_tokens, now, budget, payload, size)

    # ------------------------------------------------------------------ judging

    def fits(self, ticket: Ticket, a: Assessment, now: float) -> np.ndarray:
        """The positions of ``a`` that can take ``ticket`` now (module docstring)."""
        s = self.settings
        c = ticket.klass
        left = ticket.deadline - now
        limit = min(s.headroom[c] * ticket.budget_s, left)
        # a replica with (almost) nothing queued is never held back by the headroom: idle
        # capacity is used, by whatever class, as long as the deadline is met
        idle = a.queue_s <= s.stall_backlog_s
        ok = a.eligible & ((a.ttft_s <= limit) | (idle & (a.ttft_s <= left)))
        if math.isfinite(s.max_stall[c]):
            floor = -s.max_stall[c] * self.slo.tpot_s
            ok &= self.stall_headroom(a) - a.prefill_s >= floor
        return ok

    def stall_headroom(self, a: Assessment) -> np.ndarray:
        """Each position's replica's decode-stall headroom, seconds (module docstring)."""
        headroom = self.stall.headroom
        return np.array([headroom(k) for k in a.keys], dtype=float)

    def dispatched(
        self,
        ticket: Ticket,
        a: Assessment,
        replica: ReplicaKey,
        uncached_tokens: int,
        output_tokens: int | None = None,
    ) -> None:
        """``ticket``'s request, judged with ``a``, was sent to ``replica``: count its
        prefill against the replica's stall headroom, track its own allowance
        (``output_tokens``: its answer's length or limit; None: unknown) until
        :meth:`finished`, and charge its tenant (:meth:`served`)."""
        self.served(ticket.tenant, uncached_tokens)
        keys = a.keys
        at = list(keys).index(replica) if replica in keys else -1
        if at < 0:
            return
        out = EXPECTED_OUTPUT_TOKENS if output_tokens is None else output_tokens
        spare = max(self.slo.tpot_s - float(a.step_s[at]), 0.0)
        share = self.settings.stall_share[ticket.klass]
        allowance = share * spare * (out - 1) if out > 1 else math.inf
        self.stall.add(ticket.key, replica, float(a.prefill_s[at]), allowance)

    def retried(self, key: Hashable, replica: ReplicaKey, prefill_s: float) -> None:
        """A dispatched request is retried on ``replica`` (with ``prefill_s`` of prefill
        there): its allowance moves with it (:meth:`StallLedger.move`); one without an
        allowance (a one-token answer) still puts its prefill on that replica's clock."""
        if key in self.stall:
            self.stall.move(key, replica, prefill_s)
        else:
            self.stall.add(key, replica, prefill_s, math.inf)

    def finished(self, key: Hashable) -> None:
        """A dispatched request finished, failed or was cancelled."""
        self.stall.remove(key)

    def _ahead_s(self, klass: int, tenant: str) -> float:
        """Held prefill work that goes before a new request: every better class's, and its
        own class's of its tenant and of the tenants served less (fairness order)."""
        mine = self._counter_if_held(tenant)
        same = sum(
            w
            for (c, t), w in self._tenant_work.items()
            if c == klass and (t == tenant or self._counter.get(t, 0.0) < mine)
        )
        return sum(self._work_s[:klass]) + same

    def _counter_if_held(self, tenant: str) -> float:
        """``tenant``'s counter as it would be once it holds a request (lifted when idle)."""
        own = self._counter.get(tenant, 0.0)
        if self._tenant_held.get(tenant):
            return own
        waiting = [self._counter.get(x, 0.0) for x, n in self._tenant_held.items() if n]
        return max(own, min(waiting)) if waiting else own

    def judge(self, ticket: Ticket, a: Assessment, now: float) -> Verdict:
        """Admit, hold (the ticket joins the queue; a full one by taking the place of a
        request of a worse class: the verdict's ``displaced``, for the caller to refuse) or
        shed ``ticket`` (judged with its budget :meth:`within_reach`)."""
        ticket = self.within_reach(ticket, a)
        s = self.settings
        c = ticket.klass
        waiting_ahead = sum(self._by_class[: c + 1]) > 0
        if not waiting_ahead:
            allowed = self.fits(ticket, a, now)
            if allowed.any():
                return Verdict(ADMIT, allowed)
        eligible = int(a.eligible.sum())
        if eligible == 0:  # nothing to wait for (the caller's filter found none)
            return Verdict(SHED, reason=DEADLINE, retry_after_s=1.0)
        best = float(a.ttft_s[a.eligible].min())
        expected = best + self._ahead_s(c, ticket.tenant) / eligible
        wait = expected - s.headroom[c] * ticket.budget_s  # until a replica fits it
        if expected > ticket.budget_s or wait > s.max_hold_s:
            return Verdict(SHED, reason=DEADLINE, retry_after_s=_retry(wait))
        if ticket.key in self._held:
            return Verdict(SHED, reason=QUEUE_FULL, retry_after_s=_retry(expected))
        displaced = None
        over = self.held_bytes + ticket.size - int(s.max_queue_mb * 2**20)
        if len(self._held) >= s.max_queue or over > 0:
            displaced = self._displace(c, now, over)
            if displaced is None:
                return Verdict(SHED, reason=QUEUE_FULL, retry_after_s=_retry(expected))
        prefill = float(a.prefill_s[a.eligible].min())
        self._hold(ticket, prefill)
        if displaced is None:
            return Verdict(HOLD)
        return Verdict(HOLD, reason=QUEUE_FULL, retry_after_s=_retry(expected), displaced=displaced)

    def _displace(self, klass: int, now: float, over: int) -> Ticket | None:
        """Make room in a full queue for a request of ``klass``: remove and return the held
        request of the worst class held that would be served last (:meth:`order`), when
        that class is worse than ``klass`` and its size is at least ``over`` (the bytes
        too many); else None (nothing removed)."""
        worst = max((k for k, n in enumerate(self._by_class) if n), default=-1)
        if worst <= klass:
            return None
        last = max(
            (h for h in self._held.values() if h.ticket.klass == worst), key=self._order_key(now)
        )
        if last.ticket.size < over:
            return None
        return self._remove(last.ticket.key)

    def within_reach(self, ticket: Ticket, a: Assessment) -> Ticket:
        """``ticket``, its budget raised to its own best predicted prefill (an eligible
        replica of ``a`` with nothing queued) plus its class's budget when that prefill
        alone is over the budget: no wait makes such a request meet its target, and with
        the target's budget it would be refused however idle the fleet."""
        if not a.eligible.any():
            return ticket
        own = float(a.prefill_s[a.eligible].min())
        if own <= ticket.budget_s:
            return ticket
        return replace(ticket, budget_s=own + ticket.budget_s)

    def _hold(self, ticket: Ticket, prefill_s: float) -> None:
        t = ticket.tenant
        if not self._tenant_held.get(t):  # back from idle: no banked credit
            self._counter[t] = self._counter_if_held(t)
        self._tenant_held[t] = self._tenant_held.get(t, 0) + 1
        work = (ticket.klass, t)
        self._tenant_work[work] = self._tenant_work.get(work, 0.0) + prefill_s
        self._seq += 1
        self._held[ticket.key] = _Held(ticket, prefill_s, self._seq)
        self._due = min(self._due, self._late_at(ticket, prefill_s))
        self._work_s[ticket.klass] += prefill_s
        self._by_class[ticket.klass] += 1
        self.held_bytes += ticket.size

    def _remove(self, key: Hashable) -> Ticket | None:
        h = self._held.pop(key, None)
        if h is None:
            return None
        t = h.ticket
        self._work_s[t.klass] = max(self._work_s[t.klass] - h.prefill_s, 0.0)
        self._by_class[t.klass] -= 1
        self.held_bytes -= t.size
        work = (t.klass, t.tenant)
        rest = self._tenant_work.get(work, 0.0) - h.prefill_s
        if rest > 1e-12:
            self._tenant_work[work] = rest
        else:
            self._tenant_work.pop(work, None)
        left = self._tenant_held[t.tenant] - 1
        if left:
            self._tenant_held[t.tenant] = left
        else:
            del self._tenant_held[t.tenant]
        if not self._held:
            self._work_s = [0.0, 0.0, 0.0]
        return t

    def cancel(self, key: Hashable) -> Ticket | None:
        """Remove a held request (its client left); None if it is not held."""
        return self._remove(key)

    def expire(self, now: float) -> list[Ticket]:
        """Remove and return the held requests that can no longer meet their deadline (now
        plus their own prefill is past it) or were held ``max_hold_s``: shed them, reason
        ``deadline``."""
        if now < self._due:  # (cheap on every arrival and look: nothing is late yet)
            return []
        hold = self.settings.max_hold_s
        late = [
            k
            for k, h in self._held.items()
            if now + h.prefill_s > h.ticket.deadline or now - h.ticket.arrived > hold
        ]
        out = []
        for k in late:
            t = self._remove(k)
            if t is not None:
                out.append(t)
        late_at = self._late_at
        self._due = min(
            (late_at(h.ticket, h.prefill_s) for h in self._held.values()), default=math.inf
        )
        return out

    def _late_at(self, ticket: Ticket, prefill_s: float) -> float:
        """A bound below the time a held request becomes late (:meth:`expire`)."""
        late = min(ticket.deadline - prefill_s, ticket.arrived + self.settings.max_hold_s)
        return late - 1e-9 * max(abs(late), 1.0)  # (rounding: never after it)

    def _order_key(self, now: float) -> Callable[[_Held], tuple[int, float, float, int]]:
        power = self.settings.urgency_power
        counter = self._counter

        def key(h: _Held) -> tuple[int, float, float, int]:
            t = h.ticket
            slack = t.deadline - now - h.prefill_s
            urgency = slack / t.budget_s**power if power else slack
            return (t.klass, counter.get(t.tenant, 0.0), urgency, h.seq)

        return key

    def order(self, now: float, limit: int | None = None) -> list[Ticket]:
        """Held requests best first (at most ``limit``): what ``ready`` examines."""
        n = len(self._held) if limit is None else limit
        best = heapq.nsmallest(n, self._held.values(), key=self._order_key(now))
        return [h.ticket for h in best]

    def ready(
        self, now: float, assess_held: Callable[[Ticket], Assessment | None]
    ) -> tuple[Ticket, np.ndarray] | None:
        """The best held request that fits now (removed from the queue) with the positions
        that fit, examining at most ``scan`` of them; None when none does. A request never
        goes before a held one of a better class that does not fit yet (as :meth:`judge`
        holds new ones behind it). ``assess_held`` gives a held request's assessment now
        (None: it cannot be routed now). Call :meth:`expire` first, and again (with
        :meth:`served` for each dispatched one) until it returns None."""
        waiting = FLEX  # the best class with a held request that does not fit
        for t in self.order(now, self.settings.scan):
            if t.klass > waiting:
                break
            a = assess_held(t)
            if a is None:
                continue
            allowed = self.fits(t, a, now)
            if allowed.any():
                self._remove(t.key)
                return t, allowed
            waiting = min(waiting, t.klass)
        return None

    def served(self, tenant: str, uncached_tokens: int) -> None:
        """Charge ``tenant`` for a dispatched request's uncached prompt tokens."""
        self._counter[tenant] = self._counter.get(tenant, 0.0) + max(uncached_tokens, 0)
        if len(self._counter) > 100_000:  # forget idle tenants' counters (bounded memory)
            self._counter = {k: v for k, v in self._counter.items() if k in self._tenant_held}

    def unserved(self, tenant: str, uncached_tokens: int) -> None:
        """Take back :meth:`served`'s charge for a dispatched request that never reached its
        replica (its client left as it was committed)."""
        if tenant in self._counter:
            left = self._counter[tenant] - max(uncached_tokens, 0)
            self._counter[tenant] = max(left, 0.0)


def _retry(wait_s: float) -> float:
    """A Retry-After hint: the estimated wait, whole seconds in [1, 60]."""
    return float(min(max(math.ceil(wait_s), 1), 60))
