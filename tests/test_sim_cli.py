"""The ``kvrouter sim`` command through the console entry point's ``main`` (tests/inprocess.py),
and as a process of its own where it forks workers (``--jobs 2``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from router.core.policies import POLICY_NAMES, make_policy
from sim.tuned import load_tuned
from tests.inprocess import kvrouter

CONTRACT_KEYS = {
    "policy",
    "requests",
    "token_hit_rate",
    "ceiling_global_lru",
    "ceiling_infinite",
    "ttft_ms_p50",
    "ttft_ms_p90",
    "ttft_ms_p99",
    "wall_s",
}


FLEET = ["--replicas", "8", "--block-size", "64", "--kv-blocks", "16384"]


def kvrouter_process(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvrouter ARGS`` in a fresh process: a pool forked inside a test worker copies the
    worker's threads' locks, and one such fork never exited (a hung run_many)."""
    return subprocess.run(
        [sys.executable, "-m", "router.cli", *args], capture_output=True, text=True, timeout=110
    )


def test_replay_json_contract_single_policy() -> None:
    p = kvrouter(
        "sim",
        "replay",
        "mooncake",
        *FLEET,
        "--policy",
        "dynamo",
        "--speedup",
        "2",
        "--limit",
        "250",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert set(doc) >= CONTRACT_KEYS
    assert doc["policy"] == "dynamo" and doc["requests"] == 250 and doc["speedup"] == 2.0
    assert 0 < doc["token_hit_rate"] <= doc["ceiling_infinite"] <= 1
    assert doc["ceiling_global_lru"] <= doc["ceiling_infinite"]
    assert doc["ttft_ms_p50"] <= doc["ttft_ms_p90"] <= doc["ttft_ms_p99"]


def test_the_bundled_conversation_trace_replays_by_name() -> None:
    """``mooncake-conversation`` (sim/traces/README.md) is found by name and keeps its
    cross-request prefix reuse."""
    p = kvrouter("sim", "replay", "mooncake-conversation", *FLEET, "--policy", "ours",
                 "--limit", "300", "--json")  # fmt: skip
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["requests"] == 300
    assert 0.05 < doc["token_hit_rate"] <= doc["ceiling_infinite"]
    path = Path(__file__).resolve().parents[1] / "sim" / "traces"
    lines = (path / "mooncake_conversation_prefix.jsonl").read_text().splitlines()
    assert len(lines) == 1480 and all(json.loads(line)["hash_ids"][0] == 0 for line in lines)


def test_replay_all_policies_side_by_side() -> None:
    p = kvrouter_process(
        "sim",
        "replay",
        "mooncake",
        *FLEET,
        "--policy",
        "all",
        "--limit",
        "150",
        "--json",
        "--jobs",
        "2",
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert [r["policy"] for r in doc["runs"]] == list(POLICY_NAMES)
    assert {"ceiling_global_lru", "ceiling_infinite", "wall_s"} <= set(doc)
    for run in doc["runs"]:
        assert CONTRACT_KEYS - {"wall_s"} <= set(run)
    table = kvrouter(
        "sim", "replay", "mooncake", *FLEET, "--policy", "ours,round_robin", "--limit", "100"
    )
    assert table.returncode == 0, table.stderr
    assert "TTFT p90" in table.stdout and "round_robin" in table.stdout
    assert "ceilings: infinite cache" in table.stdout


def test_bad_input_is_a_clear_error() -> None:
    p = kvrouter("sim", "replay", "mooncake", "--policy", "nope", "--json")
    assert p.returncode == 2 and "unknown policy" in p.stderr and "Traceback" not in p.stderr
    p = kvrouter("sim", "replay", "/no/such.jsonl", "--json")
    assert p.returncode == 2 and "not found" in p.stderr
    p = kvrouter("sim", "replay", "mooncake", "--params", '{"bogus": 1}', "--limit", "5")
    assert p.returncode == 2 and "bogus" in p.stderr
    p = kvrouter("sim", "replay", "mooncake", "--transport-ms", "-1", "--limit", "5")
    assert p.returncode == 2 and "--transport-ms must be >= 0 and finite" in p.stderr
    p = kvrouter("sim", "replay", "mooncake", "--arrival-jitter-ms", "-1", "--limit", "5")
    assert p.returncode == 2 and "--arrival-jitter-ms must be >= 0 and finite" in p.stderr
    p = kvrouter("sim", "replay", "mooncake", "--reuse-window-s", "0", "--limit", "5")
    assert p.returncode == 2 and "--reuse-window-s must be positive" in p.stderr


def test_runs_report_the_median_and_spread_of_seeded_runs() -> None:
    """``--runs 3 --seed 5``: each figure is the median of the runs with seeds 5, 6 and 7
    (the same as three single runs), with their range; jittered arrivals make the three
    schedules differ."""
    args = ["sim", "replay", "mooncake", *FLEET, "--policy", "ours", "--speedup", "4"]
    # 100 requests: the median and range are of any size of run (300 cost 3x the CPU)
    args += ["--limit", "100", "--arrival-jitter-ms", "50", "--jobs", "1", "--json"]
    p = kvrouter(*args, "--runs", "3", "--seed", "5")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["runs"] == 3 and doc["settings"]["seeds"] == [5, 6, 7]
    singles = []
    for seed in ("5", "6", "7"):
        one = kvrouter(*args, "--seed", seed)
        assert one.returncode == 0, one.stderr
        singles.append(json.loads(one.stdout))
    assert "runs" not in singles[0] and "spread" not in singles[0]
    for key in ("goodput", "ttft_ms_p90", "e2e_ms_p90", "tpot_ms_p90"):
        values = sorted(s[key] for s in singles)
        assert doc[key] == round(values[1], 4)
        assert doc["spread"][key] == [values[0], values[2]]
    assert doc["spread"]["ttft_ms_p90"][0] < doc["spread"]["ttft_ms_p90"][1]
    assert doc["policy"] == "ours" and doc["requests"] == 100
    table = kvrouter(*args[:-1], "--runs", "2", "--policy", "ours,round_robin")
    assert table.returncode == 0, table.stderr
    assert "medians of 2 runs per policy (seeds 0-1); goodput range: ours " in table.stdout
    bad = kvrouter("sim", "replay", "mooncake", "--runs", "0", "--limit", "5")
    assert bad.returncode == 2 and "--runs must be in [1, 100]" in bad.stderr
    bad = kvrouter("sim", "replay", "mooncake", "--runs", "2", "--report", "/tmp/none")
    assert bad.returncode == 2 and "drop --runs or --report" in bad.stderr


def test_reuse_window_reaches_the_simulated_routers() -> None:
    """Small caches that evict from the start: the eviction term's time scale changes where
    ``ours`` sends requests."""
    args = ["sim", "replay", "mooncake", "--policy", "ours", "--replicas", "8"]
    # 400 requests already evict enough for the window to move several replicas' counts
    args += ["--kv-blocks", "2048", "--speedup", "4", "--limit", "400", "--json", "--no-progress"]
    spread = {}
    for window in ("10", "300"):
        p = kvrouter(*args, "--reuse-window-s", window)
        assert p.returncode == 0, p.stderr
        spread[window] = json.loads(p.stdout)["requests_per_replica"]
    assert spread["10"] != spread["300"]


def test_tune_writes_a_loadable_config_and_replay_uses_it(tmp_path: Path) -> None:
    out = tmp_path / "tuned.toml"
    p = kvrouter_process(
        "sim",
        "tune",
        "mooncake",
        "--replicas",
        "4",
        "--kv-blocks",
        "4096",
        "--limit",
        "120",
        "--budget",
        "3",
        "--speedups",
        "1,4",
        "--jobs",
        "2",
        "--model",
        "kimi/k3",
        "--out",
        str(out),
    )
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout)
    tuned = load_tuned(out)
    assert tuned.model == "kimi/k3" and tuned.policy == "ours" and tuned.block_size == 64
    assert {k: tuned.params[k] for k in result["best"]} == result["best"]
    policy = make_policy(tuned.policy, tuned.params)
    assert policy.name == "ours"
    p = kvrouter(
        "sim",
        "replay",
        "mooncake",
        "--replicas",
        "4",
        "--kv-blocks",
        "4096",
        "--limit",
        "60",
        "--config",
        str(out),
        "--policy",
        "round_robin",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    assert [r["policy"] for r in json.loads(p.stdout)["runs"]] == ["round_robin", "ours"]


def test_report_writes_plots_and_html(tmp_path: Path) -> None:
    p = kvrouter(
        "sim",
        "replay",
        "agentic:sessions=20,mean_turns=3",
        "--replicas",
        "4",
        "--policy",
        "ours,dynamo",
        "--sweep",
        "1,4",
        "--report",
        str(tmp_path),
        "--json",
    )
    assert p.returncode == 0, p.stderr
    names = {f.name for f in tmp_path.iterdir()}
    assert {
        "ttft_cdf.png",
        "speedup_sweep.png",
        "replica_load.png",
        "index.html",
        "summary.json",
    } <= names
    assert (tmp_path / "ttft_cdf.png").read_bytes()[:4] == b"\x89PNG"
    html = (tmp_path / "index.html").read_text()
    assert "speedup_sweep.png" in html and "dynamo" in html
    assert len(json.loads((tmp_path / "summary.json").read_text())["sweep"]) == 4


def test_json_settings_carry_every_setting_that_changed_the_run() -> None:
    """``settings`` describes the run: the regions, the eviction pricing window and the P/D
    knobs given change its figures, and were missing from it (two JSONs of different runs
    read the same)."""
    p = kvrouter("sim", "replay", "mooncake", *FLEET, "--limit", "20", "--regions", "2",
                 "--racks", "2", "--reuse-window-s", "90", "--pd", "auto",
                 "--pd-params", '{"rack_penalty_s": 1.5}', "--json")  # fmt: skip
    assert p.returncode == 0, p.stderr
    settings = json.loads(p.stdout)["settings"]
    assert settings["regions"] == 2 and settings["racks"] == 2
    assert settings["reuse_window_s"] == 90.0
    assert settings["pd_params"] == {"rack_penalty_s": 1.5}


def test_a_limit_below_one_is_an_error_not_another_workload() -> None:
    """``--limit 0`` replayed one request of a trace and the whole agentic workload;
    ``--limit -3`` one request of a trace and all but the last 3 agentic ones."""
    for trace in ("mooncake", "agentic:sessions=5"):
        for limit in ("0", "-3"):
            p = kvrouter("sim", "replay", trace, *FLEET, "--limit", limit, "--json")
            assert p.returncode == 2, (trace, limit, p.stdout)
            assert "--limit must be at least 1" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--regions", "0"], "--regions must be at least 1"),  # was a ZeroDivisionError
        (["--racks", "0"], "--racks must be at least 1"),  # the same
        (["--regions", "-1"], "--regions must be at least 1"),  # was one region per replica
        (["--cpu-blocks", "-5"], "--cpu-blocks must not be negative"),  # was no host tier
        (["--trace-block", "0"], "--trace-block must be at least 1"),  # was 512
        (["--speculative-ttl-ms", "-1"], "--speculative-ttl-ms must be >= 0 and finite"),
        (["--report-interval-ms", "-5"], "--report-interval-ms must be >= 0 and finite"),
        # NaN passed every "< 0" check: a run of NaN delays, lags and intervals
        (["--event-lag-ms", "nan"], "--event-lag-ms must be >= 0 and finite"),
        (["--transport-ms", "inf"], "--transport-ms must be >= 0 and finite"),
        (["--arrival-jitter-ms", "nan"], "--arrival-jitter-ms must be >= 0 and finite"),
        (["--report-interval-ms", "nan"], "--report-interval-ms must be >= 0 and finite"),
        (["--speculative-ttl-ms", "nan"], "--speculative-ttl-ms must be >= 0 and finite"),
        (["--share-load-ms", "nan"], "--share-load-ms must be >= 0 and finite"),
        (["--reuse-window-s", "inf"], "--reuse-window-s must be positive and finite"),
        (["--speedup", "nan"], "--speedup must be positive and finite"),  # was a run forever
        (["--speedup", "inf"], "--speedup must be positive and finite"),
        (["--jobs", "-1"], "--jobs must be >= 1"),  # was accepted
    ],
)
def test_fleet_flags_out_of_range_are_errors(flags: list[str], message: str) -> None:
    p = kvrouter("sim", "replay", "mooncake", *FLEET, "--limit", "5", *flags, "--json")
    assert p.returncode == 2, p.stdout
    assert message in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("key", ["tpot_target_s", "mode"])
