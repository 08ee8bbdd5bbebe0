"""Trace readers (Mooncake, recorded, Bailian), the hash-id -> token mapping and the
synthetic agentic generator."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from router.core.errors import ConfigError
from router.core.hashing import hash_prompt, root_hash
from sim.agentic import AgenticSpec, generate
from sim.workload import SimRequest, load_trace


def write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tokens_of(ids: list[int], n: int, tb: int) -> np.ndarray:
    return np.concatenate([np.arange(k * tb, k * tb + tb) for k in ids])[:n].astype("<u4")


@pytest.mark.parametrize("block_size", [64, 48, 512, 1024])
def test_mooncake_hashes_equal_hashing_the_synthesised_tokens(block_size: int) -> None:
    w = load_trace("mooncake", block_size=block_size, limit=40)
    rows = [json.loads(line) for line in Path(w.meta["path"]).read_text().splitlines()[:40]]
    root = root_hash("sim-model")
    for row, r in zip(rows, w.requests, strict=True):
        toks = tokens_of(row["hash_ids"], row["input_length"], 512)
        assert list(r.block_hashes) == hash_prompt(toks, block_size, root).hashes
        assert r.prompt_tokens == row["input_length"] and r.output_tokens == row["output_length"]
    assert w.requests[2].arrival_s == pytest.approx(0.040)


def test_recorded_rows_sessions_delay_and_unknown_fields(tmp_path: Path) -> None:
    rows = [
        {
            "timestamp": 1000,
            "input_length": 600,
            "output_length": 5,
            "hash_ids": [1, 2],
            "session_id": "s1",
            "model": "m",
            "extra": {"x": 1},
        },
        {"timestamp": 1500, "input_length": 100, "output_length": 3, "hash_ids": [9]},
        {
            "timestamp": 0,
            "input_length": 1100,
            "output_length": 5,
            "hash_ids": [1, 2, 3],
            "session_id": "s1",
            "delay": 250,
        },
    ]
    w = load_trace(str(write(tmp_path / "rec.jsonl", rows)), block_size=64)
    a, c, b = w.requests  # by arrival; the closed-loop turn right behind its previous one
    assert a.after is None and a.arrival_s == 0.0 and b.arrival_s == pytest.approx(0.5)
    assert c.after == a.request_id and c.delay_s == pytest.approx(0.25)
    assert list(c.block_hashes[: len(a.block_hashes)]) == list(a.block_hashes)
    assert len(c.block_hashes) == 1100 // 64


def test_rows_without_enough_hash_ids_get_fresh_blocks(tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [1]}] * 2
    w = load_trace(str(write(tmp_path / "t.jsonl", rows)), block_size=64)
    a, b = w.requests
    assert len(a.block_hashes) == 1500 // 64
    assert a.block_hashes[:8] == b.block_hashes[:8] and a.block_hashes[8] != b.block_hashes[8]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ('{"timestamp": 0, "output_length": 1}', "input_length"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
        ('{"timestamp": 0, "input_length": -5}', "non-negative"),
    ],
)
def test_bad_rows_are_clear_errors(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message) as exc:
        load_trace(str(path), block_size=64, fmt="mooncake")
    assert "bad.jsonl:1" in str(exc.value)
    with pytest.raises(ConfigError, match="not found"):
        load_trace(str(tmp_path / "missing.jsonl"), block_size=64)


def test_bailian_rows_sessions_and_16_token_blocks(tmp_path: Path) -> None:
    rows = [
        {
            "chat_id": 7,
            "parent_chat_id": -1,
            "timestamp": 10.0,
            "input_length": 100,
            "output_length": 20,
            "type": "text",
            "turn": 1,
            "hash_ids": [1, 2, 3, 4, 5, 6, 7],
        },
        {
            "chat_id": 8,
            "parent_chat_id": 7,
            "timestamp": 12.5,
            "input_length": 160,
            "output_length": 20,
            "type": "text",
            "turn": 2,
            "hash_ids": [1, 2, 3, 4, 5, 6, 10, 11, 12, 13],
        },
    ]
    w = load_trace(str(write(tmp_path / "b.jsonl", rows)), block_size=32)
    assert w.meta["format"] == "bailian"
    a, b = w.requests
    assert b.arrival_s == pytest.approx(2.5) and a.session_id == b.session_id == "7"
    assert len(a.block_hashes) == 3 and len(b.block_hashes) == 5
    assert a.block_hashes[:3] == b.block_hashes[:3]  # 6 shared 16-token ids = 3 blocks of 32
    # ids renamed in order of first appearance: 1..7 -> 0..6, then 10..13 -> 7..10
    toks = tokens_of([0, 1, 2, 3, 4, 5, 7, 8, 9, 10], 160, 16)
    assert list(b.block_hashes) == hash_prompt(toks, 32, root_hash("sim-model")).hashes


def test_agentic_sessions_share_prefixes_grow_and_close_the_loop() -> None:
    spec = AgenticSpec(sessions=30, system_prompts=2, tool_sets=1, mean_turns=4, seed=5)
    w = generate(spec, block_size=64)
    again = generate(spec, block_size=64)
    assert [r.block_hashes for r in w.requests] == [r.block_hashes for r in again.requests]
    by_id = {r.request_id: r for r in w.requests}
    follow = [r for r in w.requests if r.after is not None]
    assert follow and all(r.delay_s > 0 for r in follow)
    for r in follow:
        parent = by_id[r.after]  # type: ignore[index]
        assert r.session_id == parent.session_id and r.prompt_tokens > parent.prompt_tokens
        # the next prompt extends prompt + answer: its prefix is the parent's blocks
        # followed by the blocks the parent's answer completed
        chain = list(parent.block_hashes) + list(parent.output_block_hashes)
        assert list(r.block_hashes[: len(chain)]) == chain
    firsts = [r for r in w.requests if r.after is None]
    shared = {r.block_hashes[0] for r in firsts}
    assert len(shared) <= 2 < len(firsts)  # everybody starts with one of 2 system prompts
    heavy = generate(
        AgenticSpec(sessions=40, mean_turns=30, max_turns=60, tool_tokens=20000, seed=1),
        block_size=512,
    )
    assert max(r.prompt_tokens for r in heavy.requests) > 200_000
    assert max(r.prompt_tokens for r in heavy.requests) < 1_000_000  # capped context
    with pytest.raises(ConfigError, match="bad agentic option"):
        AgenticSpec.parse("agentic:bogus=1")


def test_agentic_open_loop_is_a_conversation_trace_without_sessions() -> None:
    """``open_loop=1``: every turn has its own arrival time, ``turn_gap_s`` after the previous
    turn's, and extends it as before; ``session_ids=0``: no session ids. The default spec's
    requests are untouched by the new knobs."""
    base = dict(sessions=30, system_prompts=2, tool_sets=1, mean_turns=4, seed=5)
    closed = generate(AgenticSpec(**base), block_size=64)  # type: ignore[arg-type]
    spec = AgenticSpec.parse(
        "agentic:sessions=30,system_prompts=2,tool_sets=1,mean_turns=4,seed=5,"
        "open_loop=1,turn_gap_s=20,session_ids=0"
    )
    assert (spec.open_loop, spec.turn_gap_s, spec.session_ids) == (1, 20.0, 0)
    w = generate(spec, block_size=64)
    assert all(r.after is None and r.session_id is None for r in w.requests)
    turns: dict[str, list[SimRequest]] = {}
    for r in w.requests:
        turns.setdefault(r.request_id.split("t")[0], []).append(r)
    grown = 0
    for chain in turns.values():
        chain.sort(key=lambda r: int(r.request_id.split("t")[1]))
        for prev, nxt in itertools.pairwise(chain):
            assert nxt.arrival_s > prev.arrival_s
            head = list(prev.block_hashes) + list(prev.output_block_hashes)
            assert list(nxt.block_hashes[: len(head)]) == head
            grown += 1
    assert grown > 10
    again = generate(AgenticSpec(**base), block_size=64)  # type: ignore[arg-type]
    assert [r.block_hashes for r in again.requests] == [r.block_hashes for r in closed.requests]
    assert [r.delay_s for r in again.requests] == [r.delay_s for r in closed.requests]


def test_bailian_duplicate_chat_id_is_an_error_naming_both_lines(tmp_path: Path) -> None:
    """Two rows with one ``chat_id`` would be one request id twice: the run merged their
    records (one counted twice, the other lost) or crashed when they overlapped."""
    row = {"chat_id": 5, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 50}
    path = write(tmp_path / "dup.jsonl", [row, {**row, "chat_id": 6}, {**row, "timestamp": 1.0}])
    with pytest.raises(ConfigError, match=r"dup\.jsonl:3: chat_id 5 already on line 1"):
        load_trace(str(path), block_size=64)


@pytest.mark.parametrize(
    ("fmt", "text", "message"),
    [
        ("mooncake", '{"timestamp": NaN, "input_length": 5}', "'timestamp' must be a finite"),
        ("mooncake", '{"timestamp": 0, "input_length": Infinity}', "'input_length' must be a fin"),
        ("bailian", '{"chat_id": 1, "timestamp": "abc", "input_length": 5}', "'timestamp' must"),
        ("bailian", '{"chat_id": 1, "timestamp": [1], "input_length": 5}', "'timestamp' must"),
        ("bailian", '{"chat_id": 1, "timestamp": NaN, "input_length": 5}', "'timestamp' must"),
        ("bailian", '{"chat_id": 1, "timestamp": -1, "input_length": 5}', "'timestamp' must"),
    ],
)
def test_non_finite_or_non_numeric_fields_name_their_line(
    tmp_path: Path, fmt: str, text: str, message: str
) -> None:
    """A value that is not a finite non-negative number (JSON's NaN / Infinity, a string, a
    list) is a ConfigError naming the file and line, not a traceback (OverflowError,
    TypeError) or a bare ``cannot convert float NaN to integer``."""
    path = tmp_path / "bad.jsonl"
    good = {"timestamp": 0, "input_length": 5, "output_length": 1}
    if fmt == "bailian":
        good["chat_id"] = 0
    path.write_text(json.dumps({**good, "session_id": "s"}) + "\n" + text + "\n")
    with pytest.raises(ConfigError, match=message) as exc:
        load_trace(str(path), block_size=64, fmt=fmt)
    assert "bad.jsonl:2" in str(exc.value)


@pytest.mark.parametrize(
    ("fmt", "first", "second"),
    [
        (
            "mooncake",
            '{"timestamp": 1767225600000, "input_length": 5, "output_length": 1}',
            '{"input_length": 5, "output_length": 1}',
        ),
        (
            "bailian",
            '{"chat_id": 1, "timestamp": 1767225600, "input_length": 5, "output_length": 1}',
            '{"chat_id": 2, "input_length": 5, "output_length": 1}',
        ),
    ],
    ids=["mooncake", "bailian"],
)
def test_a_row_without_a_timestamp_is_an_error_naming_its_line(
    tmp_path: Path, fmt: str, first: str, second: str
) -> None:
    """Every row of the formats has its arrival (docs/simulator.md "Traces"). Read as 0, a
    row without one among rows on the wall clock (a recording's ms since the epoch) arrived
    first and every other one about 1.77e9 s after it: the replay's offered load was one
    request, then nothing for 56 years."""
    path = tmp_path / "bad.jsonl"
    path.write_text(first + "\n" + second + "\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: missing 'timestamp'"):
        load_trace(str(path), block_size=64, fmt=fmt)


def test_a_line_that_is_not_utf8_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b'{"timestamp": 0, "input_length": 5}\n\xff\xfe{}\n')
    with pytest.raises(ConfigError, match=r"bin\.jsonl:2: not UTF-8"):
        load_trace(str(path), block_size=64)


def test_agentic_limit_keeps_the_first_sessions_as_its_recorded_rows_do(tmp_path: Path) -> None:
    """``agentic:... --limit N`` is the first N requests in the order sessions start, whole
    sessions first, as the same workload written as recorded rows (``to_trace_rows``, what
    ``kvrouter bench live`` replays and simulates) and read back with ``limit=N`` gives; it
    was every session's first turn (all open loop, spread over the whole trace) and a few
    follow-ups, another workload than the live bench's under the same limit."""
    from sim.agentic import to_trace_rows
    from sim.runner import build_workload

    text = "agentic:sessions=12,session_rate=0.2,mean_turns=4,seed=3"
    whole = build_workload(text, block_size=64)
    path = write(tmp_path / "agentic.jsonl", to_trace_rows(whole))  # type: ignore[arg-type]
    n = len(whole) // 2
    assert n > 12  # more than one turn a session fits in the limit
    head = build_workload(text, block_size=64, limit=n)
    rows = load_trace(str(path), block_size=64, limit=n)

    def shape(requests: list[SimRequest]) -> list[tuple[str | None, int, bool]]:
        return [(r.session_id, r.prompt_tokens, r.after is not None) for r in requests]

    assert shape(head.requests) == shape(rows.requests)


def test_a_recording_in_completion_order_is_replayed_in_arrival_order(tmp_path: Path) -> None:
    """The recorder writes a row when its request completes: a long request that came first
    is written after short ones that came later. The simulator reads arrivals from 0 in
    arrival order (the ceilings walk the requests in list order), each session's turns
    still in order."""
    rows = [
        {"timestamp": 5_000, "input_length": 100, "output_length": 2, "hash_ids": [7]},
        {"timestamp": 6_000, "input_length": 100, "output_length": 2, "hash_ids": [8],
         "session_id": "s"},
        {"timestamp": 4_000, "input_length": 900, "output_length": 90, "hash_ids": [1, 2]},
        {"timestamp": 9_000, "input_length": 200, "output_length": 2, "hash_ids": [8, 9],
         "session_id": "s", "delay": 100},
    ]  # fmt: skip
    w = load_trace(str(write(tmp_path / "rec.jsonl", rows)), block_size=64)
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals[:3] == pytest.approx([0.0, 1.0, 2.0])  # 4 s, 5 s, 6 s from the first
    assert w.requests[0].prompt_tokens == 900
    turn = w.requests[3]
    assert turn.after == w.requests[2].request_id and turn.delay_s == pytest.approx(0.1)


def test_fresh_and_wrapping_ids_never_alias_another_blocks_tokens(tmp_path: Path) -> None:
    """Token content is ``(k * trace_block + j) mod 2**32``: ids ``2**32 / trace_block``
    apart got the same tokens. The fresh ids for a row without (enough) ``hash_ids`` (the
    recorder writes ``[]`` where its block size does not divide 512) started at ``2**40``,
    which wraps to id 0: such a row shared the first row's whole prefix; Bailian ids were
    used raw, so ``2**28`` shared id 0's tokens at 16-token blocks. Unrelated prompts must
    share no block."""
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [5, 6]},
        {"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": []},
        {"timestamp": 2, "input_length": 1024, "output_length": 1},
    ]
    w = load_trace(str(write(tmp_path / "m.jsonl", rows)), block_size=64)
    chains = [set(r.block_hashes) for r in w.requests]
    assert all(len(c) == 16 for c in chains)
    assert not chains[0] & chains[1] and not chains[0] & chains[2]
    assert not chains[1] & chains[2]
    wrap = 1 << 28  # 2**32 / 16
    bailian = [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 64,
         "output_length": 1, "hash_ids": [0, 1, 2, 3]},
        {"chat_id": 2, "parent_chat_id": -1, "timestamp": 1.0, "input_length": 64,
         "output_length": 1, "hash_ids": [wrap, wrap + 1, wrap + 2, wrap + 3]},
        {"chat_id": 3, "parent_chat_id": -1, "timestamp": 2.0, "input_length": 64,
         "output_length": 1, "hash_ids": []},
    ]  # fmt: skip
    w = load_trace(str(write(tmp_path / "b.jsonl", bailian)), block_size=16)
    chains = [set(r.block_hashes) for r in w.requests]
    assert all(len(c) == 4 for c in chains)
    assert not chains[0] & chains[1] and not chains[0] & chains[2]


