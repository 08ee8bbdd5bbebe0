"""EAGLE / MTP engines end to end: mock replicas whose engine model gives back the last block
of every hit and keeps a hybrid prompt's last checkpoint one block lower (as vLLM with a
drafting head does), behind a router told ``eagle = true``: every request's predicted usable
hit is the engine's cached tokens, for a KV-only and a hybrid model (real HTTP, ZMQ events,
the openai client). Without the setting the router over-predicts (checked too)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from router.core.hashing import hash_prompt, root_hash
from router.core.types import ReplicaKey
from router.service.app import STATE
from router.service.config import build_settings
from router.service.state import RouterState
from tests.backends import events_applied, start_mock_fleet, start_router
from tests.waiting import eventually

B = 64
MODEL = "m"


def _profile(hybrid: bool) -> str:
    return f"""
name = "eagle-small"
block_size = {B}
kv_blocks = 20000
hybrid = {"true" if hybrid else "false"}
checkpoint = "every_n"
checkpoint_interval_tokens = {16 * B}
checkpoint_prompt_end = true
state_checkpoint_blocks = {"4.0" if hybrid else "0.0"}
eagle = true

[cost]
step_overhead_s = 0.002
prefill_s_per_token = 1e-6
decode_s_per_seq = 1e-4
"""


async def _turns(
    url: str, state: RouterState, hybrid: bool, applied: Callable[[], bool]
) -> list[tuple[int, int]]:
    """Six two-turn sessions sharing a system prompt, one request at a time, each sent once
    the index holds the previous prompt's blocks (and its last checkpoint): (predicted usable,
    engine-reported cached) per request."""
    rng = random.Random(5)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    system = [rng.randrange(1, 50_000) for _ in range(5 * B + 9)]
    rows = []
    try:
        for _ in range(6):
            context = system + [rng.randrange(1, 50_000) for _ in range(rng.randrange(300, 1200))]
            for _ in range(2):
                reply = await client.completions.create(model=MODEL, prompt=context, max_tokens=2)
                details = reply.usage.prompt_tokens_details if reply.usage else None
                assert details is not None and details.cached_tokens is not None
                decision = state.recent_decisions(1)[0]
                rows.append(
                    (min(decision["usable_tokens"], len(context) - 1), details.cached_tokens)
                )
                hashes = hash_prompt(context, B, root_hash(MODEL)).hashes
                owner = ReplicaKey.parse(decision["replica"])

                def caught_up(h: list[int] = hashes, k: ReplicaKey = owner) -> bool:
                    if not applied() or state.index.match(h).get(k).kv_blocks != len(h):
                        return False
                    end = len(h) - 1  # an EAGLE engine's last checkpoint
                    held = state.index.match(h[:end], hybrid=True).get(k).usable_blocks
                    return not hybrid or held == end

                await eventually(caught_up)
                context = context + [
                    rng.randrange(1, 50_000) for _ in range(rng.randrange(90, 600))
                ]
    finally:
        await client.close()
    return rows


@pytest.mark.parametrize("hybrid", [False, True], ids=["kv_only", "hybrid"])
@pytest.mark.parametrize("told", [True, False], ids=["eagle", "not_told"])
async def test_eagle_hits_are_predicted_as_the_engine_grants_them(
    tmp_path: Path, hybrid: bool, told: bool
) -> None:
    profile = tmp_path / "eagle.toml"
    profile.write_text(_profile(hybrid))
    runners: list[Any] = []
    try:
        replicas = await start_mock_fleet(
            2, runners, model=MODEL, block_size=B, profile=str(profile), engine_block_size=16
        )
        table = {"block_size": B, "policy": "ours", "eagle": told, "hybrid": hybrid}
        settings = build_settings({"replicas": replicas, "models": {MODEL: table}})
        router, url = await start_router(settings)
        applied = events_applied(router.app, [r.app for r in runners])
        runners.append(router)
        rows = await _turns(url, router.app[STATE], hybrid, applied)
        assert sum(cached for _, cached in rows) > 0
        if told:
            assert rows == [(cached, cached) for _, cached in rows], rows
        else:  # one block over on every hit
            assert any(predicted > cached for predicted, cached in rows), rows
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
