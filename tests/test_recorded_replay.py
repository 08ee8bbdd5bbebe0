"""A recording replayed live (router/demo/replay.py: ``kvrouter demo --trace``, the benches)
sends what the simulator replays from the same file: one loader (sim.workload), arrivals
from 0 in arrival order, dense block ids, a limit that keeps the first arrivals, and each
closed-loop turn after the request the simulator ties it to."""

from __future__ import annotations

import asyncio
import json
import pathlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from router.core.hashing import hash_prompt, root_hash
from router.demo.replay import TraceRequest, load_requests, replay
from router.recorder import RecordSettings, TraceRecorder, record_key, session_label
from sim.workload import load_trace
from tests.inprocess import kvrouter
from tests.ports import free_port

KEY = record_key("fleet secret")
WALL = 1_700_000_000.0  # the recorder's wall clock at its start: epoch seconds


def _record(rec: TraceRecorder, toks: list[int], at: float, done: float, **kw: object) -> None:
    chain = hash_prompt(toks, 64, root_hash("m")).hashes
    rec.record(arrived_at=at, model="m", input_length=len(toks), output_length=2,
               block_hashes=chain, block_size=64, finished_at=done, **kw)  # type: ignore[arg-type]  # fmt: skip


def _completion_order_recording(tmp_path: pathlib.Path) -> pathlib.Path:
    """A real recording, rows in order of completion: a long request that came first (A,
    1,500 tokens) is written after a later short one (B), and session s's follow-up (C,
    extending A) came 0.25 s after A's answer."""
    rec = TraceRecorder(RecordSettings(tmp_path / "rec.jsonl", key=KEY), 0.0, WALL)
    a = list(range(1500))
    _record(rec, list(range(9000, 9300)), 2.0, 2.5)  # B
    _record(rec, a, 1.0, 4.0, session_id="s")  # A
    _record(rec, [*a, *range(5000, 5600)], 4.25, 5.0, session_id="s")  # C
    _record(rec, list(range(7000, 7100)), 6.0, 6.5)  # D
    rec.close()
    return tmp_path / "rec.jsonl"


def _prompt(req: TraceRequest) -> list[int]:
    prompt = json.loads(req.body)["prompt"]
    assert isinstance(prompt, list)
    return prompt


def test_a_recording_replays_live_as_the_simulator_replays_it(tmp_path: pathlib.Path) -> None:
    """The live replay read rows in file order (completion order) with their epoch-ms
    timestamps (a first wait of decades) and raw 53-bit ids (which do not fit the uint32
    tokens: it raised); it must send the simulator's requests: same order, same arrivals
    from 0, same prompts (their hashes are the simulator's), same closed-loop ties."""
    path = _completion_order_recording(tmp_path)
    sim = load_trace(str(path), block_size=64, model="m")
    live = load_requests(path, 100, "m", max_output=64)
    assert [r.prompt_tokens for r in live] == [1500, 300, 2100, 100]  # A, B, C, D
    assert [r.prompt_tokens for r in live] == [r.prompt_tokens for r in sim.requests]
    assert [r.arrival_s for r in live] == pytest.approx([0.0, 1.0, 3.25, 5.0])
    root = root_hash("m")
    for lr, sr in zip(live, sim.requests, strict=True):
        prompt = _prompt(lr)
        assert len(prompt) == lr.prompt_tokens and max(prompt) < 2**32
        assert hash_prompt(prompt, 64, root).hashes == list(sr.block_hashes)
    ids = [r.request_id for r in sim.requests]
    assert [None if r.after is None else ids[r.after] for r in live] == [
        r.after for r in sim.requests
    ]
    c = live[2]
    assert c.after == 0 and c.delay_s == pytest.approx(0.25)
    assert c.session_id == session_label("s", KEY)
    assert _prompt(c)[:1024] == _prompt(live[0])[:1024]  # the shared full blocks survive


