"""The router's live-traffic recording (router/service/background.py ``recording``) when the
trace cannot be written for a while: requests are still served, the failure is logged, and
recording resumes once the path is writable again."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from router.service.config import build_settings
from router.service.keys import STATE
from tests.backends import Backend, start_router
from tests.procs import FAST, Fleet, token_prompt
from tests.waiting import eventually, wait_until


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


def _post(url: str, path: str, body: dict[str, object]) -> bytes:
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read()


def _recorded(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


async def _completed(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    """POST ``body`` to the router's completions endpoint and read its 200 answer whole."""
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        await r.read()


async def _backend_router(trace: Path) -> tuple[Backend, Any, str]:
    """A router recording to ``trace`` in front of the test backend, which (unlike the mock
    replica) answers batches and ``n`` > 1 as vLLM does: one choice per prompt and sample,
    their tokens summed in the usage."""
    backend = await Backend("b", ["m"]).start()
    replicas = [{"url": backend.url, "model": "m", "name": "b"}]
    server = {"record_path": str(trace), "record_key": "k"}
    models = {"m": {"block_size": 16}}
    router, url = await start_router(
        build_settings({"replicas": replicas, "server": server, "models": models})
    )
    return backend, router, url


async def test_a_completions_batch_is_one_row_per_prompt_each_with_its_own_blocks(
    tmp_path: Path,
) -> None:
    """A batch is k independent prompts: the engine prefills each with its own prefix
    blocks, so the trace holds one row per prompt, at the batch's arrival."""
    trace = tmp_path / "trace.jsonl"
    short, long = token_prompt(1, 600), token_prompt(2, 1100)
    backend, router, url = await _backend_router(trace)
    try:
        async with aiohttp.ClientSession() as http:
            for prompt in ([short, long], short, long):
                body = {"model": "m", "prompt": prompt, "max_tokens": 4}
                await _completed(http, url, body)
            await eventually(lambda: len(_recorded(trace)) >= 4, timeout=20)
    finally:
        await router.cleanup()
        await backend.stop()
    batch, alone = _recorded(trace)[:2], _recorded(trace)[2:]
    assert [r["input_length"] for r in batch] == [600, 1100]
    assert [r["hash_ids"] for r in batch] == [r["hash_ids"] for r in alone]
    assert batch[0]["timestamp"] == batch[1]["timestamp"]
    # the usage sums both prompts' answers (4 tokens each): each row has its own
    assert [r["output_length"] for r in batch] == [4, 4]


async def test_n_samples_are_one_row_with_n_and_each_sample_s_length(tmp_path: Path) -> None:
    """``n`` sequences of one prompt share its prefill and decode n answers: one row, its
    ``n``, and the length of one answer (the usage sums them)."""
    trace = tmp_path / "trace.jsonl"
    backend, router, url = await _backend_router(trace)
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "m", "prompt": token_prompt(3, 700), "max_tokens": 4, "n": 3}
            await _completed(http, url, body)
            await eventually(lambda: len(_recorded(trace)) >= 1, timeout=20)
    finally:
        await router.cleanup()
        await backend.stop()
    (row,) = _recorded(trace)
    assert (row["input_length"], row["n"], row["output_length"]) == (700, 3, 4)


def test_rows_name_the_endpoint_and_whether_the_request_streamed(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    with Fleet(tmp_path) as fleet:
        mock = fleet.mock("r1", time_scale=FAST)
        router = fleet.router(
            "router", [("r1", mock.url)], server={"record_path": str(trace), "record_key": "k"}
        )
        chat = {"role": "user", "content": "hello there"}
        _post(
            router.url,
            "/v1/chat/completions",
            {"model": "m", "messages": [chat], "max_tokens": 2, "stream": True},
        )
        wait_until(lambda: len(_recorded(trace)) == 1, timeout=20)
        _post(router.url, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})
        wait_until(lambda: len(_recorded(trace)) == 2, timeout=20)
        batch = {"model": "m", "prompt": ["one prompt", "another"], "max_tokens": 2}
        _post(router.url, "/v1/completions", batch)
        wait_until(lambda: len(_recorded(trace)) == 4, timeout=20)
    rows = _recorded(trace)
    assert [(r["endpoint"], r["stream"]) for r in rows] == [
        ("chat", True), ("completions", False), ("completions", False), ("completions", False)
    ]  # fmt: skip
    # a batch's rows name it (one id, its own), a single prompt's none
    assert "batch" not in rows[0] and "batch" not in rows[1]
    assert rows[2]["batch"] == rows[3]["batch"] and isinstance(rows[2]["batch"], str)


async def test_the_router_serves_when_the_trace_cannot_be_opened_at_start(
    tmp_path: Path, caplog: Any
) -> None:
    """The trace path unwritable when the router starts (here a directory in its place; a
    full disk or a read-only volume alike). The defect: the recorder's construction failed
    and the router did not start at all, where docs/tuning.md promises requests served all
    along and recording resumed once the path takes writes."""
    trace = tmp_path / "trace.jsonl"
    trace.mkdir()
    caplog.set_level("ERROR")
    backend, router, url = await _backend_router(trace)
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "m", "prompt": token_prompt(4, 600), "max_tokens": 4}
            await _completed(http, url, body)
            assert "recording: cannot write the trace" in caplog.text
            trace.rmdir()
            state = router.app[STATE]
            await eventually(lambda: state.recorder is not None, timeout=20)
            await _completed(http, url, body)
            await eventually(lambda: len(_recorded(trace)) >= 1, timeout=20)
    finally:
        await router.cleanup()
        await backend.stop()
