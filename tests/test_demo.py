"""`kvrouter demo` end to end as a real process: mock replicas, router, agentic replay over
HTTP, simulator prediction; every process it started is gone afterwards."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import uuid
from dataclasses import dataclass

import pytest

from tests.inprocess import kvrouter

# one xdist worker runs this module: its live demo (a session fixture) runs once, even when
# the worker runs other modules' tests between this module's
pytestmark = pytest.mark.xdist_group("demo")

SMALL = (
    "agentic:sessions=6,session_rate=4,system_prompts=2,system_tokens=2000,tool_sets=1,"
    "tool_def_tokens=1000,mean_turns=3,max_turns=4,answer_tokens=20,tool_tokens=300,"
    "think_s=0.1,tool_latency_s=0.1,max_context=16384,seed=3"
)


def _demo_processes(tag: str) -> set[int]:
    """Live processes started by the demo run tagged ``tag`` (children inherit the tag in
    their environment; other demos running on the machine carry another or none)."""
    marker = f"KVROUTER_TEST_TAG={tag}".encode()
    found = set()
    for proc in pathlib.Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
            env = (proc / "environ").read_bytes() if b"router.cli" in cmd else b""
        except OSError:
            continue
        if marker in env.split(b"\0"):
            found.add(int(proc.name))
    return found


@dataclass(frozen=True)
class LiveDemo:
    out: subprocess.CompletedProcess[str]
    record: pathlib.Path  # the --record prefix
    tag: str  # KVROUTER_TEST_TAG of its processes


@pytest.fixture(scope="session")
def live_demo(tmp_path_factory: pytest.TempPathFactory) -> LiveDemo:
    """One live demo (two policies, traffic recorded) for the tests below: it is the slowest
    thing the suite runs, so it runs once."""
    tag = uuid.uuid4().hex
    prefix = tmp_path_factory.mktemp("demo") / "live"
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "demo", "--replicas", "2", "--agentic", SMALL,
         "--speedup", "4", "--policies", "round_robin,ours", "--max-output", "8",
         "--record", str(prefix)],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "KVROUTER_TEST_TAG": tag},
    )  # fmt: skip
    return LiveDemo(out, prefix, tag)


def test_demo_runs_live_and_simulated_and_cleans_up(live_demo: LiveDemo) -> None:
    out = live_demo.out
    rows = _rows(out)
    for cols in rows.values():
        requests = int(cols[1])
        assert requests > 6  # every turn completed (sessions x turns)
        hit, kv = float(cols[2].rstrip("%")), float(cols[3].rstrip("%"))
        goodput = float(cols[6].rstrip("%"))
        assert 0 <= hit <= kv <= 100 and kv > 0  # prefixes were reused (usable: timing's)
        assert 0 <= goodput <= 100 and float(cols[9]) > 0  # goodput and TPOT p90 reported
    assert _demo_processes(live_demo.tag) == set()


@pytest.mark.soak
def test_soak_live_demo_hits_as_the_simulator_predicts(live_demo: LiveDemo) -> None:
    """The live usable hit rate depends on the timing of turns and KV events: on a loaded
    machine (the default run, in parallel) it can fall to nothing, so it is compared with
    the simulator's prediction here."""
    rows = _rows(live_demo.out)
    for cols in rows.values():
        hit = float(cols[2].rstrip("%"))
        sim_hit = float(cols[cols.index("|") + 1].rstrip("%"))  # first simulator column
        assert 0 < hit <= 100 and abs(hit - sim_hit) < 15
    assert float(rows["ours"][2].rstrip("%")) >= float(rows["round_robin"][2].rstrip("%"))


def _rows(out: subprocess.CompletedProcess[str]) -> dict[str, list[str]]:
    """The demo's table: policy -> its columns."""
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("round", "ours"))}
    assert set(rows) == {"round_robin", "ours"}
    return rows


def test_demo_sim_only_needs_no_processes() -> None:
    out = kvrouter("demo", "--sim-only", "--agentic", SMALL)
    assert out.returncode == 0, out.stderr
    assert "ours" in out.stdout and "sim hit%" in out.stdout


@pytest.mark.parametrize("bad", [["--policies", "nope"], ["--trace", "/nonexistent.jsonl"]])
def test_demo_bad_arguments_fail_cleanly(bad: list[str]) -> None:
    out = kvrouter("demo", "--sim-only", *bad)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr


def test_recorded_demo_traffic_replays_in_the_simulator(live_demo: LiveDemo) -> None:
    import json

    out, prefix = live_demo.out, live_demo.record
    assert out.returncode == 0, out.stdout + out.stderr
    live = next(line.split() for line in out.stdout.splitlines() if line.startswith("ours"))
    trace = pathlib.Path(f"{prefix}.ours.jsonl")
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(rows) == int(live[1])
    assert all(r["hash_ids"] and r["model"] == "demo-model" and "session_id" in r for r in rows)
    assert sum("delay" in r for r in rows) >= len(rows) - 6  # follow-up turns: closed loop
    assert not any(key in r for r in rows for key in ("prompt", "tokens", "text"))
    sim = kvrouter("sim", "replay", str(trace), "--replicas", "2", "--policy", "ours",
                   "--speedup", "4", "--json", "--no-progress")  # fmt: skip
    assert sim.returncode == 0, sim.stderr
    result = json.loads(sim.stdout)
    assert result["requests"] == len(rows)
    # The recorded trace keeps the prefix sharing: the replay finds real hits.
    assert result["token_hit_rate"] > 0.2
