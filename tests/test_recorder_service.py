"""The router's live-traffic recording (router/service/background.py ``recording``) when the
trace cannot be written for a while: requests are still served, the failure is logged, and
recording resumes once the path is writable again."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from tests.procs import FAST, Fleet, token_prompt
from tests.waiting import wait_until


def _complete(url: str, seed: int) -> int:
    body = {"model": "m", "prompt": token_prompt(seed, 64), "max_tokens": 2}
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()
        return resp.status


def _rows(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def test_recording_survives_a_trace_that_cannot_be_written(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    with Fleet(tmp_path) as fleet:
        mock = fleet.mock("r1", time_scale=FAST)
        router = fleet.router(
            "router",
            [("r1", mock.url)],
            server={"record_path": str(trace), "record_key": "secret"},
        )
        assert _complete(router.url, 1) == 200
        wait_until(lambda: _rows(trace) == 1, timeout=20)
        trace.rename(tmp_path / "before.jsonl")
        trace.mkdir()  # the next flush cannot open the live file
        assert _complete(router.url, 2) == 200  # still served
        wait_until(lambda: "recording: cannot write the trace" in router.log(), timeout=20)
        trace.rmdir()
        assert _complete(router.url, 3) == 200
        wait_until(lambda: _rows(trace) == 1, timeout=20, message="recording never resumed")