def test_a_limit_keeps_the_first_arrivals_not_the_first_rows(tmp_path: pathlib.Path) -> None:
    """``--limit N`` on a recording kept its first N rows, i.e. the first N to complete:
    here B and A (arrived second and first); the first two arrivals are A and B, and with
    three, C's previous turn A is kept with it."""
    path = _completion_order_recording(tmp_path)
    for n, expected in ((1, [1500]), (2, [1500, 300]), (3, [1500, 300, 2100])):
        sim = load_trace(str(path), block_size=64, model="m", limit=n)
        live = load_requests(path, n, "m", max_output=64)
        assert [r.prompt_tokens for r in sim.requests] == expected
        assert [r.prompt_tokens for r in live] == expected
    # the first arrivals of a recording whose rows are in completion order
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["input_length"] for r in rows] == [300, 1500, 2100, 100]


def test_a_row_without_hash_ids_is_replayed_at_its_full_length(tmp_path: pathlib.Path) -> None:
    """A row whose ``hash_ids`` are empty (the recorder wrote such rows where the router's
    block size did not divide 512; a hand-made trace may): the live replay sent such a
    prompt empty (the simulator gives it fresh blocks)."""
    row = {"timestamp": 1000, "input_length": 700, "output_length": 2, "hash_ids": []}
    (tmp_path / "rec.jsonl").write_text(json.dumps(row) + "\n")
    (req,) = load_requests(tmp_path / "rec.jsonl", 10, "m", max_output=64)
    assert len(_prompt(req)) == 700 and req.arrival_s == 0.0


@pytest.fixture
async def replica() -> AsyncIterator[tuple[str, list[str]]]:
    """A replica on loopback answering every request with one token and its usage; the
    request with a 300-token prompt (B) is held until the one with 2,100 (C) arrived, or
    10 s (a bound on the failure). Yields its URL and the log of requests (by prompt length)
    arriving and finishing."""
    c_arrived = asyncio.Event()
    log: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = len(body["prompt"])
        log.append(f"sent {n}")
        if n == 2100:
            c_arrived.set()
        if n == 300:
            try:
                await asyncio.wait_for(c_arrived.wait(), 10)
            except TimeoutError:
                log.append("B held for nothing")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        choice = {"index": 0, "text": "a", "finish_reason": "length"}
        usage = {"prompt_tokens": n, "completion_tokens": 1}
        await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        log.append(f"done {n}")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", log
    finally:
        await runner.cleanup()


async def test_a_closed_loop_turn_follows_the_answer_the_simulator_ties_it_to(
    tmp_path: pathlib.Path, replica: tuple[str, list[str]]
) -> None:
    """Session s had two requests in flight: A (first, finished last) and B (arrived while A
    ran); its next turn C came 0.1 s after A's answer (``trace merge`` measures ``delay``
    from the latest finish; the simulator ties C to A). The live replay chained C behind the
    session's last open-loop request in the list, B: here B's answer waits for C, so the
    two never met; C must go once A is answered, B still in flight."""
    from router.trace_merge import merge

    rows = merge([
        {"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [1, 2, 3],
         "session_id": "s", "e2e_ms": 2_000.0},
        {"timestamp": 100, "input_length": 300, "output_length": 1, "hash_ids": [9],
         "session_id": "s", "e2e_ms": 1_000.0},
        {"timestamp": 2_100, "input_length": 2100, "output_length": 1,
         "hash_ids": [1, 2, 3, 4, 5], "session_id": "s", "e2e_ms": 50.0},
    ])  # fmt: skip
    assert rows[2]["delay"] == 100 and "delay" not in rows[1]
    path = tmp_path / "merged.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sim = load_trace(str(path), block_size=64)
    assert sim.requests[2].after == sim.requests[0].request_id
    url, log = replica
    outcomes = await replay(url, load_requests(path, 10, "m", max_output=1), speedup=100.0)
    assert all(o.ok for o in outcomes), outcomes
    assert "B held for nothing" not in log, log
    assert log.index("done 1500") < log.index("sent 2100") < log.index("done 300"), log


