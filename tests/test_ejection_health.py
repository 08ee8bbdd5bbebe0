"""An ejection (router/service/ejection.py) and the fleet's unhealthy marks
(router/service/fleet.py) share ``Fleet.unhealthy_until``: a failed health probe or a
dropped connection must not cut an ejection, or a probation's one attempt, short."""

from __future__ import annotations

from typing import Any

from router.core.types import ReplicaKey
from router.service.config import build_settings
from router.service.ejection import Ejections, outlier_settings
from router.service.state import RouterState

COOLDOWN_S = 5.0


def _state() -> Any:
    return RouterState(
        build_settings(
            {
                "server": {
                    "unhealthy_cooldown_s": COOLDOWN_S,
                    "outlier_base_ejection_s": 30.0,
                    "outlier_max_ejection_s": 120.0,
                },
                "replicas": [
                    {"url": f"http://10.0.0.{i}:8000", "model": "m", "name": n}
                    for i, n in enumerate(("a", "b", "c", "d"), 1)
                ],
                "models": {"m": {"block_size": 16}},
            }
        )
    )


def _eject(ejections: Ejections, key: ReplicaKey, at: float) -> None:
    for i in range(3):
        token = object()
        ejections.sent(key, token, at + i * 0.01, 1.0)
        ejections.failed(key, "http_5xx", at + i * 0.01 + 0.005, token)


def test_a_failed_health_probe_does_not_end_an_ejection_early() -> None:
    state = _state()
    ejections = Ejections(state, outlier_settings(state.settings.server))
    a = ReplicaKey("a")
    _eject(ejections, a, 0.0)
    assert ejections.status(a, 1.0)["ejected"] is True  # for 30 s
    state.fleet.mark_unhealthy(a, 1.0)  # its /health fails meanwhile (or a connection drops)
    later = 1.0 + COOLDOWN_S + 1.0
    state.fleet.restore_health(later)  # the housekeeping, past the unhealthy cooldown
    assert ejections.status(a, later)["ejected"] is True
    assert state.load.view(a, later).healthy is False  # still out of rotation
    state.fleet.restore_health(31.0)  # the ejection is over
    assert state.load.view(a, 31.0).healthy is True


def test_a_failed_health_probe_does_not_end_a_probation_hold() -> None:
    """A readmitted replica takes one attempt at a time until one is answered: a health
    probe failing while that attempt is out must not readmit it for everyone after the
    unhealthy cooldown."""
    state = _state()
    ejections = Ejections(state, outlier_settings(state.settings.server))
    a = ReplicaKey("a")
    _eject(ejections, a, 0.0)
    state.fleet.restore_health(31.0)  # readmitted, on probation
    probe = object()
    ejections.sent(a, probe, 31.0, 1.0)  # its one attempt
    assert state.load.view(a, 31.0).healthy is False
    state.fleet.mark_unhealthy(a, 32.0)
    later = 32.0 + COOLDOWN_S + 1.0
    state.fleet.restore_health(later)
    assert state.load.view(a, later).healthy is False  # the attempt is still out
    ejections.answered(a, probe, later + 1.0)
    assert state.load.view(a, later + 1.0).healthy is True


def test_a_refused_probation_attempt_keeps_its_replica_out_for_the_cooldown() -> None:
    """The probation attempt's connection is refused and the pool's ejected share is at its
    cap (no new ejection): the replica still sits out the unhealthy cooldown."""
    state = _state()
    ejections = Ejections(state, outlier_settings(state.settings.server))
    a, b, c = ReplicaKey("a"), ReplicaKey("b"), ReplicaKey("c")
    _eject(ejections, a, 0.0)
    _eject(ejections, b, 25.0)
    state.fleet.restore_health(31.0)  # a readmitted, on probation
    _eject(ejections, c, 31.0)  # b and c ejected: the cap of a pool of 4 (half)
    probe = object()
    ejections.sent(a, probe, 31.5, 1.0)
    state.fleet.connect_failed(a, 32.0, connected=False)
    ejections.failed(a, "connect", 32.0, probe)
    assert ejections.status(a, 32.0)["ejected"] is False  # the cap
    assert state.load.view(a, 32.1).healthy is False
    state.fleet.restore_health(32.0 + COOLDOWN_S + 0.1)
    assert state.load.view(a, 32.0 + COOLDOWN_S + 0.1).healthy is True


