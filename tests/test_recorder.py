"""Trace recording: Mooncake-compatible rows, fleet-consistent ids that preserve prefix
sharing (the same in every worker and pod), outcome columns, rotation shared by workers,
``kvrouter trace merge`` and the simulator's replay of a merged recording, and the coarsening
of router hash chains to 512-token blocks."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import pytest

from router.core.hashing import coarsen_chain, hash_prompt, root_hash
from router.recorder import (
    RecordSettings,
    TraceRecorder,
    block_id,
    key_id,
    record_key,
    session_label,
)
from router.trace_merge import merge, read_rows
from tests.inprocess import kvrouter

ROOT = root_hash("m")
KEY = record_key("fleet secret")


def sid(name: str) -> str:
    """The recorded label of session ``name`` under ``KEY``."""
    return session_label(name, KEY)


def ids_of(toks: list[int]) -> list[int]:
    coarse = coarsen_chain(hash_prompt(toks, 64, ROOT).hashes, 64, len(toks))
    return [block_id(h, KEY) for h in coarse]


def test_coarsen_chain_matches_direct_hashing_at_512() -> None:
    tokens = list(range(5000))
    fine = hash_prompt(tokens, 64, ROOT).hashes
    coarse = coarsen_chain(fine, 64, len(tokens))
    assert len(coarse) == 10  # ceil(5000 / 512)
    # Full coarse blocks are exactly the fine hashes at every 8th block.
    assert coarse[:9] == [fine[8 * k + 7] for k in range(9)]
    # Same prefix, different length tails -> different tail ids; same tail -> same id.
    other = coarsen_chain(hash_prompt(tokens[:4999], 64, ROOT).hashes, 64, 4999)
    assert other[:9] == coarse[:9] and other[9] != coarse[9]
    assert coarsen_chain(fine, 64, 5000) == coarse
    assert coarsen_chain([], 64, 0) == []
    with pytest.raises(ValueError):
        coarsen_chain(fine, 48, 5000)
    with pytest.raises(ValueError):
        coarsen_chain(fine[:3], 64, 5000)


def test_rows_are_mooncake_compatible(tmp_path: pathlib.Path) -> None:
    rec = TraceRecorder(RecordSettings(tmp_path / "t.jsonl", key=KEY), started_at=100.0)
    a = list(range(2048))
    b = a[:1024] + [7] * 1500
    for at, toks, session in ((100.5, a, "s1"), (101.0, b, None)):
        rec.record(
            arrived_at=at,
            model="m",
            input_length=len(toks),
            output_length=5,
            block_hashes=hash_prompt(toks, 64, ROOT).hashes,
            block_size=64,
            session_id=session,
        )
    rec.close()
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert rows[0] == {
        "timestamp": 500,
        "input_length": 2048,
        "output_length": 5,
        "hash_ids": ids_of(a),
        "model": "m",
        "key_id": key_id(KEY),
        "router_block": 64,
        "session_id": sid("s1"),
    }
    # b shares the first two 512-token blocks with a, then diverges; ceil(2524/512) = 5 ids.
    assert rows[1]["hash_ids"][:2] == ids_of(a)[:2] and rows[1]["timestamp"] == 1000
    assert len(set(rows[1]["hash_ids"][2:]) | set(ids_of(a))) == 4 + 3
    assert "session_id" not in rows[1]
    text = (tmp_path / "t.jsonl").read_text()
    assert "7, 7" not in text and str(hash_prompt(a, 64, ROOT).hashes[0]) not in text
    assert '"s1"' not in text  # a session id (an e-mail in ``user``, say) is keyed too


def test_rotation_keeps_backups_and_ids(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(RecordSettings(path, max_bytes=300, backups=2, key=KEY), started_at=0.0)
    chain = hash_prompt(list(range(1024)), 64, ROOT).hashes
    for i in range(12):
        rec.record(
            arrived_at=float(i),
            model="m",
            input_length=1024,
            output_length=1,
            block_hashes=chain,
            block_size=64,
        )
    rec.close()
    files = sorted(p.name for p in tmp_path.iterdir() if p.suffix not in (".lock", ".key"))
    assert files == ["t.jsonl", "t.jsonl.1", "t.jsonl.2"]
    for name in files:
        for line in (tmp_path / name).read_text().splitlines():
            assert json.loads(line)["hash_ids"] == ids_of(list(range(1024)))
    assert rec.rows == 12
    assert all((tmp_path / n).stat().st_size <= 300 for n in files)


def _shared(a: list[int], b: list[int]) -> int:
    """How many leading hashes two chains share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("block_size", [48, 96, 1024])
