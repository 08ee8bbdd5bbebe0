"""Record live traffic as a Mooncake-compatible JSONL trace that ``kvrouter sim replay`` reads.

One row per completed request, written when it completes:

    {"timestamp": ms since the recording started (arrival time), "input_length": n,
     "output_length": m, "hash_ids": [...], "model": "...", "session_id": "..."}

``hash_ids`` name 512-token prefix blocks (the last one may be partial) and are remapped to
dense integers in order of first appearance, as in Mooncake's traces. Never text, never token
ids: the canonical hashes themselves are not written either (they would let a reader confirm
a guessed prompt). Rows are in completion order; readers sort by ``timestamp``.

With a session id, a request that arrived after its session's previous request finished also
gets ``delay`` (ms since that finish), so the simulator replays the session closed loop, as
agents behave: a slower fleet delays the next turn.

Files rotate at ``max_bytes``: ``trace.jsonl`` is the live file, ``trace.jsonl.1`` the newest
full one, up to ``backups`` of them. The dense-id map is shared across rotations so ids stay
consistent; it is bounded (``max_ids``) and, when full, restarts numbering after the largest id
given so far (old prefixes then get new ids: a replay sees them as misses, never as false hits).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from router.core.hashing import coarsen_chain

TRACE_BLOCK_TOKENS = 512
MAX_SESSIONS = 1_000_000  # sessions whose last finish time is kept for ``delay``


@dataclass(slots=True, frozen=True)
class RecordSettings:
    path: pathlib.Path
    max_bytes: int = 256 * 2**20
    backups: int = 5
    max_ids: int = 20_000_000


class TraceRecorder:
    """Append-only, rotating trace writer. Not thread-safe; the event loop owns it."""

    def __init__(self, settings: RecordSettings, started_at: float) -> None:
        self.settings = settings
        self.started_at = started_at
        self.rows = 0
        self._ids: dict[int, int] = {}
        self._last_finish: OrderedDict[str, float] = OrderedDict()
        self._next_id = 0
        settings.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: IO[str] = open(settings.path, "a", encoding="utf-8")  # noqa: SIM115
        self._size = self._fh.tell()

    def _dense(self, hashes: list[int]) -> list[int]:
        ids = self._ids
        if len(ids) + len(hashes) > self.settings.max_ids:
            ids.clear()
        out = []
        for h in hashes:
            dense = ids.get(h)
            if dense is None:
                dense = ids[h] = self._next_id
                self._next_id += 1
            out.append(dense)
        return out

    def record(
        self,
        *,
        arrived_at: float,
        model: str,
        input_length: int,
        output_length: int,
        block_hashes: Sequence[int],
        block_size: int,
        session_id: str | None = None,
        finished_at: float | None = None,
    ) -> None:
        """Append one request. ``block_hashes`` is its canonical chain at ``block_size``; when
        that size does not divide 512 the row gets no ``hash_ids`` (lengths only)."""
        row: dict[str, object] = {
            "timestamp": max(0, round((arrived_at - self.started_at) * 1000)),
            "input_length": input_length,
            "output_length": output_length,
        }
        if TRACE_BLOCK_TOKENS % block_size == 0:
            coarse = coarsen_chain(block_hashes, block_size, input_length, TRACE_BLOCK_TOKENS)
            row["hash_ids"] = self._dense(coarse)
        else:
            row["hash_ids"] = []
        row["model"] = model
        if session_id:
            row["session_id"] = session_id
            previous = self._last_finish.pop(session_id, None)
            if previous is not None and arrived_at >= previous:
                row["delay"] = round((arrived_at - previous) * 1000)
            self._last_finish[session_id] = arrived_at if finished_at is None else finished_at
            if len(self._last_finish) > MAX_SESSIONS:
                self._last_finish.popitem(last=False)
        line = json.dumps(row, separators=(",", ":")) + "\n"
        if self._size + len(line) > self.settings.max_bytes and self._size > 0:
            self._rotate()
        self._fh.write(line)
        self._size += len(line.encode("utf-8"))
        self.rows += 1

    def flush(self) -> None:
        self._fh.flush()

    def _rotate(self) -> None:
        self._fh.close()
        path = self.settings.path
        # trace.jsonl.(k-1) -> trace.jsonl.k, oldest first; the one past `backups` is dropped.
        for i in range(self.settings.backups, 0, -1):
            src = path.with_name(f"{path.name}.{i - 1}") if i > 1 else path
            if src.exists():
                os.replace(src, path.with_name(f"{path.name}.{i}"))
        self._fh = open(path, "w", encoding="utf-8")  # noqa: SIM115
        self._size = 0

    def close(self) -> None:
        self._fh.close()
