"""Roles of replicas discovered from the Redis registry under prefill/decode disaggregation
(docs/pd.md): a registration's role is read as the configuration reads one (real Redis,
real HTTP, the stub prefill replica and backends of tests/test_pd_service.py)."""

from __future__ import annotations

from typing import Any

import aiohttp

from router.service.app import STATE
from router.service.config import build_settings
from router.store.base import ReplicaInfo
from router.store.redis_store import RedisStore
from router.store.schema import KeySchema
from tests.backends import Backend, start_router
from tests.test_pd_service import MODEL, TOKEN, B, _post, _Prefill, _prompt
from tests.waiting import eventually


async def test_a_registered_role_in_another_spelling_is_that_role(
    redis_url: str, key_prefix: str
) -> None:
    """A registration's role is accepted as ``Role.parse`` reads it (any case, spaces
    around, empty for ``both``), as a configured one is. It was kept as registered, and the
    disaggregator's role lookup (``Role(ep.role)``) then raised ValueError for every request
    of the model: each one failed instead of being disaggregated."""
    store = RedisStore.from_url(redis_url, KeySchema(key_prefix, stream_shards=2))
    prefill = await _Prefill().start()
    decode = await Backend("d0", [MODEL]).start()
    both = await Backend("b0", [MODEL]).start()
    settings = build_settings(
        {
            "server": {"redis_url": redis_url, "redis_key_prefix": key_prefix,
                       "admin_token": TOKEN, "health_interval_s": 0},
            "models": {MODEL: {"block_size": B, "hybrid": True, "pd": {"mode": "always"}}},
        }
    )  # fmt: skip
    router, url = await start_router(settings)
    state = router.app[STATE]
    try:
        for name, u, role in (("p0", prefill.url, "Prefill"), ("d0", decode.url, " DECODE "),
                              ("b0", both.url, "")):  # fmt: skip
            info = ReplicaInfo(name, url=u, model=MODEL, role=role, block_size=B)
            await store.register(info, f"pub-{name}", 30)
        await eventually(lambda: len(state.registry.keys_for(MODEL)) == 3)
        roles = {str(ep.key): ep.role for ep in state.registry.endpoints()}
        assert roles == {"p0": "prefill", "d0": "decode", "b0": "both"}
        for i in range(4):
            status, raw, _ = await _post(url, {"model": MODEL, "prompt": _prompt(i)})
            assert status == 200, raw

        def legs(bodies: list[dict[str, Any]], flag: str) -> int:
            return sum(bool((b.get("kv_transfer_params") or {}).get(flag)) for b in bodies)

        sent_both = [got["body"] for got in both.received]
        sent_decode = [got["body"] for got in decode.received]
        # every request disaggregated: its prefill leg on a prefill-capable replica (the
        # decode-only one never gets one), then one decode leg (or, after the stub ``both``
        # replica's leg, which answers no transfer params, a local prefill) on a
        # decode-capable one
        assert len(prefill.seen) + legs(sent_both, "do_remote_decode") == 4
        assert legs(sent_decode, "do_remote_decode") == 0
        decode_side = len(sent_both) + len(sent_decode) - legs(sent_both, "do_remote_decode")
        assert decode_side == 4
        assert legs(sent_both, "do_remote_prefill") + legs(sent_decode, "do_remote_prefill") == len(
            prefill.seen
        )
        assert state.load.in_flight() == 0
        async with (
            aiohttp.ClientSession() as http,
            http.get(url + "/admin/pd", headers={"X-Admin-Token": TOKEN}) as r,
        ):
            view: dict[str, Any] = (await r.json())["models"][MODEL]
        assert sorted(view["prefill"]) == ["b0", "p0"]
        assert sorted(view["decode"]) == ["b0", "d0"]
    finally:
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()
        await both.stop()
        await store.close()