def test_a_block_size_not_dividing_512_still_records_prefix_sharing(
    tmp_path: pathlib.Path, block_size: int
) -> None:
    """A router block size that does not divide 512 (a config takes any: 48, 1024) gave
    every row ``hash_ids: []``: the replay of such a recording shared no prefix at all,
    silently (hit rate 0). Its ids now name each 512-token block by the router's last whole
    block before the block's end: a turn extending the previous one shares all of it, a
    different prompt nothing, and prompts parting inside a router block share less than one
    router block more than they do."""
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(RecordSettings(path, key=KEY), started_at=0.0)
    first = list(range(2000))
    prompts = {
        "first": first,
        "next turn": first + [7] * 1000,
        "parts at 1100": first[:1100] + [9] * 900,
        "other": [5] * 2000,
    }
    root = root_hash("m")
    for at, toks in enumerate(prompts.values()):
        rec.record(
            arrived_at=float(at),
            model="m",
            input_length=len(toks),
            output_length=1,
            block_hashes=hash_prompt(toks, block_size, root).hashes,
            block_size=block_size,
        )
    rec.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [len(r["hash_ids"]) for r in rows] == [4, 6, 4, 4]
    from sim.workload import read_mooncake

    work = read_mooncake(path, block_size=64, model="m")
    chains = dict(zip(prompts, (r.block_hashes for r in work.requests), strict=True))
    # every whole 512-token block of turn one (a partial last block's id names its length
    # too, as in Mooncake's traces and at any block size)
    assert _shared(chains["first"], chains["next turn"]) == 1536 // 64
    assert _shared(chains["first"], chains["other"]) * 64 < block_size
    parted = _shared(chains["first"], chains["parts at 1100"]) * 64
    assert 1024 <= parted < 1100 + block_size


def test_session_follow_ups_get_closed_loop_delays(tmp_path: pathlib.Path) -> None:
    rec = TraceRecorder(RecordSettings(tmp_path / "t.jsonl"), started_at=0.0)
    chain = hash_prompt(list(range(600)), 64, ROOT).hashes
    common = {"model": "m", "input_length": 600, "output_length": 3, "block_hashes": chain,
              "block_size": 64}  # fmt: skip
    rec.record(arrived_at=1.0, finished_at=2.5, session_id="s", **common)  # type: ignore[arg-type]
    rec.record(arrived_at=3.0, finished_at=4.0, session_id="s", **common)  # type: ignore[arg-type]
    rec.record(arrived_at=3.5, finished_at=5.0, session_id="s", **common)  # type: ignore[arg-type]
    rec.close()
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert "delay" not in rows[0]
    assert rows[1]["delay"] == 500
    assert "delay" not in rows[2]  # arrived before the previous turn finished: open loop


def _record(rec: TraceRecorder, toks: list[int], at: float, **kw: object) -> None:
    rec.record(
        arrived_at=at,
        model="m",
        input_length=len(toks),
        output_length=4,
        block_hashes=hash_prompt(toks, 64, ROOT).hashes,
        block_size=64,
        **kw,  # type: ignore[arg-type]
    )


