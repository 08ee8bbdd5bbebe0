"""The outlier detector (router/core/outliers.py) and the retry budget
(router/service/retry.py): pure, with the clock passed in."""

from __future__ import annotations

from router.core.outliers import OutlierDetector, OutlierSettings
from router.core.types import ReplicaKey
from router.service.retry import (
    RetryBudget,
    expected_first_byte_s,
    first_byte_deadline,
    retry_after_s,
)

A, B, C, D = (ReplicaKey(n) for n in "abcd")


def _fail(det: OutlierDetector, key: ReplicaKey, n: int, now: float, kind: str = "http_5xx"):
    got = None
    for _ in range(n):
        got = det.failure(key, "m", kind, now, pool_size=4)
    return got


def test_consecutive_failures_eject_for_a_growing_interval() -> None:
    det = OutlierDetector(OutlierSettings(consecutive_failures=3, base_ejection_s=2.0))
    assert _fail(det, A, 2, 0.0) is None
    det.answered(A, None, 0.5)  # a success ends the run
    assert _fail(det, A, 2, 1.0) is None
    got = _fail(det, A, 1, 1.0, "timeout")
    assert got is not None and got.until == 3.0 and got.count == 1
    assert "http_5xx x2" in got.reason and "timeout x1" in got.reason
    assert det.ejected(A, 2.9) is not None and det.ejected(A, 3.0) is None
    # readmitted with its run: one more failure ejects it again, for twice as long
    again = _fail(det, A, 1, 3.5)
    assert again is not None and again.until == 3.5 + 4.0 and again.count == 2
    assert det.status(A, 4.0)["ejected"] is True
    # readmitted on probation (the caller sends one attempt at a time) until one succeeds
    assert not det.on_probation(A, 7.0) and det.on_probation(A, 7.5)
    det.answered(A, None, 7.6)
    assert not det.on_probation(A, 7.7)


def test_a_stream_s_first_byte_is_a_sample_not_a_success() -> None:
    """A replica that answers every stream's head and first token, then breaks it off, kept
    ending its own failure run with each first byte: it was never ejected. The first byte
    is a latency sample; the stream's end is the success or the failure."""
    det = OutlierDetector(OutlierSettings(consecutive_failures=3, base_ejection_s=2.0))
    got = None
    for i in range(3):
        det.sent(A, "m", i, float(i), 0.5)
        det.answered(A, i, i + 0.1, succeeded=False)
        got = det.failure(A, "m", "broken", i + 0.2, token=i, pool_size=4)
    assert got is not None and "broken x3" in got.reason
    assert det.status(A, 2.5)["ejected"] is True
    # a stream that ends whole is the success that ends the run
    det.sent(B, "m", "s", 0.0, 0.5)
    _fail(det, B, 2, 0.0)
    det.answered(B, "s", 0.1, succeeded=False)
    det.success(B, 0.2)
    assert _fail(det, B, 2, 0.3) is None


def test_the_ejected_share_of_a_pool_is_capped_and_the_rest_are_penalised() -> None:
    det = OutlierDetector(OutlierSettings(max_ejected_share=0.5, penalty_s=5.0))
    assert _fail(det, A, 3, 0.0) is not None
    assert _fail(det, B, 3, 0.0) is not None  # 2 of 4
    assert _fail(det, C, 3, 0.0) is None  # over the cap: stays, penalised
    assert det.penalty(C, 1.0) == 3 * det.settings.penalty_requests_per_failure
    assert det.penalty(C, 5.0) == 0  # lapsed
    assert det.penalty(D, 1.0) == 0


def test_the_cap_is_the_configured_share_despite_float_rounding() -> None:
    """0.7 of 90 replicas is 63, although ``0.7 * 90`` is 62.99999999999999 in floats."""
    det = OutlierDetector(OutlierSettings(consecutive_failures=1, max_ejected_share=0.7))
    keys = [ReplicaKey(f"r{i}") for i in range(90)]
    got = [det.failure(k, "m", "http_5xx", 0.0, pool_size=90) for k in keys[:64]]
    assert sum(g is not None for g in got) == 63