def _rows_file(tmp_path: pathlib.Path, rows: list[dict[str, object]]) -> pathlib.Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ENDPOINT_ROWS: list[dict[str, object]] = [
    {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]},  # old row
    {"timestamp": 1, "input_length": 600, "output_length": 3, "hash_ids": [1, 2],
     "endpoint": "completions", "stream": False},
    {"timestamp": 2, "input_length": 700, "output_length": 3, "hash_ids": [1, 3],
     "endpoint": "chat", "stream": True},
    {"timestamp": 3, "input_length": 700, "output_length": 3, "hash_ids": [1, 3],
     "endpoint": "chat", "stream": False},
    {"timestamp": 4, "input_length": 300, "output_length": 3, "hash_ids": [4],
     "endpoint": "responses", "stream": True},
    {"timestamp": 5, "input_length": 300, "output_length": 3, "hash_ids": [4],
     "endpoint": "responses", "stream": False},
    {"timestamp": 6, "input_length": 200, "output_length": 3, "hash_ids": [5],
     "endpoint": "messages", "stream": True},
    {"timestamp": 7, "input_length": 200, "output_length": 3, "hash_ids": [5],
     "endpoint": "messages", "stream": False},
]  # fmt: skip


def test_a_row_is_sent_to_its_endpoint_streamed_as_it_was(tmp_path: pathlib.Path) -> None:
    """Rows name their endpoint and whether they streamed: the live replay sent every one
    as a streaming completion. A row without them (an older recording) still is one."""
    path = _rows_file(tmp_path, ENDPOINT_ROWS)
    live = load_requests(path, 100, "m", max_output=64)
    assert [(r.path, json.loads(r.body).get("stream", False)) for r in live] == [
        ("/v1/completions", True),
        ("/v1/completions", False),
        ("/v1/chat/completions", True),
        ("/v1/chat/completions", False),
        ("/v1/responses", True),
        ("/v1/responses", False),
        ("/v1/messages", True),
        ("/v1/messages", False),
    ]
    chat = json.loads(live[2].body)
    text = chat["messages"][0]["content"]
    # one ASCII character a token (the mock's byte tokenizer: one token each), the shared
    # block the same text in every prompt that has it
    assert len(text) == 700 and text.isascii()
    other = {**ENDPOINT_ROWS[2], "hash_ids": [1, 9]}
    a, b = load_requests(_rows_file(tmp_path, [ENDPOINT_ROWS[2], other]), 2, "m", 64)
    assert _prompt_text(a)[:512] == _prompt_text(b)[:512]
    assert _prompt_text(a)[512:] != _prompt_text(b)[512:]
    assert json.loads(live[4].body)["input"] != text[:300]


def _prompt_text(req: TraceRequest) -> str:
    return str(json.loads(req.body)["messages"][0]["content"])


async def test_every_endpoint_replays_against_a_replica_streamed_or_not(
    tmp_path: pathlib.Path,
) -> None:
    """Each request reaches the mock replica at its endpoint and its answer is read in that
    endpoint's shape: usage from the body, or from the stream (TTFT only for streams)."""
    from router.mock.server import MockSettings
    from tests.backends import start_mock

    path = _rows_file(tmp_path, ENDPOINT_ROWS)
    runner, url = await start_mock(MockSettings(model="m", replica="r0", time_scale=0.01))
    try:
        outcomes = await replay(url, load_requests(path, 100, "m", max_output=64), 100.0)
    finally:
        await runner.cleanup()
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    streamed = [True, False, True, False, True, False, True, False]
    assert [o.ttft_s == o.ttft_s for o in outcomes] == streamed
    assert all(o.e2e_s > 0 and o.output_tokens == 3 for o in outcomes)
    assert [o.prompt_tokens for o in outcomes][:2] == [600, 600]
    lengths = [int(str(r["input_length"])) for r in ENDPOINT_ROWS]
    assert all(o.prompt_tokens >= n for o, n in zip(outcomes, lengths, strict=True))


def test_n_samples_are_replayed_as_one_request_of_n(tmp_path: pathlib.Path) -> None:
    """A row with ``n`` is one request sampling n sequences of one prompt (live: ``n`` in
    the body; simulated: one prefill, n sequences decoded on one replica)."""
    row = {"timestamp": 0, "input_length": 1500, "output_length": 20, "hash_ids": [1, 2, 3]}
    path = _rows_file(tmp_path, [{**row, "n": 3, "endpoint": "chat"}])
    (live,) = load_requests(path, 10, "m", max_output=64)
    assert json.loads(live.body)["n"] == 3
    (sim,) = load_trace(str(path), block_size=64).requests
    assert sim.samples == 3


