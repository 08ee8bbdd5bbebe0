"""Workloads: the requests a simulation replays, and the readers that build them from traces.

A ``Workload`` is a list of ``SimRequest`` values. A request either arrives at a fixed time
(open loop, ``after is None``) or ``delay_s`` after the request ``after`` finished (closed
loop: the next turn of a session starts once the previous answer is back). Every request
carries the canonical block hashes of its prompt at the router block size, computed by
``router.core.hashing.hash_prompt`` exactly as the live router hashes tokens.

Trace formats (JSON lines; unknown extra fields are ignored; a row without its
``timestamp`` is an error naming its line: read as 0 among wall-clock arrivals it would
come decades early; so is one without its ``output_length``: read as 1 it would decode one
token and meet the TPOT target by having no TPOT):

* Mooncake: ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``;
  each hash id names a ``trace_block``-token prefix block (512 in Mooncake's releases).
* Recorded (the router's own format): Mooncake rows plus optional ``session_id``, ``model``
  (a simulation's ``model``, when rows name it, replays that model's rows alone),
  ``n`` (sequences sampled from the prompt: one prefill, ``n`` answers of ``output_length``
  each; default 1), ``stream`` and ``endpoint`` (how the live replay sends the row: default a
  streamed ``completions`` request, as rows recorded before them were replayed) and
  ``delay`` (ms). A row with ``delay`` whose session already had a row is closed-loop:
  it arrives ``delay`` ms after the answer of the session's earlier rows that finished last
  (``timestamp + e2e_ms``, as ``kvrouter trace merge`` measures ``delay``; the last such row
  where ``e2e_ms`` is missing: a worker's own file is in order of completion).
* Alibaba Bailian: ``{"chat_id", "parent_chat_id" (-1 for none), "timestamp" (s),
  "input_length", "output_length", "type", "turn", "hash_ids"}`` over 16-token blocks;
  replayed open loop at its timestamps, sessions follow the parent chain; a ``chat_id`` is
  one request's id, so a second row with it is an error.

Hash ids -> tokens. A trace names blocks, not tokens, so token content is synthesised
deterministically: a trace's ids are renamed densely in order of first appearance (``k`` = 0,
1, 2, ...; the bundled traces' ids already are) and token ``j`` of the block renamed ``k`` is
``(k * trace_block + j) mod 2**32``. Distinct ids get distinct content (up to ``2**32 /
trace_block`` of them) and a shared id gets identical content, so the router's chained hashing
sees exactly the sharing the trace describes (raw ids ``2**32 / trace_block`` apart, or the
fresh ids below, would otherwise share tokens). The partial last block of a
prompt is the first tokens of its block's content. Hashes of the router blocks that end inside
a full trace block depend only on its id (an id names the whole prefix), so they are memoised
per id and a block shared by many requests is hashed once. Blocks beyond a row's ids (rows whose
``input_length`` exceeds ``len(hash_ids) * trace_block``) get fresh ids after every id taken so
far, never shared.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np

from router.core.errors import ConfigError
from router.core.hashing import hash_prompt, root_hash
from router.recorder import CLIENT_CLOSED, parse_row, torn_note

_log = logging.getLogger(__name__)

BUNDLED_DIR = Path(__file__).resolve().parent / "traces"
BUNDLED = {
    "mooncake": BUNDLED_DIR / "mooncake_synthetic_trace.jsonl",
    "mooncake-conversation": BUNDLED_DIR / "mooncake_conversation_prefix.jsonl",
}


@dataclass(slots=True, frozen=True)
class SimRequest:
    """One request of a workload. ``arrival_s`` is the open-loop arrival time; for a
    closed-loop turn (``after`` set) it is ignored and the request arrives ``delay_s`` after
    ``after`` finished. ``output_block_hashes`` name the full blocks the answer completes when
    the workload knows the answer's content (synthetic sessions), else empty."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_hashes: Sequence[int]
    session_id: str | None = None
    after: str | None = None
    delay_s: float = 0.0
    output_block_hashes: Sequence[int] = ()
    # sequences sampled from the prompt (a request's ``n``): one prefill, ``samples``
    # answers of ``output_tokens`` each, decoded on the replica the request went to
    samples: int = 1
    # the API it came through (router/recorder.py ENDPOINTS: chat, completions, responses,
    # messages), which decides whether a disaggregated fleet may split it
    endpoint: str = "completions"
    # the completions batch it is one prompt of: the requests of a batch arrive together
    # with its first (in workload order) and go to one replica, routed by the longest;
    # each decodes the batch's largest output (:func:`batch_outputs`)
    batch: str | None = None
    # its answer is streamed (else its client, and the router, get it whole at its end)
    stream: bool = True


