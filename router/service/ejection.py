"""The router's outlier ejection (router/core/outliers.py) applied to its fleet: attempts'
outcomes go in, ejections come out as the replica's health in the load tracker (so no
policy picks it until ``until``) and a failing replica's penalty as phantom load in the cost.

Ejection rides the fleet's unhealthy cooldown (router/service/fleet.py): an ejected key is
in ``Fleet.unhealthy_until`` until its ejection ends, then readmitted by the same
housekeeping that readmits replicas after a failed health probe; neither a passing health
probe nor a failed one's shorter cooldown (``Fleet.mark_unhealthy`` keeps the later end)
readmits it early. A readmitted replica is on probation until an attempt succeeds:
while its one attempt is out it is out of rotation again (so a replica that hangs takes one
request per readmission, whatever the policy), and counts toward the pool's ejected share
(``OutlierDetector.hold``).

Metrics: ``kvrouter_replica_ejections_total{model, replica, reason}`` and
``kvrouter_replica_failures_total{model, replica, kind}``; ``GET /admin/replicas`` shows
each replica's failure run, and why and for how long it is ejected (:meth:`Ejections.status`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from router.core.outliers import Ejection, OutlierDetector, OutlierSettings
from router.core.types import ReplicaKey
from router.service.loop_metrics import LoopCounter
from router.service.settings import ServerSettings
from router.service.state import RouterState

_log = logging.getLogger("kvrouter.service")
PENALTY_TOKENS = 4096  # prompt tokens of one phantom request of a failing replica
_UNTIL_ANSWERED = float("inf")  # a replica on probation with its one attempt out


def outlier_settings(s: ServerSettings) -> OutlierSettings:
    """The ``server.outlier_*`` settings."""
    return OutlierSettings(
        enabled=s.outlier_detection,
        consecutive_failures=max(s.outlier_consecutive_failures, 1),
        base_ejection_s=s.outlier_base_ejection_s,
        max_ejection_s=s.outlier_max_ejection_s,
        max_ejected_share=s.outlier_max_ejected_share,
        latency_factor=s.outlier_latency_factor,
        latency_min_s=s.outlier_latency_min_s,
        penalty_s=2 * s.outlier_base_ejection_s,
    )


class Ejections:
    """One per router process (owned by the forwarder)."""

    def __init__(self, state: RouterState, settings: OutlierSettings) -> None:
        self.state = state
        self.detector = OutlierDetector(settings)
        self._penalised: set[ReplicaKey] = set()
        self._probing: dict[ReplicaKey, object] = {}  # on probation: its one attempt
        r = state.metrics.registry
        self.ejections = LoopCounter(
            "kvrouter_replica_ejections",
            "Replicas taken out of rotation by outlier detection, by reason (failures, "
            "retry_after, latency)",
            ["model", "replica", "reason"],
            registry=r,
        )
        self.failures = LoopCounter(
            "kvrouter_replica_failures",
            "Failed attempts by kind (http_5xx, http_429, timeout, broken, error_event, connect, "
            "reported)",
            ["model", "replica", "kind"],
            registry=r,
        )
        state.fleet.on_forget.append(self.forget)

    def forget(self, key: ReplicaKey) -> None:
        """``key`` left the fleet: its failure run, ejection and penalty go with it, as its
        unhealthy mark does (a replica registered again under its name starts clean), and
        so do its failure and ejection series (as its ``kvrouter_requests_total`` do)."""
        self.detector.forget(key)
        for family in (self.failures, self.ejections):
            family.remove_where("replica", key)
        self._penalised.discard(key)
        self._probing.pop(key, None)

    def _pool(self, key: ReplicaKey) -> tuple[str, int]:
        ep = self.state.registry.endpoint(key)
        model = ep.model if ep is not None else ""
        return model, len(self.state.registry.keys_for(model)) if model else 1

    def sent(self, key: ReplicaKey, token: object, now: float, expect_s: float) -> None:
        self.detector.sent(key, self._pool(key)[0], token, now, expect_s)
        if self.detector.on_probation(key, now) and key not in self._probing:
            # readmitted after an ejection: one attempt at a time until one succeeds
            self._probing[key] = token
            self.detector.hold(key, True)  # counts toward the ejected share
            self.state.fleet.unhealthy_until[key] = _UNTIL_ANSWERED
            self.state.load.set_health(key, False)

    def _probed(self, key: ReplicaKey, token: object, now: float, hold: float = 0.0) -> None:
        """The probation attempt ``token`` on ``key`` ended: readmit it unless ejected, or
        held out until ``hold`` (a connection failure's unhealthy cooldown, which the
        fleet's mark could not record over the probation's hold)."""
        if token is None or self._probing.get(key) is not token:
            return
        del self._probing[key]
        self.detector.hold(key, False)
        fleet = self.state.fleet
        ejected = self.detector.ejected(key, now)
        until = max(ejected.until if ejected is not None else 0.0, hold)
        if until > now:
            fleet.unhealthy_until[key] = until
            self.state.load.set_health(key, False)
        elif fleet.unhealthy_until.get(key) == _UNTIL_ANSWERED:
            del fleet.unhealthy_until[key]
            self.state.load.set_health(key, True)

    def answered(
        self, key: ReplicaKey, token: object, now: float, *, succeeded: bool = True
    ) -> None:
        """The attempt's first byte (or whole answer) came. ``succeeded`` False: a stream's
        first byte, a latency sample only; its end is :meth:`ended` or :meth:`failed`, with
        the same ``token`` (a probation attempt lasts until then)."""
        self.detector.answered(key, token, now, succeeded=succeeded)
        if succeeded:
            self.ended(key, token, now)

    def ended(self, key: ReplicaKey, token: object, now: float) -> None:
        """The attempt's answer ended whole: a success."""
        self.detector.success(key, now)
        if key in self._penalised:
            self._penalise(key, now)
        self._probed(key, token, now)

    def _penalise(self, key: ReplicaKey, now: float) -> None:
        n = self.detector.penalty(key, now)
        self.state.load.set_penalty(key, n, n * PENALTY_TOKENS)
        if n:
            self._penalised.add(key)
        else:
            self._penalised.discard(key)

    def phantom_tokens(self, key: ReplicaKey, now: float) -> int:
        """The prompt tokens of ``key``'s penalty (not work the replica has queued)."""
        return self.detector.penalty(key, now) * PENALTY_TOKENS if key in self._penalised else 0

    def dropped(self, key: ReplicaKey, token: object, now: float) -> None:
        self.detector.dropped(key, token)
        self._probed(key, token, now)

    def failed(
        self,
        key: ReplicaKey,
        kind: str,
        now: float,
        token: object = None,
        retry_after_s: float | None = None,
    ) -> None:
        if self.state.registry.endpoint(key) is None:  # left while the attempt was out
            self._probed(key, token, now)
            return
        model, size = self._pool(key)
        self.failures.labels(model, str(key), kind).inc()
        got = self.detector.failure(
            key, model, kind, now, token=token, retry_after_s=retry_after_s, pool_size=size
        )
        self._penalise(key, now)
        if got is not None:
            self._apply(got, "retry_after" if retry_after_s else "failures", model)
        # a failed connection takes the replica out for the unhealthy cooldown (Fleet.
        # connect_failed), a probation attempt's too
        hold = now + self.state.settings.server.unhealthy_cooldown_s if kind == "connect" else 0.0
        self._probed(key, token, now, hold)

    def sweep(self, now: float) -> None:
        """Latency outliers, and lapsed penalties (call a few times a second)."""
        for key in list(self._penalised):
            self._penalise(key, now)
        registry = self.state.registry
        for key in [k for k in self._probing if registry.endpoint(k) is None]:
            del self._probing[key]
        sizes = {m: len(registry.keys_for(m)) for m in self.state.engines}
        for got in self.detector.sweep(now, sizes):
            ep = registry.endpoint(got.key)
            if ep is None:
                self.detector.forget(got.key)
                continue
            self._apply(got, "latency", ep.model)
            # its attempts still waiting give up now (and are retried elsewhere), rather
            # than at their first-byte deadlines
            for token in got.stalled:
                if isinstance(token, asyncio.Timeout):
                    with contextlib.suppress(RuntimeError):  # already over
                        token.reschedule(now)

    def _apply(self, got: Ejection, reason: str, model: str) -> None:
        fleet = self.state.fleet
        if self.state.registry.endpoint(got.key) is None:
            return
        held = fleet.unhealthy_until.get(got.key, 0.0)
        fleet.unhealthy_until[got.key] = max(0.0 if held == _UNTIL_ANSWERED else held, got.until)
        self.state.load.set_health(got.key, False)
        self.ejections.labels(model, str(got.key), reason).inc()
        _log.warning(
            "replica %s ejected (#%d in a row): %s",
            got.key,
            got.count,
            got.reason,
        )

    def status(self, key: ReplicaKey, now: float) -> dict[str, object]:
        out = self.detector.status(key, now)
        out["penalty_requests"] = self.detector.penalty(key, now)
        return out