def _busy(rows: list[dict[str, object]], tmp_path: pathlib.Path) -> list[float]:
    """Each replica's busy time when a fleet of three, routed round robin, replays ``rows``."""
    from sim.cluster import ClusterConfig, Simulation
    from sim.profiles import load_profile

    path = _rows_file(tmp_path, rows)
    workload = load_trace(str(path), block_size=64)
    config = ClusterConfig(profile=load_profile("dense-70b"), replicas=3, block_size=64)
    sim = Simulation(workload, config, "round_robin")
    result = sim.run()
    assert result.summary["completed"] == len(rows)
    return [e.busy_s for e in sim.engines]


def test_the_simulator_runs_n_samples_on_one_replica_prefilling_once(
    tmp_path: pathlib.Path,
) -> None:
    """Live, ``n`` sequences are one request on one replica, which prefills the prompt
    once and decodes n answers; n rows would be n requests, routed apart, each prefilled."""
    row: dict[str, object] = {"timestamp": 0, "input_length": 4000, "output_length": 50,
                              "hash_ids": list(range(8))}  # fmt: skip
    (one,) = [b for b in _busy([row], tmp_path) if b]
    sampled = _busy([{**row, "n": 3}], tmp_path)
    apart = _busy([row, row, row], tmp_path)
    assert sorted(sampled)[:2] == [0.0, 0.0]  # one replica did all of it
    assert one < max(sampled) < sum(apart)
    assert all(b == one for b in apart)


async def test_a_recording_with_n_samples_and_batches_replays_against_a_mock(
    tmp_path: pathlib.Path,
) -> None:
    """The router records ``n`` on a row and a completions batch as one row per prompt;
    ``kvrouter demo --trace`` and ``bench live`` replay them against mock replicas, which
    refused ``n`` > 1 (every such row failed). Each request is answered, its usage summing
    its sequences' tokens (the batch's: both prompts', sent as one request again)."""
    from router.mock.server import MockSettings
    from tests.backends import start_mock

    rec = TraceRecorder(RecordSettings(tmp_path / "rec.jsonl", key=KEY), 0.0, WALL)
    a, b = list(range(700)), list(range(3000, 3300))
    _record(rec, a, 0.0, 0.5, samples=3, stream=True, endpoint="chat")
    _record(rec, a, 0.1, 0.6, samples=2, stream=False, endpoint="completions")
    batch = rec.next_batch()
    for toks in (a, b):  # a batch of two prompts: a row each, at the batch's arrival
        _record(rec, toks, 0.2, 0.7, samples=2, stream=True, endpoint="completions",
                batch=batch)  # fmt: skip
    _record(rec, b, 0.3, 0.8, stream=False, endpoint="chat")
    rec.close()
    requests = load_requests(tmp_path / "rec.jsonl", 10, "m", max_output=64)
    assert [json.loads(r.body).get("n", 1) for r in requests] == [3, 2, 2, 1]
    assert [len(p) for p in json.loads(requests[2].body)["prompt"]] == [700, 300]
    runner, url = await start_mock(MockSettings(model="m", replica="r0", time_scale=0.01))
    try:
        outcomes = await replay(url, requests, 100.0)
    finally:
        await runner.cleanup()
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    assert [o.output_tokens for o in outcomes] == [6, 4, 8, 2]
    assert all(o.prompt_tokens >= r.prompt_tokens for o, r in zip(outcomes, requests, strict=True))


