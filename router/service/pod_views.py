"""The latest snapshot of every member of the other pods (router/service/pod_exchange.py).

Staleness bound: a snapshot carries its member's sequence number; a member whose sequence has
not moved for ``pods_stale_s`` (by the reader's clock: no clock sync needed) stops counting,
so a pod that dies, or is cut off, stops weighing on the replicas within that bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.core.load import PeerLoad
from router.core.types import ReplicaKey
from router.service.peer_sum import summed
from router.service.pod_snapshot import Snapshot

GONE_MAX = 4096  # members remembered as gone (PodViews.gone)


@dataclass(slots=True)
class _View:
    member: str
    pod: str
    seq: int
    moved_at: float  # reader's clock when ``seq`` last changed
    load: dict[ReplicaKey, PeerLoad]
    graced: bool = False  # ``moved_at`` moved to a stream gap's end (PodViews.lost)


@dataclass(slots=True)
class PodViews:
    """The latest snapshot of every member of the other pods, and when each last moved,
    by sender (:attr:`Snapshot.sender`). No I/O, no clock: ``now`` comes in."""

    pod: str
    stale_s: float
    views: dict[str, _View] = field(default_factory=dict)
    # senders dropped as stale, their last view; the same seq read again (a dead member's
    # hash field, re-read every poll) is no sign of life
    gone: dict[str, _View] = field(default_factory=dict)

    def take(self, snap: Snapshot, now: float, dated: bool = True) -> None:
        """Take ``snap``, read at ``now``. ``dated``: the read can tell when a new seq was
        sent (hash mode: the previous poll was within the bound); if not, a sender not
        counted now is taken as gone at this seq, and counts once it moves again."""
        if snap.pod == self.pod:
            return
        sender = snap.sender
        old = self.views.get(sender)
        if old is None:
            dead = self.gone.get(sender)
            if dead is not None and dead.seq == snap.seq:
                return
            if not dated:
                self.gone[sender] = _View(snap.member, snap.pod, snap.seq, now, snap.load)
                return
            self.gone.pop(sender, None)
        if old is None or old.seq != snap.seq:
            self.views[sender] = _View(snap.member, snap.pod, snap.seq, now, snap.load)

    def expire(self, now: float) -> bool:
        """Drop the senders silent past ``stale_s``; whether any was dropped."""
        stale = [m for m, v in self.views.items() if now - v.moved_at > self.stale_s]
        for sender in stale:
            self.gone[sender] = self.views.pop(sender)
        if len(self.gone) > GONE_MAX:  # oldest first (insertion order): bounded memory
            for member in list(self.gone)[: len(self.gone) - GONE_MAX]:
                del self.gone[member]
        return bool(stale)

    def lost(self, since: float, until: float) -> None:
        """Whatever was sent between ``since`` and ``until`` (reader's clock) may be lost (a
        stream reader that fell behind the trim). A sender counting at ``since``, dropped
        since or not, counts as if it had spoken at ``until``: one bound from the gap, once
        per seq (a member never heard again still stops counting, however many gaps follow).
        A loss longer than the bound is an outage, not a lag: no sender is assumed alive
        through it (each counts again from its next snapshot, as after an outage)."""
        if until - since > self.stale_s:
            return
        for sender, v in list(self.gone.items()):
            if not v.graced and v.moved_at + self.stale_s >= since and sender not in self.views:
                self.views[sender] = self.gone.pop(sender)
        for v in self.views.values():
            if not v.graced and v.moved_at + self.stale_s >= since and v.moved_at < until:
                v.moved_at = until
                v.graced = True

    def keep_only(self, fields: set[str]) -> None:
        """Forget every sender whose field is not in ``fields`` (hash mode: the fields
        present; a field is its sender, or its member for a sender of an earlier version)."""
        for sender in [k for k, v in self.views.items() if not {k, v.member} & fields]:
            del self.views[sender]
        for sender in [k for k, g in self.gone.items() if not {k, g.member} & fields]:
            del self.gone[sender]

    def total(self, now: float) -> dict[ReplicaKey, PeerLoad]:
        """What the live members have in flight, per replica (stale ones dropped first)."""
        self.expire(now)
        return summed(v.load for v in self.views.values())

    def ages(self, now: float) -> dict[str, float]:
        """Per other pod, the age of its freshest member's view (seconds)."""
        out: dict[str, float] = {}
        for v in self.views.values():
            age = now - v.moved_at
            out[v.pod] = min(age, out.get(v.pod, age))
        return out