def test_a_closed_loop_turn_waits_for_its_sessions_last_answer_in_a_merged_trace(
    tmp_path: Path,
) -> None:
    """``kvrouter trace merge`` orders rows by arrival and measures a turn's ``delay`` from
    the latest finish (``timestamp + e2e_ms``) of its session's earlier requests. With two
    requests of a session in flight (A long, B short, arrived while A ran), the next turn C
    came 0.5 s after A's answer; the reader attached it to the last row (B) instead, so the
    replay sent C while A was still being answered, seconds early."""
    from router.trace_merge import merge

    rows = [
        {"timestamp": 1_000, "input_length": 100, "output_length": 2, "hash_ids": [2],
         "session_id": "s", "e2e_ms": 1_000.0},
        {"timestamp": 0, "input_length": 900, "output_length": 900, "hash_ids": [1, 3],
         "session_id": "s", "e2e_ms": 10_000.0},
        {"timestamp": 10_500, "input_length": 1100, "output_length": 2, "hash_ids": [1, 3, 4],
         "session_id": "s", "e2e_ms": 50.0},
    ]  # fmt: skip
    merged = merge(rows)
    assert [r["timestamp"] for r in merged] == [0, 1_000, 10_500]
    assert merged[2]["delay"] == 500 and "delay" not in merged[1]
    w = load_trace(str(write(tmp_path / "merged.jsonl", merged)), block_size=64)
    by_prompt = {r.prompt_tokens: r for r in w.requests}
    a, b, c = by_prompt[900], by_prompt[100], by_prompt[1100]
    assert b.after is None and b.arrival_s == pytest.approx(1.0)
    assert c.after == a.request_id and c.delay_s == pytest.approx(0.5)


