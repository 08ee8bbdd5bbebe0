"""A recorded completions batch (router/recorder.py: one row per prompt, one ``batch`` id on
all of them) replayed as the service received it: live (router/demo/replay.py) one
``/v1/completions`` request whose ``prompt`` lists the rows' prompts, judged per sequence;
simulated (sim/cluster.py, sim/fanout.py) one request whose load counts every row until the
last one ends, as the service's tracker books a batch (``LoadTracker.dispatch``
``prompts``)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from router.core.errors import ConfigError
from router.core.load import LoadView
from router.demo.replay import count_requests, load_requests, replay
from router.recorder import RecordSettings, TraceRecorder, record_key
from router.service.config import build_settings
from sim.cluster import ClusterConfig, Simulation
from sim.profiles import load_profile
from sim.workload import SimRequest, load_trace
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


@pytest.mark.parametrize("endpoint", ["chat", "responses", "messages"])
def test_a_batch_on_another_endpoint_is_refused_by_reader_and_recorder(
    tmp_path: pathlib.Path, endpoint: str
) -> None:
    """Only completions take a batch of prompts. The simulator ran a chat row's ``batch``
    as one batch while the live replay sent its rows apart, so the two disagreed on the
    same trace: such a row is an error where it is read and where it would be written."""
    rows = [{**row, "endpoint": endpoint} for row in ROWS[:3]]
    path = _rows_file(tmp_path, rows)
    with pytest.raises(ConfigError, match="'batch' is for completions rows"):
        load_trace(str(path), block_size=64)
    with pytest.raises(ConfigError, match="'batch' is for completions rows"):
        count_requests(path, 10)
    recorder = TraceRecorder(RecordSettings(tmp_path / "t.jsonl", key=record_key("k")), 0.0, 0.0)
    with pytest.raises(ValueError, match="goes to completions"):
        recorder.record(arrived_at=0.0, model="m", input_length=64, output_length=1,
                        block_hashes=[1], block_size=64, endpoint=endpoint,
                        batch=recorder.next_batch())  # fmt: skip
    recorder.close()


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
    assert batch.tpot_s() == (batch.last_s - batch.ttft_s) / 3  # one sequence's 4 tokens
    recorded = sorted(rows(), key=lambda r: "batch" not in r)
    assert [r["input_length"] for r in recorded[:3]] == [300, 1200, 600]
    assert len({r.get("batch") for r in recorded[:3]}) == 1 and "batch" in recorded[0]
    assert "batch" not in recorded[3] and recorded[0]["n"] == 2


class _Spy(Simulation):
    """A simulation that keeps its router's load view of every replica when ``probe``
    arrives (what a policy sees then)."""

    probe = ""
    seen: dict[str, LoadView]

    def _arrive(self, req: SimRequest, now: float) -> None:
        if req.request_id == self.probe:
            load = self.routers[0].engine.load
            self.seen = {str(k): load.view(k, now) for k in self.keys}
        super()._arrive(req, now)


def test_the_simulator_books_a_batch_s_load_until_its_last_row_ends(
    tmp_path: pathlib.Path,
) -> None:
    """The service books a batch as one flight of all its prompts (``prompts``: each
    prompt's sequences decoding, every prompt's tokens in flight) until the whole answer
    ends. The simulator booked it under its first row and released it when that row
    finished: a request arriving while the batch's other rows still decoded saw the
    replica idle. (Its rows decode one output, sim.workload ``batch_outputs``: the first
    row, prefilled first, ends a little before the other; the probe comes in between, where
    a first run without it saw the rows end.)"""
    short = {"timestamp": 0, "input_length": 300, "output_length": 400, "hash_ids": [1],
             "batch": "b1"}  # fmt: skip
    long = {**short, "input_length": 1200, "hash_ids": [2, 3, 4]}
    config = ClusterConfig(profile=load_profile("dense-70b"), replicas=2, block_size=64)
    alone = load_trace(str(_rows_file(tmp_path, [short, long])), block_size=64)
    dry = Simulation(alone, config, "round_robin")
    dry.run()
    ends = [dry._records[r.request_id].finish * 1000.0 for r in alone.requests]
    at = int(ends[0]) + 1  # ms: after the first row's end, before the other's
    assert ends[0] < at < ends[1], ends
    probe = {"timestamp": at, "input_length": 300, "output_length": 2, "hash_ids": [9]}
    workload = load_trace(str(_rows_file(tmp_path, [short, long, probe])), block_size=64)
    sim = _Spy(workload, config, "round_robin")
    first, other, later = workload.requests
    sim.probe = later.request_id
    assert sim.run().summary["completed"] == 2  # the batch is one request (its rows all ended)
    records = sim._records
    # the probe came after the first row's answer, while the other row still decoded
    assert records[first.request_id].finish < at / 1000.0 < records[other.request_id].finish
    view = sim.seen[str(sim.keys[records[first.request_id].replica])]
    assert (view.prefilling, view.decoding) == (0, 2)  # one sequence a prompt
    assert view.in_flight_prompt_tokens == 1500
    for key in sim.keys:  # nothing is left booked once every row ended
        assert sim.routers[0].engine.load.view(key, 1e9).in_flight == 0


def test_the_simulator_sends_a_turn_tied_to_a_batch_s_row_after_the_whole_batch(
    tmp_path: pathlib.Path,
) -> None:
    """The service answers a batch as one request: a session's next turn comes after that
    answer, all of it (the live replay's turn follows the batch's one request), not after
    the row it was tied to, here the batch's first (the one recorded to finish last), which
    the simulator ends a little before the other (prefilled first, both decode the batch's
    one output)."""
    long = {"timestamp": 0, "input_length": 1200, "output_length": 400, "e2e_ms": 50,
            "hash_ids": [2, 3, 4], "batch": "b1", "session_id": "s"}  # fmt: skip
    short = {**long, "input_length": 300, "e2e_ms": 10, "hash_ids": [1]}
    turn = {"timestamp": 100, "input_length": 300, "output_length": 2, "hash_ids": [9],
            "session_id": "s", "delay": 10}  # fmt: skip
    workload = load_trace(str(_rows_file(tmp_path, [long, short, turn])), block_size=64)
    first, other, later = workload.requests
    assert later.after == first.request_id  # the row of its session that finished last
    config = ClusterConfig(profile=load_profile("dense-70b"), replicas=2, block_size=64)
    sim = Simulation(workload, config, "round_robin")
    assert sim.run().summary["completed"] == 2  # the batch is one request (its rows all ended)
    records = sim._records
    assert records[first.request_id].finish < records[other.request_id].finish
    assert records[later.request_id].arrival >= records[other.request_id].finish + 0.01


def test_the_simulator_judges_a_batch_once_as_the_live_figures_do(
    tmp_path: pathlib.Path,
) -> None:
    """The same trace with a batch through the simulator's figures (sim/metrics.py) and the
    live replay's (router/demo/figures.py over the ``Outcome`` each request's client
    measures, grouped as router/demo/replay.py ``load_requests`` sends them): one request
    of the batch, judged once by its summed prompt's tier, its first token and its last end.
    The simulator judged each row on its own, by its own prompt's tier, and counted each
    in goodput's denominator. Here a short prompt's target cannot be met and a long one's
    cannot be missed: the batch (three short rows, 2100 tokens in all) meets its SLO, the
    request alone misses it."""
    from router.core.slo import SloTargets, SloTier
    from router.demo.figures import summarize as live_figures
    from router.demo.replay import Outcome

    path = _rows_file(tmp_path, ROWS[:4])
    slo = SloTargets((SloTier(1500, 1e-9), SloTier(None, 1e9)), 1e9)
    workload = load_trace(str(path), block_size=64)
    config = ClusterConfig(profile=load_profile("dense-70b"), replicas=2, block_size=64, slo=slo)
    sim = Simulation(workload, config, "round_robin")
    figures = sim.run().summary
    # what each request's client measured, from the simulated rows it went in
    rows = iter(sim._records[r.request_id] for r in workload.requests)
    outcomes = []
    for req in load_requests(path, 10, "m", max_output=64):
        recs = [next(rows) for _ in range(req.prompts)]
        arrival = recs[0].arrival
        outcomes.append(
            Outcome(
                True,
                min(r.first for r in recs) - arrival,
                sum(r.prompt for r in recs),
                e2e_s=max(r.finish for r in recs) - arrival,
                output_tokens=sum(r.output * r.samples for r in recs),
                samples=req.samples,
                prompts=req.prompts,
            )
        )
    live = live_figures(outcomes, slo)
    assert (live["requests"], live["goodput"]) == (2, 0.5)
    assert (figures["requests"], figures["completed"]) == (live["requests"], live["ok"])
    assert figures["goodput"] == live["goodput"]
    assert figures["goodput_by_slo_scale"] == live["goodput_by_slo_scale"]
    assert figures["goodput_by_tier"] == {"le1500": 0.0, "any": 1.0}
    for name in ("ttft_p50", "ttft_p90", "e2e_p50", "e2e_p90", "tpot_p50"):
        sim_name = name.replace("_p", "_ms_p")
        assert figures[sim_name] == pytest.approx(live[f"{name}_ms"], abs=0.1), name


def test_sim_replay_counts_a_batch_as_one_request_in_its_json(tmp_path: pathlib.Path) -> None:
    """``kvrouter sim replay --json`` printed the trace's rows as ``requests`` (over the
    summary's count of requests), so a batch of three rows and one request alone read as
    4 requests, 2 completed, goodput 1.0: goodput's denominator is 2, the requests the
    clients sent, as the live figures count them (``count_requests``)."""
    from tests.inprocess import kvrouter

    path = _rows_file(tmp_path, ROWS[:4])
    assert count_requests(path, 10) == 2
    one = ["--replicas", "1", "--json", "--no-progress"]
    p = kvrouter("sim", "replay", str(path), "--policy", "round_robin", *one)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert (doc["requests"], doc["completed"], doc["goodput"]) == (2, 2, 1.0)
    p = kvrouter("sim", "replay", str(path), "--policy", "round_robin,random", *one)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["requests"] == 2
    assert [(r["requests"], r["completed"]) for r in doc["runs"]] == [(2, 2), (2, 2)]
    p = kvrouter("sim", "replay", str(path), "--policy", "round_robin", "--replicas", "1")
    assert p.returncode == 0, p.stderr
    assert "\n2 requests, speed-up" in p.stdout