def test_pd_params_naming_what_other_flags_set_are_errors(key: str) -> None:
    """``tpot_target_s`` is the SLO's (``--slo-tpot-ms``), as the service takes it from the
    model's SLO and refuses it in ``[models.NAME.pd]``; ``mode`` is ``--pd``'s. Both passed
    the flag's check and then crashed the run with a TypeError traceback."""
    value = 0.05 if key == "tpot_target_s" else '"always"'
    p = kvrouter(
        "sim", "replay", "agentic:sessions=2", "--replicas", "4", "--racks", "2",
        "--pd", "auto", "--pd-params", f'{{"{key}": {value}}}', "--json",
    )  # fmt: skip
    assert p.returncode == 2, p.stdout
    assert f"--pd-params: {key!r}" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("tune", ["policy", "admission"])
def test_tune_refuses_an_out_path_it_cannot_write_before_tuning(tmp_path: Path, tune: str) -> None:
    """A tuning run takes minutes to hours: an ``--out`` in a directory that does not exist
    is refused before it starts, naming the flag, not after the search."""
    out = tmp_path / "missing" / "tuned.toml"
    p = kvrouter(
        "sim", "tune", "mooncake", "--limit", "40", "--budget", "1", "--speedups", "1",
        "--tune", tune, "--out", str(out),
    )  # fmt: skip
    assert p.returncode == 2
    assert f"--out {out}: directory {out.parent} does not exist" in p.stderr, p.stderr
    assert "rung" not in p.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--budget", "0"], "--budget must be >= 1"),  # was a search of one setting
        (["--budget", "-1"], "--budget must be >= 1"),
        (["--speedups", "1,nan"], "--speedups must list positive finite numbers"),  # no end
        (["--speedups", "inf"], "--speedups must list positive finite numbers"),
        (["--tune", "admission", "--min-priority", "nan"], "--min-priority must be in [0, 1]"),
        (["--tune", "admission", "--min-priority", "2"], "--min-priority must be in [0, 1]"),
    ],
)
def test_tune_flags_out_of_range_are_errors(tmp_path: Path, flags: list[str], message: str) -> None:
    p = kvrouter(
        "sim", "tune", "mooncake", *FLEET, "--limit", "10", *flags,
        "--out", str(tmp_path / "tuned.toml"),
    )  # fmt: skip
    assert p.returncode == 2, p.stdout
    assert message in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "tuned.toml").exists()