@dataclass(slots=True)
class Workload:
    """Requests plus where they came from; ``block_size``/``model`` are those of the hashes."""

    name: str
    requests: list[SimRequest]
    block_size: int
    model: str
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        """Its engine requests' rows (a completions batch's rows each count):
        :meth:`client_requests` counts what its clients sent."""
        return len(self.requests)

    def client_requests(self) -> int:
        """The requests its clients sent, as the figures count them (``requests``,
        goodput's denominator; sim/metrics.py ``answers``, the live replay's
        ``count_requests``): a completions batch's rows are one (:func:`by_batch`)."""
        return len(by_batch(self.requests, lambda r: r.batch))

    def head(self, n: int) -> Workload:
        """The first ``n`` requests (closed-loop turns whose parent is cut become open)."""
        kept = self.requests[:n]
        ids = {r.request_id for r in kept}
        fixed = [
            r if r.after is None or r.after in ids else replace(r, after=None, delay_s=0.0)
            for r in kept
        ]
        return Workload(self.name, fixed, self.block_size, self.model, dict(self.meta))


class BlockIdHasher:
    """Canonical router-block hashes for prompts named by trace block ids (see module doc)."""

    def __init__(self, block_size: int, trace_block: int, model: str) -> None:
        if block_size <= 0 or trace_block <= 0:
            raise ConfigError("block sizes must be positive")
        self.block_size = block_size
        self.trace_block = trace_block
        self.root = root_hash(model)
        self._memo: dict[int, list[int]] = {}
        self._offsets = np.arange(trace_block, dtype="<u4")
        self.hashed_tokens = 0

    def _tokens(self, ids: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Tokens ``lo:hi`` of the prompt: the trace blocks covering them, built in one
        broadcast (uint32 arithmetic wraps, i.e. ``(k * trace_block + j) mod 2**32``), then
        cut to the range."""
        tb = self.trace_block
        first = lo // tb
        ids32 = ids[first : -(-hi // tb)].astype("<u4")
        full = (ids32[:, None] * np.uint32(tb) + self._offsets).reshape(-1)
        return full[lo - first * tb : hi - first * tb]

    def hashes(self, ids: Sequence[int], prompt_tokens: int) -> list[int]:
        """Hashes of the full router blocks of a prompt of ``prompt_tokens`` tokens.

        Runs of trace blocks not seen before are hashed in one ``hash_prompt`` call, then
        split per id into the memo."""
        tb, bs = self.trace_block, self.block_size
        memo = self._memo
        n = min(len(ids), -(-prompt_tokens // tb))
        # The memoised leading run (most of a prompt in a trace with shared prefixes) in one
        # C-level pass; the loop below takes over at the first id to hash.
        known = list(map(memo.get, ids[: min(n, prompt_tokens // tb)]))
        i = known.index(None) if None in known else len(known)
        out: list[int] = list(chain.from_iterable(cast(list[list[int]], known[:i])))
        arr: np.ndarray | None = None
        while i < n:
            if (i + 1) * tb <= prompt_tokens:
                cached = memo.get(ids[i])
                if cached is not None:
                    out.extend(cached)
                    i += 1
                    continue
            j = i + 1
            while j < n and not ((j + 1) * tb <= prompt_tokens and ids[j] in memo):
                j += 1
            base = len(out)
            lo = base * bs
            hi = (min(j * tb, prompt_tokens) // bs) * bs
            new: list[int] = []
            if hi > lo:
                if arr is None:
                    arr = np.asarray(ids, dtype=np.int64)
                parent = out[-1] if out else None
                new = hash_prompt(self._tokens(arr, lo, hi), bs, self.root, parent=parent).hashes
                self.hashed_tokens += hi - lo
            for idx in range(i, j):
                if (idx + 1) * tb <= prompt_tokens:
                    memo[ids[idx]] = new[(idx * tb) // bs - base : ((idx + 1) * tb) // bs - base]
            out.extend(new)
            i = j
        return out


# ---------------------------------------------------------------------------- readers


class DenseIds:
    """A trace's block ids renamed ``0, 1, 2, ...`` in order of first appearance, and fresh
    ids for the blocks a row's ids do not cover, taken from the same sequence: no two get the
    same token content (module doc)."""

    __slots__ = ("_next", "_of")

    def __init__(self) -> None:
        self._of: dict[int, int] = {}
        self._next = 0

    def prompt(self, ids: Sequence[int], prompt_tokens: int, trace_block: int) -> list[int]:
        """The renamed ids of a prompt of ``prompt_tokens`` tokens, fresh ones appended where
        ``ids`` fall short of it."""
        out: list[int] = []
        of = self._of
        for raw in ids:
            k = of.get(raw)
            if k is None:
                k = of[raw] = self._next
                self._next += 1
            out.append(k)
        missing = -(-prompt_tokens // trace_block) - len(out)
        if missing > 0:
            out.extend(range(self._next, self._next + missing))
            self._next += missing
        return out


def _rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """A trace's rows by line number; a torn recorded row (router.recorder.parse_row) is
    skipped, with a warning once the file is read."""
    torn: list[int] = []
    with path.open("rb") as fh:  # decoded line by line, so a bad byte names its line
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise ConfigError(f"{path}:{lineno}: not UTF-8") from None
            if not line:
                continue
            try:
                row = parse_row(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: not JSON: {exc.msg}") from None
            if row is None:
                torn.append(lineno)
                continue
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{lineno}: expected a JSON object")
            yield lineno, row
    if torn:
        _log.warning("%s", torn_note(path, torn))


def _number(row: dict[str, Any], key: str, where: str, default: float | None = None) -> float:
    """``row[key]`` as a finite non-negative number (JSON's NaN and Infinity are not)."""
    value = row.get(key, default)
    if value is None:
        raise ConfigError(f"{where}: missing {key!r}")
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ConfigError(f"{where}: {key!r} must be a finite non-negative number, got {value!r}")
    return value


def _int(row: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    """``row[key]`` as a non-negative whole number (one written as a float, ``700.0``, is
    that number; a fraction is an error, never cut down)."""
    value = _number(row, key, where, default)
    if value != int(value):
        raise ConfigError(f"{where}: {key!r} must be a whole number, got {value!r}")
    return int(value)


def resolve_trace(trace: str) -> Path:
    """``mooncake`` means the bundled trace; anything else is a path."""
    path = BUNDLED.get(trace, Path(trace))
    if not path.is_file():
        raise ConfigError(f"trace {trace!r} not found (use a path or: {', '.join(BUNDLED)})")
    return path


def sniff_format(path: Path) -> str:
    """``bailian`` if the first row has ``chat_id``, else ``mooncake`` (covers recorded)."""
    for _, row in _rows(path):
        return "bailian" if "chat_id" in row else "mooncake"
    raise ConfigError(f"{path}: empty trace")


@dataclass(slots=True, frozen=True)
class TraceRow:
    """One request of a Mooncake / recorded trace before hashing, as both replays (the
    simulator's and the live one, router/demo/replay.py) take it: its prompt as dense trace
    block ids (module doc), its open-loop arrival from 0, and for a closed-loop turn the
    index of the request it follows (in the list :func:`mooncake_rows` returns) and the
    delay after that request's answer."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_ids: list[int]
    session_id: str | None = None
    after: int | None = None
    delay_s: float = 0.0
    samples: int = 1
    stream: bool = True
    endpoint: str = "completions"
    # the completions batch the row's prompt came in (router/recorder.py), None: alone
    batch: str | None = None


ENDPOINTS = ("completions", "chat", "responses", "messages")
# ms a recorded ``delay`` may differ from its arrival less the finish it was measured from
# (``timestamp + e2e_ms``): each is rounded where it is written
DELAY_ROUNDING_MS = 2.0

_T = TypeVar("_T")


def by_batch(items: Iterable[_T], batch_of: Callable[[_T], str | None]) -> list[list[_T]]:
    """``items`` (in arrival order) as the requests they make, in order of their first
    item: an item alone, or the items of one completions batch (``batch_of`` the same id),
    which arrived together with the first of them. The live replay sends each group as one
    request (router/demo/replay.py) and the simulator's figures judge it as one
    (sim/metrics.py ``answers``)."""
    out: list[list[_T]] = []
    batches: dict[str, list[_T]] = {}
    for item in items:
        batch = batch_of(item)
        if batch is None:
            out.append([item])
        elif (group := batches.get(batch)) is not None:
            group.append(item)
        else:
            batches[batch] = group = [item]
            out.append(group)
    return out


def _manner(row: dict[str, Any], where: str) -> tuple[int, bool, str, str | None]:
    """A row's ``n`` (>= 1), ``stream``, ``endpoint`` and ``batch`` (defaults: 1, a stream,
    completions, none)."""
    samples = row.get("n", 1)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ConfigError(f"{where}: 'n' must be a positive integer, got {samples!r}")
    stream = row.get("stream", True)
    if not isinstance(stream, bool):
        raise ConfigError(f"{where}: 'stream' must be true or false, got {stream!r}")
    endpoint = row.get("endpoint", "completions")
    if endpoint not in ENDPOINTS:
        raise ConfigError(f"{where}: 'endpoint' must be one of {', '.join(ENDPOINTS)}")
    batch = row.get("batch")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, str | int)):
        raise ConfigError(f"{where}: 'batch' must be a string, got {batch!r}")
    if batch is not None and endpoint != "completions":
        # the simulator would run such rows as one batch, the live replay as requests apart
        raise ConfigError(f"{where}: 'batch' is for completions rows, not {endpoint}")
    return samples, stream, str(endpoint), None if batch is None else str(batch)


def mooncake_rows(
    path: Path, *, trace_block: int = 512, limit: int | None = None, model: str | None = None
) -> list[TraceRow]:
    """The requests of a Mooncake JSONL trace, including the router's recorded rows
    (``session_id``, ``delay``), in arrival order: a recording holds its rows in order of
    completion. A closed-loop turn (a ``delay`` row of a session already seen) follows the
    session's earlier request that finished last (``timestamp + e2e_ms``; where finishes are
    unknown, the last row, as a worker's file is in order of completion) and sorts at its own
    timestamp, never before that request (a synthetic trace's turns carry their session's
    start). ``limit``: the first ``limit`` of that order (a kept turn's request is kept).
    Timestamps are ms; arrivals start at the first one. Block ids are renamed densely in
    arrival order. A completions batch's kept rows each decode the largest output among
    them (:func:`batch_outputs`). ``model``: when rows name it (a recording's ``model``),
    its rows alone (:func:`_of_model`)."""
    raw: list[tuple[float, int, int, list[int], str | None, int | None, float]] = []
    manners: list[tuple[int, bool, str, str | None]] = []
    last_of_session: dict[str, tuple[int, float | None]] = {}  # (row, finish ms)
    for lineno, row in _of_model(path, _offered_rows(path), model):
        where = f"{path}:{lineno}"
        ts = _number(row, "timestamp", where) / 1000.0
        n_in = _int(row, "input_length", where)
        n_out = _int(row, "output_length", where)
        ids = row.get("hash_ids", [])
        if not isinstance(ids, list) or not set(map(type, ids)) <= {int}:
            raise ConfigError(f"{where}: 'hash_ids' must be a list of integers")
        if n_in <= 0:
            raise ConfigError(f"{where}: 'input_length' must be positive")
        index = len(raw)
        session = row.get("session_id")
        session = None if session is None else str(session)
        after = None
        delay = 0.0
        if session is not None and "delay" in row and session in last_of_session:
            after, tied = last_of_session[session]
            delay = _number(row, "delay", where) / 1000.0
            if tied is not None and tied > (ts - delay) * 1000.0 + DELAY_ROUNDING_MS:
                # workers sharing a file: this row's worker measured ``delay`` from the
                # last answer it served itself, and another worker's came later (the one
                # tied to): the turn follows that answer, or came before it (open loop)
                if ts * 1000.0 >= tied:
                    delay = (ts * 1000.0 - tied) / 1000.0
                else:
                    after, delay = None, 0.0
        if session is not None:
            e2e = row.get("e2e_ms")
            finish: float | None = None
            if isinstance(e2e, int | float) and not isinstance(e2e, bool) and 0 <= e2e < math.inf:
                finish = ts * 1000.0 + e2e
            held = last_of_session.get(session)
            # the session's answer that finished last (file order where finishes are unknown)
            if held is None or finish is None or held[1] is None or finish >= held[1]:
                last_of_session[session] = (index, finish)
        raw.append((ts, n_in, max(n_out, 1), ids, session, after, delay))
        manners.append(_manner(row, where))
    # a turn sorts at its own arrival, never before its previous request (ties: file order,
    # which puts that request first)
    key: list[float] = []
    for ts, _, _, _, _, after, _ in raw:
        key.append(ts if after is None else max(ts, key[after]))
    order = sorted(range(len(raw)), key=key.__getitem__)
    if limit is not None:
        order = order[:limit]
    position = {k: i for i, k in enumerate(order)}
    start = raw[order[0]][0] if order else 0.0
    dense = DenseIds()
    out: list[TraceRow] = []
    for k in order:
        ts, n_in, n_out, ids, session, after, delay = raw[k]
        out.append(
            TraceRow(
                ts - start,
                n_in,
                n_out,
                # Recorded ids are 53-bit keyed hashes (router/recorder.py): renamed densely,
                # so block contents (built from ids mod 2**32) stay distinct.
                dense.prompt(ids, n_in, trace_block),
                session,
                None if after is None else position[after],
                delay,
                *manners[k],
            )
        )
    return batch_outputs(out)


def offered(row: Mapping[str, Any]) -> bool:
    """Whether a replay offers a recorded ``row`` again: every one but a request its replica
    refused as the client's error (a 4xx ``status`` other than 408 / 429 / 499: a request
    the engine found wrong, as one the router refused itself before routing, which is no
    row; offered again it would run as a request that never ran). A shed (429), a request
    its client left before its answer (499, router.recorder ``CLIENT_CLOSED``), one no
    replica answered (5xx) and one without a status are offered load."""
    status = row.get("status")
    return not (
        type(status) is int and 400 <= status < 500 and status not in (408, 429, CLIENT_CLOSED)
    )


def _offered_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """The rows of ``path`` a replay offers (:func:`offered`), with a warning naming the
    lines of those it skips."""
    rows: list[tuple[int, dict[str, Any]]] = []
    skipped: list[tuple[int, dict[str, Any]]] = []
    for lineno, row in _rows(path):
        (rows if offered(row) else skipped).append((lineno, row))
    if skipped:
        lines = ", ".join(str(n) for n, _ in skipped[:10]) + (", ..." if len(skipped) > 10 else "")
        _log.warning(
            "%s: %d rows skipped (lines %s): a replica refused them as the client's error "
            "(a 4xx status but 408 / 429 / 499), so a replay does not offer them again",
            path,
            len(skipped),
            lines,
        )
    return rows


def _of_model(
    path: Path, rows: list[tuple[int, dict[str, Any]]], model: str | None
) -> list[tuple[int, dict[str, Any]]]:
    """The rows of ``model`` when some row names it (a pod serving several models records
    them all in one trace, each row naming its ``model``; each runs on a fleet of its own);
    else all of them, with a warning when they name more than one model (replayed as one,
    on one fleet)."""
    models = {str(row["model"]) for _, row in rows if row.get("model") is not None}
    if model is not None and model in models:
        return [(n, row) for n, row in rows if str(row.get("model")) == model]
    if len(models) > 1:
        _log.warning(
            "%s: rows of %d models (%s) replayed as one, on one fleet; --model NAME "
            "replays one of them",
            path,
            len(models),
            ", ".join(sorted(models)),
        )
    return rows


def batch_outputs(rows: list[TraceRow]) -> list[TraceRow]:
    """``rows`` with every row of a completions batch decoding the batch's largest output.
    The batch is one request with one ``max_tokens`` (the live replay sends it so,
    router/demo/replay.py, and the API has no other way): each of its prompts decodes up to
    the largest row's output, not its own, and the simulator models what that request does.
    The one place of the rule for both replays. A recording's rows of a batch all carry one
    sequence's share of its usage (router/recorder.py): it changes nothing there."""
    out = list(rows)
    for group in by_batch(range(len(rows)), lambda i: rows[i].batch):
        if len(group) > 1:
            top = max(rows[i].output_tokens for i in group)
            for i in group:
                if rows[i].output_tokens != top:
                    out[i] = replace(rows[i], output_tokens=top)
    return out


def read_mooncake(
    path: Path,
    *,
    block_size: int,
    trace_block: int = 512,
    model: str = "sim-model",
    limit: int | None = None,
) -> Workload:
    """Mooncake JSONL, including the router's recorded rows (:func:`mooncake_rows`)."""
    hasher = BlockIdHasher(block_size, trace_block, model)
    requests = [
        SimRequest(
            f"r{i}",
            r.arrival_s,
            r.prompt_tokens,
            r.output_tokens,
            hasher.hashes(r.block_ids, r.prompt_tokens),
            r.session_id,
            None if r.after is None else f"r{r.after}",
            r.delay_s,
            samples=r.samples,
            endpoint=r.endpoint,
            batch=r.batch,
            stream=r.stream,
        )
        for i, r in enumerate(
            mooncake_rows(path, trace_block=trace_block, limit=limit, model=model)
        )
    ]
    meta = {"format": "mooncake", "path": str(path), "trace_block": trace_block}
    meta["hashed_tokens"] = hasher.hashed_tokens
    return Workload(path.stem, requests, block_size, model, meta)


def read_bailian(
    path: Path,
    *,
    block_size: int,
    trace_block: int = 16,
    model: str = "sim-model",
    limit: int | None = None,
) -> Workload:
    """Alibaba Bailian JSONL (open loop at its timestamps, sessions via parent_chat_id)."""
    hasher = BlockIdHasher(block_size, trace_block, model)
    rows: list[tuple[float, str, dict[str, Any], str]] = []
    parent_of: dict[str, str] = {}
    line_of: dict[str, int] = {}  # a chat id is its request's id: one row each
    for lineno, row in _rows(path):
        where = f"{path}:{lineno}"
        if "chat_id" not in row:
            raise ConfigError(f"{where}: missing 'chat_id'")
        chat = str(row["chat_id"])
        if chat in line_of:
            raise ConfigError(f"{where}: chat_id {chat} already on line {line_of[chat]}")
        line_of[chat] = lineno
        parent = row.get("parent_chat_id", -1)
        if parent not in (-1, None, "-1", ""):
            parent_of[chat] = str(parent)
        ts = float(_number(row, "timestamp", where))
        rows.append((ts, chat, row, where))
    rows.sort(key=lambda r: r[0])
    if limit is not None:  # the first arrivals, not the first lines
        rows = rows[:limit]
    t0 = rows[0][0] if rows else 0.0
    # a session is its chain's root, once every row is read (a file need not list a parent
    # first); a parent not in the trace (cut by ``limit``) is the root
    root_of: dict[str, str] = {}
    for chat in line_of:
        chain = [chat]
        while chain[-1] in parent_of and chain[-1] not in root_of and len(chain) <= len(line_of):
            chain.append(parent_of[chain[-1]])
        root = root_of.get(chain[-1], chain[-1])
        root_of.update(dict.fromkeys(chain, root))
    dense = DenseIds()  # raw ids 2**28 apart would share tokens at 16-token blocks
    requests: list[SimRequest] = []
    for ts, chat, row, where in rows:
        n_in = _int(row, "input_length", where)
        n_out = _int(row, "output_length", where)
        if n_in <= 0:
            raise ConfigError(f"{where}: 'input_length' must be positive")
        ids = row.get("hash_ids", [])
        if not isinstance(ids, list) or not set(map(type, ids)) <= {int}:
            raise ConfigError(f"{where}: 'hash_ids' must be a list of integers")
        ids = dense.prompt(ids, n_in, trace_block)
        requests.append(
            SimRequest(
                f"c{chat}",
                ts - t0,
                n_in,
                max(n_out, 1),
                hasher.hashes(ids, n_in),
                root_of.get(chat, chat),
            )
        )
    meta = {"format": "bailian", "path": str(path), "trace_block": trace_block}
    return Workload(path.stem, requests, block_size, model, meta)


def check_limit(limit: int | None, name: str = "the request limit") -> None:
    """A request limit is None (all) or at least 1: 0 or less named no workload anyone
    meant (a reader kept one request, ``Workload.head`` all or all but the last few)."""
    if limit is not None and limit < 1:
        raise ConfigError(f"{name} must be at least 1, got {limit}")


def load_trace(
    trace: str,
    *,
    block_size: int,
    fmt: str = "auto",
    trace_block: int | None = None,
    model: str = "sim-model",
    limit: int | None = None,
) -> Workload:
    """Read ``trace`` (a path or ``mooncake``) in format ``auto|mooncake|recorded|bailian``."""
    check_limit(limit)
    path = resolve_trace(trace)
    kind = sniff_format(path) if fmt == "auto" else fmt
    if kind in ("mooncake", "recorded"):
        return read_mooncake(
            path,
            block_size=block_size,
            trace_block=512 if trace_block is None else trace_block,
            model=model,
            limit=limit,
        )
    if kind == "bailian":
        return read_bailian(
            path,
            block_size=block_size,
            trace_block=16 if trace_block is None else trace_block,
            model=model,
            limit=limit,
        )
    raise ConfigError(f"unknown trace format {fmt!r} (auto, mooncake, recorded, bailian)")


def scale_arrivals(requests: Iterable[SimRequest], speedup: float) -> list[SimRequest]:
    """Arrival times and closed-loop delays divided by ``speedup``."""
    if speedup <= 0:
        raise ConfigError("speedup must be positive")
    if speedup == 1.0:
        return list(requests)
    return [
        replace(r, arrival_s=r.arrival_s / speedup, delay_s=r.delay_s / speedup) for r in requests
    ]