def test_two_workers_write_the_same_ids_for_the_same_prompts(tmp_path: pathlib.Path) -> None:
    """The defect this guards against: two recorders on one path numbered prompts each from
    0, so different prompts shared ids (false prefix hits in a replay). Workers of one pod
    share the path's key file; pods share ``record_key``."""
    a, b = list(range(1024)), [5] * 1024
    path = tmp_path / "t.jsonl"
    one = TraceRecorder(RecordSettings(path), started_at=0.0)
    two = TraceRecorder(RecordSettings(path), started_at=0.0)  # another worker, same path
    _record(one, a, 1.0)
    _record(two, b, 1.5)  # first prompt of this worker: used to get [0, 1] like `a`
    _record(two, a, 2.0)
    for rec in (one, two):
        rec.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == 3 and (path.with_name("t.jsonl.key").stat().st_mode & 0o777) == 0o600
    by_ts = {r["timestamp"]: r["hash_ids"] for r in rows}
    assert by_ts[1000] == by_ts[2000]  # same prompt, two workers: same ids
    assert not set(by_ts[1000]) & set(by_ts[1500])  # different prompts: no id in common
    # two pods (separate files) with the same record_key agree too; another key does not
    pods = [TraceRecorder(RecordSettings(tmp_path / f"pod{i}.jsonl", key=KEY), 0.0) for i in (0, 1)]
    other = TraceRecorder(RecordSettings(tmp_path / "x.jsonl", key=record_key("other")), 0.0)
    for rec in (*pods, other):
        _record(rec, a, 1.0)
        rec.close()
    files = sorted(tmp_path.glob("*.jsonl"))
    got = [json.loads(p.read_text().splitlines()[0])["hash_ids"] for p in files]
    assert got[0] == got[1] == ids_of(a) != got[3]  # pod0, pod1, t, x
    assert all(0 <= i < 2**53 for i in got[0])


def test_outcome_columns_and_wall_clock(tmp_path: pathlib.Path) -> None:
    rec = TraceRecorder(RecordSettings(tmp_path / "t.jsonl", key=KEY), 10.0, wall_at_start=1e9)
    _record(
        rec,
        list(range(600)),
        11.0,
        finished_at=11.5,
        first_token_at=11.2,
        replica="r1/0",
        predicted_hit=512,
        cached_tokens=512,
    )
    rec.close()
    row = json.loads((tmp_path / "t.jsonl").read_text())
    assert row["timestamp"] == 1_000_000_001_000
    assert (row["replica"], row["pred_hit"], row["cached"]) == ("r1/0", 512, 512)
    assert (row["ttft_ms"], row["e2e_ms"]) == (200.0, 500.0)


def test_merge_orders_rebases_and_recomputes_delays(tmp_path: pathlib.Path) -> None:
    """A session whose turns went through two pods: each pod alone sees no previous turn;
    the merge gives the follow-ups their closed-loop delay, and sim replay reads the result."""
    files = []
    for pod, turns in enumerate(((1.0, 3.0), (2.0,))):
        rec = TraceRecorder(RecordSettings(tmp_path / f"p{pod}.jsonl", key=KEY), 0.0, 100.0)
        for at in turns:
            toks = list(range(int(at) * 512))  # each turn extends the previous one
            _record(rec, toks, at, session_id="s", finished_at=at + 0.5)
        rec.close()
        files.append(tmp_path / f"p{pod}.jsonl")
    rows = merge(read_rows(files))
    assert [r["timestamp"] for r in rows] == [0, 1000, 2000]
    assert [r.get("delay") for r in rows] == [None, 500, 500]
    assert rows[1]["hash_ids"][:1] == rows[0]["hash_ids"]  # the shared prefix survives
    out = tmp_path / "merged.jsonl"
    run = kvrouter("trace", "merge", *map(str, files), "-o", str(out))
    assert run.returncode == 0, run.stderr
    assert [json.loads(x) for x in out.read_text().splitlines()] == rows
    replay = ["sim", "replay", str(out), "--replicas", "2", "--block-size", "64"]
    sim = kvrouter(*replay, "--json")
    assert sim.returncode == 0, sim.stderr
    assert json.loads(sim.stdout)["requests"] == 3
    from sim.workload import read_mooncake

    work = read_mooncake(out, block_size=64)
    assert [r.after for r in work.requests] == [None, "r0", "r1"]
    assert work.requests[1].block_hashes[:8] == work.requests[0].block_hashes
    assert work.requests[2].block_hashes[:16] == work.requests[1].block_hashes


