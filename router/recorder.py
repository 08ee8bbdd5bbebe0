"""Record live traffic as a Mooncake-compatible JSONL trace that ``kvrouter sim replay`` reads.

One row per prompt of a completed request (a completions batch: one row per prompt, all at
the batch's arrival), written when it completes:

    {"timestamp": arrival, ms since the Unix epoch (wall clock), "input_length": n,
     "output_length": m, "hash_ids": [...], "model": "...", "key_id": "k-...",
     "router_block": b, "n": k,
     "stream": true, "endpoint": "chat", "batch": "...", "session_id": "...", "replica": "name/dp",
     "pred_hit": t, "cached": t, "ttft_ms": x, "e2e_ms": y}

``output_length`` is one sequence's (the usage sums every sequence of every prompt: it is
shared out over them). ``n`` (only when > 1) is the sequences sampled from the prompt: the
engine prefills it once and decodes ``n`` answers, which the simulator models from this
field (n rows would be n requests, routed and prefilled apart). A batch's prompts are
independent requests to the engine, each with its own prefix blocks, hence a row each; they
share ``batch`` (only on a batch's rows), an id naming that batch alone in any merged trace
(:meth:`TraceRecorder.next_batch`): the router sent the batch to one replica, chosen by its
longest prompt, and the simulator routes the rows so, together.
``stream`` and ``endpoint`` (``chat``, ``completions``, ``responses``, ``messages``) say how
the request came, so a live replay (router/demo/replay.py) sends it the same way (a batch's
rows as one request again, ``prompt`` the list of their prompts); a reader
takes a row without them as a streamed completion.

``hash_ids`` name 512-token prefix blocks (the last one may be partial). Each id is a keyed
hash of the block's canonical hash (the hash of the whole prefix up to it): the same prompt
gets the same ids in every worker and every pod that records with the same key, different
prefixes get different ids (53-bit ids: collisions are negligible), and without the key a
reader cannot confirm a guessed prompt. Never text, never token ids, never canonical hashes.
With a router block size that does not divide 512 (48, 1024) a block's id is made from the
router's last whole block before its end (router.core.hashing ``coarse_prefix_ids``): a
turn extending the previous one still shares all of it; prompts parting inside a router
block look shared up to its end at most.
``session_id`` is keyed the same way (:func:`session_label`): never the id as sent.
The key is ``server.record_key`` (set the same secret on every pod); without one, the workers
of one pod share a random key created next to the trace (``<path>.key``, mode 0600, created
once by whichever worker comes first). Every row names its key by ``key_id``
(:func:`key_id`, a keyed hash of a constant: it tells keys apart and reveals nothing of
one), so ``kvrouter trace merge`` can tell when its inputs' ids cannot match. So does
``router_block``, the router block size the ids were made at: a canonical hash depends on
it, so one model's ids match only between rows recorded at one size.

The outcome columns (present when known): ``replica`` the request was sent to, the usable
prefix the router predicted (``pred_hit``, tokens), what the engine reported cached
(``cached``, tokens; neither on a batch's rows: the router predicts its longest prompt and
the usage holds one prompt's cached tokens), TTFT and E2E in ms (TTFT only for streams).

With a session id, a request that arrived after its session's previous request (in this
worker) finished also gets ``delay`` (ms since that finish), so the simulator replays the
session closed loop, as agents behave (a batch: its first row; the others arrived before
that row finished, as ``trace merge`` finds too). ``kvrouter trace merge`` recomputes
``delay`` across all the files merged (sessions spread over workers and pods).

Several workers may record to one path: rows are buffered and appended with one
``O_APPEND`` write of whole lines per flush (lines never interleave), and rotation at
``max_bytes`` happens under an exclusive lock on ``<path>.lock``: whoever finds the live file
over the limit renames ``trace.jsonl`` -> ``trace.jsonl.1`` -> ... (up to ``backups``), the
others notice the new file at their next flush and reopen it. A row written to the old file
during the swap lands in ``trace.jsonl.1``, not lost. A write cut short (a full disk, a
crash) leaves a torn row: the next append, by any recorder, starts a new line after it, and
the readers skip it (:func:`parse_row`). Pods write files of their own (one path each; a
shared network volume's locks are not trusted) and ``kvrouter trace merge`` combines them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import pathlib
import secrets
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from router.core.hashing import coarse_prefix_ids

TRACE_BLOCK_TOKENS = 512
MAX_SESSIONS = 1_000_000  # sessions whose last finish time is kept for ``delay``
ID_BITS = 53  # ids stay exact in any JSON reader (IEEE doubles)
KEY_BYTES = 32
# the request paths the router records, by the ``endpoint`` name a row carries
ENDPOINTS = {
    b"/v1/chat/completions": "chat",
    b"/v1/completions": "completions",
    b"/v1/responses": "responses",
    b"/v1/messages": "messages",
}
ROW_START = '{"timestamp":'  # how every row :meth:`TraceRecorder.record` writes begins
# the ``status`` of a request its client left before it had the whole answer (nginx's "client
# closed request"; no answer status at all reached that client)
CLIENT_CLOSED = 499


def parse_row(line: str) -> Any:
    """The JSON value of one line of a trace; None for a recorded row a write left torn (a
    crash or a full disk mid-write cut it short: a line that begins as a recorded row and is
    not JSON). Raises ``json.JSONDecodeError`` for any other line that is not JSON. Readers
    skip a torn row and say how many they skipped (:func:`torn_note`)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        text = line.strip()
        if text.startswith(ROW_START) or ROW_START.startswith(text):
            return None
        raise