def test_retry_after_ejects_at_once_for_that_long() -> None:
    det = OutlierDetector(OutlierSettings(max_retry_after_s=30.0, base_ejection_s=2.0))
    got = det.failure(A, "m", "http_429", 10.0, retry_after_s=7.0, pool_size=3)
    assert got is not None and got.until == 17.0 and "Retry-After" in got.reason
    capped = det.failure(B, "m", "http_429", 10.0, retry_after_s=999.0, pool_size=4)
    assert capped is not None and capped.until == 40.0
    # a short Retry-After again and again: the growing interval wins (2 s, 4 s, 6 s)
    for n, at in ((1, 50.0), (2, 53.0), (3, 58.0)):
        again = det.failure(C, "m", "http_429", at, retry_after_s=1.0, pool_size=8)
        assert again is not None and again.until == at + 2.0 * n


def test_a_replica_that_stops_answering_is_a_latency_outlier() -> None:
    det = OutlierDetector(OutlierSettings(latency_min_s=1.0, latency_factor=5.0))
    for i in range(5):  # peers answer about on time
        for key in (A, B):
            det.sent(key, "m", (key, i), float(i), 0.1)
            det.answered(key, (key, i), i + 0.12)
    det.sent(C, "m", "hung", 5.0, 0.1)
    assert det.sweep(5.5, {"m": 3}) == []
    got = det.sweep(6.2, {"m": 3})
    assert [e.key for e in got] == [C] and "first byte" in got[0].reason
    assert got[0].stalled == ("hung",)  # the caller retries it elsewhere
    assert det.sweep(6.3, {"m": 3}) == []  # judged again on new answers only


def test_a_slow_replica_is_judged_against_its_peers_even_in_a_pool_of_two() -> None:
    """The bar is ``latency_factor`` times the *peers'* median ratio: with two replicas the
    pool's own median (the upper of two) is the slow replica's own ratio, which no replica
    ever exceeds five times over."""
    for pool in ((A, B), (A, B, C)):
        det = OutlierDetector(OutlierSettings(latency_min_s=1.0, latency_factor=5.0))
        for i in range(5):
            for key in pool:
                took = 2.5 if key == A else 0.12  # A: 25x its prediction, 2.4 s past it
                det.sent(key, "m", (key, i), float(i), 0.1)
                det.answered(key, (key, i), i + took)
        got = det.sweep(10.0, {"m": len(pool)})
        assert [e.key for e in got] == [A], pool


def test_nothing_is_ejected_when_disabled() -> None:
    det = OutlierDetector(OutlierSettings(enabled=False))
    assert _fail(det, A, 10, 0.0) is None
    assert det.penalty(A, 0.0) == 0


def test_the_retry_budget_is_a_share_of_recent_requests_plus_a_floor() -> None:
    budget = RetryBudget(ratio=0.2, min_retries=2)
    for _ in range(10):
        budget.request(100.0)
    spent = 0
    while budget.allows(100.5):
        budget.spend(100.5)
        spent += 1
    assert spent == 4  # 2 + 0.2 x 10
    assert budget.allows(111.0)  # the window moved on


def test_first_byte_deadline_and_retry_after() -> None:
    assert first_byte_deadline(0.1, 10.0, 4.0, 600.0) == 10.0
    assert first_byte_deadline(50.0, 10.0, 4.0, 600.0) == 200.0
    assert first_byte_deadline(500.0, 10.0, 4.0, 600.0) == 600.0
    # a non-stream of unknown length waits the whole first_byte_timeout_s
    unknown = expected_first_byte_s(0, 100, 0, stream=False, max_output_tokens=None)
    assert first_byte_deadline(unknown, 10.0, 4.0, 600.0) == 600.0
    assert expected_first_byte_s(0, 100, 0, stream=True, max_output_tokens=None) < 0.1
    assert retry_after_s(b"3") == 3.0 and retry_after_s(b"Wed, 21 Oct") is None
    # the HTTP-date form (RFC 9110 10.2.3), against the wall clock; one past is none
    at = 1445412480.0  # Wed, 21 Oct 2015 07:28:00 GMT
    assert retry_after_s(b"Wed, 21 Oct 2015 07:28:30 GMT", wall_now=at) == 30.0
    assert retry_after_s(b"Wed, 21 Oct 2015 07:27:00 GMT", wall_now=at) is None
