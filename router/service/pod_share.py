"""Router pods share what they speculate and which sessions they bind (``pods_exchange``).

In-flight load is not all a router knows that another pod lacks. When it sends a request it
also *speculates*: it puts the prompt's blocks in its prefix index as held by the chosen
replica (for the model's speculative TTL) before the engine's KV events arrive, and, for the
policies that use session hints, it *binds* the session to that replica (router/core/session.py).
In approximate mode (no tokenizer) those entries are the whole index; in exact mode they
cover the event lag. Without sharing them, pod B routes a session's next turn, or a prompt
sharing a prefix just sent, without knowing that pod A just sent its previous turn to
replica X.

So every worker of every pod keeps an :class:`Outbox` of its own recent dispatches (filled by
:attr:`~router.core.routing.RoutingEngine.on_dispatch`) and its next exchange message
(router/service/pod_exchange.py: the same stream entry or hash field as its load snapshot)
carries what is new since the last one, as the ``x`` rows of the snapshot: per dispatch the
model, the replica, the prompt's block hashes (and hybrid state checkpoints) with their
remaining speculative TTL, and the session's :func:`~router.core.session.session_digest`
(never the session id) with the prompt blocks its next turn reuses (the hint's reach:
router/core/engine_hits.py), the last one's hash and the remaining session TTL.
Every other member, of this pod or another, applies them (:meth:`PodShare.apply`) to its own
index (``speculate``) and session table (``learn``) for the remaining TTL counted from when
the message is read, less its known age (a reader catching up on a backlog): on the
reader's clock, never longer than the sender's own entry (the Redis transit, one round
trip, aside), so a dead pod's entries lapse by themselves; a binding dates from then too,
so that the session's own later turn stays the more recent.

A dispatch its replica refused (:meth:`~router.core.routing.RoutingEngine.withdraw`) is
taken back on the other members too: each row goes with an id (the message's ``i`` field),
a later message names the ids withdrawn (``w``), and a reader, remembering what it took of
each row (:meth:`~router.core.routing.RoutingEngine.adopt`), takes that back. The rows keep
their ten fields and ``i`` / ``w`` are fields a reader of the previous version does not
read: in a rolling update it applies the rows as before and ignores the withdrawals.

Bounded: the outbox keeps at most ``OUTBOX_MAX`` dispatches (older ones dropped, counted),
a message carries at most ``MAX_ROWS`` of them, in at most ``ROWS_BYTES``, and at most
``MAX_BLOCKS`` block hashes per row (a prefix: a prompt's first blocks are the ones others
share); a reader ignores, and
counts, a message over ``MAX_MESSAGE_BYTES`` and any malformed row. In ``hash`` mode a reader
that polls less often than a member writes misses the rows of the versions it skipped (the
load is a snapshot; these are deltas): ``stream`` mode delivers every message.
"""

from __future__ import annotations

import base64
import binascii
import secrets
import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from router.core.routing import Dispatch, RoutingEngine
from router.core.session import session_digest
from router.core.types import ReplicaKey, RouteRequest

OUTBOX_MAX = 2048
MAX_ROWS = 128
MAX_BLOCKS = 1024
MAX_MESSAGE_BYTES = 1 << 20
# the rows of one message, at most (the rest of MAX_MESSAGE_BYTES is the load snapshot's):
# MAX_ROWS rows of MAX_BLOCKS hashes would be ~1.4 MB, a message every reader drops whole
ROWS_BYTES = MAX_MESSAGE_BYTES // 2
_ROW_FIXED = 9 * 24  # a row's numbers (<= 20 digits each) and its id, quotes, commas
MAX_WITHDRAWN = 1024  # withdrawals a message (~17 bytes each: 17 KiB)
RECALL_MAX = 16384  # rows of other members remembered, per part, for their withdrawal
FIELDS = ("x", "i", "w")  # the message's fields that are this module's
_U64 = 1 << 64
_ID_MAX = 1 << 53  # row ids: exact in every JSON reader


@dataclass(slots=True, frozen=True)
class Shared:
    """One dispatch as other pods learn it. ``spec_until`` / ``session_until``: the sender's
    expiries on its own clock (converted to remaining TTLs when sent); ``id``: what its
    withdrawal names."""

    model: str
    replica: ReplicaKey
    hashes: tuple[int, ...]
    states: tuple[int, ...]
    spec_until: float
    session: int  # session digest; 0: none
    blocks: int
    last_hash: int
    session_until: float
    id: int


def _pack(hashes: tuple[int, ...]) -> str:
    return base64.b64encode(struct.pack(f"<{len(hashes)}Q", *hashes)).decode()


