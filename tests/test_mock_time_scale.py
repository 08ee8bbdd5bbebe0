"""The mock replica's time scale (``kvrouter mock-replica --time-scale``): the engine model's
schedule runs on the loop clock scaled by it, never ahead of it; 1.0 is the profile's own
timing."""

from __future__ import annotations

import asyncio

import pytest

from router.core.types import ReplicaKey
from router.mock.driver import EngineDriver
from router.mock.server import MockSettings, create_app


async def _run_one(time_scale: float, output_tokens: int) -> tuple[float, float]:
    """(modelled seconds from submit to finish, wall seconds it took)."""
    from sim.engine import EngineModel, EngineRequest, Finished
    from sim.profiles import load_profile

    model = EngineModel(load_profile("dense-70b"), ReplicaKey("a"), 64)
    driver = EngineDriver(model, time_scale=time_scale)
    await driver.start()
    try:
        loop = asyncio.get_running_loop()
        wall0, model0 = loop.time(), driver.now()
        queue = driver.submit(EngineRequest("r1", (1, 2, 3), 192, output_tokens))
        while not isinstance(out := await queue.get(), Finished):
            pass
        return out.time - model0, loop.time() - wall0
    finally:
        await driver.stop()


async def test_a_scaled_engine_keeps_the_schedule_on_a_faster_clock() -> None:
    modelled, wall = await _run_one(0.1, 300)
    assert modelled > 1.0  # 300 decode steps of the profile: ~2 s of modelled time
    assert wall >= 0.1 * modelled * 0.95  # never ahead of the scaled schedule
    assert wall < modelled  # and not on the unscaled one


async def test_the_default_scale_is_the_profile_s_timing() -> None:
    modelled, wall = await _run_one(1.0, 20)
    assert wall >= modelled * 0.95


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_a_scale_that_is_not_positive_is_refused(scale: float) -> None:
    """inf: every modelled prefill or decode step would sleep for ever (a hung replica)."""
    with pytest.raises(ValueError, match="time-scale must be > 0"):
        create_app(MockSettings(time_scale=scale))
