"""router/store/load_gate.py: which load samples read from the change streams are taken, and
as how old, whatever the offset between the publisher's clock and the router's."""

from __future__ import annotations

import pytest

from router.core.types import ReplicaKey
from router.store.base import LoadSample
from router.store.load_gate import MAX_SKEW_S, RECENT, LoadGate

K = ReplicaKey("r")
NOW = 500.0  # the router's monotonic clock, fixed: only wall times move


def sample(wall_ts: float, running: int = 1) -> LoadSample:
    return LoadSample(running, 0, 0.0, wall_ts)


@pytest.mark.parametrize("offset", [-30.0, -4.0, 0.0, 2.5, MAX_SKEW_S, 20.0])
def test_load_samples_of_a_publisher_whose_clock_is_off_are_fresh(offset: float) -> None:
    """A publisher host whose clock is ``offset`` s behind the router's (ahead: negative)
    samples every second: each is taken as taken now, from the first on (report_max_age_s,
    1.5 s, would otherwise drop every one of them past 1.5 s of offset); an offset over
    MAX_SKEW_S from the RECENT-th on."""
    gate = LoadGate(max_age_s=10.0)
    wall = 10_000.0
    for i in range(50):
        taken = gate.admit(K, sample(wall + i - offset), NOW, wall + i + 0.01)
        if offset > MAX_SKEW_S and i < RECENT:
            assert taken is None, i
        else:
            assert taken is not None and NOW - taken < 0.02, (i, taken)


def test_a_sample_later_than_its_publishers_usual_is_dated_so() -> None:
    """The offset is learned from the rank's recent samples: one read 3 s later than the
    others (a router that lagged, a backlog) is 3 s old; one later than max_age_s is not
    taken; a first sample a minute old is not taken either."""
    gate = LoadGate(max_age_s=10.0)
    assert gate.admit(K, sample(9_940.0), NOW, 10_000.0) is None  # a minute old, first
    for i in range(5):
        assert gate.admit(K, sample(10_000.0 + i - 2), NOW, 10_000.0 + i) == NOW
    assert gate.admit(K, sample(10_010.0 - 2), NOW, 10_013.0) == NOW - 3.0
    assert gate.admit(K, sample(10_020.0 - 2), NOW, 10_041.0) is None  # 19 s late


def test_an_older_sample_than_the_one_held_is_ignored_and_a_clock_set_back_is_learned() -> None:
    gate = LoadGate(max_age_s=10.0)
    assert gate.admit(K, sample(10_000.0), NOW, 10_000.0) == NOW
    assert gate.admit(K, sample(9_999.0), NOW, 10_000.5) is None  # a replay: older
    # the publisher's clock is set back 20 s: refused while the bar holds, then late
    # (20 s > max_age_s) until the rank's recent samples show the new offset
    taken = [gate.admit(K, sample(9_981.0 + i), NOW + 11 + i, 10_001.0 + i) for i in range(40)]
    assert taken[0] is None
    assert taken[-1] == NOW + 11 + 39  # fresh again, RECENT samples on
    assert sum(t is None for t in taken) <= RECENT + 1


def test_a_sample_without_a_time_is_ignored_and_forget_starts_afresh() -> None:
    gate = LoadGate(max_age_s=10.0)
    assert gate.admit(K, sample(float("nan")), NOW, 10_000.0) is None
    assert gate.admit(K, sample(10_000.0), NOW, 10_000.0) == NOW
    gate.forget(K)
    assert gate.admit(K, sample(9_990.0), NOW, 10_000.0) == NOW - (10.0 - MAX_SKEW_S)