def _unpack(text: object) -> tuple[int, ...]:
    if not isinstance(text, str):
        raise ValueError("hashes: expected base64 text")
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"hashes: {exc}") from None
    if len(raw) % 8 or len(raw) > 8 * MAX_BLOCKS:
        raise ValueError("hashes: not a bounded list of 64-bit values")
    return struct.unpack(f"<{len(raw) // 8}Q", raw)


def _ms(value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"expected a TTL in ms, got {value!r}")
    return value


class Outbox:
    """This member's dispatches not sent yet (newest last, at most ``OUTBOX_MAX``), and its
    withdrawals of dispatches it sent (as many). Row ids grow from a random start, so that
    a member restarted under the same name (pid 1 in a container) names none of its
    previous life's rows."""

    def __init__(self, first_id: int | None = None) -> None:
        self.pending: deque[Shared] = deque(maxlen=OUTBOX_MAX)
        self.withdrawn: deque[int] = deque(maxlen=OUTBOX_MAX)
        self.dropped = 0  # dispatches / withdrawals pushed out before they could be sent
        self._next_id = first_id if first_id is not None else 1 + secrets.randbelow(1 << 50)
        # what the last take() carried, for put_back() if its message never got through
        self._taken: tuple[list[Shared], list[int]] = ([], [])

    def record(
        self, model: str, request: RouteRequest, replica: ReplicaKey, states: list[int],
        now: float, ttl: float, session_ttl: float, hint_blocks: int,
    ) -> int:  # fmt: skip
        """``hint_blocks``: the prompt blocks the session's binding covers (what the engine
        grants a later turn, as the sender's own hint: router/core/engine_hits.py). Returns
        the row's id, for :meth:`withdraw` (0: nothing to share)."""
        hashes = tuple(request.block_hashes[:MAX_BLOCKS]) if ttl > 0 else ()
        session = session_digest(request.session_id) if request.session_id and session_ttl else 0
        if not hashes and not session:
            return 0
        n = min(hint_blocks, len(request.block_hashes))
        if len(self.pending) == OUTBOX_MAX:
            self.dropped += 1
        row_id = self._next_id
        self._next_id = row_id + 1 if row_id + 1 < _ID_MAX else 1
        self.pending.append(
            Shared(
                model,
                replica,
                hashes,
                tuple(states[:MAX_BLOCKS]) if hashes else (),
                now + ttl,
                session,
                n if session else 0,
                request.block_hashes[n - 1] if session and n else 0,
                now + session_ttl,
                row_id,
            )
        )
        return row_id

    def withdraw(self, row_id: int) -> None:
        """The dispatch :meth:`record` gave ``row_id`` never reached its replica's cache:
        dropped if not sent yet, else its withdrawal goes in the next message."""
        pending = self.pending
        if pending and pending[0].id <= row_id <= pending[-1].id:
            for i, s in enumerate(pending):
                if s.id == row_id:
                    del pending[i]
                    return
        if len(self.withdrawn) == OUTBOX_MAX:
            self.dropped += 1
        self.withdrawn.append(row_id)

    def __bool__(self) -> bool:
        return bool(self.pending or self.withdrawn)

    def take(self, now: float) -> dict[str, list[Any]]:
        """The message's fields (:data:`FIELDS`): ``x``, up to ``MAX_ROWS`` pending
        dispatches in at most ``ROWS_BYTES`` of JSON (one at least), oldest first, as rows
        (remaining TTLs in ms; lapsed parts left out), ``i`` their ids, ``w`` up to
        ``MAX_WITHDRAWN`` ids of rows sent before and withdrawn since. Fields with nothing
        to carry are left out."""
        rows: list[list[Any]] = []
        ids: list[int] = []
        taken: list[Shared] = []
        pending = self.pending
        size = 0
        while pending and len(rows) < MAX_ROWS:
            s = pending[0]
            spec_ms = int((s.spec_until - now) * 1000)
            session_ms = int((s.session_until - now) * 1000) if s.session else 0
            if spec_ms <= 0 and session_ms <= 0:
                pending.popleft()
                continue
            keep = spec_ms > 0 and all(0 <= h < _U64 for h in (*s.hashes, *s.states))
            kv, states = (_pack(s.hashes), _pack(s.states)) if keep else ("", "")
            # the row's JSON: its texts, 20-digit numbers and punctuation at most
            size += len(kv) + len(states) + len(s.model) + len(s.replica.replica) + _ROW_FIXED
            if rows and size > ROWS_BYTES:
                break  # in the next message
            pending.popleft()
            rows.append(
                [
                    s.model,
                    s.replica.replica,
                    s.replica.dp_rank,
                    max(spec_ms, 0) if keep else 0,
                    kv,
                    states,
                    str(s.session) if session_ms > 0 else "",
                    s.blocks,
                    str(s.last_hash),
                    max(session_ms, 0),
                ]
            )
            ids.append(s.id)
            taken.append(s)
        out: dict[str, list[Any]] = {}
        if rows:
            out["x"], out["i"] = rows, ids
        withdrawn = self.withdrawn
        if withdrawn:
            n = min(len(withdrawn), MAX_WITHDRAWN)
            out["w"] = [withdrawn.popleft() for _ in range(n)]
        self._taken = (taken, out.get("w", []))
        return out

    def put_back(self) -> None:
        """The message of the last :meth:`take` never got through (Redis refused it, or
        did not answer): its dispatches and withdrawals go first in the next one, the
        dispatches with the TTLs then remaining. A dispatch withdrawn since is not sent again
        (its withdrawal is: the message may have got through after all). Beyond
        ``OUTBOX_MAX`` the oldest are dropped, counted."""
        taken, withdrawn = self._taken
        self._taken = ([], [])
        since = set(self.withdrawn)
        self._restore(self.pending, [s for s in taken if s.id not in since])
        self._restore(self.withdrawn, withdrawn)

    def _restore(self, queue: deque[Any], items: list[Any]) -> None:
        """``items`` (oldest first) back at the head of ``queue``, as many as it has room
        for (the newest of them)."""
        room = OUTBOX_MAX - len(queue)
        if len(items) > room:
            self.dropped += len(items) - room
            items = items[len(items) - room :]
        queue.extendleft(reversed(items))