def test_merge_skips_the_key_file_and_names_a_non_trace(tmp_path: pathlib.Path) -> None:
    """docs/tuning.md's ``trace merge /data/router-*.jsonl*`` also matches the key file
    written beside a trace recorded without record_key (``trace.jsonl.key``, binary): given
    with its trace, it is skipped; given alone, the merge names it."""
    rec = TraceRecorder(RecordSettings(tmp_path / "trace.jsonl"), 0.0, 100.0)
    _record(rec, list(range(512)), 1.0)
    rec.close()
    key = tmp_path / "trace.jsonl.key"
    assert key.exists()
    run = kvrouter("trace", "merge", str(tmp_path / "trace.jsonl"), str(key))
    assert run.returncode == 0, run.stderr
    assert len(run.stdout.splitlines()) == 1 and f"skipped {key}" in run.stderr
    run = kvrouter("trace", "merge", str(key))
    assert run.returncode == 2
    assert f"{key}: not a recorded trace (not UTF-8 text)" in run.stderr, run.stderr


def test_merge_warns_when_the_traces_were_recorded_with_different_keys(
    tmp_path: pathlib.Path,
) -> None:
    """Two pods recording without a shared ``record_key`` each make a random key: the same
    prompt gets other ids in each file, and a merge of them silently lost every prefix the
    pods shared. The merge now says so; files sharing one key (or record_key) merge quietly."""
    toks = list(range(1024))
    for pod in ("a", "b"):
        (tmp_path / pod).mkdir()
        rec = TraceRecorder(RecordSettings(tmp_path / pod / "trace.jsonl"), 0.0, 100.0)
        _record(rec, toks, 1.0)
        rec.close()
    a, b = tmp_path / "a" / "trace.jsonl", tmp_path / "b" / "trace.jsonl"
    run = kvrouter("trace", "merge", str(a), str(b))
    assert run.returncode == 0, run.stderr
    first, second = (json.loads(x)["hash_ids"] for x in run.stdout.splitlines())
    assert first != second  # the same prompt, other ids
    assert "recorded with different keys" in run.stderr and "record_key" in run.stderr
    rotated = a.with_name("trace.jsonl.1")  # a backup shares its live file's key
    rotated.write_bytes(a.read_bytes())
    run = kvrouter("trace", "merge", str(a), str(rotated))
    assert run.returncode == 0 and "different keys" not in run.stderr, run.stderr
    # rows recorded before rows named their key: their files' key files tell
    for path in (a, b):
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**r, "key_id": None}) + "\n" for r in rows))
    run = kvrouter("trace", "merge", str(a), str(b))
    assert "recorded with different keys" in run.stderr, run.stderr


def test_merge_warns_when_pods_set_different_record_keys(tmp_path: pathlib.Path) -> None:
    """Pods given different ``record_key`` secrets write no key files to compare: each row
    names its key (``key_id``), so the merge still finds that the ids cannot match, names the
    files of each key, and keeps quiet for pods that share one secret."""
    toks = list(range(1024))
    paths = {}
    for pod, secret in (("a", "one"), ("b", "two"), ("c", "one")):
        paths[pod] = tmp_path / f"{pod}.jsonl"
        settings = RecordSettings(paths[pod], key=record_key(secret))
        rec = TraceRecorder(settings, 0.0, 100.0)
        _record(rec, toks, 1.0)
        rec.close()
    ids = {pod: json.loads(p.read_text())["key_id"] for pod, p in paths.items()}
    assert ids["a"] == ids["c"] != ids["b"]
    assert "one" not in ids["a"] and "two" not in ids["b"]  # names the key, never holds it
    run = kvrouter("trace", "merge", str(paths["a"]), str(paths["b"]), str(paths["c"]))
    assert run.returncode == 0, run.stderr
    assert "recorded with different keys" in run.stderr, run.stderr
    assert f"{ids['a']}: {paths['a']}, {paths['c']}" in run.stderr, run.stderr
    assert f"{ids['b']}: {paths['b']}" in run.stderr, run.stderr
    run = kvrouter("trace", "merge", str(paths["a"]), str(paths["c"]))
    assert run.returncode == 0 and "different keys" not in run.stderr, run.stderr


