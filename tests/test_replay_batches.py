"""A recorded completions batch (router/recorder.py: one row per prompt, one ``batch`` id on
all of them) replayed live (router/demo/replay.py) as the service received it: one
``/v1/completions`` request whose ``prompt`` lists the rows' prompts, judged per sequence."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from router.demo.replay import count_requests, load_requests, replay
from router.service.config import build_settings
from tests.backends import start_mock, start_router
from tests.waiting import eventually


def _rows_file(tmp_path: pathlib.Path, rows: list[dict[str, object]]) -> pathlib.Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


BATCH = {"endpoint": "completions", "batch": "b1", "n": 2, "stream": True, "session_id": "s"}
ROWS: list[dict[str, object]] = [
    {"timestamp": 0, "input_length": 300, "output_length": 4, "hash_ids": [1], **BATCH},
    {"timestamp": 0, "input_length": 1200, "output_length": 4, "hash_ids": [2, 3, 4], **BATCH},
    {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [5, 6], **BATCH},
    {"timestamp": 5, "input_length": 300, "output_length": 4, "hash_ids": [7],
     "endpoint": "completions"},
    # the session's next turn, tied to the batch's last row (no finish times: the last)
    {"timestamp": 9, "input_length": 400, "output_length": 4, "hash_ids": [2, 8],
     "endpoint": "completions", "session_id": "s", "delay": 1},
]  # fmt: skip


def test_a_batch_is_loaded_as_one_request_of_its_prompts(tmp_path: pathlib.Path) -> None:
    """The live replay sent each row of a batch as a request of its own: the service would
    route k requests apart, where the recorded one was one request routed once."""
    path = _rows_file(tmp_path, ROWS)
    requests = load_requests(path, 10, "m", max_output=64)
    assert count_requests(path, 10) == len(requests) == 3
    batch = requests[0]
    body = json.loads(batch.body)
    prompts = body["prompt"]
    assert [len(p) for p in prompts] == [300, 1200, 600]  # in row order
    assert (body["n"], body["max_tokens"], body["stream"]) == (2, 4, True)
    assert (batch.prompt_tokens, batch.prompts, batch.samples) == (2100, 3, 2)
    # each prompt is its row's, as the simulator hashes it
    alone = [json.loads(r.body)["prompt"] for r in requests[1:]]
    assert prompts[1][:400] == alone[1]  # the turn's 400 tokens of their shared block (id 2)
    # the turn tied to a row of the batch follows the batch's request
    assert requests[2].after == 0 and requests[1].after is None


async def test_a_recorded_batch_replays_through_the_router_as_one_request(
    tmp_path: pathlib.Path,
) -> None:
    """Through a real router (recording what it serves) in front of a mock replica: the
    router records the replayed batch as a batch again (it came as one request), and the
    replay judges it per sequence: its usage sums 3 prompts x 2 samples x 4 tokens, its
    TPOT is one sequence's."""
    from router.mock.server import MockSettings

    path = _rows_file(tmp_path, ROWS[:4])
    requests = load_requests(path, 10, "m", max_output=64)
    trace = tmp_path / "again.jsonl"
    mock, mock_url = await start_mock(MockSettings(model="m", replica="r0", time_scale=0.02))
    router, url = await start_router(
        build_settings({
            "replicas": [{"url": mock_url, "model": "m", "name": "r0"}],
            "server": {"record_path": str(trace), "record_key": "k"},
            "models": {"m": {"block_size": 16}},
        })
    )  # fmt: skip
    try:
        outcomes = await replay(url, requests, 10.0)

        def rows() -> list[dict[str, Any]]:
            text = trace.read_text() if trace.is_file() else ""
            return [json.loads(line) for line in text.splitlines()]

        await eventually(lambda: len(rows()) >= 4, timeout=20)
    finally:
        await router.cleanup()
        await mock.cleanup()
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    assert len(outcomes) == 2
    batch, alone = outcomes
    assert batch.output_tokens == 24 and batch.prompt_tokens >= 2100
    assert alone.output_tokens == 4 and alone.prompts == 1
    assert batch.tpot_s() == (batch.e2e_s - batch.ttft_s) / 3  # one sequence's 4 tokens
    recorded = sorted(rows(), key=lambda r: "batch" not in r)
    assert [r["input_length"] for r in recorded[:3]] == [300, 1200, 600]
    assert len({r.get("batch") for r in recorded[:3]}) == 1 and "batch" in recorded[0]
    assert "batch" not in recorded[3] and recorded[0]["n"] == 2