def torn_note(path: pathlib.Path | str, lines: Sequence[int]) -> str:
    """What a reader says of the torn rows it skipped (:func:`parse_row`) at ``lines``."""
    at = ", ".join(map(str, lines[:5])) + (", ..." if len(lines) > 5 else "")
    return (
        f"skipped {len(lines)} torn row(s) in {path} (line {at}): cut short by a crash or a "
        "full disk while it was written"
    )


def endpoint_of(path: bytes) -> str | None:
    """The ``endpoint`` of a request path (its query string aside); None for another."""
    return ENDPOINTS.get(path.partition(b"?")[0].rstrip(b"/"))


@dataclass(slots=True, frozen=True)
class RecordSettings:
    path: pathlib.Path
    max_bytes: int = 256 * 2**20
    backups: int = 5
    max_ids: int = 1_000_000  # memoised block ids (a cache: ids do not depend on it)
    key: bytes | None = None  # None: the shared ``<path>.key`` file


def block_id(canonical: int, key: bytes) -> int:
    """The recorded id of a block: a keyed BLAKE2b of its canonical hash, ``ID_BITS`` bits."""
    digest = hashlib.blake2b(
        (canonical & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little"), key=key, digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") >> (64 - ID_BITS)


def session_label(session_id: str, key: bytes) -> str:
    """The recorded name of a session: a keyed BLAKE2b of its id (which may come from the
    OpenAI ``user`` field: an e-mail, an account id), the same in every worker and pod that
    records with the same key, so merged traces and replays still tie a session's turns."""
    digest = hashlib.blake2b(session_id.encode("utf-8"), key=key, digest_size=8).hexdigest()
    return "s-" + digest


def key_id(key: bytes) -> str:
    """The name of a recording key that rows carry (``key_id``): equal for equal keys, and
    different keys get different names (48 bits), so files whose ids cannot match across
    them are found by reading them, whoever set the key."""
    return "k-" + hashlib.blake2b(b"kvrouter trace key id", key=key, digest_size=6).hexdigest()


def record_key(text: str) -> bytes:
    """``server.record_key`` as a BLAKE2b key (any length of secret; hashed down to 32 bytes)."""
    if not text:
        raise ValueError("server.record_key is empty")
    return hashlib.blake2b(text.encode("utf-8"), digest_size=KEY_BYTES).digest()


def shared_key(path: pathlib.Path) -> bytes:
    """The random key of the recording at ``path`` (``<path>.key``), created on first use;
    every process recording to ``path`` reads the same one. It is made under the path's lock
    and put in place whole (a rename), so nobody reads half of one; a key file shorter than a
    key (a worker that died writing it, with an older version) never named a row: replaced."""
    key_path = path.with_name(path.name + ".key")
    with _locked(path):
        try:
            data = key_path.read_bytes()
        except FileNotFoundError:
            data = b""
        if len(data) == KEY_BYTES:
            return data
        if len(data) > KEY_BYTES:
            raise ValueError(f"{key_path}: not a {KEY_BYTES}-byte key")
        key = secrets.token_bytes(KEY_BYTES)
        # hidden: a glob of the traces (``trace merge router-*.jsonl*``) never takes it
        tmp = key_path.with_name(f".{key_path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(key)
            os.replace(tmp, key_path)
        finally:
            tmp.unlink(missing_ok=True)
        return key


@contextlib.contextmanager
def _locked(path: pathlib.Path) -> Iterator[None]:
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


class TraceRecorder:
    """Append-only, rotating trace writer. Not thread-safe; the event loop owns it.

    ``started_at`` is the caller's clock (e.g. the event loop's) at ``wall_at_start`` (Unix
    seconds); arrival times passed to :meth:`record` are on the caller's clock."""

    def __init__(
        self, settings: RecordSettings, started_at: float, wall_at_start: float = 0.0
    ) -> None:
        self.settings = settings
        self.started_at = started_at
        self.wall_at_start = wall_at_start
        self.rows = 0
        settings.path.parent.mkdir(parents=True, exist_ok=True)
        self._key = settings.key if settings.key is not None else shared_key(settings.path)
        self._key_id = key_id(self._key)
        self._ids: dict[int, int] = {}
        self._last_finish: OrderedDict[str, float] = OrderedDict()
        self._pending: list[str] = []
        self._fd = self._open()
        # batch ids: this recorder's random prefix (unique across workers and pods) + a count
        self._batch_prefix = secrets.token_hex(6)
        self._batches = 0

    def _open(self) -> int:
        # read too: :meth:`_write` looks at the file's last byte
        return os.open(self.settings.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)

    def next_batch(self) -> str:
        """A fresh ``batch`` id for the rows of one completions batch (module doc)."""
        self._batches += 1
        return f"{self._batch_prefix}-{self._batches}"

    def ids(self, hashes: Sequence[int]) -> list[int]:
        """The recorded ids of canonical (512-token) block hashes (see :func:`block_id`)."""
        memo = self._ids
        if len(memo) + len(hashes) > self.settings.max_ids:
            memo.clear()
        out = []
        for h in hashes:
            got = memo.get(h)
            if got is None:
                got = memo[h] = block_id(h, self._key)
            out.append(got)
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
        replica: str | None = None,
        predicted_hit: int | None = None,
        cached_tokens: int | None = None,
        first_token_at: float | None = None,
        samples: int = 1,
        stream: bool | None = None,
        endpoint: str | None = None,
        batch: str | None = None,
        status: int | None = None,
    ) -> None:
        """Append one prompt of a request (a completions batch: one call per prompt, at the
        batch's arrival). ``block_hashes`` is its canonical chain at ``block_size``; when
        that size does not divide 512 the ids are a close approximation
        (router.core.hashing ``coarse_prefix_ids``).
        ``output_length`` is one sequence's, ``samples`` the sequences sampled (``n``): a
        row with ``n`` > 1 gets it. ``stream`` and ``endpoint`` (:data:`ENDPOINTS`), when
        known, say how the request was sent; ``batch`` (:meth:`next_batch`) names the
        completions batch the prompt came in, on each of its rows. The row reaches the file
        at the next :meth:`flush`. A ``batch`` on another endpoint is a ``ValueError``:
        only completions take a batch of prompts, and the trace reader refuses such a row.
        ``status``: what the client of a request without an answer learnt (429: shed by
        admission; 503: none could take it; a replica's error; :data:`CLIENT_CLOSED`: it
        left), a row of offered load without an outcome."""
        if batch is not None and endpoint not in (None, "completions"):
            raise ValueError(f"a batch of prompts goes to completions, not {endpoint}")
        wall_ms = (self.wall_at_start + arrived_at - self.started_at) * 1000
        row: dict[str, object] = {
            "timestamp": max(0, round(wall_ms)),
            "input_length": input_length,
            "output_length": output_length,
        }
        coarse = coarse_prefix_ids(block_hashes, block_size, input_length, TRACE_BLOCK_TOKENS)
        row["hash_ids"] = self.ids(coarse)
        row["model"] = model
        row["key_id"] = self._key_id
        row["router_block"] = block_size
        if samples > 1:
            row["n"] = samples
        if stream is not None:
            row["stream"] = stream
        if endpoint is not None:
            row["endpoint"] = endpoint
        if batch is not None:
            row["batch"] = batch
        if session_id:
            row["session_id"] = session_label(session_id, self._key)
            previous = self._last_finish.pop(session_id, None)
            if previous is not None and arrived_at >= previous:
                row["delay"] = round((arrived_at - previous) * 1000)
            self._last_finish[session_id] = arrived_at if finished_at is None else finished_at
            if len(self._last_finish) > MAX_SESSIONS:
                self._last_finish.popitem(last=False)
        if replica is not None:
            row["replica"] = replica
        if predicted_hit is not None:
            row["pred_hit"] = predicted_hit
        if cached_tokens is not None:
            row["cached"] = cached_tokens
        if first_token_at is not None:
            row["ttft_ms"] = round((first_token_at - arrived_at) * 1000, 1)
        if finished_at is not None:
            row["e2e_ms"] = round((finished_at - arrived_at) * 1000, 1)
        if status is not None:
            row["status"] = status
        self._pending.append(json.dumps(row, separators=(",", ":")) + "\n")
        self.rows += 1

    @property
    def pending(self) -> int:
        """Rows recorded and not yet flushed."""
        return len(self._pending)

    def flush(self) -> None:
        """Append the pending rows (whole lines, one write per file), rotating whenever the
        live file would pass ``max_bytes``. A failed or short write (full disk, a path that
        cannot be opened) raises OSError; its rows are dropped, and the next flush tries
        again, starting a new line after any torn one."""
        if not self._pending:
            return
        lines, self._pending = self._pending, []
        self._follow_rotation()
        size = os.fstat(self._fd).st_size
        chunk: list[bytes] = []
        for text in lines:
            line = text.encode("utf-8")
            if size + len(line) > self.settings.max_bytes and size > 0:
                if chunk:
                    self._write(b"".join(chunk))
                    chunk = []
                self._rotate(len(line))
                size = os.fstat(self._fd).st_size
            chunk.append(line)
            size += len(line)
        if chunk:
            self._write(b"".join(chunk))

    def _write(self, data: bytes) -> None:
        """One append of whole lines; OSError when the file took less than all of it (the
        rest is dropped: a retry would not be one append, and could interleave). A file
        that ends in a partial line (a short write of this worker's or another's, a crash
        mid-write before a restart) gets a new line first, so the torn row stays alone on
        its line (readers skip it: :func:`parse_row`) and the rows after it whole."""
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        written = os.write(self._fd, data)
        if written < len(data):
            raise OSError(
                errno.ENOSPC,
                f"{self.settings.path}: wrote {written} of {len(data)} bytes",
            )

    def _follow_rotation(self) -> None:
        """Reopen the live file if another worker rotated it away."""
        try:
            same = os.stat(self.settings.path).st_ino == os.fstat(self._fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # the new file opened first: a failure leaves the old fd valid
            fd, old = self._open(), self._fd
            self._fd = fd
            os.close(old)

    def _rotate(self, need: int) -> None:
        """Rotate the live file, which has no room for ``need`` more bytes, unless another
        worker rotated it while this one waited for the lock (then its new file has room)."""
        path = self.settings.path
        with _locked(path):
            self._follow_rotation()  # someone else may have rotated while we waited
            size = os.fstat(self._fd).st_size
            if size == 0 or size + need <= self.settings.max_bytes:
                return
            # trace.jsonl.(k-1) -> trace.jsonl.k, oldest first; the one past `backups` goes.
            for i in range(self.settings.backups, 0, -1):
                src = path.with_name(f"{path.name}.{i - 1}") if i > 1 else path
                if src.exists():
                    os.replace(src, path.with_name(f"{path.name}.{i}"))
            if self.settings.backups <= 0:
                path.unlink(missing_ok=True)
            fd, old = self._open(), self._fd
            self._fd = fd
            os.close(old)

    def close(self) -> None:
        self.flush()
        os.close(self._fd)
