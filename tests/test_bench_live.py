"""``kvrouter bench live`` and ``kvrouter demo --router-url`` as real processes: the JSON
contract of the bench (a tiny run, kvrouter's row only; a vllm-router row without a binary
says so instead of failing), and the demo replaying through a router it did not start."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from router.demo.fleet import MODEL
from router.mock.server import MockSettings, create_app
from tests.ports import free_port
from tests.test_demo import SMALL

ROW_KEYS = {
    "ok", "failed", "hit", "goodput", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
    "e2e_p50_ms", "e2e_p90_ms", "e2e_p99_ms", "tpot_p50_ms", "tpot_p90_ms",
    "goodput_by_slo_scale",
}  # fmt: skip


def test_bench_live_prints_rows_and_the_simulators_prediction() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench", "live", "--workload", "agentic",
         "--rows", "kvrouter_ours,vllm_router_kv_aware", "--requests", "12", "--replicas", "2",
         "--speedup", "4", "--sim-runs", "3", "--json"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["bench"] == "live" and doc["requests"] == 12 and doc["replicas"] == 2
    ours = doc["rows"]["kvrouter_ours"]
    assert set(ours) >= ROW_KEYS, set(ROW_KEYS) - set(ours)
    assert ours["ok"] == 12 and ours["failed"] == 0 and 0 < ours["hit"] <= 1
    assert 0 <= ours["goodput"] <= 1 and ours["ttft_p50_ms"] <= ours["ttft_p90_ms"]
    assert "vllm-router" in doc["rows"]["vllm_router_kv_aware"]["error"]
    assert doc["versus"] == {}  # a row that did not run is not compared
    scales = ours["goodput_by_slo_scale"]
    assert list(scales) == ["0.25", "0.5", "1", "2"] and scales["1"] == ours["goodput"]
    assert scales["0.25"] <= scales["0.5"] <= scales["1"] <= scales["2"]
    sim = doc["sim"]["kvrouter_ours"]
    assert {"hit", "goodput", "ttft_p50_ms", "tpot_p90_ms"} <= set(sim)
    assert sim["goodput_by_slo_scale"]["1"] == sim["goodput"]
    # the HTTP path's share of TTFT, probed on the idle fleet, is what the simulator adds
    assert 0 < ours["transport_ms"] < ours["ttft_p50_ms"]
    assert doc["sim"]["kvrouter_ours"]["transport_ms"] == ours["transport_ms"]
    # the mocks' own TTFT over the replay (vLLM's histogram): within what the client saw
    assert 0 < ours["engine_ttft_mean_ms"] <= ours["ttft_mean_ms"]
    assert 0 < ours["engine_model_ttft_mean_ms"] <= ours["engine_ttft_mean_ms"]
    assert sim["ttft_mean_ms"] > sim["transport_ms"]
    # arrivals jittered by that transport: the medians of --sim-runs runs, with their spread
    assert sim["runs"] == 3 and sim["spread"]["goodput"][0] <= sim["goodput"]
    assert sim["spread"]["ttft_p50_ms"][0] <= sim["ttft_p50_ms"] <= sim["spread"]["ttft_p50_ms"][1]


@pytest.mark.parametrize(
    ("flag", "value"), [("--repeat", "0"), ("--sim-runs", "0"), ("--sim-samples", "-1")]
)
def test_bench_live_refuses_counts_out_of_range(flag: str, value: str) -> None:
    """A usage error before anything starts: in this process (an exception other than the
    usage error's SystemExit would fail the test as a traceback would)."""
    from tests.inprocess import kvrouter

    out = kvrouter("bench", "live", "--rows", "", flag, value)
    assert out.returncode != 0 and flag in out.stderr and "Traceback" not in out.stderr


def test_bench_live_refuses_a_vllm_router_it_cannot_run_before_running_anything() -> None:
    """A ``--vllm-router`` path that is no executable is a usage error before the first row
    starts: found only at its own row, it cost the rows run before it."""
    from tests.inprocess import kvrouter

    out = kvrouter(
        "bench", "live", "--rows", "kvrouter_ours,vllm_router_kv_aware",
        "--vllm-router", "/nonexistent/vllm-router",
    )  # fmt: skip
    assert out.returncode != 0 and "/nonexistent/vllm-router" in out.stderr, out.stderr
    assert "bench live: kvrouter_ours" not in out.stderr and "Traceback" not in out.stderr


def test_a_run_that_breaks_is_its_rows_error_and_the_other_rows_are_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A row whose processes die or never come up (``_row`` raises) ends that run as the
    row's ``error``; the rows measured before and after it are printed, and the bench exits
    non-zero."""
    from router.demo import live_bench
    from router.demo.replay import Outcome
    from tests.inprocess import kvrouter

    async def row(name: str, *args: object, **kwargs: object) -> tuple[dict[str, object], list]:
        if name == "vllm_router_kv_aware":
            raise RuntimeError("vllm-router exited with code 1")
        return {"ok": 1, "failed": 0, "goodput": 1.0}, [Outcome(True, 0.1, 10)]

    monkeypatch.setattr(live_bench, "_row", row)
    out = kvrouter(
        "bench", "live", "--rows", "kvrouter_ours,vllm_router_kv_aware,vllm_router_cache_aware",
        "--vllm-router", sys.executable, "--sim-policies", "", "--requests", "3", "--json",
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert rows["kvrouter_ours"]["goodput"] == rows["vllm_router_cache_aware"]["goodput"] == 1.0
    assert "exited with code 1" in rows["vllm_router_kv_aware"]["error"]
    assert "vllm-router exited" in out.stderr


@pytest.fixture
async def external() -> AsyncIterator[str]:
    """A mock replica serving the demo's model: any OpenAI-compatible endpoint will do."""
    runner = web.AppRunner(create_app(MockSettings(model=MODEL)))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_demo_replays_through_a_running_router(external: str) -> None:
    import asyncio

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.cli", "demo", "--router-url", external, "--agentic",
        SMALL, "--speedup", "4", "--max-output", "8",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, stdout.decode() + stderr.decode()
    row = next(line.split() for line in stdout.decode().splitlines() if line.startswith("ext"))
    assert row[0] == "external" and int(row[1]) > 6
    assert float(row[2].rstrip("%")) > 0  # the mock's own cache answered the follow-ups


def test_fleet_router_is_calibrated_to_the_mocks_engine_profile() -> None:
    """A router whose timing model is not the engines' misjudges queueing: the demo and bench
    fleets hand a timing policy the mocks' profile cost; policies without one get none."""
    import tomllib

    from router.demo.fleet import PROFILE, FleetSpec, _router_toml
    from sim.profiles import load_profile

    replicas = [{"url": "http://127.0.0.1:1", "model": MODEL, "name": "r0"}]
    doc = tomllib.loads(_router_toml(FleetSpec(replicas=1, policy="ours"), 1, replicas))
    cost = doc["models"][MODEL]["policy_params"]["cost"]
    assert cost["step_overhead_s"] == load_profile(PROFILE).cost.step_overhead_s
    assert cost["chunk_tokens"] == load_profile(PROFILE).cost.chunk_tokens
    plain = tomllib.loads(_router_toml(FleetSpec(replicas=1, policy="round_robin"), 1, replicas))
    assert "policy_params" not in plain["models"][MODEL]
    assert "speculative_ttl_s" not in plain["models"][MODEL]  # the router's default
    spec = FleetSpec(replicas=1, policy="ours", speculative_ttl_s=30)
    guessing = tomllib.loads(_router_toml(spec, 1, replicas))
    assert guessing["models"][MODEL]["speculative_ttl_s"] == 30.0


def test_fleet_router_is_told_when_the_mocks_give_back_a_block(tmp_path: Any) -> None:
    """Mocks of an EAGLE / MTP profile give back a block of every hit: the demo and bench
    fleets' router is told (``eagle = true``), as the simulator's routers are, or it
    predicts one block more than the engines grant on every hit."""
    import tomllib

    from router.demo.fleet import PROFILE, FleetSpec, _router_toml
    from router.service.config import build_settings

    profile = tmp_path / "eagle.toml"
    profile.write_text(
        'name = "eagle-small"\nblock_size = 64\nkv_blocks = 2000\neagle = true\n'
        "[cost]\nstep_overhead_s = 0.002\nprefill_s_per_token = 1e-6\ndecode_s_per_seq = 1e-4\n"
    )
    replicas = [{"url": "http://127.0.0.1:1", "model": MODEL, "name": "r0"}]
    told = tomllib.loads(_router_toml(FleetSpec(1, "ours", profile=str(profile)), 1, replicas))
    assert build_settings(told).model(MODEL).routing.eagle
    plain = tomllib.loads(_router_toml(FleetSpec(1, "ours", profile=PROFILE), 1, replicas))
    assert not build_settings(plain).model(MODEL).routing.eagle


def test_vllm_router_hashes_in_the_block_size_the_mocks_publish() -> None:
    """kv_aware reads the events' blocks and chunks prompts in the block size it is given:
    it must be the size the mocks publish."""
    from router.demo.fleet import FleetSpec
    from router.demo.live_bench import _vllm_router_cmd, _vllm_router_pd_cmd

    spec = FleetSpec(replicas=1, policy=None)
    replica = {"url": "http://r", "zmq": "tcp://z", "zmq_replay": "tcp://y"}
    cmd = _vllm_router_cmd("vr", "vllm_router_kv_aware", 1, [replica], 600, spec.engine_block_size)
    assert cmd[cmd.index("--kv-event-block-size") + 1] == str(spec.engine_block_size) == "64"
    replica = {**replica, "role": "prefill"}
    pd = _vllm_router_pd_cmd("vr", 1, 2, [replica], spec.engine_block_size)
    assert pd[pd.index("--kv-event-block-size") + 1] == "64" and "--pd-kv-events" in pd


def test_repeated_runs_combine_into_medians_totals_and_spread() -> None:
    from router.demo.figures import combine_runs

    runs = [
        {"requests": 10, "ok": 10, "failed": 0, "hit": 0.5, "goodput": 0.9, "ttft_p90_ms": 300.0},
        {"requests": 10, "ok": 9, "failed": 1, "hit": 0.4, "goodput": 0.7, "ttft_p90_ms": 500.0,
         "errors": ["HTTP 502"]},
        {"requests": 10, "ok": 10, "failed": 0, "hit": 0.6, "goodput": 0.8, "ttft_p90_ms": 100.0},
    ]  # fmt: skip
    row = combine_runs(runs)
    assert (row["requests"], row["ok"], row["failed"], row["runs"]) == (30, 29, 1, 3)
    assert (row["hit"], row["goodput"], row["ttft_p90_ms"]) == (0.5, 0.8, 300.0)
    assert row["spread"]["goodput"] == [0.7, 0.9] and row["spread"]["ttft_p90_ms"] == [100.0, 500.0]
    assert row["errors"] == ["HTTP 502"]
    scaled = [{"0.5": 0.2, "1": 0.9}, {"0.5": 0.6, "1": 0.7}, {"0.5": 0.4, "1": 0.8}]
    for run, scales in zip(runs, scaled, strict=True):
        run["goodput_by_slo_scale"] = scales
    assert combine_runs(runs)["goodput_by_slo_scale"] == {"0.5": 0.4, "1": 0.8}
    assert combine_runs(runs[:1]) == runs[0]
    failed = {"error": "no vllm-router binary"}
    assert combine_runs([failed]) == failed and combine_runs([runs[0], failed]) == failed


def test_median_row_keeps_what_the_runs_agree_on() -> None:
    from router.bench.measure import median_row

    runs = [
        {"policy": "ours", "trace": "a", "n": 1, "flag": True, "scale": {"1": 0.2, "x": "s"}},
        {"policy": "ours", "trace": "b", "n": 5, "flag": True, "scale": {"1": 0.6, "x": "s"}},
        {"policy": "ours", "n": 2, "flag": True, "scale": {"1": 0.4, "x": "s"}},
    ]
    row = median_row(runs, spread=("n", "missing"))
    assert row["policy"] == "ours" and "trace" not in row  # differs, or missing in a run
    assert row["n"] == 2 and row["flag"] is True and row["scale"] == {"1": 0.4}
    assert row["runs"] == 3 and row["spread"] == {"n": [1, 5]}
    assert median_row(runs, totals=("n",))["n"] == 8
    assert median_row(runs[:1]) == runs[0] and median_row(runs[:1]) is not runs[0]


def test_sim_params_change_only_the_simulators_prediction() -> None:
    """``--rows ''`` runs nothing live; ``--sim-params`` reaches the simulated ``ours`` and
    a wrong one is a usage error that names it."""
    from tests.inprocess import kvrouter

    base = ["bench", "live", "--workload", "agentic", "--rows", "", "--requests", "80",
            "--replicas", "2", "--speedup", "8", "--json"]  # fmt: skip
    greedy_params = '{"w_prefill": 1, "w_interference": 0}'  # a TTFT minimiser
    default, greedy = (kvrouter(*base, *extra) for extra in ([], ["--sim-params", greedy_params]))
    assert default.returncode == greedy.returncode == 0, default.stderr + greedy.stderr
    a, b = (json.loads(out.stdout) for out in (default, greedy))
    assert a["rows"] == b["rows"] == {}
    assert a["sim"]["kvrouter_ours"] != b["sim"]["kvrouter_ours"]
    bad = kvrouter(*base, "--sim-params", '{"w_nope": 1}')
    assert bad.returncode != 0 and "w_nope" in bad.stderr
    both = kvrouter(*base, "--sim-policies", "ours,vllm_kv_aware", "--sim-params", greedy_params)
    assert both.returncode == 0, both.stderr
    sim = json.loads(both.stdout)["sim"]
    assert sim["kvrouter_ours"] == b["sim"]["kvrouter_ours"]  # the params are ours' alone
    assert set(sim["vllm_kv_aware"]) == set(sim["kvrouter_ours"])
    assert sim["vllm_kv_aware"] != sim["kvrouter_ours"]
    keyed = (
        '{"vllm_kv_aware": {"session_ttl_s": 600}, "ours": {"w_prefill": 1, "w_interference": 0}}'
    )
    sticky = kvrouter(*base, "--sim-policies", "ours,vllm_kv_aware", "--sim-params", keyed)
    assert sticky.returncode == 0, sticky.stderr
    per_policy = json.loads(sticky.stdout)["sim"]
    assert per_policy["kvrouter_ours"] == sim["kvrouter_ours"]
    assert per_policy["vllm_kv_aware"] != sim["vllm_kv_aware"]  # its sessions are pinned
    unknown = kvrouter(*base, "--sim-policies", "ours,nope")
    assert unknown.returncode != 0 and "nope" in unknown.stderr
    # the router's speculative TTL reaches the simulated router too (open-loop requests
    # that share prefixes with ones still queued)
    mooncake = ["bench", "live", "--workload", "mooncake", "--rows", "", "--requests", "100",
                "--replicas", "2", "--json"]  # fmt: skip
    events, guessing = (kvrouter(*mooncake, "--speculative-ttl-s", t) for t in ("0", "30"))
    assert events.returncode == guessing.returncode == 0, events.stderr + guessing.stderr
    assert json.loads(guessing.stdout)["sim"] != json.loads(events.stdout)["sim"]
    negative = kvrouter(*base, "--speculative-ttl-s", "-1")
    assert negative.returncode != 0 and "--speculative-ttl-s" in negative.stderr


def test_on_the_conversation_workload_the_eviction_term_keeps_more_context() -> None:
    """The workload whose small caches turn over while conversations come back: the
    simulated ``ours`` reuses more with its eviction term than without (the term is live:
    the engines' removed blocks reach the router's turnover meter)."""
    from tests.inprocess import kvrouter

    base = ["bench", "live", "--workload", "conversation", "--rows", "", "--json"]
    on, off = kvrouter(*base), kvrouter(*base, "--sim-params", '{"w_eviction": 0}')
    assert on.returncode == off.returncode == 0, on.stderr + off.stderr
    a, b = (json.loads(out.stdout)["sim"]["kvrouter_ours"] for out in (on, off))
    assert a["hit"] > b["hit"] + 0.01, (a, b)
    assert a["ttft_p90_ms"] < b["ttft_p90_ms"]


def test_sim_samples_predict_each_policy_on_several_samples_of_the_workload() -> None:
    """``--sim-samples N``: the agentic workload's next seeds, the Mooncake trace's next
    windows; each policy's mean, and ours over each other policy on every sample."""
    from tests.inprocess import kvrouter

    agentic = ["bench", "live", "--workload", "agentic", "--rows", "", "--requests", "60",
               "--replicas", "2", "--speedup", "8", "--json",
               "--sim-policies", "ours,vllm_kv_aware"]  # fmt: skip
    out = kvrouter(*agentic, "--sim-samples", "3")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    drawn = doc["sim_samples"]
    assert drawn["samples"] == ["seed=7", "seed=8", "seed=9"]
    assert set(drawn["mean"]) == {"kvrouter_ours", "vllm_kv_aware"}
    ratio = drawn["ours_over"]["vllm_kv_aware"]["ttft_p90_ms"]
    assert ratio["min"] <= ratio["mean"] <= ratio["max"]
    # the first sample is the workload itself: one sample is what `sim` predicts
    alone = json.loads(kvrouter(*agentic, "--sim-samples", "1").stdout)["sim_samples"]
    assert alone["mean"]["kvrouter_ours"]["goodput"] == doc["sim"]["kvrouter_ours"]["goodput"]
    assert alone["mean"]["kvrouter_ours"] != drawn["mean"]["kvrouter_ours"]
    mooncake = ["bench", "live", "--workload", "mooncake", "--rows", "", "--requests", "100",
                "--replicas", "2", "--json", "--sim-samples", "2"]  # fmt: skip
    windows = json.loads(kvrouter(*mooncake).stdout)["sim_samples"]
    assert windows["samples"] == ["rows 0-99", "rows 100-199"]
    assert windows["ours_over"] == {}  # ours alone: nothing to compare with
    assert kvrouter(*mooncake[:-2], "--sim-samples", "-1").returncode != 0


def test_trace_windows_start_at_time_zero_and_stop_before_a_partial_window(tmp_path: Path) -> None:
    from router.demo.live_bench import WORKLOADS, _trace_file
    from router.demo.sim_samples import samples

    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 1000 + 10 * i, "input_length": 64, "output_length": 2,
             "hash_ids": [i]} for i in range(5)]  # fmt: skip
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    workload = dataclasses.replace(WORKLOADS["mooncake"], requests=2)
    drawn = samples(workload, trace, 9, tmp_path, _trace_file)
    assert [name for name, _, _ in drawn] == ["rows 0-1", "rows 2-3"]
    second = [json.loads(line) for line in drawn[1][2].read_text().splitlines()]
    assert [r["timestamp"] for r in second] == [0, 10] and second[0]["hash_ids"] == [2]