def test_workers_sharing_a_path_rotate_without_losing_rows(tmp_path: pathlib.Path) -> None:
    """Two workers append to one path and rotate it in turns: every row lands whole in one of
    the files (none lost while the backups last, none torn or interleaved)."""
    path = tmp_path / "t.jsonl"
    settings = RecordSettings(path, max_bytes=2000, backups=50, key=KEY)
    workers = [TraceRecorder(settings, 0.0), TraceRecorder(settings, 0.0)]
    toks = list(range(1024))
    for i in range(60):
        rec = workers[i % 2]
        _record(rec, toks, float(i), session_id=f"s{i}")
        if i % 3 == 0:
            rec.flush()
    for rec in workers:
        rec.close()
    files = [p for p in tmp_path.iterdir() if p.name.startswith("t.jsonl") and p.suffix not in
             (".lock", ".key")]  # fmt: skip
    assert len(files) > 3  # it did rotate, several times
    rows = [json.loads(line) for p in files for line in p.read_text().splitlines()]
    assert sorted(r["session_id"] for r in rows) == sorted(sid(f"s{i}") for i in range(60))
    assert all(p.stat().st_size <= 2000 for p in files)


def test_recording_resumes_after_the_trace_could_not_be_written(tmp_path: pathlib.Path) -> None:
    """The live file replaced by something that cannot be opened for appending (here a
    directory; a full or read-only volume alike): that flush fails with an OSError, and once
    the path is writable again the next flush writes to it. The defect: the failed reopen left
    the recorder holding an fd it had already closed, so every later flush failed (or, with
    the number reused by a socket, acted on that socket) and recording never resumed."""
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(RecordSettings(path, key=KEY), 0.0)
    toks = list(range(1024))
    _record(rec, toks, 1.0, session_id="before")
    rec.flush()
    path.rename(tmp_path / "moved.jsonl")
    path.mkdir()
    _record(rec, toks, 2.0, session_id="lost")
    with pytest.raises(OSError):
        rec.flush()
    path.rmdir()
    _record(rec, toks, 3.0, session_id="after")
    rec.close()
    assert [json.loads(x)["session_id"] for x in path.read_text().splitlines()] == [sid("after")]


def test_a_short_write_is_an_error_and_the_next_row_starts_a_line(
    tmp_path: pathlib.Path,
) -> None:
    """A write the file system cuts short (a full disk; here the file size limit, which
    Python turns into EFBIG): the flush raises instead of dropping the rest of the batch
    silently, and the next row, once there is room, starts on a line of its own instead of
    being glued to the torn one (which would make both unreadable)."""
    import resource

    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(RecordSettings(path, key=KEY), 0.0)
    toks = list(range(1024))
    for i in range(3):
        _record(rec, toks, float(i), session_id=f"s{i}")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (300, hard))  # room for one row and a bit
    try:
        with pytest.raises(OSError):
            rec.flush()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert path.stat().st_size == 300  # the kernel wrote what fitted
    _record(rec, toks, 9.0, session_id="next")
    rec.close()
    lines = path.read_text().splitlines()
    *whole, torn, last = lines
    assert [json.loads(x)["session_id"] for x in whole] == [sid(f"s{i}") for i in range(len(whole))]
    assert torn and not torn.endswith("}")  # the row cut short, on its own line
    assert json.loads(last)["session_id"] == sid("next")