async def test_replayed_figures_judge_n_samples_and_unstreamed_answers_per_sequence(
    tmp_path: pathlib.Path,
) -> None:
    """A replayed row sampling ``n`` answers ``n`` sequences decoded side by side: its TPOT
    is one sequence's (the usage sums all n, which would make it n times too fast), as the
    simulator and the router's own SLO count it. A row recorded unstreamed has no TTFT: the
    figures' TTFT and TPOT leave it out (never NaN), and the SLO judges it by its E2E, when
    the client had its first token, rather than as a miss."""
    from router.core.slo import SloTargets, SloTier
    from router.demo.compare import _columns
    from router.demo.figures import summarize
    from router.mock.server import MockSettings
    from tests.backends import start_mock

    row = {"timestamp": 0, "input_length": 600, "output_length": 8, "hash_ids": [1, 2]}
    rows = [{**row, "hash_ids": [7, 8]}, {**row, "n": 4}, {**row, "timestamp": 1, "stream": False}]
    requests = load_requests(_rows_file(tmp_path, rows), 10, "m", max_output=64)
    runner, url = await start_mock(MockSettings(model="m", replica="r0", time_scale=0.05))
    try:
        one, sampled, whole = await replay(url, requests, 1.0)
    finally:
        await runner.cleanup()
    assert one.ok and sampled.ok and whole.ok, [one.error, sampled.error, whole.error]
    assert sampled.output_tokens == 32  # the usage's: every sequence's tokens
    # one sequence's TPOT: 8 tokens decoded over the time after the first, not 32
    assert sampled.tpot_s() == (sampled.last_s - sampled.ttft_s) / 7  # to its last token
    assert whole.ttft_s != whole.ttft_s and whole.tpot_s() is None
    lax = SloTargets((SloTier(None, 3600.0),), 3600.0)
    figures = summarize([one, sampled, whole], lax)
    assert figures["goodput"] == 1.0
    assert figures["ttft_mean_ms"] == round((one.ttft_s + sampled.ttft_s) / 2 * 1e3, 1)
    assert all(v == v for k, v in figures.items() if k.startswith(("ttft", "tpot", "e2e")))
    assert list(_columns([one, sampled, whole], lax)["met"]) == [1.0, 1.0, 1.0]
    strict = SloTargets((SloTier(None, whole.e2e_s / 2),), 3600.0)
    assert summarize([whole], strict)["goodput"] == 0.0  # its first token came at its end


def test_the_simulator_counts_every_sampled_sequence_s_output(tmp_path: pathlib.Path) -> None:
    """A row sampling ``n`` decodes ``n`` answers of ``output_length`` each: the run's
    output throughput counts all of them (the engine generated them, as the mock's
    ``vllm:generation_tokens`` counts), its TPOT stays one sequence's."""
    from sim.cluster import ClusterConfig, Simulation
    from sim.profiles import load_profile

    row: dict[str, object] = {"timestamp": 0, "input_length": 1000, "output_length": 40,
                              "hash_ids": [1, 2]}  # fmt: skip

    def summary(rows: list[dict[str, object]]) -> dict[str, object]:
        workload = load_trace(str(_rows_file(tmp_path, rows)), block_size=64)
        config = ClusterConfig(profile=load_profile("dense-70b"), replicas=1, block_size=64)
        return Simulation(workload, config, "round_robin").run().summary

    sampled = summary([{**row, "n": 3}])
    tokens = float(str(sampled["output_tokens_per_s"])) * float(str(sampled["makespan_s"]))
    assert round(tokens) == 120
    one = summary([row])
    assert sampled["tpot_ms_p50"] >= one["tpot_ms_p50"]  # type: ignore[operator]


def test_the_simulator_never_disaggregates_a_request_sampling_n(tmp_path: pathlib.Path) -> None:
    """The service serves a request of ``n`` > 1 where it routes it, never split into a
    prefill and a decode leg (vLLM's connector hands over one sequence's blocks:
    ``keep_local`` ``parallel_sampling``, docs/pd.md); the simulator's disaggregated fleet
    runs such a row as the service would, locally."""
    from sim.cluster import ClusterConfig, Simulation
    from sim.profiles import load_profile

    row: dict[str, object] = {"timestamp": 0, "input_length": 6000, "output_length": 20,
                              "hash_ids": list(range(12))}  # fmt: skip
    rows = [{**row, "n": 3}, {**row, "timestamp": 1000, "hash_ids": list(range(50, 62))}]
    workload = load_trace(str(_rows_file(tmp_path, rows)), block_size=64)
    config = ClusterConfig(
        profile=load_profile("dense-70b"), replicas=4, block_size=64, pd="always"
    )
    sim = Simulation(workload, config, "round_robin")
    assert sim.run().summary["completed"] == 2
    assert (sim.pd_stats.requests, sim.pd_stats.remote) == (2, 1)  # the n = 1 row alone