@dataclass(slots=True)
class ShareCounters:
    applied_spec: int = 0  # speculative rows applied to the index
    applied_sessions: int = 0  # session bindings learned
    withdrawn: int = 0  # rows applied here that their sender withdrew since
    rejected: int = 0  # malformed / oversized messages or rows, ignored


class _Recall:
    """What this member took of other members' rows, by (member, row id), until the part
    lapses (oldest first: a sender's TTLs are alike) or ``RECALL_MAX`` later ones push it
    out; one per part, so that a row's hashes are not kept past its speculative TTL for
    its session's sake."""

    __slots__ = ("_rows",)

    def __init__(self) -> None:
        self._rows: OrderedDict[tuple[str, int], tuple[RoutingEngine, Dispatch, float]]
        self._rows = OrderedDict()

    def add(self, key: tuple[str, int], took: tuple[RoutingEngine, Dispatch, float]) -> None:
        rows = self._rows
        rows[key] = took
        if len(rows) > RECALL_MAX:
            rows.popitem(last=False)

    def expire(self, now: float) -> None:
        rows = self._rows
        while rows:
            key = next(iter(rows))
            if rows[key][2] > now:
                break
            del rows[key]

    def pop(self, key: tuple[str, int]) -> tuple[RoutingEngine, Dispatch, float] | None:
        return self._rows.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self._rows)


