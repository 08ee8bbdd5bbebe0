"""Which load samples read from the change streams are a replica's load (``IndexSync``).

A change entry of kind ``L`` says what a replica's load was when its publisher sampled it
(``LoadSample.wall_ts``, the publisher's wall clock), not what it is when a router reads it:
a backlog read late or an entry appended again brings old samples. ``latest_loads`` keeps,
of one read, each key's newest sample; ``LoadGate.admit`` refuses a sample older than the
key's last admitted one (while that one is at most ``max_age_s`` old by the router's clock)
or later than ``max_age_s``, and dates the others by how late they are.

How late a sample is compares two hosts' clocks, which may disagree: a sample's lateness is
its age (the router's wall clock less ``wall_ts``) less the smallest age of the key's last
:data:`RECENT` samples, which stands for the clocks' offset plus the path's least delay. So
a publisher whose clock is seconds behind the router's has its samples taken as fresh once
one of them was, while one that lags behind its own usual delay is taken as late. Until a
key has :data:`RECENT` samples that floor is at most :data:`MAX_SKEW_S`: a key's first
samples, read a minute late (a backlog at start), are late; a larger offset is learned once
the key has that many.
Time is passed in: no clock is read here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from router.core.types import ReplicaKey
from router.store.base import Change, LoadChange, LoadSample

RECENT = 32  # samples of a key whose least age is taken for the clocks' offset
MAX_SKEW_S = 5.0  # the largest offset so taken: beyond it, age is lateness


def latest_loads(changes: Sequence[Change]) -> list[Change]:
    """``changes`` with one load entry per key: the one of the newest sample (the last of
    those as new). The others were not the replica's load by the time of the read."""
    newest: dict[ReplicaKey, tuple[float, int]] = {}
    for i, c in enumerate(changes):
        if isinstance(c, LoadChange) and c.sample.wall_ts >= newest.get(c.key, (-1e300, 0))[0]:
            newest[c.key] = (c.sample.wall_ts, i)
    return [
        c for i, c in enumerate(changes) if not isinstance(c, LoadChange) or newest[c.key][1] == i
    ]


class LoadGate:
    """Per key, the last admitted sample's ``wall_ts`` and when (router clock) it was, and
    the ages of its last :data:`RECENT` samples."""

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._held: dict[ReplicaKey, tuple[float, float]] = {}
        self._ages: dict[ReplicaKey, deque[float]] = {}

    def admit(self, key: ReplicaKey, sample: LoadSample, now: float, wall: float) -> float | None:
        """When (``now``'s clock) ``sample`` was taken, at most ``now``; None to ignore it.
        ``now``: the router's clock; ``wall``: its wall clock."""
        age = wall - sample.wall_ts
        if age != age:  # NaN: no time to judge it by
            return None
        held, admitted = self._held.get(key, (sample.wall_ts, now))
        # the bar lapses: a publisher whose clock was ahead, then set back, recovers
        if sample.wall_ts < held and now - admitted <= self.max_age_s:
            return None
        ages = self._ages.get(key)
        if ages is None:
            ages = self._ages[key] = deque(maxlen=RECENT)
        # (capped until the key has RECENT samples: a backlog read at start is not its usual)
        floor = min(age, *ages) if len(ages) == RECENT else min(MAX_SKEW_S, age, *ages)
        late = age - floor
        ages.append(age)  # (a late one too: a clock set back is learned, not refused for ever)
        if not late <= self.max_age_s:
            return None
        self._held[key] = (sample.wall_ts, now)
        return now - late

    def forget(self, key: ReplicaKey) -> None:
        """``key`` left: a replica that comes back may sample on another host's clock."""
        self._held.pop(key, None)
        self._ages.pop(key, None)
