"""A completions batch decodes one output for every prompt in both replays: the live replay
(router/demo/replay.py) sends a batch's rows as one request with one ``max_tokens``, the
largest row's, so every prompt decodes it; the simulator decoded each row its own output,
and judged and timed a batch the live request could not be (sim.workload
``batch_outputs``, the one rule)."""

from __future__ import annotations

import json
import pathlib

from router.core.slo import sequence_tokens
from router.demo.replay import load_requests
from sim.cluster import ClusterConfig, Simulation
from sim.metrics import answers
from sim.profiles import load_profile
from sim.workload import load_trace

BATCH = {"endpoint": "completions", "batch": "b1", "stream": True}
ROWS: list[dict[str, object]] = [
    {"timestamp": 0, "input_length": 300, "output_length": 2, "hash_ids": [1], **BATCH},
    {"timestamp": 0, "input_length": 1200, "output_length": 40, "hash_ids": [2, 3, 4], **BATCH},
    {"timestamp": 0, "input_length": 600, "output_length": 7, "hash_ids": [5, 6], **BATCH},
    {"timestamp": 5, "input_length": 300, "output_length": 3, "hash_ids": [7]},
]  # fmt: skip


def _trace(tmp_path: pathlib.Path, rows: list[dict[str, object]]) -> pathlib.Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_each_row_of_a_batch_decodes_the_output_the_live_request_asks_for(
    tmp_path: pathlib.Path,
) -> None:
    path = _trace(tmp_path, ROWS)
    live = load_requests(path, 10, "m", max_output=1000)
    asked = [json.loads(r.body)["max_tokens"] for r in live]
    assert asked == [40, 3]  # one max_tokens for the batch: its largest row's
    workload = load_trace(str(path), block_size=64)
    assert [r.output_tokens for r in workload.requests] == [40, 40, 40, 3]
    config = ClusterConfig(profile=load_profile("dense-70b"), replicas=2, block_size=64)
    sim = Simulation(workload, config, "round_robin")
    assert sim.run().summary["completed"] == 2
    records = [sim._records[r.request_id] for r in workload.requests]
    assert [r.output for r in records] == [40, 40, 40, 3]  # what each engine request decoded
    # judged as the live replay judges the answer: its usage (3 prompts x 40 tokens) over
    # its sequences
    batch, alone = answers(records)
    assert batch.output == sequence_tokens(3 * asked[0], 3) == 40 and alone.output == 3


def test_a_batch_cut_by_the_limit_decodes_the_largest_of_its_kept_rows(
    tmp_path: pathlib.Path,
) -> None:
    """Both replays read the first ``limit`` rows: a batch cut there is the rows kept, and
    its output the largest of theirs, in the live request and in the simulation alike."""
    path = _trace(tmp_path, ROWS[:3])
    live = load_requests(path, 1, "m", max_output=1000)
    assert [json.loads(r.body)["max_tokens"] for r in live] == [2]
    assert [r.output_tokens for r in load_trace(str(path), block_size=64, limit=1).requests] == [2]
    live = load_requests(path, 2, "m", max_output=1000)
    assert [json.loads(r.body)["max_tokens"] for r in live] == [40]
    kept = load_trace(str(path), block_size=64, limit=2).requests
    assert [r.output_tokens for r in kept] == [40, 40]


def test_rows_outside_a_batch_keep_their_own_output(tmp_path: pathlib.Path) -> None:
    rows = [{k: v for k, v in r.items() if k != "batch"} for r in ROWS]
    path = _trace(tmp_path, rows)
    assert [r.output_tokens for r in load_trace(str(path), block_size=64).requests] == [
        2,
        40,
        7,
        3,
    ]
    live = load_requests(path, 10, "m", max_output=1000)
    assert [json.loads(r.body)["max_tokens"] for r in live] == [2, 40, 7, 3]