def test_the_simulator_keeps_messages_and_responses_rows_local(tmp_path: pathlib.Path) -> None:
    """The service never disaggregates an Anthropic Messages or a Responses API request
    (``keep_local`` ``messages_api`` / ``responses_api``): the simulator runs such rows
    locally too, and disaggregates the chat and completions rows as the service would."""
    from sim.cluster import ClusterConfig, Simulation
    from sim.profiles import load_profile

    row: dict[str, object] = {"input_length": 6000, "output_length": 20}
    rows = [
        {**row, "timestamp": 1000 * i, "hash_ids": list(range(20 * i, 20 * i + 12)),
         "endpoint": endpoint}
        for i, endpoint in enumerate(("messages", "responses", "chat", "completions"))
    ]  # fmt: skip
    workload = load_trace(str(_rows_file(tmp_path, rows)), block_size=64)
    assert [r.endpoint for r in workload.requests] == [
        "messages", "responses", "chat", "completions"
    ]  # fmt: skip
    config = ClusterConfig(
        profile=load_profile("dense-70b"), replicas=4, block_size=64, pd="always"
    )
    sim = Simulation(workload, config, "round_robin")
    assert sim.run().summary["completed"] == 4
    assert (sim.pd_stats.requests, sim.pd_stats.remote) == (4, 2)


BATCH_ROWS: list[dict[str, object]] = [
    {"timestamp": 0, "input_length": 300, "output_length": 4, "hash_ids": [1],
     "endpoint": "completions", "batch": "b1"},
    {"timestamp": 0, "input_length": 1200, "output_length": 4, "hash_ids": [2, 3, 4],
     "endpoint": "completions", "batch": "b1"},
    {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [5, 6],
     "endpoint": "completions", "batch": "b1"},
    {"timestamp": 0, "input_length": 300, "output_length": 4, "hash_ids": [7],
     "endpoint": "completions"},
]  # fmt: skip


def test_the_simulator_sends_a_completions_batch_to_one_replica(tmp_path: pathlib.Path) -> None:
    """A batch of completion prompts is one request to the service, routed once (by its
    longest prompt) to one replica: the simulator routes a batch's rows together, even round
    robin over three replicas (the row outside the batch is the next pick)."""
    from sim.cluster import ClusterConfig, Simulation
    from sim.profiles import load_profile

    workload = load_trace(str(_rows_file(tmp_path, BATCH_ROWS)), block_size=64)
    config = ClusterConfig(profile=load_profile("dense-70b"), replicas=3, block_size=64)
    sim = Simulation(workload, config, "round_robin")
    assert sim.run().summary["completed"] == 2  # the batch is one request (its rows all ended)
    replicas = [sim._records[r.request_id].replica for r in workload.requests]
    assert replicas[0] == replicas[1] == replicas[2] != replicas[3]
    busy = [e.busy_s > 0 for e in sim.engines]
    assert sum(busy) == 2


def test_the_simulator_routes_a_batch_by_its_longest_prompt(tmp_path: pathlib.Path) -> None:
    """The router places a batch where its longest prompt is cached (the prompt whose
    prefill dominates): a batch whose long prompt an earlier request left on one replica
    goes there, with its short prompts."""
    from sim.cluster import ClusterConfig, Simulation
    from sim.profiles import load_profile

    warm = {"timestamp": 0, "input_length": 1200, "output_length": 4, "hash_ids": [2, 3, 4]}
    later = [{**r, "timestamp": 5000} for r in BATCH_ROWS[:3]]
    # the short prompts first: routed one by one, each would go elsewhere
    rows = [warm, later[0], later[2], later[1]]
    workload = load_trace(str(_rows_file(tmp_path, rows)), block_size=64)
    config = ClusterConfig(profile=load_profile("dense-70b"), replicas=3, block_size=64)
    sim = Simulation(workload, config, "ours")
    assert sim.run().summary["completed"] == 2  # the batch is one request (its rows all ended)
    replicas = {sim._records[r.request_id].replica for r in workload.requests}
    assert len(replicas) == 1