def test_agentic_mean_turns_counts_the_turns_after_the_first() -> None:
    """``mean_turns`` is the mean number of follow-ups (docs/simulator.md): sessions have
    ``mean_turns + 1`` turns on average and at least two; the default spec's 200 sessions
    are the 1,798 requests the documented figures were measured on."""
    small = dict(system_tokens=64, tool_def_tokens=64, user_tokens=16, answer_tokens=16)
    spec = AgenticSpec(sessions=2000, mean_turns=4, max_turns=1000, tool_tokens=16, **small)
    w = generate(spec, block_size=64)
    turns: dict[str, int] = {}
    for r in w.requests:
        turns[str(r.session_id)] = turns.get(str(r.session_id), 0) + 1
    assert min(turns.values()) == 2
    assert sum(turns.values()) / len(turns) == pytest.approx(5.0, abs=0.25)
    assert len(generate(AgenticSpec(), block_size=64)) == 1798


def test_closed_loop_sessions_without_ids_are_not_written_as_open_loop_rows() -> None:
    """Recorded rows tie a follow-up to its previous turn by ``session_id``: a closed-loop
    workload without session ids (``agentic:session_ids=0``) was written with ``delay`` but no
    session, which readers (the simulator's and the live replay's, ``kvrouter demo
    --agentic``) take as open loop at the row's timestamp, the session's start: every turn
    of a session arrived at once. Such a workload cannot be written as rows."""
    from sim.agentic import to_trace_rows

    w = generate(AgenticSpec(sessions=4, mean_turns=3, session_ids=0, seed=1), block_size=64)
    assert any(r.after is not None for r in w.requests)
    with pytest.raises(ConfigError, match="session_ids=0"):
        to_trace_rows(w)
    spec = AgenticSpec(sessions=4, mean_turns=3, session_ids=0, open_loop=1, seed=1)
    rows = to_trace_rows(generate(spec, block_size=64))  # open loop: nothing to tie
    assert rows and not any("delay" in row or "session_id" in row for row in rows)


