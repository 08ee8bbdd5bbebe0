"""``kvrouter bench tokenize`` at a small size (its output contract, not its speed), and a real
1M-token token-id prompt through the router with default settings (the default body limit
admits it)."""

from __future__ import annotations

import json
import random

import aiohttp
import pytest

from router.service.config import build_settings
from tests.backends import Backend, start_router
from tests.inprocess import kvrouter

FIGURES = ("incremental_ms", "cold_ms", "tiktoken_ms", "speedup_vs_tiktoken")


def bench_tokenize(tokens: int, *extra: str) -> dict[str, object]:
    done = kvrouter("bench", "tokenize", "--tokens", str(tokens), "--reps", "1", *extra)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout[-2000:]  # one JSON object, one line
    out = json.loads(lines[0])
    assert isinstance(out, dict)
    return out


def check_figures(out: dict[str, object], tokens: int) -> None:
    assert out["bench"] == "tokenize"
    for key in FIGURES:
        v = out[key]
        assert isinstance(v, (int, float)) and not isinstance(v, bool), (key, v)
        assert v >= 0, (key, v)
    assert isinstance(out["tokens"], int) and out["tokens"] >= tokens * 0.9


def test_bench_tokenize_prints_one_json_object() -> None:
    check_figures(bench_tokenize(100_000), 100_000)


def test_bench_tokenize_kimi_k3_style_renders_incrementally() -> None:
    out = bench_tokenize(100_000, "--template", "kimi_k3_style")
    check_figures(out, 100_000)
    assert out["template"] == "kimi_k3_style" and out["incremental_render"] is True
    assert isinstance(out["reused_tokens"], int) and out["reused_tokens"] > 0


@pytest.mark.parametrize("tokens", [1_000, 20_000])
def test_bench_tokenize_small_size(tokens: int) -> None:
    """Below ~60K tokens build_session used to run out of corpus (StopIteration): cutting the
    previous turn to length throws away the rest of its last file."""
    check_figures(bench_tokenize(tokens), tokens)


@pytest.mark.parametrize("engine", ["fast"])
async def test_million_token_id_prompt_with_default_settings(engine: str) -> None:
    backend = await Backend("b0", ["m"]).start()
    backend.chunks = 1
    settings = build_settings({"replicas": [{"url": backend.url, "model": "m", "name": "b0"}]})
    runner, url = await start_router(settings, engine)
    try:
        rng = random.Random(11)
        prompt = [rng.randrange(100_000, 160_000) for _ in range(1_000_000)]
        body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode()
        assert len(body) > 7 * 2**20  # ~8 MB of JSON
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", data=body) as r:
                status, data = r.status, await r.read()
            assert status == 200, data[:300]
            assert json.loads(data)["choices"]
            async with http.get(url + "/metrics") as r:
                metrics = await r.text()
        assert len(backend.received) == 1
        assert backend.received[0]["body"]["prompt"] == prompt  # forwarded untouched
        routed = [
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith('kvrouter_prompt_tokens_total{model="m"} ')
        ]
        assert routed == [1_000_000]
    finally:
        await runner.cleanup()
        await backend.stop()
