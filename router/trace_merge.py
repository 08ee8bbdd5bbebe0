"""``kvrouter trace merge``: one trace from the recordings of many workers and pods.

Each router pod records its own files (router/recorder.py); the block ids in them are
fleet-consistent (a keyed hash, same key on every pod), so merging is a sort, not a remap:
rows from all files ordered by arrival (``timestamp``, wall-clock ms), rebased so the first
arrives at 0 (``--keep-time``: leave them absolute). A session's requests may have gone
through several workers or pods, which each saw only their own: ``delay`` is recomputed over
the merged rows from each row's arrival and its session's previous request's finish
(``timestamp + e2e_ms``): present when the request arrived after that finish (closed loop),
absent otherwise. Rows without ``e2e_ms`` (older recordings) keep the ``delay`` they had.

Rows name the key their ids were made with (``key_id``, router/recorder.py): when the inputs
hold more than one, their ids cannot match across them (the same prefix gets other ids in
each pod's files, so shared prefixes look unshared), and the merge says so, naming the files
of each key; whether the pods set different ``record_key`` secrets or none (each pod's
random key). Rows recorded before ``key_id`` existed are named by their file's key file
(``<trace>.key``) when there is one. Rows name the router block size their ids were made
at too (``router_block``): a model recorded at more than one (pods configured apart, one pod
before and after a change) has ids that do not match across them, and the merge says so.

Inputs may overlap: a pod's live file copied off before a rotation and its ``.1`` after it
hold the same rows, as do two copies of a file taken while it grew, or one file named twice.
Such rows would replay twice; a row is kept as often as the one input holding it most often
(identical rows in one file, a batch's identical prompts, all stay) and the merge says how
many copies it dropped. Two requests' rows are never identical across pods in practice: a
row holds its arrival (ms), its E2E (0.1 ms) and its replica besides its prompt's ids.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from router.core.errors import ConfigError
from router.recorder import key_id, parse_row, torn_note

# the files of each recording key (``key_id``) among a merge's inputs
KeyFiles = dict[str, list[Path]]
# the files of each router block size (``router_block``), by model, among a merge's inputs
BlockFiles = dict[str, dict[int, list[Path]]]


def read_rows(
    paths: Iterable[Path],
    notes: list[str] | None = None,
    keys: KeyFiles | None = None,
    blocks: BlockFiles | None = None,
) -> Iterator[dict[str, Any]]:
    """The rows of recorded traces; raises ConfigError naming file and line for a bad one.
    A torn row (router.recorder.parse_row) is skipped, and said so in ``notes``. ``keys``
    gets the files of each recording key the rows name (:func:`file_keys`), ``blocks`` those
    of each model's router block sizes (``router_block``). A row found in
    more than one input (copies of one recording: module doc) is kept as often as the input
    holding it most often, and ``notes`` says how many copies were dropped."""
    kept: dict[bytes, int] = {}  # each distinct row (its digest): how often it was kept
    dropped = 0
    for path in paths:
        with path.open(encoding="utf-8") as fh:
            try:
                rows = list(_rows(path, fh, notes))
            except UnicodeDecodeError:  # a recorder's key file (trace.jsonl.key), say
                raise ConfigError(f"{path}: not a recorded trace (not UTF-8 text)") from None
        if keys is not None:
            for name in file_keys(path, rows):
                keys.setdefault(name, []).append(path)
        if blocks is not None:
            sizes = {(str(r.get("model")), r["router_block"]) for r in rows if "router_block" in r}
            for model, size in sorted(sizes):
                blocks.setdefault(model, {}).setdefault(size, []).append(path)
        seen: dict[bytes, int] = {}  # each distinct row: how often in this file
        for row in rows:
            # a digest, not the row's text: a merge holds one per row of every input
            text = json.dumps(row, sort_keys=True, separators=(",", ":")).encode()
            digest = hashlib.blake2b(text, digest_size=16).digest()
            seen[digest] = count = seen.get(digest, 0) + 1
            if count > kept.get(digest, 0):
                kept[digest] = count
                yield row
            else:
                dropped += 1
    if dropped and notes is not None:
        notes.append(
            f"dropped {dropped} row(s) found in more than one input: copies of one recording "
            "(a file named twice, copied before and after a rotation, or while it grew)"
        )


def file_keys(path: Path, rows: Iterable[dict[str, Any]]) -> set[str]:
    """The recording keys of ``path``'s ``rows``: each row's ``key_id``; for rows without
    one (recorded before rows named their key), the key in ``path``'s key file, if any."""
    names: set[str] = set()
    unnamed = False
    for row in rows:
        name = row.get("key_id")
        if isinstance(name, str):
            names.add(name)
        else:
            unnamed = True
    if unnamed:
        with contextlib.suppress(OSError):  # recorded with record_key: no key file
            names.add(key_id(key_file(path).read_bytes()))
    return names


