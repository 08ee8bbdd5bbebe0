"""``kvrouter_pd_transfer_bytes``: the bytes a decode replica pulled, counted for the one
that got the transfer params and answered, over its own link (router/service/pd_serve.py
``serve``), not for the decode pick when the decode leg was retried elsewhere. Over real
HTTP: the stub prefill server of tests/test_pd_release.py, a decode replica refusing the
connection or answering 500, a test backend serving the retry."""

from __future__ import annotations

from typing import Any

from router.service.app import STATE
from router.service.config import build_settings
from tests.backends import Backend, start_router
from tests.ports import free_port
from tests.test_pd_release import MODEL, PARAMS, _chat, _Prefill
from tests.waiting import eventually

KV = 1000.0  # bytes a token


def _settings(decode0: str, decode1: str, prefill: str) -> Any:
    """``d0`` shares the prefill replica's rack (the pick: NVLink, no rack penalty), ``d1``
    is in another rack (the network)."""
    reps = [("p0", prefill, "prefill", "r0"), ("d0", decode0, "decode", "r0"),
            ("d1", decode1, "decode", "r1")]  # fmt: skip
    pd = {"mode": "always", "kv_bytes_per_token": KV, "state_bytes": 0.0}
    return build_settings(
        {
            "server": {"max_retries": 2, "health_interval_s": 0},
            "replicas": [
                {"url": u, "model": MODEL, "name": n, "role": r, "rack": rack, "region": "g0"}
                for n, u, r, rack in reps
            ],
            "models": {MODEL: {"block_size": 16, "pd": pd}},
        }
    )


async def test_a_decode_leg_retried_after_a_refused_connection_counts_the_retrys_pull() -> None:
    """The decode pick (same rack) refuses the connection: the transfer params go to the
    next decode replica (another rack), which pulls the whole prompt over the network. The
    bytes are counted there, once, and none on NVLink (the pick's link)."""
    prefill = await _Prefill().start()
    dead = f"http://127.0.0.1:{free_port()}"
    d1 = await Backend("d1", [MODEL]).start()
    router, url = await start_router(_settings(dead, d1.url, prefill.url))
    state = router.app[STATE]
    md = next(iter(state.disagg.values()))
    try:
        assert await _chat(url) == 200
        await eventually(lambda: state.load.in_flight() == 0)  # (the request's end is run)
        (got,) = d1.received
        assert got["body"]["kv_transfer_params"] == PARAMS  # d1 pulled
        assert set(md.bytes_by_link) == {"network"}, md.bytes_by_link
        assert md.bytes_by_link["network"] > 0
    finally:
        await router.cleanup()
        await d1.stop()
        await prefill.runner.cleanup()


async def test_a_decode_leg_retried_after_a_failed_answer_counts_no_transfer() -> None:
    """The decode pick got the transfer params and answered 500: the retry carries the
    original body (a local prefill on the next replica), so no replica that served the
    request pulled anything: no bytes are counted (the pick's included)."""
    prefill = await _Prefill().start()
    d0 = await Backend("d0", [MODEL], fail_next=1).start()
    d1 = await Backend("d1", [MODEL]).start()
    router, url = await start_router(_settings(d0.url, d1.url, prefill.url))
    state = router.app[STATE]
    md = next(iter(state.disagg.values()))
    try:
        assert await _chat(url) == 200
        await eventually(lambda: state.load.in_flight() == 0)  # (the request's end is run)
        assert d0.received[0]["body"]["kv_transfer_params"] == PARAMS
        (got,) = d1.received
        assert got["body"]["kv_transfer_params"] is None  # a local prefill there
        assert md.bytes_by_link == {}
    finally:
        await router.cleanup()
        await d0.stop()
        await d1.stop()
        await prefill.runner.cleanup()