def test_bailian_sessions_follow_the_parent_chain_whatever_the_row_order(
    tmp_path: Path,
) -> None:
    """The reader sorts Bailian rows by timestamp itself, so files need not be sorted; but the
    session (the chain's root) was resolved in file order: a turn listed before its parent
    got the parent's id as its session, one conversation split in two."""
    base = {"input_length": 32, "output_length": 1, "type": "text", "hash_ids": [1, 2]}
    rows = [
        {**base, "chat_id": 1, "parent_chat_id": -1, "timestamp": 0.0, "turn": 1},
        {**base, "chat_id": 3, "parent_chat_id": 2, "timestamp": 2.0, "turn": 3},
        {**base, "chat_id": 2, "parent_chat_id": 1, "timestamp": 1.0, "turn": 2},
    ]
    w = load_trace(str(write(tmp_path / "b.jsonl", rows)), block_size=16)
    assert [r.request_id for r in w.requests] == ["c1", "c2", "c3"]
    assert [r.session_id for r in w.requests] == ["1", "1", "1"]


def test_a_bailian_limit_keeps_the_first_arrivals(tmp_path: Path) -> None:
    """``limit`` cut the file's first rows before sorting them by timestamp: a file not in
    arrival order gave later requests than the first ``limit`` arrivals."""
    rows = [
        {"chat_id": i, "parent_chat_id": -1, "timestamp": float(ts), "input_length": 16 * n,
         "output_length": 1, "hash_ids": list(range(10 * i, 10 * i + n))}
        for i, (ts, n) in enumerate(((3, 1), (1, 2), (2, 3)))
    ]  # fmt: skip
    w = load_trace(str(write(tmp_path / "b.jsonl", rows)), block_size=16, limit=2)
    assert [r.prompt_tokens for r in w.requests] == [32, 48]
    assert [r.arrival_s for r in w.requests] == [0.0, 1.0]