@pytest.mark.parametrize("sweep", ["inf", "nan", "0", "1,-2", "fast", ","])
def test_a_sweep_of_bad_speed_ups_is_an_error_before_the_runs(sweep: str, tmp_path: Path) -> None:
    """``--sweep`` was read only after the main runs, unchecked: ``inf`` plotted a sweep
    point of every arrival at 0 as if it were a load, ``nan`` one of NaN arrivals, ``0`` and
    ``fast`` ended in a traceback after the runs, an empty list in a plot of no points."""
    p = kvrouter("sim", "replay", "mooncake", *FLEET, "--limit", "5", "--sweep", sweep,
                 "--report", str(tmp_path), "--json")  # fmt: skip
    assert p.returncode == 2, p.stdout
    assert "--sweep must list positive finite numbers" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and not list(tmp_path.iterdir())


def test_json_settings_give_the_host_tier_the_engines_ran_with() -> None:
    """``settings.cpu_blocks`` was the flag as given: null for a profile's own host tier
    (kimi-k3: 1.5M blocks of 64 tokens), which the engines ran with, as ``kv_blocks``
    gives the profile's GPU blocks; both in blocks of the run's ``block_size``."""
    fleet = ["--profile", "kimi-k3", "--replicas", "2", "--limit", "5", "--json"]
    p = kvrouter("sim", "replay", "mooncake", *fleet, "--block-size", "32")
    assert p.returncode == 0, p.stderr
    settings = json.loads(p.stdout)["settings"]
    assert (settings["kv_blocks"], settings["cpu_blocks"]) == (1_600_000, 3_000_000)
    p = kvrouter("sim", "replay", "mooncake", *fleet, "--cpu-blocks", "0")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["settings"]["cpu_blocks"] == 0