def test_a_worker_that_waited_for_another_s_rotation_does_not_rotate_again(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker A finds the live file full and waits for the rotation lock while worker B
    rotates and starts a new file; A must write into B's new file, not rotate again (which
    would push a full backup out early, losing it with few backups)."""
    import contextlib

    import router.recorder as recorder

    path = tmp_path / "t.jsonl"
    settings = RecordSettings(path, max_bytes=3000, backups=1, key=KEY)
    a, b = TraceRecorder(settings, 0.0), TraceRecorder(settings, 0.0)
    toks = list(range(1024))
    _record(a, toks, 0.0, session_id="old")
    a.flush()
    row = path.stat().st_size
    while path.stat().st_size + row <= settings.max_bytes:  # full: one more row rotates
        _record(a, toks, 0.0, session_id="old")
        a.flush()
    _record(a, toks, 1.0, session_id="a")
    _record(b, toks, 2.0, session_id="b")
    locked = recorder._locked
    calls = []

    @contextlib.contextmanager
    def b_rotates_first(p: pathlib.Path) -> Iterator[None]:
        if not calls:  # A's wait: B takes the lock first, rotates and writes its row
            calls.append(1)
            b.flush()
        with locked(p):
            yield

    monkeypatch.setattr(recorder, "_locked", b_rotates_first)
    a.flush()
    a.close()
    b.close()
    backup = path.with_name("t.jsonl.1").read_text()
    assert sid("old") in backup  # the full file B rotated is still the backup
    live = [json.loads(line)["session_id"] for line in path.read_text().splitlines()]
    assert sorted(live) == sorted([sid("a"), sid("b")])


def test_a_batch_s_rows_keep_their_delays_and_fields_through_merge(tmp_path: pathlib.Path) -> None:
    """A batch recorded as one row per prompt (same arrival, same finish) within a closed-
    loop session: only its first row follows the previous turn; ``trace merge`` recomputes
    the same delays and keeps ``n``, ``stream``, ``endpoint`` and ``batch``; the reader sends
    both of the batch's prompts at once and ties the next turn to the batch."""
    from sim.workload import mooncake_rows

    rec = TraceRecorder(RecordSettings(tmp_path / "t.jsonl", key=KEY), 0.0, 1_700_000_000.0)
    a, b = list(range(600)), list(range(5000, 5900))
    batch = rec.next_batch()
    calls = [(1.0, 2.0, a, 1, None), (2.5, 3.0, a + b[:100], 2, batch), (2.5, 3.0, b, 2, batch),
             (3.5, 4.0, b, 1, None)]  # fmt: skip
    for at, done, toks, n, bid in calls:
        rec.record(arrived_at=at, model="m", input_length=len(toks), output_length=3,
                   block_hashes=hash_prompt(toks, 64, ROOT).hashes, block_size=64,
                   session_id="s", finished_at=done, samples=n, stream=False,
                   endpoint="completions", batch=bid)  # fmt: skip
    rec.close()
    rows = list(read_rows([tmp_path / "t.jsonl"]))
    assert [r.get("delay") for r in rows] == [None, 500, None, 500]
    merged = merge([dict(r) for r in rows])
    assert [r.get("delay") for r in merged] == [None, 500, None, 500]
    assert [(r.get("n", 1), r["stream"], r["endpoint"]) for r in merged] == [
        (1, False, "completions"),
        (2, False, "completions"),
        (2, False, "completions"),
        (1, False, "completions"),
    ]
    path = tmp_path / "merged.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in merged))
    read = mooncake_rows(path)
    assert [(r.after, r.samples) for r in read] == [(None, 1), (0, 2), (None, 2), (2, 1)]
    assert read[2].arrival_s == 1.5 and not read[2].stream and read[2].endpoint == "completions"
    assert [r.get("batch") for r in merged] == [None, batch, batch, None]
    assert [r.batch for r in read] == [None, batch, batch, None]


def test_each_batch_gets_an_id_of_its_own(tmp_path: pathlib.Path) -> None:
    """Batch ids name one batch in a merged trace: distinct per batch and per recorder (two
    workers, or two pods, recording at once)."""
    one = TraceRecorder(RecordSettings(tmp_path / "a.jsonl", key=KEY), 0.0)
    two = TraceRecorder(RecordSettings(tmp_path / "b.jsonl", key=KEY), 0.0)
    ids = [one.next_batch(), one.next_batch(), two.next_batch(), two.next_batch()]
    assert len(set(ids)) == 4 and all(isinstance(i, str) and i for i in ids)
    one.close()
    two.close()