def test_retry_after_is_the_time_until_the_first_replica_comes_back() -> None:
    """Only when every replica of the model is out until a known time; capped at 60 s."""
    from router.service.fleet import RETRY_AFTER_MAX_S

    state = _state()
    fleet = state.fleet
    keys = [ReplicaKey(n) for n in ("a", "b", "c")]
    for i, key in enumerate(keys):
        fleet.mark_unhealthy(key, 10.0 + i)  # out until 15, 16, 17
    assert fleet.retry_after_s("m", 10.5) == 1  # "d" is still in rotation
    fleet.mark_unhealthy(ReplicaKey("d"), 10.0)
    assert fleet.retry_after_s("m", 10.5) == 5  # ceil(15 - 10.5)
    assert fleet.retry_after_s("m", 14.9) == 1  # never under the configured value
    fleet.unhealthy_until[ReplicaKey("a")] = 10.0 + 3600.0
    fleet.unhealthy_until[ReplicaKey("b")] = 10.0 + 3600.0
    fleet.unhealthy_until[ReplicaKey("c")] = 10.0 + 3600.0
    fleet.unhealthy_until[ReplicaKey("d")] = 10.0 + 3600.0
    assert fleet.retry_after_s("m", 10.0) == RETRY_AFTER_MAX_S
    fleet.unhealthy_until[ReplicaKey("d")] = float("inf")  # on probation: no known end
    assert fleet.retry_after_s("m", 10.0) == 1
    assert fleet.retry_after_s("unknown", 10.0) == 1


def test_a_probation_hold_counts_toward_the_ejected_share() -> None:
    """A readmitted replica whose one probation attempt is out is out of rotation as an
    ejected one is: with it held, a pool at its cap ejects no other replica (a pool of two
    would otherwise have both out, and every request refused, for as long as that attempt,
    a long stream, lasts)."""
    state = RouterState(
        build_settings(
            {
                "server": {"outlier_base_ejection_s": 30.0, "outlier_max_ejection_s": 120.0},
                "replicas": [
                    {"url": f"http://10.0.0.{i}:8000", "model": "m", "name": n}
                    for i, n in enumerate(("a", "b"), 1)
                ],
                "models": {"m": {"block_size": 16}},
            }
        )
    )
    ejections = Ejections(state, outlier_settings(state.settings.server))
    a, b = ReplicaKey("a"), ReplicaKey("b")
    _eject(ejections, a, 0.0)
    state.fleet.restore_health(31.0)  # a readmitted, on probation
    probe = object()
    ejections.sent(a, probe, 31.0, 1.0)  # its one attempt, out for a while
    assert state.load.view(a, 31.0).healthy is False
    _eject(ejections, b, 32.0)  # b fails three times meanwhile
    assert ejections.status(b, 33.0)["ejected"] is False  # the cap: one of two
    assert state.load.view(b, 33.0).healthy is True  # b stays in rotation, penalised
    assert ejections.status(b, 33.0)["penalty_requests"] > 0
    ejections.answered(a, probe, 34.0)  # a's attempt ends well: a is back
    assert state.load.view(a, 34.0).healthy is True
    _eject(ejections, b, 35.0)  # now b may go
    assert ejections.status(b, 36.0)["ejected"] is True


def test_a_failed_probation_attempt_ejects_its_replica_again_within_the_cap() -> None:
    """The held replica's own failure ejects it again (it was the one out)."""
    state = _state()
    ejections = Ejections(state, outlier_settings(state.settings.server))
    a, b = ReplicaKey("a"), ReplicaKey("b")
    _eject(ejections, a, 0.0)
    _eject(ejections, b, 1.0)  # a and b ejected: the cap of a pool of 4
    state.fleet.restore_health(32.0)  # both readmitted, on probation
    pa, pb = object(), object()
    ejections.sent(a, pa, 32.0, 1.0)
    ejections.sent(b, pb, 32.0, 1.0)
    ejections.failed(a, "http_5xx", 32.5, pa)  # a fails its attempt: ejected again
    assert ejections.status(a, 33.0)["ejected"] is True
    assert state.load.view(a, 33.0).healthy is False


def test_a_request_on_a_replica_that_left_keeps_its_id_taken() -> None:
    """A replica leaves (its load goes) while a request is still out on it: a new request
    re-sending that id must not take it over, or the first one's end (or its retry) would
    complete the second's accounting on the replica it went to, which then looks idle."""
    from router.service.request_identity import unique_in_flight

    state = _state()
    a, b = ReplicaKey("a"), ReplicaKey("b")
    state.load.dispatch("x", a, 1000, 0)
    state.load.remove_replica(a)  # a left (deregistered, lease expired) mid-request
    assert unique_in_flight(state, "x") != "x"  # still in flight: the new one is renamed
    other = unique_in_flight(state, "x")
    state.load.dispatch(other, b, 1000, 0)
    state.load.complete("x")  # the first request ends (or is cancelled)
    assert state.load.view(b, 0.0).prefilling == 1  # the second one still counts on b
    assert unique_in_flight(state, "x") == "x"  # and the id is free again
