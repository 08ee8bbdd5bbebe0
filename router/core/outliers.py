"""Outlier detection and ejection of replicas, in the spirit of Envoy's: a replica that keeps
failing, asks for a pause, or answers far slower than its peers leaves rotation for a while.

Pure: every call gets ``now``; nothing here reads a clock or does I/O. The service feeds it
each attempt's outcome (router/service/ejection.py) and applies what it decides (the
replica's health in the load tracker, a load penalty in the cost).

* **Consecutive failures.** ``failure(key, kind, now)`` with ``kind`` one of
  :data:`FAILURE_KINDS` (a 5xx, a 429, a first-byte timeout, a broken answer, a stream the
  engine ended with its error event, a dropped connection, a failure a gateway reported over
  gRPC); ``consecutive_failures`` of them in a
  row, of any kinds, eject the replica. A success (an answer that ended whole: a stream's
  first byte is not one yet) resets the run; a replica readmitted after
  an ejection keeps its run, so one more failure ejects it again.
* **Growing ejection interval.** The n-th ejection in a row lasts ``n x base_ejection_s``,
  at most ``max_ejection_s``; n falls back to 0 once a readmitted replica has answered well
  for ``max_ejection_s``.
* **Cap on the ejected share of a pool.** Pools are the caller's (a model's replicas): at most
  ``max_ejected_share`` of a pool's replicas (at least one) are ejected at once; a replica
  that would exceed the cap stays in rotation, with its penalty.
* **Retry-After.** A failure that carries the replica's ``Retry-After`` ejects it at once for
  that long (at most ``max_retry_after_s``) or for its growing interval if longer, within
  the cap.
* **First-byte latency outliers.** Each attempt is known from :meth:`sent` (with the time the
  router predicted for its first byte) to :meth:`answered`; its *excess* is the time past that
  prediction and its *ratio* the time over the prediction (at least :data:`MIN_EXPECT_S`).
  A replica is ejected (:meth:`sweep`) when its answered attempts (moving averages) or its
  oldest attempt still waiting show an excess over ``latency_min_s`` *and* a ratio over
  ``latency_factor`` times the median of its peers' average ratios (the pool's others: in a
  pool of two the pool's own median would be the slow replica's ratio): a replica that hangs is
  caught in about ``latency_min_s``, not after a first-byte timeout, while a prediction that
  is wrong for every replica alike (a cost model slower or faster than the engines) moves the
  median with it.
* **Probation.** :meth:`on_probation`: readmitted, and no attempt succeeded since (the
  caller sends it one attempt at a time, and holds it out of rotation while that attempt is
  out: :meth:`hold`, which counts toward the cap as an ejection does).
* **Penalty.** :meth:`penalty` is what the cost should add to a replica that failed recently
  but is not (or can no longer be) ejected: ``penalty_requests_per_failure`` phantom requests
  per failure of its run, so a replica that fails fast never looks idle; it lapses
  ``penalty_s`` after the run's last failure.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace

from router.core.types import ReplicaKey

FAILURE_KINDS = (
    "http_5xx",
    "http_429",
    "timeout",
    "broken",
    "error_event",
    "connect",
    "reported",
)
MIN_EXPECT_S = 0.05  # predictions below this count as this in ratios


@dataclass(slots=True, frozen=True)
class OutlierSettings:
    """See the module docstring. ``enabled`` False: nothing is ever ejected or penalised."""

    enabled: bool = True
    consecutive_failures: int = 3
    base_ejection_s: float = 2.0
    max_ejection_s: float = 60.0
    max_ejected_share: float = 0.5
    max_retry_after_s: float = 60.0
    latency_factor: float = 5.0
    latency_min_s: float = 1.0
    latency_alpha: float = 0.3  # weight of the newest answer in the moving average
    penalty_requests_per_failure: int = 2
    penalty_s: float = 5.0  # the penalty lasts this long after the run's last failure


@dataclass(slots=True, frozen=True)
class Ejection:
    """Why ``key`` is out of rotation, and until when (the caller's clock)."""

    key: ReplicaKey
    reason: str
    until: float
    count: int  # ejections in a row, this one included
    stalled: tuple[object, ...] = ()  # a latency ejection: the attempts it gave up waiting on


@dataclass(slots=True)
class _Replica:
    pool: str
    run: int = 0  # consecutive failures
    last_failure: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)  # the run, by kind
    ejected_until: float = 0.0
    reason: str = ""
    ejections: int = 0  # in a row
    probation: bool = False  # ejected, and no attempt succeeded since
    held: bool = False  # on probation with its one attempt out: out of rotation (hold)
    good_since: float = 0.0  # readmitted and answering well since
    excess_avg: float | None = None  # moving average of answered attempts' excess (s)
    ratio_avg: float | None = None  # ... and of their time over the prediction
    pending: dict[object, tuple[float, float]] = field(default_factory=dict)  # token: sent, expect


