"""Which load samples read from the change streams are a replica's load (``IndexSync``).

A change entry of kind ``L`` says what a replica's load was when its publisher sampled it
(``LoadSample.wall_ts``, the publisher's wall clock), not what it is when a router reads it:
a backlog read late or an entry appended again brings old samples. ``latest_loads`` keeps,
of one read, each key's newest sample; ``LoadGate.admit`` refuses a sample older than the
key's last admitted one (while that one is at most ``max_age_s`` old by the router's clock)
or older than ``max_age_s`` by the router's wall clock, and dates the others by their age.
Time is passed in: no clock is read here.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.core.types import ReplicaKey
from router.store.base import Change, LoadChange, LoadSample


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
    """Per key, the last admitted sample's ``wall_ts`` and when (router clock) it was."""

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._held: dict[ReplicaKey, tuple[float, float]] = {}

    def admit(self, key: ReplicaKey, sample: LoadSample, now: float, wall: float) -> float | None:
        """When (``now``'s clock) ``sample`` was taken, at most ``now``; None to ignore it.
        ``now``: the router's clock; ``wall``: its wall clock."""
        age = wall - sample.wall_ts
        held, admitted = self._held.get(key, (sample.wall_ts, now))
        # the bar lapses: a publisher whose clock was ahead, then set back, recovers
        older = sample.wall_ts < held and now - admitted <= self.max_age_s
        if older or not age <= self.max_age_s:  # (NaN ages are refused too)
            return None
        self._held[key] = (sample.wall_ts, now)
        return now - max(age, 0.0)

    def forget(self, key: ReplicaKey) -> None:
        """``key`` left: a replica that comes back may sample on another host's clock."""
        self._held.pop(key, None)
