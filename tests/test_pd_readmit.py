"""A decode replica whose time out of rotation ends while a disaggregated request's prefill
leg runs is readmitted for its decode pick (router/service/pd_serve.py ``_pick_decode``), as
every other routing step readmits replicas first (``RouterState.decide``, ``disagg.route``).
Over real HTTP against the stub prefill server and mock backends of
tests/test_pd_service.py."""

from __future__ import annotations

import asyncio

from router.core.types import ReplicaKey
from router.service.app import STATE
from tests.backends import Backend, start_router, without_housekeeping_readmission
from tests.test_pd_service import MODEL, _post, _Prefill, _prompt, _stub_settings


async def test_a_decode_replica_readmitted_during_the_prefill_leg_takes_the_decode() -> None:
    """``d0``, the one decode replica, is out of rotation until the moment its prefill leg
    is served (an ejection or cooldown that ends then): by the decode pick it is due back.
    Before, the pick read its stale health and answered 503 ``no_replica_available``
    (after freeing the prefill's blocks) while ``d0`` was fit to decode."""
    prefill = await _Prefill().start()
    decode = await Backend("d0", [MODEL]).start()
    router, url = await start_router(_stub_settings(prefill.url, [(decode.url, "decode")]))
    state = router.app[STATE]
    without_housekeeping_readmission(state)
    cooldown = state.settings.server.unhealthy_cooldown_s
    loop = asyncio.get_running_loop()
    # out of rotation from before the leg until the leg arrives (the mark ends then)
    prefill.hook = lambda: state.fleet.mark_unhealthy(ReplicaKey("d0"), loop.time() - cooldown)
    try:
        body = {"model": MODEL, "prompt": _prompt(51), "max_tokens": 3}
        status, raw, _ = await _post(url, body)
        assert status == 200, raw
        assert len(prefill.seen) == 1
        assert len(decode.received) == 1
        assert decode.received[0]["body"]["kv_transfer_params"] == _Prefill.PARAMS
        assert ReplicaKey("d0") not in state.fleet.unhealthy_until
    finally:
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()
