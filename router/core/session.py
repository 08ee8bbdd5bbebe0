"""Session affinity as a soft signal: where a session's last request went.

Multi-turn and agentic clients resend the whole conversation each turn, so a session's next
prompt extends its previous one. The replica that served the previous turn holds that prefix,
but the router learns it only when the engine's KV events arrive (and never, in approximate
mode without speculative entries). :class:`SessionTable` remembers, per session id, the
replica of its last request and that request's prompt chain (its length and last block hash:
canonical hashes name the whole prefix, so one comparison tells whether the new prompt
extends it). The routing step then credits that replica with the previous prompt as a cached
prefix when the index shows less; the policy still weighs it against load, so a busy or
failed replica loses the session like any other: a hint, never a pin.

Bounded: at most ``max_sessions`` entries (least recently used dropped first), each expiring
``ttl_s`` after the session's last request. Pure: the caller passes ``now``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from router.core.types import ReplicaKey


class SessionHint(NamedTuple):
    """The session's previous request: sent to ``replica`` at ``at`` with ``blocks`` full
    prompt blocks, the last of them hashed ``last_hash``."""

    replica: ReplicaKey
    blocks: int
    last_hash: int
    at: float

    def covers(self, block_hashes: Sequence[int]) -> int:
        """Blocks of ``block_hashes`` the previous prompt is known to share: all of its own
        when the new prompt extends it, else 0 (the conversation was edited)."""
        n = self.blocks
        if 0 < n <= len(block_hashes) and block_hashes[n - 1] == self.last_hash:
            return n
        return 0


class SessionTable:
    """Session id -> :class:`SessionHint` of its last request (see the module doc)."""

    __slots__ = ("_entries", "max_sessions", "ttl_s")

    def __init__(self, ttl_s: float, max_sessions: int = 100_000) -> None:
        if ttl_s < 0 or max_sessions < 1:
            raise ValueError("a session table needs ttl_s >= 0 and max_sessions >= 1")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._entries: OrderedDict[str, SessionHint] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str, now: float) -> SessionHint | None:
        """The session's last request, unless it is older than ``ttl_s``."""
        hint = self._entries.get(session_id)
        if hint is None:
            return None
        if now - hint.at > self.ttl_s:
            del self._entries[session_id]
            return None
        return hint

    def record(
        self, session_id: str, replica: ReplicaKey, block_hashes: Sequence[int], now: float
    ) -> None:
        """The session's request with prompt chain ``block_hashes`` went to ``replica``."""
        entries = self._entries
        n = len(block_hashes)
        entries[session_id] = SessionHint(replica, n, block_hashes[n - 1] if n else 0, now)
        entries.move_to_end(session_id)
        while len(entries) > self.max_sessions:
            entries.popitem(last=False)

    def forget(self, replica: ReplicaKey) -> None:
        """Drop every session bound to ``replica`` (it left the fleet)."""
        for sid in [s for s, h in self._entries.items() if h.replica == replica]:
            del self._entries[sid]