class PodShare:
    """This member's side of the sharing: its :class:`Outbox` and applying the rows of the
    other members' messages to ``engines`` (by model name). ``known(model, replica)``:
    whether the replica serves that model here (rows for others are skipped)."""

    def __init__(
        self,
        engines: Mapping[str, RoutingEngine],
        known: Callable[[str, ReplicaKey], bool],
        max_spec_ttl: Callable[[str], float] | None = None,
    ) -> None:
        """``max_spec_ttl(model)``: the longest speculative TTL this pod gives the model's
        entries itself, which a row's never exceeds here (None: the engine's settings')."""
        self.engines = engines
        self.known = known
        self.max_spec_ttl = max_spec_ttl
        self.outbox = Outbox()
        self.counters = ShareCounters()
        self._spec = _Recall()  # the speculative part of rows taken
        self._bound = _Recall()  # the session part

    def attach(self) -> None:
        """Have every engine report its dispatches, and their withdrawals, to the outbox."""
        for name, engine in self.engines.items():
            engine.on_dispatch = self._listener(name, engine)
            engine.on_withdraw = self.outbox.withdraw

    def _listener(
        self, model: str, engine: RoutingEngine
    ) -> Callable[[RouteRequest, ReplicaKey, list[int], float, float, int], int]:
        record = self.outbox.record

        def on_dispatch(
            request: RouteRequest, replica: ReplicaKey, states: list[int], now: float,
            ttl: float, hint_blocks: int,
        ) -> int:  # fmt: skip
            session_ttl = engine.sessions.ttl_s if engine.sessions is not None else 0.0
            return record(model, request, replica, states, now, ttl, session_ttl, hint_blocks)

        return on_dispatch

    def apply(self, message: object, now: float, age_s: float = 0.0, member: str = "") -> None:
        """Apply the :data:`FIELDS` of ``member``'s message, read at ``now`` and known to be
        at least ``age_s`` old (its rows dated back by it): first its withdrawals (they
        name rows of its earlier messages), then its rows. A malformed field or row is
        counted and skipped (the others still apply)."""
        if not isinstance(message, Mapping):
            self.counters.rejected += 1
            return
        self._spec.expire(now)
        self._bound.expire(now)
        if "w" in message:
            self._withdraw(message["w"], member)
        if "x" not in message:
            return
        rows, ids = message["x"], message.get("i")
        if not isinstance(rows, list) or len(rows) > MAX_ROWS:
            self.counters.rejected += 1
            return
        if ids is not None and (not isinstance(ids, list) or len(ids) != len(rows)):
            self.counters.rejected += 1
            ids = None  # the rows apply, and cannot be withdrawn
        for n, row in enumerate(rows):
            row_id = ids[n] if ids is not None else None
            if type(row_id) is int and (
                (member, row_id) in self._spec or (member, row_id) in self._bound
            ):
                continue  # heard before: its sender resent a message it took for lost
            try:
                took = self._apply_row(row, now, age_s)
            except (ValueError, TypeError, OverflowError):
                self.counters.rejected += 1
                continue
            if took is None or row_id is None:
                continue
            if type(row_id) is not int or not 0 < row_id < _ID_MAX:
                self.counters.rejected += 1
                continue
            engine, got, spec_until, session_until = took
            if got.spec_id:
                part = Dispatch(got.replica, got.spec_id, got.kv, got.states)
                self._spec.add((member, row_id), (engine, part, spec_until))
            if got.hint is not None:
                part = Dispatch(
                    got.replica,
                    hint=got.hint,
                    previous=got.previous,
                    awaited=got.awaited,
                    digest=got.digest,
                )
                self._bound.add((member, row_id), (engine, part, session_until))

    def _withdraw(self, ids: object, member: str) -> None:
        """``member`` withdrew the rows ``ids`` (its replica never took their requests)."""
        if not isinstance(ids, list) or len(ids) > MAX_WITHDRAWN:
            self.counters.rejected += 1
            return
        for row_id in ids:
            if type(row_id) is not int or not 0 < row_id < _ID_MAX:
                self.counters.rejected += 1
                continue
            took = False
            for recall in (self._spec, self._bound):
                got = recall.pop((member, row_id))
                if got is not None:
                    got[0].withdraw(got[1])
                    took = True
            self.counters.withdrawn += took

    def _apply_row(
        self, row: object, now: float, age_s: float
    ) -> tuple[RoutingEngine, Dispatch, float, float] | None:
        """Apply one row; what was taken of it, until when (None: nothing)."""
        if not isinstance(row, list) or len(row) != 10:
            raise ValueError("expected a row of 10 fields")
        model, name, rank, spec_ms, hashes, states, session, blocks, last_hash, session_ms = row
        if not isinstance(model, str) or not isinstance(name, str) or type(rank) is not int:
            raise ValueError("bad model / replica")
        engine = self.engines.get(model)
        key = ReplicaKey(name, rank)
        if engine is None or not self.known(model, key):
            return None
        # made when it was sent, ``age_s`` ago on this reader's clock: its TTLs count from
        # then, and a binding is as recent as then (a reader catching up on a backlog must
        # not let it beat the session's own later turn)
        sent = now - age_s
        spec_s, session_s = _ms(spec_ms) / 1000, _ms(session_ms) / 1000
        kv = _unpack(hashes) if hashes else ()
        st = _unpack(states) if states else ()
        if session and (not isinstance(session, str) or type(blocks) is not int or blocks < 0):
            raise ValueError("bad session binding")
        digest = int(session) if session else 0
        last = int(last_hash) if isinstance(last_hash, str) else -1
        if not 0 <= digest < _U64 or not 0 <= last < _U64:
            raise ValueError("bad session digest / last hash")
        if self.max_spec_ttl is not None:
            spec_s = min(spec_s, self.max_spec_ttl(model))
        else:
            spec_s = min(spec_s, engine.settings.speculative_ttl())
        if sent + spec_s <= now:  # lapsed on its way
            spec_s = 0.0
        if sent + session_s <= now:
            digest = 0
        took = engine.adopt(key, kv, st, sent, spec_s, digest, blocks, last, sent + session_s)
        self.counters.applied_spec += bool(took.spec_id)
        self.counters.applied_sessions += took.hint is not None
        if not took.spec_id and took.hint is None:
            return None
        return engine, took, sent + spec_s, sent + session_s