def test_a_recording_of_several_models_replays_the_one_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pod serving two models records both into one trace (each row names its ``model``);
    the simulator replayed every row as one model on one fleet, silently: the other model's
    load and cache on the replicas of this one. ``--model`` naming a recorded model now
    replays its rows alone; without one, the replay says it mixes them."""
    from router.recorder import RecordSettings, TraceRecorder

    path = tmp_path / "trace.jsonl"
    rec = TraceRecorder(RecordSettings(path, key=b"k" * 32), 0.0, 100.0)
    for i, model in enumerate(("small", "big", "big", "small", "big")):
        toks = list(range(700 + i))
        rec.record(arrived_at=float(i), model=model, input_length=len(toks), output_length=3,
                   block_hashes=hash_prompt(toks, 64, root_hash(model)).hashes,
                   block_size=64)  # fmt: skip
    rec.close()
    assert len(load_trace(str(path), block_size=64, model="big")) == 3
    assert len(load_trace(str(path), block_size=64, model="small")) == 2
    with caplog.at_level("WARNING"):
        assert len(load_trace(str(path), block_size=64)) == 5
    assert "rows of 2 models (big, small) replayed as one" in caplog.text, caplog.text


@pytest.mark.parametrize(
    ("fmt", "text", "message"),
    [
        ("mooncake", '{"timestamp": 0, "input_length": 700.6}', "'input_length' must be a whole"),
        ("mooncake", '{"timestamp": 0, "input_length": 7, "output_length": 2.5}', "'output_l"),
        ("bailian", '{"chat_id": 1, "timestamp": 0, "input_length": 9.9}', "'input_length'"),
    ],
)
def test_a_fractional_length_is_an_error_not_cut_down(
    tmp_path: Path, fmt: str, text: str, message: str
) -> None:
    """A token count with a fraction was cut down without a word (700.6 tokens replayed as
    700): a row no recorder writes, whose meaning is unknown. A whole number written as a
    float (700.0) is that number."""
    path = tmp_path / "bad.jsonl"
    good = {"timestamp": 0, "input_length": 5.0, "output_length": 1}
    if fmt == "bailian":
        good["chat_id"] = 0
    path.write_text(json.dumps(good) + "\n" + text + "\n")
    with pytest.raises(ConfigError, match=message) as exc:
        load_trace(str(path), block_size=64, fmt=fmt)
    assert "bad.jsonl:2" in str(exc.value)


def test_fractional_milliseconds_are_kept(tmp_path: Path) -> None:
    """A Mooncake row's ``timestamp`` and a recorded row's ``delay`` are ms; a fraction of
    one was dropped (1000.6 ms after a row at 0.4 ms arrived 1.000 s after it, not 1.0002 s;
    a delay of 250.9 ms was 250 ms), so a trace of sub-ms arrivals replayed bunched."""
    rows = [
        {"timestamp": 0.4, "input_length": 100, "output_length": 2, "hash_ids": [1],
         "session_id": "s", "e2e_ms": 0.6},
        {"timestamp": 1000.6, "input_length": 100, "output_length": 2, "hash_ids": [2]},
        {"timestamp": 1251.9, "input_length": 100, "output_length": 2, "hash_ids": [1, 3],
         "session_id": "s", "delay": 1250.9},
    ]  # fmt: skip
    w = load_trace(str(write(tmp_path / "ms.jsonl", rows)), block_size=64)
    a, b, c = w.requests
    assert b.arrival_s == pytest.approx(1.0002, abs=1e-9)
    assert c.after == a.request_id and c.delay_s == pytest.approx(1.2509, abs=1e-9)


@pytest.mark.parametrize(
    ("fmt", "first", "second"),
    [
        (
            "mooncake",
            '{"timestamp": 0, "input_length": 5, "output_length": 40}',
            '{"timestamp": 1000, "input_length": 5}',
        ),
        (
            "recorded",
            '{"timestamp": 0, "input_length": 5, "output_length": 40, "session_id": "s"}',
            '{"timestamp": 1000, "input_length": 5, "session_id": "s"}',
        ),
        (
            "bailian",
            '{"chat_id": 1, "timestamp": 0, "input_length": 5, "output_length": 40}',
            '{"chat_id": 2, "timestamp": 1, "input_length": 5}',
        ),
    ],
    ids=["mooncake", "recorded", "bailian"],
)
def test_a_row_without_its_output_length_is_an_error_naming_its_line(
    tmp_path: Path, fmt: str, first: str, second: str
) -> None:
    """Every format's row carries its output length (docs/simulator.md "Traces": Mooncake's
    published traces on every row, the router's recorder always writes it, Bailian's rows
    list it). Read as 1 output token, a row without it decoded one token: its TPOT was no
    figure, it met the TPOT half of the SLO by having none, and it loaded its replica's
    batch for one step, all with no word said."""
    path = tmp_path / "bad.jsonl"
    path.write_text(first + "\n" + second + "\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: missing 'output_length'"):
        load_trace(str(path), block_size=64, fmt=fmt)


def test_rows_a_replica_refused_as_the_clients_error_are_skipped_aloud(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A recorded row whose request a replica refused as the client's error (a 4xx but
    408 / 429 / 499) is not offered again, as the router's own refusals are no row; the
    reader dropped such rows without a word, so a replay offered fewer requests than the
    file holds and nothing said why. A shed (429), a client that left (499) and a 5xx
    are offered load, replayed."""
    rows = [
        {"timestamp": 0, "input_length": 64, "output_length": 3, "hash_ids": [1]},
        {"timestamp": 1, "input_length": 64, "output_length": 3, "hash_ids": [2], "status": 400},
        {"timestamp": 2, "input_length": 64, "output_length": 3, "hash_ids": [3], "status": 429},
        {"timestamp": 3, "input_length": 64, "output_length": 3, "hash_ids": [4], "status": 499},
        {"timestamp": 4, "input_length": 64, "output_length": 3, "hash_ids": [5], "status": 503},
        {"timestamp": 5, "input_length": 64, "output_length": 3, "hash_ids": [6], "status": 404},
    ]
    path = write(tmp_path / "statuses.jsonl", rows)
    with caplog.at_level("WARNING"):
        w = load_trace(str(path), block_size=64)
    assert [r.arrival_s for r in w.requests] == [0.0, 0.002, 0.003, 0.004]
    assert f"{path}: 2 rows skipped" in caplog.text, caplog.text
    assert "lines 2, 6" in caplog.text, caplog.text
