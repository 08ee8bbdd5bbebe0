"""Session affinity as a soft signal: where a session's last request went.

Multi-turn and agentic clients resend the whole conversation each turn, so a session's next
prompt extends its previous one. The replica that served the previous turn holds that prefix,
but the router learns it only when the engine's KV events arrive (and never, in approximate
mode without speculative entries). :class:`SessionTable` remembers, per session id, the
replica of its last request and that request's prompt chain (its length and last block hash:
canonical hashes name the whole prefix, so one comparison tells whether the new prompt
extends it). The routing step then credits that replica with the previous prompt as a cached
prefix when the index shows less (and still describes the cache the hint was made on:
``PrefixIndex.cache_epoch``); the policy still weighs it against load, so a busy or
failed replica loses the session like any other: a hint, never a pin.

A hint covers the engine's event lag, nothing more: for a prompt hashed as the engines hash
it, the credit ends when the replica's events report the prompt's last block stored
(``PrefixIndex.await_store``), and from then on the index alone says what is cached there,
the blocks the engine has evicted since included. Only approximate prompts, which no event
names, are credited for the hint's whole life.

Bounded: at most ``max_sessions`` entries (least recently used dropped first), each expiring
``ttl_s`` after the session's last request. Pure: the caller passes ``now``.

Bindings made by *other* router pods (router/service/pod_share.py) arrive keyed by
:func:`session_digest` (session ids never leave the pod) with their sender's expiry; they are
kept apart (:meth:`SessionTable.learn`, as bounded) and :meth:`SessionTable.get` returns the
more recent of the session's own and learned binding. A binding its sender took back (the
replica refused the request) is taken back here too (:meth:`SessionTable.unlearn`), as the
pod's own are (:meth:`SessionTable.undo`).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import MutableMapping, Sequence
from typing import NamedTuple, TypeVar

from router.core.types import ReplicaKey


class SessionHint(NamedTuple):
    """The session's previous request: sent to ``replica`` at ``at`` with ``blocks`` full
    prompt blocks, the last of them hashed ``last_hash``, while the replica's cache was the
    one the prefix index numbers ``epoch`` (``PrefixIndex.cache_epoch``: a hint credits no
    other). ``settles``: the engine's events will name that last block (the prompt was
    hashed as the engines hash it), and once they have the hint credits nothing more
    (``PrefixIndex.await_store``). ``until``: when a binding learned from another pod
    lapses (the pod's own lapse ``ttl_s`` after ``at``)."""

    replica: ReplicaKey
    blocks: int
    last_hash: int
    at: float
    epoch: int = 0
    settles: bool = False
    until: float = math.inf

    def covers(self, block_hashes: Sequence[int]) -> int:
        """Blocks of ``block_hashes`` the previous prompt is known to share: all of its own
        when the new prompt extends it, else 0 (the conversation was edited)."""
        n = self.blocks
        if 0 < n <= len(block_hashes) and block_hashes[n - 1] == self.last_hash:
            return n
        return 0


def session_digest(session_id: str) -> int:
    """A session id as pods share it: a 64-bit keyed digest (the id itself is not recoverable).
    Any ``str`` a body's JSON can give, lone surrogate escapes included (``surrogatepass``,
    as router/service/request_identity.py ``session_key`` digests long ids)."""
    raw = session_id.encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(raw, digest_size=8, key=b"kvrouter-session")
    return int.from_bytes(digest.digest(), "little")


class SessionTable:
    """Session id -> :class:`SessionHint` of its last request (see the module doc)."""

    __slots__ = ("_entries", "_learned", "_unlearned", "_withdrawn", "max_sessions", "ttl_s")

    def __init__(self, ttl_s: float, max_sessions: int = 100_000) -> None:
        if ttl_s < 0 or max_sessions < 1:
            raise ValueError("a session table needs ttl_s >= 0 and max_sessions >= 1")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._entries: OrderedDict[str, SessionHint] = OrderedDict()
        # session digest -> the hint learned from another pod (lapsing at its ``until``)
        self._learned: OrderedDict[int, SessionHint] = OrderedDict()
        # hints taken back (undo, unlearn) while a later request's was the session's -> the
        # hint to give back in their place; bounded as the sessions are
        self._withdrawn: OrderedDict[SessionHint, SessionHint | None] = OrderedDict()
        self._unlearned: OrderedDict[SessionHint, SessionHint | None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str, now: float) -> SessionHint | None:
        """The session's last request, unless it is older than ``ttl_s`` (or, learned
        from another pod, past its sender's expiry); the more recent of the two."""
        hint = self._entries.get(session_id)
        if hint is not None and now - hint.at > self.ttl_s:
            del self._entries[session_id]
            hint = None
        if self._learned:
            digest = session_digest(session_id)
            got = self._learned.get(digest)
            if got is not None:
                if now >= got.until:
                    del self._learned[digest]
                elif hint is None or got.at > hint.at:
                    return got
        return hint

    def learn(
        self,
        digest: int,
        replica: ReplicaKey,
        blocks: int,
        last_hash: int,
        now: float,
        expires_at: float,
        epoch: int = 0,
        settles: bool = False,
    ) -> tuple[SessionHint | None, SessionHint | None]:
        """Another pod sent the session (by :func:`session_digest`) to ``replica`` (its
        prompt: ``blocks`` full blocks, the last hashed ``last_hash``), seen at ``now`` while
        the replica's cache was ``epoch``; the binding lapses at ``expires_at`` (never later
        than ``now + ttl_s``). ``settles``: see :class:`SessionHint`. Returns the binding
        learned (None: it had lapsed) and the learned one it replaced, for :meth:`unlearn`."""
        learned = self._learned
        expires_at = min(expires_at, now + self.ttl_s)
        if expires_at <= now:
            return None, None
        previous = learned.get(digest)
        hint = learned[digest] = SessionHint(
            replica, blocks, last_hash, now, epoch, settles, expires_at
        )
        learned.move_to_end(digest)
        while len(learned) > self.max_sessions:
            learned.popitem(last=False)
        return hint, previous

    def record(
        self,
        session_id: str,
        replica: ReplicaKey,
        block_hashes: Sequence[int],
        now: float,
        epoch: int = 0,
        settles: bool = False,
    ) -> tuple[SessionHint, SessionHint | None]:
        """The session's request with prompt chain ``block_hashes`` went to ``replica``,
        whose cache was ``epoch``. ``settles``: see :class:`SessionHint`. Returns the hint
        recorded and the session's own one it replaced (None: none), for :meth:`undo`."""
        entries = self._entries
        n = len(block_hashes)
        last = block_hashes[n - 1] if n else 0
        previous = entries.get(session_id)
        hint = entries[session_id] = SessionHint(replica, n, last, now, epoch, settles)
        entries.move_to_end(session_id)
        while len(entries) > self.max_sessions:
            entries.popitem(last=False)
        return hint, previous

    def undo(self, session_id: str, hint: SessionHint, previous: SessionHint | None) -> None:
        """Take back :meth:`record`'s ``hint`` (the request never reached its replica's
        cache): the session's hint is ``previous`` again (None: none) if ``hint`` is still
        the one it has; a later request's stays, and should it be taken back too, the
        session gets ``previous`` back, not ``hint``. So is a ``previous`` taken back
        before: the hint of the last request not taken back comes back."""
        _take_back(self._entries, self._withdrawn, session_id, hint, previous, self.max_sessions)

    def unlearn(self, digest: int, hint: SessionHint, previous: SessionHint | None) -> None:
        """Take back :meth:`learn`'s ``hint`` (its sender withdrew the dispatch), as
        :meth:`undo` does the pod's own: the learned binding it replaced (``previous``)
        comes back if ``hint`` is still the session's, a later one stays."""
        _take_back(self._learned, self._unlearned, digest, hint, previous, self.max_sessions)

    def forget(self, replica: ReplicaKey) -> None:
        """Drop every session bound to ``replica`` (it left the fleet)."""
        for sid in [s for s, h in self._entries.items() if h.replica == replica]:
            del self._entries[sid]
        for digest in [d for d, h in self._learned.items() if h.replica == replica]:
            del self._learned[digest]


_K = TypeVar("_K")


def _take_back(
    table: MutableMapping[_K, SessionHint],
    withdrawn: OrderedDict[SessionHint, SessionHint | None],
    key: _K,
    hint: SessionHint,
    previous: SessionHint | None,
    bound: int,
) -> None:
    """:meth:`SessionTable.undo` on ``table`` (keyed by session id or digest), the hints
    taken back while a later one was the key's remembered in ``withdrawn`` (at most
    ``bound``)."""
    while previous is not None and previous in withdrawn:
        previous = withdrawn[previous]
    if table.get(key) is not hint:
        # the request recorded after ``hint`` has it as its previous hint
        withdrawn[hint] = previous
        withdrawn.move_to_end(hint)
        while len(withdrawn) > bound:
            withdrawn.popitem(last=False)
        return
    if previous is None:
        del table[key]
    else:
        table[key] = previous
