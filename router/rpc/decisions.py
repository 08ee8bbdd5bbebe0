"""The gRPC Router service's decisions awaiting Report (router/rpc/router_service.py).

A Pick books its decision under its ``decision_id`` (the caller's ``request_id``, else a
uuid) with the caller that made it (:func:`owner_of`); a Report applies only to a decision
whose owner is exactly the reporting caller, and to any other caller the decision is unknown.
The book is bounded in count and age: an evicted or expired decision is handed back to the
servicer, which ends it (completed in the load model, its per-key slot freed, its outcome
counted ``expired``), not leaked.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.core.routing import Dispatch
from router.core.types import ReplicaKey

if TYPE_CHECKING:
    from router.service.admission import Admission
    from router.service.state import Routed


def owner_of(caller: object) -> str | None:
    """The owner a decision made for ``caller`` (router/rpc/calls.py ``CALLER``)
    records, as text a Report relayed to another worker process carries
    (router/service/report_relay.py): ``key:N`` for the gate's client key N; None for a
    caller that presented no client key: ``server.grpc_token``, no gate, or a router with no
    client keys (a client address is no credential, and an open deployment's gateways may
    pick from one host and report from another).

    The contract: a Report applies only to a decision whose owner equals the reporting
    caller's exactly. None matches only None, so the gateway's token neither ends a client
    key's decision nor has its own ended by one; to any other caller a decision is unknown
    (the Report's answer is that of an id never picked, so it does not tell it exists)."""
    if caller is None:
        return None
    if isinstance(caller, int):
        return f"key:{caller}"
    return None


def scoped_id(decision_id: str, owner: str | None) -> str:
    """The id a decision is booked and dispatched under: the caller's ``decision_id`` within
    its owner (:func:`owner_of`), so two client keys may use the same ids and neither can
    hold an id another needs; a caller without a key uses its ids as given (the HTTP
    endpoints' request ids share that space)."""
    # NUL, which no HTTP request id (a header value) can hold: the HTTP endpoints' ids, which
    # share the load tracker, never take a key's
    return decision_id if owner is None else f"{owner}\x00{decision_id}"


@dataclass(slots=True)
class Pending:
    """A decision awaiting its Report: what ends it and what its metrics need."""

    request_id: str
    model: str
    predicted_tokens: int
    created: float
    # what the outcome and SLO metrics need when the reports come (the HTTP forwarder's)
    replica: ReplicaKey | None = None
    prompt_tokens: int = 0
    ttft_factor: float = 1.0
    service_class: str = "default"
    first_at: float = 0.0  # when FIRST_TOKEN was reported (0: not yet)
    cached_counted: bool = False  # the engine's cached tokens were counted (once a request)
    # an exact prompt of one sequence: its Report's cached tokens judge its prediction
    # (router.service.answer_relay ``judged``)
    exact: bool = False
    held: object = None  # the caller's slot of the gate's per-key limit (None: not counted)
    owner: str | None = None  # the caller that made it (:func:`owner_of`): only its Reports
    # when a Pick held by admission came: its TTFT and SLO are timed from then, as its
    # deadline is (None: from ``created``, as HTTP times a request it dispatched at once)
    arrived: float | None = None
    # its attempt for outlier ejection (Ejections.sent / answered / failed / dropped)
    token: object = field(default_factory=object)
    # what was guessed of it on its replica (RoutingEngine.dispatched), withdrawn on a
    # REFUSED report (RouterState.withdraw)
    dispatch: Dispatch | None = None
    # sequences it decodes side by side (``n`` of each prompt): its reported output tokens
    # are their sum (router.service.answer_relay.count_slo)
    sequences: int = 1
    # with ``server.record_path``: the decision, for the trace row its COMPLETED Report
    # writes (router.service.answer_relay ``record_answer``), and the row's endpoint
    routed: Routed | None = None
    endpoint: str | None = None
    # the tenant SLO-aware admission charged for it (None: not dispatched by admission),
    # whose charge a Pick that never reached its caller takes back (Admission.unserved)
    tenant: str | None = None

    def unsent(self, admission: Admission | None) -> None:
        """It never reached its replica (its Pick's caller never got the answer): the
        charge of its tenant, if admission made one, is taken back."""
        if admission is not None and self.tenant is not None:
            admission.unserved(self.model, self.tenant, self.prompt_tokens - self.predicted_tokens)

    @property
    def since(self) -> float:
        """What the request's TTFT and SLO are timed from."""
        return self.created if self.arrived is None else self.arrived


class DecisionBook:
    """Decisions awaiting Report, bounded in count and age so a gateway that never reports
    cannot grow it; an evicted decision is completed in the load model (not leaked)."""

    def __init__(self, max_entries: int = 100_000, ttl_s: float = 3600.0) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._items: OrderedDict[str, Pending] = OrderedDict()

    def add(self, decision_id: str, pending: Pending) -> list[Pending]:
        self._items[decision_id] = pending
        evicted = []
        while len(self._items) > self.max_entries:
            evicted.append(self._items.popitem(last=False)[1])
        return evicted

    def expire(self, now: float) -> list[Pending]:
        out = []
        while self._items:
            first = next(iter(self._items.values()))
            if now - first.created < self.ttl_s:
                break
            out.append(self._items.popitem(last=False)[1])
        return out

    def get(self, decision_id: str) -> Pending | None:
        return self._items.get(decision_id)

    def pop(self, decision_id: str) -> Pending | None:
        return self._items.pop(decision_id, None)

    def __len__(self) -> int:
        return len(self._items)


RETRY_WINDOW_S = 10.0
"""How long a ``FAILED`` (or ``REFUSED``) decision waits for its retry: a Pick with the same
``request_id`` (docs/grpc.md); one that none follows within it is a miss of its SLO."""


@dataclass(slots=True, frozen=True)
class Unanswered:
    """A decision reported failed: what its SLO miss is counted by, and when its request
    came (its retry, if one follows, is timed from then)."""

    model: str
    prompt_tokens: int
    service_class: str
    status: int
    since: float
    at: float  # when it was reported failed


class RetryWindow:
    """The decisions reported failed within :data:`RETRY_WINDOW_S`, by scoped id (bounded:
    past ``max_entries`` the oldest end at once): a retry's Pick takes its request's entry
    (:meth:`take`); :meth:`expire` hands back those no retry followed."""

    def __init__(self, max_entries: int = 100_000, window_s: float = RETRY_WINDOW_S) -> None:
        self.max_entries = max_entries
        self.window_s = window_s
        self._items: OrderedDict[str, Unanswered] = OrderedDict()

    def add(self, decision_id: str, failed: Unanswered) -> list[Unanswered]:
        """Keep ``failed``; returns those pushed out past the bound (ended)."""
        self._items.pop(decision_id, None)
        self._items[decision_id] = failed
        out = []
        while len(self._items) > self.max_entries:
            out.append(self._items.popitem(last=False)[1])
        return out

    def take(self, decision_id: str) -> Unanswered | None:
        return self._items.pop(decision_id, None)

    def expire(self, now: float) -> list[Unanswered]:
        out = []
        while self._items:
            first = next(iter(self._items.values()))
            if now - first.at < self.window_s:
                break
            out.append(self._items.popitem(last=False)[1])
        return out
