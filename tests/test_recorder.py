"""Trace recording: Mooncake-compatible rows, dense ids that preserve prefix sharing,
rotation, and the coarsening of router hash chains to 512-token blocks."""

from __future__ import annotations

import json
import pathlib

import pytest

from router.core.hashing import coarsen_chain, hash_prompt, root_hash
from router.recorder import RecordSettings, TraceRecorder

ROOT = root_hash("m")


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
    rec = TraceRecorder(RecordSettings(tmp_path / "t.jsonl"), started_at=100.0)
    a = list(range(2048))
    b = a[:1024] + [7] * 1500
    for at, toks, sid in ((100.5, a, "s1"), (101.0, b, None)):
        rec.record(
            arrived_at=at,
            model="m",
            input_length=len(toks),
            output_length=5,
            block_hashes=hash_prompt(toks, 64, ROOT).hashes,
            block_size=64,
            session_id=sid,
        )
    rec.close()
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert rows[0] == {
        "timestamp": 500,
        "input_length": 2048,
        "output_length": 5,
        "hash_ids": [0, 1, 2, 3],
        "model": "m",
        "session_id": "s1",
    }
    # b shares the first two 512-token blocks with a, then diverges; ceil(2524/512) = 5 ids.
    assert rows[1]["hash_ids"] == [0, 1, 4, 5, 6] and rows[1]["timestamp"] == 1000
    assert "session_id" not in rows[1]
    text = (tmp_path / "t.jsonl").read_text()
    assert "7, 7" not in text and str(hash_prompt(a, 64, ROOT).hashes[0]) not in text


def test_rotation_keeps_backups_and_ids(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(RecordSettings(path, max_bytes=300, backups=2), started_at=0.0)
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
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["t.jsonl", "t.jsonl.1", "t.jsonl.2"]
    for name in files:
        for line in (tmp_path / name).read_text().splitlines():
            assert json.loads(line)["hash_ids"] == [0, 1]
    assert rec.rows == 12
    assert all((tmp_path / n).stat().st_size <= 300 for n in files)


def test_block_size_not_dividing_512_records_lengths_only(tmp_path: pathlib.Path) -> None:
    rec = TraceRecorder(RecordSettings(tmp_path / "t.jsonl"), started_at=0.0)
    rec.record(
        arrived_at=1.0,
        model="m",
        input_length=100,
        output_length=1,
        block_hashes=[1, 2],
        block_size=48,
    )
    rec.close()
    assert json.loads((tmp_path / "t.jsonl").read_text())["hash_ids"] == []


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