def test_a_row_a_crash_cut_short_is_skipped_and_counted_not_fatal(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A crash mid-write (or a full disk) leaves a recorded row cut short at the end of the
    file. The defects: every reader (``trace merge``, ``sim replay``, the live replay)
    refused the whole file for that one line, and the recorder restarted on the file glued
    its first row to the torn one (so that whole row was lost too). Now the readers skip a
    torn row, counting it aloud, and a recorder starts a new line after any torn end it
    finds; a line that is not JSON and no recorded row is still refused."""
    from router.demo.replay import load_requests
    from sim.workload import mooncake_rows

    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(RecordSettings(path, key=KEY), 0.0, 100.0)
    for i in range(3):
        _record(rec, list(range(600)), float(i), session_id=f"s{i}", finished_at=i + 0.5)
    rec.close()
    path.write_bytes(path.read_bytes()[:-40])  # the crash: the last row cut short
    again = TraceRecorder(RecordSettings(path, key=KEY), 10.0, 110.0)  # the worker restarted
    _record(again, list(range(600)), 11.0, session_id="after", finished_at=11.5)
    again.close()
    kept = [sid("s0"), sid("s1"), sid("after")]
    run = kvrouter("trace", "merge", str(path))
    assert run.returncode == 0, run.stderr
    assert [json.loads(x)["session_id"] for x in run.stdout.splitlines()] == kept
    assert f"skipped 1 torn row(s) in {path} (line 3)" in run.stderr, run.stderr
    with caplog.at_level("WARNING"):
        assert [r.session_id for r in mooncake_rows(path)] == kept
    assert f"skipped 1 torn row(s) in {path} (line 3)" in caplog.text
    assert len(load_requests(path, 10, "m", 16)) == 3  # the live replay's reader
    sim = kvrouter("sim", "replay", str(path), "--replicas", "2", "--block-size", "64", "--json")
    assert sim.returncode == 0, sim.stderr
    assert json.loads(sim.stdout)["requests"] == 3
    with path.open("a") as fh:
        fh.write("not a row\n")
    run = kvrouter("trace", "merge", str(path))
    assert run.returncode == 2 and f"{path}:5: not JSON" in run.stderr, run.stderr


def test_a_key_file_left_empty_is_made_again_and_shared(tmp_path: pathlib.Path) -> None:
    """A worker that died (or hit a full disk) between creating ``<path>.key`` and writing
    its key left the file empty. The defect: every recorder after it, on every restart,
    gave up with "not a 32-byte key" (the router did not start) until someone deleted the
    file by hand. No row was ever written with such a key, so a new one replaces it, and
    the workers still share one."""
    path = tmp_path / "t.jsonl"
    path.with_name("t.jsonl.key").write_bytes(b"")
    one = TraceRecorder(RecordSettings(path), 0.0)
    two = TraceRecorder(RecordSettings(path), 0.0)
    assert len(path.with_name("t.jsonl.key").read_bytes()) == 32
    assert one.ids([123, 456]) == two.ids([123, 456])
    assert path.with_name("t.jsonl.key").stat().st_mode & 0o777 == 0o600
    one.close()
    two.close()


def test_workers_sharing_a_path_replay_a_session_at_its_own_pace(tmp_path: pathlib.Path) -> None:
    """Workers of one pod record to one file, each measuring ``delay`` from the session's
    last answer it served itself. Turns 1 and 3 went to worker A, turn 2 to worker B: A
    wrote turn 3's delay from turn 1's answer (4 s), while the reader ties turn 3 to the
    session's answer that finished last, turn 2's. The defect: the replay sent turn 3 four
    seconds after turn 2's answer, three seconds late; it now follows turn 2's answer by
    the 1 s it really did, as the same file merged (``trace merge``) replays (which also
    ties turn 2 to turn 1: run it on such a file for every closed-loop tie)."""
    from sim.workload import mooncake_rows

    path = tmp_path / "t.jsonl"
    a = TraceRecorder(RecordSettings(path, key=KEY), 0.0, 100.0)
    b = TraceRecorder(RecordSettings(path, key=KEY), 0.0, 100.0)
    for rec, at, done in ((a, 0.0, 5.0), (b, 6.0, 8.0), (a, 9.0, 10.0)):
        _record(rec, list(range(int(at + 1) * 512)), at, session_id="s", finished_at=done)
        rec.flush()
    a.close()
    b.close()
    merged = tmp_path / "merged.jsonl"
    run = kvrouter("trace", "merge", str(path), "-o", str(merged))
    assert run.returncode == 0, run.stderr
    # turn 2: B had served none of the session, so the file has it open loop, at its time
    for trace, second in ((path, (6.0, None, 0.0)), (merged, (6.0, 0, 1.0))):
        rows = mooncake_rows(trace)
        got = [(r.arrival_s, r.after, r.delay_s) for r in rows]
        assert got == [(0.0, None, 0.0), second, (9.0, 1, 1.0)], trace


def test_merge_keeps_one_copy_of_rows_found_in_several_inputs(tmp_path: pathlib.Path) -> None:
    """A pod's files copied off at different moments overlap: the live file copied before a
    rotation and its ``.1`` after hold the same rows (so do yesterday's copy of a file still
    growing and today's, or one file named twice). The merge summed them: every such request
    replayed twice, silently. It now keeps each row as often as the one input holding it most
    often (a batch's identical prompts are identical rows of one file: both stay) and says
    how many copies it dropped."""
    live = tmp_path / "trace.jsonl"
    rec = TraceRecorder(RecordSettings(live, key=KEY), 0.0, 100.0)
    _record(rec, list(range(512)), 1.0, finished_at=1.5)
    batch = rec.next_batch()
    for _ in range(2):  # one batch of two identical prompts: two identical rows
        _record(rec, list(range(600)), 2.0, finished_at=2.5, batch=batch, endpoint="completions")
    rec.flush()
    copied = tmp_path / "copy-before-rotation.jsonl"
    copied.write_bytes(live.read_bytes())
    _record(rec, [7] * 512, 3.0, finished_at=3.5)
    rec.close()
    other = tmp_path / "pod-b.jsonl"
    rec = TraceRecorder(RecordSettings(other, key=KEY), 0.0, 100.0)
    # another pod, the same prompt at the same ms: its own row (its E2E differs)
    _record(rec, list(range(512)), 1.0, finished_at=1.6)
    rec.close()
    out = tmp_path / "merged.jsonl"
    run = kvrouter("trace", "merge", str(copied), str(live), str(other), str(live), "-o", str(out))
    assert run.returncode == 0, run.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["timestamp"] for r in rows] == [0, 0, 1000, 1000, 2000]
    assert "dropped 7 row(s) found in more than one input" in run.stderr, run.stderr
    assert "merged 5 rows from 4 files" in run.stderr


def test_merge_warns_when_a_model_was_recorded_at_different_block_sizes(
    tmp_path: pathlib.Path,
) -> None:
    """A block's id is made from the router's canonical hash at its ``block_size``: the same
    prefix gets other ids at another size (pods configured apart, or one pod before and
    after a change), so a merge of such files lost every prefix they shared, silently, the
    key being the same. Rows now carry ``router_block`` and the merge says so; other models
    at other sizes (ids never shared across models) merge quietly."""
    toks = list(range(1024))
    paths = {}
    for pod, size, model in (("a", 64, "m"), ("b", 32, "m"), ("c", 32, "other")):
        paths[pod] = tmp_path / f"{pod}.jsonl"
        rec = TraceRecorder(RecordSettings(paths[pod], key=KEY), 0.0, 100.0)
        rec.record(
            arrived_at=1.0,
            model=model,
            input_length=len(toks),
            output_length=1,
            block_hashes=hash_prompt(toks, size, root_hash(model)).hashes,
            block_size=size,
        )
        rec.close()
    assert json.loads(paths["a"].read_text())["router_block"] == 64
    run = kvrouter("trace", "merge", str(paths["a"]), str(paths["b"]))
    assert run.returncode == 0, run.stderr
    first, second = (json.loads(x)["hash_ids"] for x in run.stdout.splitlines())
    assert first != second  # the same prompt, other ids
    assert "model m was recorded at router block sizes" in run.stderr, run.stderr
    assert f"32: {paths['b']}; 64: {paths['a']}" in run.stderr
    run = kvrouter("trace", "merge", str(paths["a"]), str(paths["c"]))
    assert run.returncode == 0 and "block sizes" not in run.stderr, run.stderr
