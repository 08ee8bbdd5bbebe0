"""Admission in the simulator: ``sim replay --admission slo`` and its class and tenant flags,
the figures ``--json`` adds, and ``sim tune --tune admission``."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from router.cli import main

FLEET = ["--replicas", "2", "--block-size", "64", "--kv-blocks", "4096", "--limit", "200"]


def replay(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    """``kvrouter sim replay ... --json`` in this process (no interpreter start-up)."""
    args = ["sim", "replay", "mooncake", *FLEET, "--json", "--no-progress", *extra]
    assert main(args) == 0, capsys.readouterr().err
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def test_overload_with_and_without_admission(capsys: pytest.CaptureFixture[str]) -> None:
    # 2 replicas at 2x: the load of 8 replicas at 8x
    flags = ("--speedup", "2", "--priority-share", "0.2", "--flex-share", "0.1")
    off = replay(capsys, *flags, "--tenants", "3")
    on = replay(capsys, *flags, "--tenants", "3", "--admission", "slo")
    for doc in (off, on):
        assert set(doc["slo_attainment"]) == {"priority", "default", "flex"}
        assert doc["requests_by_class"]["priority"] > 0 and doc["requests_by_class"]["flex"] > 0
        for key in ("goodput", "router_wait_ms_p50", "router_wait_ms_p90", "shed"):
            assert key in doc, key
        # every request was answered or shed: nothing lost
        assert doc["completed"] + doc["rejected"] == doc["requests"] == 200
    assert off["admission"] == "off" and off["shed"] == 0 and off["router_wait_ms_p90"] == 0
    assert on["admission"] == "slo" and on["shed"] == on["rejected"] > 0
    assert on["settings"]["admission"]["headroom"] == [1.0, 0.5, 0.3]
    # overloaded: admission sheds what cannot make it and keeps the priority class's SLO
    assert on["goodput"] > off["goodput"]
    assert on["slo_attainment"]["priority"] > off["slo_attainment"]["priority"]
    assert on["slo_attainment"]["priority"] >= on["slo_attainment"]["default"]


def test_admission_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    for flags in (
        ["--priority-share", "0.8", "--flex-share", "0.5"],
        ["--tenants", "0"],
        ["--admission-params", '{"headroom": [2, 1, 1]}'],
        ["--admission-params", '{"nope": 1}'],
    ):
        assert main(["sim", "replay", "mooncake", "--limit", "10", *flags]) == 2, flags
        assert "error" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sim", "replay", "mooncake", "--admission", "maybe"])


def test_tune_admission_writes_a_service_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "admission.toml"
    args = [
        "sim", "tune", "mooncake", *FLEET[:-2], "--limit", "80", "--tune", "admission",
        "--priority-share", "0.3", "--speedups", "2", "--out", str(out), "--budget", "3",
        "--jobs", "1",
    ]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    doc = json.loads(capsys.readouterr().out)
    assert doc["tune"] == "admission" and doc["settings_tried"] == 3
    assert 0 <= doc["goodput"] <= 1 and doc["cases"][0]["speedup"] == 2
    table = tomllib.loads(out.read_text())["models"]["sim-model"]["admission"]
    assert table["enabled"] is True and len(table["stall_share"]) == 3
    assert table["engine_priority"] is False  # a TOML boolean: the service loads it


def test_tune_ranks_settings_under_the_priority_floor_by_priority() -> None:
    """Settings that miss ``--min-priority`` rank after the others, by their worst priority
    attainment (docs/simulator.md): when none meets the floor, the table written is the one
    closest to it, not the one with the most goodput."""
    from router.core.admission import AdmissionSettings
    from sim.tune_admission import AdmissionTrial, ranked

    def trial(share: float, goodput: float, priority: float) -> AdmissionTrial:
        return AdmissionTrial(
            AdmissionSettings(stall_share=(share, 0.5, 0.5)), goodput, priority, ()
        )

    meets = trial(0.2, 0.50, 0.995)
    close = trial(0.1, 0.60, 0.985)
    far = trial(0.3, 0.70, 0.90)
    assert ranked([far, close, meets], 0.99) == [meets, close, far]
    assert ranked([far, close], 0.99)[0] is close


def test_a_request_displaced_from_a_full_queue_is_refused_not_lost() -> None:
    """A full queue takes a better class's request in the place of a worse class's held one
    (router/core/admission.py ``Verdict.displaced``): the simulator refuses that one as the
    service answers it 429, so every request is completed or refused."""
    from router.core.admission import AdmissionSettings
    from sim.agentic import AgenticSpec, generate
    from sim.cluster import Simulation
    from sim.cluster_config import ClusterConfig
    from sim.profiles import load_profile

    workload = generate(AgenticSpec(sessions=30, session_rate=60.0), block_size=64)
    config = ClusterConfig(
        load_profile("dense-70b"),
        replicas=1,
        admission=AdmissionSettings(max_queue=2, max_hold_s=5.0),
        priority_share=0.2,
        flex_share=0.5,
    )
    s = Simulation(workload, config, "ours", speedup=8).run().summary
    assert s["requests"] == len(workload) and s["shed"] > 0
    assert s["completed"] + s["rejected"] == s["requests"]


def _held_run(a_output: int, *late: float) -> tuple[dict[str, Any], Any, Any, list[Any]]:
    """One replica: ``a`` (a long prompt) arrives on an idle replica at 0 and is admitted;
    ``b`` arrives at 0.01, while ``a`` prefills, and is held (a small headroom: it fits
    only a replica with nothing queued); requests of ``late`` arrive at those times.
    Returns the summary and the records of ``a``, ``b`` and the late ones."""
    from router.core.admission import AdmissionSettings
    from sim.cluster import Simulation
    from sim.cluster_config import ClusterConfig
    from sim.profiles import load_profile
    from sim.workload import SimRequest, Workload

    def req(rid: str, at: float, prompt: int, output: int, first_block: int) -> SimRequest:
        blocks = list(range(first_block, first_block + prompt // 64))
        return SimRequest(rid, at, prompt, output, blocks)

    requests = [req("a", 0.0, 8000, a_output, 1000), req("b", 0.01, 640, 4, 2000)]
    requests += [req(f"l{i}", t, 64, 2, 3000 + i) for i, t in enumerate(late)]
    config = ClusterConfig(
        load_profile("dense-70b"),
        replicas=1,
        block_size=64,
        admission=AdmissionSettings(headroom=(0.05, 0.05, 0.05), max_hold_s=5.0),
    )
    sim = Simulation(Workload("held", requests, 64, "sim-model"), config, "ours")
    summary = sim.run().summary
    records = [sim._records[r.request_id] for r in requests]
    return summary, records[0], records[1], records[2:]


def test_the_simulator_looks_at_held_requests_on_the_service_s_cadence() -> None:
    """The service's pump (router/service/admission.py) looks at held requests every
    ``TICK_S`` while any is held, and when a request finishes; an arrival only sheds the
    late ones. The simulator looked on every engine output (``a``'s first token here) and
    on every arrival, dispatching ``b`` at once where the service dispatches it at its next
    tick. Here nothing finishes before ``b`` goes: it goes at a tick after its hold."""
    from router.service.admission import TICK_S

    # b fits once a's prefill is over (a's first token, some 0.3 s in); a request arrives
    # just after that, between two ticks of b's hold
    _, a, b, _ = _held_run(400)
    assert b.sent >= a.first > b.arrival  # held, through a's prefill
    summary, a, b, (late,) = _held_run(400, a.first + 0.001)
    assert summary["completed"] == 3 and b.sent < a.finish  # nothing finished before it went
    ticks = (b.sent - b.arrival) / TICK_S
    assert ticks == pytest.approx(round(ticks), abs=1e-6), (b.sent, a.first, late.arrival)
    assert b.sent > late.arrival  # the arrival did not look


def test_the_simulator_looks_at_held_requests_when_one_finishes() -> None:
    """A finish wakes the service's pump at once: ``a`` (one output token) finishes at its
    first token, and ``b``, held behind it, goes then, not at the next tick."""
    _, a, b, _ = _held_run(1)
    assert b.arrival < b.sent == a.finish


def test_a_request_its_engine_refuses_at_once_leaves_no_stall_allowance() -> None:
    """A request the engine rejects as it is submitted (prompt and answer over its whole KV
    cache) ends inside its dispatch: admission must not start tracking its decode-stall
    allowance after that (a ledger entry nothing removes would hold its replica's stall
    headroom down for the rest of the run, as the service's ``finished`` never comes twice)."""
    from router.core.admission import AdmissionSettings
    from sim.cluster import Simulation
    from sim.cluster_config import ClusterConfig
    from sim.profiles import load_profile
    from sim.workload import SimRequest, Workload

    requests = [
        SimRequest("huge", 0.0, 64 * 40, 64 * 40, list(range(40))),  # 80 blocks of 64
        SimRequest("small", 1.0, 640, 4, list(range(100, 110))),
    ]
    config = ClusterConfig(
        load_profile("dense-70b"),
        replicas=1,
        block_size=64,
        kv_blocks=64,
        admission=AdmissionSettings(),
    )
    sim = Simulation(Workload("refused", requests, 64, "sim-model"), config, "ours")
    summary = sim.run().summary
    assert sim._records["huge"].rejected and summary["completed"] == 1
    assert [len(r.admission.stall) for r in sim.routers] == [0]