def _rows(path: Path, lines: Iterable[str], notes: list[str] | None) -> Iterator[dict[str, Any]]:
    torn: list[int] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = parse_row(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
        if row is None:
            torn.append(lineno)
            continue
        ts = row.get("timestamp") if isinstance(row, dict) else None
        if not isinstance(ts, int | float) or isinstance(ts, bool):
            raise ConfigError(f"{path}:{lineno}: a row needs a numeric 'timestamp'")
        yield row
    if torn and notes is not None:
        notes.append(torn_note(path, torn))


def merge(rows: Iterable[dict[str, Any]], keep_time: bool = False) -> list[dict[str, Any]]:
    """Rows in arrival order with ``delay`` recomputed across them (see the module doc)."""
    out = sorted(rows, key=lambda r: r["timestamp"])
    t0 = out[0]["timestamp"] if out and not keep_time else 0
    finish: dict[str, float] = {}
    for row in out:
        arrived = row["timestamp"]
        session = row.get("session_id")
        e2e = row.get("e2e_ms")
        if session is not None:
            session = str(session)
            previous = finish.get(session)
            if isinstance(e2e, int | float):
                row.pop("delay", None)
                if previous is not None and arrived >= previous:
                    row["delay"] = round(arrived - previous)
            done = arrived + e2e if isinstance(e2e, int | float) else arrived
            finish[session] = max(done, previous if previous is not None else done)
        row["timestamp"] = arrived - t0
    return out


def key_file(trace: Path) -> Path:
    """Where the recorder of ``trace`` (a live file or a rotated ``.N`` backup) keeps its
    random key when it records without ``record_key`` (router/recorder.py)."""
    live = trace.with_suffix("") if trace.suffix[1:].isdigit() else trace
    return live.with_name(live.name + ".key")


def mixed_keys_warning(keys: KeyFiles) -> str | None:
    """What to tell when the merged files were recorded with more than one key, else None."""
    if len(keys) < 2:
        return None
    groups = "; ".join(
        f"{name}: {', '.join(map(str, files))}" for name, files in sorted(keys.items())
    )
    return (
        f"warning: these traces were recorded with different keys ({groups}): their hash_ids "
        "do not match across them, so prefixes shared between them look unshared; set "
        "server.record_key to one secret on every pod"
    )


def mixed_blocks_warning(blocks: BlockFiles) -> str | None:
    """What to tell when a model's rows were recorded at more than one router block size
    (its ids do not match across them), else None."""
    mixed = [
        f"model {model} was recorded at router block sizes "
        + "; ".join(f"{size}: {', '.join(map(str, files))}" for size, files in sorted(of.items()))
        for model, of in sorted(blocks.items())
        if len(of) > 1
    ]
    if not mixed:
        return None
    return (
        f"warning: {' and '.join(mixed)}: a block's id is made from the router's hash at "
        "its block size, so prefixes shared between them look unshared; record with one "
        "[models.NAME] block_size"
    )


def _run(args: argparse.Namespace) -> int:
    paths = [Path(p) for p in args.files]
    # a trace recorded without record_key has its key beside it (router/recorder.py):
    # ``trace.jsonl*`` matches both
    key_files = {p for p in paths if p.suffix == ".key" and p.with_suffix("") in paths}
    for key in key_files:
        print(f"skipped {key}: the recorder's key file of {key.with_suffix('')}", file=sys.stderr)
    paths = [p for p in paths if p not in key_files]
    notes: list[str] = []
    keys: KeyFiles = {}
    blocks: BlockFiles = {}
    rows = merge(read_rows(paths, notes, keys, blocks), keep_time=args.keep_time)
    for note in notes:
        print(note, file=sys.stderr)
    for warning in (mixed_keys_warning(keys), mixed_blocks_warning(blocks)):
        if warning:
            print(warning, file=sys.stderr)
    if not rows:
        raise ConfigError("no rows in " + ", ".join(args.files))
    out = sys.stdout if args.output in (None, "-") else open(args.output, "w", encoding="utf-8")  # noqa: SIM115
    try:
        for row in rows:
            out.write(json.dumps(row, separators=(",", ":")) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    print(f"merged {len(rows)} rows from {len(paths)} files", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    trace = sub.add_parser("trace", help="recorded traces: merge files from many pods")
    cmds = trace.add_subparsers(dest="trace_command", metavar="CMD", required=True)
    m = cmds.add_parser("merge", help="merge recordings (all pods, rotated files) into one")
    m.add_argument("files", nargs="+", help="recorded JSONL files (trace.jsonl, .1, ...)")
    m.add_argument("-o", "--output", help="output JSONL path (default: stdout)")
    m.add_argument(
        "--keep-time", action="store_true", help="keep wall-clock timestamps (default: from 0)"
    )
    m.set_defaults(handler=_run)