def test_the_simulator_never_disaggregates_a_batch(tmp_path: pathlib.Path) -> None:
    """vLLM hands over only a batch's first prompt's KV, so the service keeps a batch local
    (``keep_local`` ``batch_prompts``): the simulator's disaggregated fleet runs the batch's
    rows on one replica, locally, counted as one request as the service counts it."""
    from sim.cluster import ClusterConfig, Simulation
    from sim.profiles import load_profile

    workload = load_trace(str(_rows_file(tmp_path, BATCH_ROWS)), block_size=64)
    config = ClusterConfig(
        profile=load_profile("dense-70b"), replicas=4, block_size=64, pd="always"
    )
    sim = Simulation(workload, config, "round_robin")
    assert sim.run().summary["completed"] == 2  # the batch is one request (its rows all ended)
    assert (sim.pd_stats.requests, sim.pd_stats.remote) == (2, 1)
    replicas = [sim._records[r.request_id].replica for r in workload.requests]
    assert replicas[0] == replicas[1] == replicas[2]


def test_a_replayed_request_decodes_its_recorded_output_on_vllm(tmp_path: pathlib.Path) -> None:
    """The live replay asked a recorded output as ``max_tokens`` alone: a real engine stops
    at its end-of-sequence token long before (its stand-in prompts are no text a model
    answers at length), so a replay on a real fleet decoded far fewer tokens than the
    recording, silently. Each body now makes vLLM (its own request models, 0.34) decode
    exactly the recorded output: ``ignore_eos`` where the endpoint has it, the Messages API
    ``min_tokens`` at its ``max_tokens``."""
    from tests.engines import anthropic_ref, responses_ref

    trace = tmp_path / "t.jsonl"
    rows = [
        {
            "timestamp": 1000 * i,
            "input_length": 600,
            "output_length": 37,
            "hash_ids": [i, 9],
            "endpoint": endpoint,
            "stream": i % 2 == 0,
        }
        for i, endpoint in enumerate(("completions", "chat", "responses", "messages"))
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bodies = {
        req.path: json.loads(req.body) for req in load_requests(trace, 10, "m", max_output=64)
    }
    base = anthropic_ref.load()
    completion = base["vllm.entrypoints.openai.completion.protocol"].CompletionRequest
    chat = base["vllm.entrypoints.openai.chat_completion.protocol"].ChatCompletionRequest
    messages = base["vllm.entrypoints.anthropic.protocol"].AnthropicMessagesRequest
    responses = responses_ref.load()["vllm.entrypoints.openai.responses.protocol"]
    for path, model in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        request = model.model_validate(bodies[path])
        assert (request.max_tokens, request.ignore_eos) == (37, True), path
    request = responses.ResponsesRequest.model_validate(bodies["/v1/responses"])
    assert (request.max_output_tokens, request.ignore_eos) == (37, True)
    request = messages.model_validate(bodies["/v1/messages"])
    assert (request.max_tokens, request.min_tokens) == (37, 37)


def test_the_live_replay_refuses_a_bailian_trace_it_would_misread(tmp_path: pathlib.Path) -> None:
    """``kvrouter demo --trace`` simulated a Bailian trace as one (seconds, 16-token blocks:
    sim.workload sniffs it) and replayed it live as a Mooncake one: its seconds taken for
    ms, its 16-token ids for 512-token blocks; the two columns of the table ran different
    workloads, silently. The live replay reads Mooncake and recorded traces alone: a Bailian
    one is an error naming it."""
    trace = tmp_path / "bailian.jsonl"
    rows = [
        {
            "chat_id": i,
            "parent_chat_id": -1,
            "timestamp": 1.5 * i,
            "input_length": 64,
            "output_length": 4,
            "type": "text",
            "turn": 1,
            "hash_ids": [1, 2, 3, 4 + i],
        }
        for i in range(3)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = kvrouter("demo", "--trace", str(trace), "--sim-only", "--requests", "3")
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"{trace} is a Bailian trace" in run.stderr, run.stderr