class OutlierDetector:
    """Per-replica failure runs, latency and ejections (see the module docstring)."""

    def __init__(self, settings: OutlierSettings) -> None:
        self.settings = settings
        self._replicas: dict[ReplicaKey, _Replica] = {}

    def _get(self, key: ReplicaKey, pool: str) -> _Replica:
        rep = self._replicas.get(key)
        if rep is None:
            rep = self._replicas[key] = _Replica(pool)
        return rep

    def forget(self, key: ReplicaKey) -> None:
        """The replica left the fleet."""
        self._replicas.pop(key, None)

    def hold(self, key: ReplicaKey, held: bool) -> None:
        """The caller holds ``key`` out of rotation (``held``: its probation attempt is out)
        or no longer: a held replica counts toward its pool's ejected share as an ejected
        one does (else a pool of two could have one held and the other ejected: none left)."""
        rep = self._replicas.get(key)
        if rep is not None:
            rep.held = held

    # ------------------------------------------------------------------ attempts

    def sent(self, key: ReplicaKey, pool: str, token: object, now: float, expect_s: float) -> None:
        """An attempt went to ``key``; its first byte is predicted within ``expect_s``."""
        self._get(key, pool).pending[token] = (now, max(expect_s, 0.0))

    def answered(
        self, key: ReplicaKey, token: object, now: float, *, succeeded: bool = True
    ) -> None:
        """The attempt's first byte (or whole answer) came: a latency sample, and a success
        (ends the failure run). ``succeeded`` False: a stream's first byte, the sample only;
        its end is a :meth:`success` or a :meth:`failure` (a replica that breaks every
        stream after its first token keeps its run)."""
        rep = self._replicas.get(key)
        if rep is None:
            return
        got = rep.pending.pop(token, None)
        if got is not None and math.isfinite(got[1]):  # (no prediction: not a sample)
            took, expect = now - got[0], got[1]
            excess = max(took - expect, 0.0)
            ratio = took / max(expect, MIN_EXPECT_S)
            a = self.settings.latency_alpha
            rep.excess_avg = (
                excess if rep.excess_avg is None else a * excess + (1 - a) * rep.excess_avg
            )
            rep.ratio_avg = ratio if rep.ratio_avg is None else a * ratio + (1 - a) * rep.ratio_avg
        if succeeded:
            self.success(key, now)

    def success(self, key: ReplicaKey, now: float) -> None:
        """An attempt's answer ended whole: ends the failure run and the probation."""
        rep = self._replicas.get(key)
        if rep is None:
            return
        rep.probation = False
        if rep.run:
            rep.run = 0
            rep.kinds.clear()
        if rep.ejections and now >= rep.ejected_until:
            if not rep.good_since:
                rep.good_since = now
            elif now - rep.good_since >= self.settings.max_ejection_s:
                rep.ejections = 0
                rep.good_since = 0.0

    def dropped(self, key: ReplicaKey, token: object) -> None:
        """The attempt ended without a first byte and without a failure of the replica's
        (the client left): neither a sample nor a failure."""
        rep = self._replicas.get(key)
        if rep is not None:
            rep.pending.pop(token, None)

    def failure(
        self,
        key: ReplicaKey,
        pool: str,
        kind: str,
        now: float,
        *,
        token: object = None,
        retry_after_s: float | None = None,
        pool_size: int = 1,
    ) -> Ejection | None:
        """A failed attempt (``kind`` in :data:`FAILURE_KINDS`); returns the ejection it
        caused, if any. ``pool_size``: how many replicas the pool has (for the cap)."""
        rep = self._get(key, pool)
        if token is not None:
            rep.pending.pop(token, None)
        rep.run += 1
        rep.last_failure = now
        rep.kinds[kind] = rep.kinds.get(kind, 0) + 1
        rep.good_since = 0.0
        s = self.settings
        if not s.enabled or now < rep.ejected_until:
            return None
        if retry_after_s is not None and retry_after_s > 0:
            # at least what it asked for, and the growing interval of its ejections in a row
            hold = max(
                min(retry_after_s, s.max_retry_after_s),
                min(s.base_ejection_s * (rep.ejections + 1), s.max_ejection_s),
            )
            return self._eject(
                key, rep, f"{kind} with Retry-After {retry_after_s:g}s", now, pool_size, hold
            )
        if rep.run >= s.consecutive_failures:
            runs = ", ".join(f"{k} x{n}" for k, n in sorted(rep.kinds.items()))
            return self._eject(key, rep, f"{rep.run} failures in a row ({runs})", now, pool_size)
        return None

    # ------------------------------------------------------------------ ejections

    def _ejected_in(self, pool: str, now: float, besides: _Replica) -> int:
        """Replicas of ``pool`` other than ``besides`` out of rotation: ejected or held."""
        return sum(
            1
            for r in self._replicas.values()
            if r.pool == pool and r is not besides and (r.ejected_until > now or r.held)
        )

    def _eject(
        self,
        key: ReplicaKey,
        rep: _Replica,
        reason: str,
        now: float,
        pool_size: int,
        hold: float | None = None,
    ) -> Ejection | None:
        s = self.settings
        # (a hair over, so a share that is a whole number of replicas is not one short:
        # 0.7 * 90 is 62.99999999999999 in floats)
        cap = max(1, int(s.max_ejected_share * pool_size + 1e-9))
        if self._ejected_in(rep.pool, now, rep) >= cap:
            return None  # the cap: it stays, penalised
        rep.ejections += 1
        if hold is None:
            hold = min(s.base_ejection_s * rep.ejections, s.max_ejection_s)
        rep.ejected_until = now + hold
        rep.probation = True
        rep.reason = reason
        rep.good_since = 0.0
        return Ejection(key, reason, rep.ejected_until, rep.ejections)

    def sweep(self, now: float, pool_sizes: dict[str, int]) -> list[Ejection]:
        """Eject the first-byte latency outliers (see the module docstring); call it a few
        times a second. ``pool_sizes``: each pool's replica count."""
        s = self.settings
        if not s.enabled:
            return []
        pools: dict[str, list[tuple[ReplicaKey, _Replica]]] = {}
        for key, rep in self._replicas.items():
            pools.setdefault(rep.pool, []).append((key, rep))
        out: list[Ejection] = []
        for pool, members in pools.items():
            if len(members) < 2:
                continue  # no peers to compare with
            ratios = sorted(rep.ratio_avg or 1.0 for _, rep in members)
            for key, rep in members:
                if now < rep.ejected_until:
                    continue
                median = _peers_median(ratios, rep.ratio_avg or 1.0)
                bar = s.latency_factor * median
                views = [(rep.excess_avg or 0.0, rep.ratio_avg or 0.0)]
                for sent, expect in rep.pending.values():
                    age = now - sent
                    views.append((age - expect, age / max(expect, MIN_EXPECT_S)))
                worst = max(
                    (v for v in views if v[0] > s.latency_min_s and v[1] > bar),
                    default=None,
                )
                if worst is None:
                    continue
                why = (
                    f"first byte {worst[0]:.2f}s past its prediction, {worst[1]:.1f}x it "
                    f"(peers' median {median:.1f}x)"
                )
                got = self._eject(key, rep, why, now, pool_sizes.get(pool, len(members)))
                if got is not None:
                    # judged again on new answers only; the caller may retry the stalled ones
                    stalled = tuple(rep.pending)
                    rep.pending.clear()
                    rep.excess_avg = rep.ratio_avg = None
                    out.append(replace(got, stalled=stalled))
        return out

    # ------------------------------------------------------------------ queries

    def ejected(self, key: ReplicaKey, now: float) -> Ejection | None:
        rep = self._replicas.get(key)
        if rep is None or rep.ejected_until <= now:
            return None
        return Ejection(key, rep.reason, rep.ejected_until, rep.ejections)

    def on_probation(self, key: ReplicaKey, now: float) -> bool:
        """Readmitted after an ejection, and no attempt succeeded since."""
        rep = self._replicas.get(key)
        return rep is not None and rep.probation and now >= rep.ejected_until

    def penalty(self, key: ReplicaKey, now: float) -> int:
        """Phantom requests the cost should add to ``key``: 0 when it has not failed since
        its last success, or not for ``penalty_s`` (a replica the penalty keeps idle must
        get a chance to show it recovered)."""
        rep = self._replicas.get(key)
        s = self.settings
        if rep is None or not s.enabled or not rep.run or now - rep.last_failure >= s.penalty_s:
            return 0
        return rep.run * s.penalty_requests_per_failure

    def status(self, key: ReplicaKey, now: float) -> dict[str, object]:
        """JSON-ready: the failure run, the ejection (reason, seconds left) if any."""
        rep = self._replicas.get(key)
        if rep is None:
            return {"failures_in_a_row": 0, "ejected": False}
        out: dict[str, object] = {
            "failures_in_a_row": rep.run,
            "ejected": rep.ejected_until > now,
            "ejections_in_a_row": rep.ejections,
        }
        if rep.ejected_until > now:
            out["ejection_reason"] = rep.reason
            out["ejected_for_s"] = round(rep.ejected_until - now, 3)
        if rep.excess_avg is not None and rep.ratio_avg is not None:
            out["first_byte_excess_s"] = round(rep.excess_avg, 4)
            out["first_byte_ratio"] = round(rep.ratio_avg, 2)
        return out


def _peers_median(ratios: list[float], own: float) -> float:
    """The (upper) median of sorted ``ratios`` without one occurrence of ``own``."""
    at = bisect.bisect_left(ratios, own)
    middle = (len(ratios) - 1) // 2  # in the list without ``own``
    return ratios[middle] if middle < at else ratios[middle + 1]
