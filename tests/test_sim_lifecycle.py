"""The simulator's request lifecycle against the service's (sim/cluster.py against
router/service/handling.py, proxy.py, answer_relay.py): what reaches an engine, and what the
router books and takes back, at the moments the service does."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from router.core.admission import PRIORITY, AdmissionSettings, engine_priority
from sim.cluster import ClusterConfig, Simulation
from sim.engine import EngineRequest
from sim.profiles import load_profile
from sim.workload import ENDPOINTS, load_trace


def _rows_file(tmp_path: pathlib.Path, rows: list[dict[str, object]]) -> pathlib.Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_batch_with_a_prompt_no_engine_can_take_is_refused_whole(
    tmp_path: pathlib.Path,
) -> None:
    """A completions batch is one request to vLLM, which checks every prompt before it
    starts any (a prompt past the model's length: 400 for the whole request; the mock
    replica's router/mock/multi.py does the same with the engine model's ``refusal``): the
    service withdraws what it guessed and no prompt of the batch runs. The simulator ran
    the rows that fit, whose blocks then drew the next request of the same prefix to that
    replica."""
    short = {"timestamp": 0, "input_length": 300, "output_length": 4, "hash_ids": [1, 2],
             "batch": "b1"}  # fmt: skip
    huge = {**short, "input_length": 64 * 40, "hash_ids": list(range(10, 50))}
    config = ClusterConfig(
        profile=load_profile("dense-70b"), replicas=2, block_size=64, kv_blocks=32
    )
    workload = load_trace(str(_rows_file(tmp_path, [short, huge])), block_size=64)
    sim = Simulation(workload, config, "longest_prefix")
    summary = sim.run().summary
    records = [sim._records[r.request_id] for r in workload.requests]
    assert all(r.rejected for r in records)
    assert all(r.first != r.first for r in records)  # no row answered (NaN)
    assert sum(e.busy_s for e in sim.engines) == 0.0  # no engine computed any of it
    assert all(not e.cached_blocks() for e in sim.engines)
    assert summary["completed"] == 0
    router = sim.routers[0].engine
    for key in sim.keys:  # nothing booked, nothing guessed left
        assert router.load.view(key, 1e9).in_flight == 0
    held = router.index.match(workload.requests[1].block_hashes, now=0.0)
    assert all(held.get(k).kv_blocks == 0 for k in sim.keys)


class _Submits(Simulation):
    """A simulation that keeps every engine request it submits."""

    sent: list[EngineRequest]

    def _submit(self, i: int, ereq: EngineRequest, now: float) -> None:
        self.sent = [*getattr(self, "sent", []), ereq]
        super()._submit(i, ereq, now)


def test_a_messages_request_reaches_its_engine_without_a_priority(
    tmp_path: pathlib.Path,
) -> None:
    """With admission's ``engine_priority`` the service appends its class's ``priority`` to
    the body, but not to an Anthropic Messages API request (router/service/handling.py:
    vLLM's Messages API takes none), which its engine then schedules as a default one. The
    simulator gave it its class's priority: ahead of default requests in the engine's
    queue, on every endpoint."""
    row = {"timestamp": 0, "input_length": 300, "output_length": 4, "hash_ids": [1, 2]}
    rows = [{**row, "endpoint": e, "hash_ids": [i]} for i, e in enumerate(ENDPOINTS)]
    config = ClusterConfig(
        profile=load_profile("dense-70b"),
        replicas=2,
        block_size=64,
        admission=AdmissionSettings(engine_priority=True),
        priority_share=1.0,
    )
    workload = load_trace(str(_rows_file(tmp_path, rows)), block_size=64)
    sim = _Submits(workload, config, "round_robin")
    sim.run()
    endpoint = {r.request_id: r.endpoint for r in workload.requests}
    got = {endpoint[e.request_id]: e.priority for e in sim.sent}
    expected = engine_priority(PRIORITY)
    assert got == {e: 0 if e == "messages" else expected for e in ENDPOINTS}
    assert expected != 0


def test_a_decode_replica_is_picked_on_engine_reports_as_fresh_as_the_service_has(
    tmp_path: pathlib.Path,
) -> None:
    """The service's engine reports come every ``engine_metrics_interval_s`` whatever the
    traffic (router/service/engines.py ``scrape_loop``), so the decode pick at a prefill
    leg's end (router/service/disagg.py) reads one at most about that old: its busy
    thresholds (``max_kv_usage``) judge the decode replicas by it. The simulator refreshed
    reports only when a request arrived: a leg ending 2 s after the last arrival was
    judged on reports 2 s old."""
    rows = [{"timestamp": 0, "input_length": 64 * 900, "output_length": 4,
             "hash_ids": list(range(900))}]  # fmt: skip
    config = ClusterConfig(
        profile=load_profile("dense-70b"), replicas=4, block_size=64, pd="always"
    )
    workload = load_trace(str(_rows_file(tmp_path, rows)), block_size=64)
    sim = Simulation(workload, config, "round_robin")
    assert sim.pd is not None
    planner = sim.pd.planner
    pick, ages = planner.pick_decode, []

    def watched(engine: Any, request: Any, prefill: Any, keys: Any, now: float, rng: Any) -> Any:
        views = [engine.load.view(k, now) for k in keys]
        ages.append(max(v.engine_age_s for v in views))
        return pick(engine, request, prefill, keys, now, rng)

    planner.pick_decode = watched  # type: ignore[method-assign]
    sim.run()
    first = sim._records[workload.requests[0].request_id]
    assert first.first > 2 * config.report_interval_s  # the leg ended well after its arrival
    assert ages and max(ages) <= config.report_interval_s, ages
