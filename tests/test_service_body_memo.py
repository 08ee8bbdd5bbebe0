"""The exact-repeat body memo (router/service/body_memo.py): the memo itself, and the router
with it on against the router with it off on the same traffic."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace
from typing import Any

import pytest

from router.service.body_memo import Admitted, BodyMemo
from router.service.config import build_settings
from router.service.handling import serve_completion
from router.service.proxy import Forwarder
from router.service.state import RouterState
from router.service.upstream import Client, Timeouts
from router.service.wire import Headers
from router.store.base import ReplicaInfo
from router.tokenize.keying import ProcessedPrompt
from tests.test_service_api import MODEL, TOKEN, Fleet, conversation, make_fleet


def _admitted(tokens: int = 100, hashes: int = 3, model: str = "m") -> Admitted:
    prompt = ProcessedPrompt(
        prompt_tokens=tokens,
        block_hashes=list(range(hashes)),
        block_size=16,
        exact=True,
        reused_tokens=5,
        tokenize_s=0.25,
        hash_s=0.5,
    )
    return Admitted(model, prompt, "sess", 7)


# ---------------------------------------------------------------------------- the memo


def test_a_hit_returns_the_admission_with_no_processing_cost() -> None:
    memo = BodyMemo(budget_bytes=1 << 20, max_body_bytes=1 << 16)
    assert memo.get("chat", b"{}") is None
    memo.put("chat", b"{}", _admitted())
    got = memo.get("chat", b"{}")
    assert got is not None
    assert (got.model, got.session_id, got.max_output_tokens) == ("m", "sess", 7)
    assert got.prompt.block_hashes == [0, 1, 2] and got.prompt.prompt_tokens == 100
    # what a hit cost: nothing tokenized or hashed; the incremental cache's figure is kept
    assert (got.prompt.tokenize_s, got.prompt.hash_s, got.prompt.reused_tokens) == (0, 0, 5)
    assert (memo.hits, memo.misses) == (1, 1)
    # the same bytes on the other endpoint are another prompt
    assert memo.get("completion", b"{}") is None


def test_a_digest_collision_is_a_miss_never_another_bodys_admission(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Entries are found by a 64-bit digest of the body and confirmed by the bytes: two
    bodies with one digest (forced here) never share an admission, and the budget stays
    counted right when one replaces the other."""
    import router.service.body_memo as body_memo

    monkeypatch.setattr(body_memo.xxhash, "xxh3_64_intdigest", lambda raw: 42)
    memo = BodyMemo(budget_bytes=1 << 20, max_body_bytes=1 << 16)
    memo.put("chat", b'{"a": 1}', _admitted(tokens=100))
    assert memo.get("chat", b'{"a": 2}') is None
    memo.put("chat", b'{"a": 2}', _admitted(tokens=200))
    got = memo.get("chat", b'{"a": 2}')
    assert got is not None and got.prompt.prompt_tokens == 200
    assert memo.get("chat", b'{"a": 1}') is None
    assert len(memo) == 1
    assert memo.size_bytes == body_memo._cost(b'{"a": 2}', _admitted(tokens=200))


def test_large_bodies_and_a_zero_budget_are_not_kept() -> None:
    memo = BodyMemo(budget_bytes=1 << 20, max_body_bytes=100)
    memo.put("chat", b"x" * 100, _admitted())
    memo.put("chat", b"x" * 99, _admitted())
    assert len(memo) == 1 and memo.get("chat", b"x" * 100) is None
    off = BodyMemo(budget_bytes=0, max_body_bytes=100)
    off.put("chat", b"{}", _admitted())
    assert len(off) == 0 and off.get("chat", b"{}") is None and not off.enabled


def test_the_budget_evicts_least_recently_used_first() -> None:
    one = BodyMemo(budget_bytes=1 << 20, max_body_bytes=1 << 16)
    one.put("chat", b"a" * 1000, _admitted())
    per_entry = one.size_bytes
    memo = BodyMemo(budget_bytes=3 * per_entry, max_body_bytes=1 << 16)
    bodies = [bytes([c]) * 1000 for c in b"abcd"]
    for raw in bodies[:3]:
        memo.put("chat", raw, _admitted())
    assert memo.get("chat", bodies[0]) is not None  # a is now the most recent
    memo.put("chat", bodies[3], _admitted())  # evicts b, the least recent
    assert memo.get("chat", bodies[1]) is None
    assert all(memo.get("chat", raw) is not None for raw in (bodies[0], bodies[2], bodies[3]))
    assert len(memo) == 3 and memo.size_bytes == 3 * per_entry
    # re-putting a body replaces its entry without double counting
    memo.put("chat", bodies[0], _admitted())
    assert len(memo) == 3 and memo.size_bytes == 3 * per_entry
    # the session id (a copy of the body's ``user``) is counted too
    big_user = Admitted("m", _admitted().prompt, "u" * 5000, None)
    alone = BodyMemo(budget_bytes=1 << 20, max_body_bytes=1 << 16)
    alone.put("chat", b"a" * 1000, big_user)
    assert alone.size_bytes == per_entry - len("sess") + 5000
    # and so is a Responses body's previous_response_id (a decoded copy, unbounded)
    follow_up = replace(_admitted(), previous_response="r" * 50_000)
    kept = BodyMemo(budget_bytes=1 << 20, max_body_bytes=1 << 17)
    kept.put("responses", b"a" * 1000, follow_up)
    assert kept.size_bytes == per_entry + 50_000
    # an entry larger than the whole budget is not kept (and evicts nothing)
    memo.put("chat", b"z" * 1000, _admitted(hashes=10_000))
    assert len(memo) == 3 and memo.get("chat", b"z" * 1000) is None


@pytest.mark.parametrize("prompts", [[[7]] * 20_000, [[7] * 16] * 3_000, [[7] * 2_000] * 30])
def test_a_batch_bodys_prompts_count_against_the_budget(prompts: list[list[int]]) -> None:
    """A batch of completion prompts keeps every prompt's row (its token count and block
    hashes, for the live-traffic trace) in the memo: what the budget counts is at least what
    the entry holds, so a memo of small batch bodies stays within ``body_memo_mb`` (an
    80 KB body of 20,000 one-token prompts holds about 2.4 MB)."""
    import tracemalloc

    from router.service.body_memo import _cost
    from router.tokenize.pipeline import PromptProcessor

    raw = json.dumps({"model": "m", "prompt": prompts}, separators=(",", ":")).encode()
    body = json.loads(raw)
    processor = PromptProcessor("m", 16)
    tracemalloc.start()
    try:
        admitted = Admitted("m", processor.completion(body), None, None)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert admitted.prompt.prompts == len(prompts)
    assert _cost(raw, admitted) >= len(raw) + held


# ---------------------------------------------------------------------------- the router


def _metric(page: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{name}{{?{re.escape(labels)}}}? ([0-9.e+]+)$", page, re.M)
    assert m is not None, f"{name}{labels} not on the page"
    return float(m.group(1))


async def _replay(fleet: Fleet, bodies: list[bytes]) -> list[tuple[str, int, int]]:
    for raw in bodies:
        resp = await fleet.post("/v1/chat/completions", raw)
        assert resp.status == 200, await resp.text()
        await resp.read()
    hdr = {"Authorization": f"Bearer {TOKEN}"}
    got = await (
        await fleet.http.get(fleet.url + f"/admin/decisions?limit={len(bodies)}", headers=hdr)
    ).json()
    decisions = got["decisions"] if isinstance(got, dict) else got
    return [(d["replica"], d["prompt_tokens"], d["usable_tokens"]) for d in decisions][::-1]


@pytest.mark.parametrize("engine", ["fast"])
async def test_memo_on_and_off_route_the_same_traffic_the_same_way(engine: str) -> None:
    sessions = [conversation(t) for t in (1, 2, 1, 3, 2, 1, 1, 3)]
    bodies = [
        json.dumps({"model": MODEL, "messages": m, "max_tokens": 4, "user": f"u{i % 2}"}).encode()
        for i, m in enumerate(sessions)
    ]
    runs: dict[float, tuple[list[tuple[str, int, int]], str]] = {}
    for memo_mb in (0.0, 16.0):
        async for fleet in make_fleet({"body_memo_mb": memo_mb}, engine=engine):
            decisions = await _replay(fleet, bodies)
            page = await (await fleet.http.get(fleet.url + "/metrics")).text()
            runs[memo_mb] = (decisions, page)
    (off, off_page), (on, on_page) = runs[0.0], runs[16.0]
    assert on == off  # same replicas, prompt tokens and predicted hits
    repeats = len(bodies) - len(set(bodies))
    assert repeats == 3
    assert _metric(on_page, "kvrouter_body_memo_lookups_total", 'result="hit"') == repeats
    assert _metric(off_page, "kvrouter_body_memo_lookups_total", 'result="hit"') == 0
    for name in ("kvrouter_prompt_tokens_total", "kvrouter_predicted_hit_tokens_total"):
        label = f'model="{MODEL}"'
        assert _metric(on_page, name, label) == _metric(off_page, name, label)
    assert _metric(on_page, "kvrouter_body_memo_bytes") > 0


@pytest.mark.parametrize("engine", ["fast"])
async def test_bad_bodies_are_checked_every_time(engine: str) -> None:
    async for fleet in make_fleet(engine=engine):
        chat = json.dumps({"model": MODEL, "messages": conversation(1)}).encode()
        for _ in range(2):
            resp = await fleet.post("/v1/chat/completions", b'{"model": 1}')
            assert resp.status == 400
            over = json.dumps({"model": MODEL, "messages": conversation(40)}).encode()
            resp = await fleet.post("/v1/chat/completions", over)  # over the 4096-token context
            assert (
                resp.status == 400 and "context length" in (await resp.json())["error"]["message"]
            )
        assert (await fleet.post("/v1/chat/completions", chat)).status == 200
        # the same bytes on /v1/completions have no prompt: still refused after the chat hit
        for _ in range(2):
            resp = await fleet.post("/v1/completions", chat)
            assert resp.status == 400
        page = await (await fleet.http.get(fleet.url + "/metrics")).text()
        assert _metric(page, "kvrouter_body_memo_lookups_total", 'result="hit"') == 0


class _Answer:
    """The client side of :func:`serve_completion`: records the answer."""

    def __init__(self) -> None:
        self.status = 0
        self.body = b""

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self.status, self.body = status, body

    async def start(
        self, status: int, headers: Headers, data: bytes = b"", end: bool = False
    ) -> None:
        raise AssertionError("no stream expected")

    async def write(self, data: bytes) -> None:
        raise AssertionError("no stream expected")

    async def end(self, data: bytes = b"") -> None:
        raise AssertionError("no stream expected")


async def test_a_memo_hit_for_a_model_whose_replicas_left_is_404() -> None:
    state = RouterState(build_settings({"models": {"m": {"block_size": 16}}}))
    assert state.fleet.add_discovered(ReplicaInfo("a", url="http://127.0.0.1:9", model="m"))
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    memo: Any = state.body_memo
    memo.put("chat", raw, _admitted(model="m"))
    state.fleet.remove_discovered("a")
    answer = _Answer()
    unused = Forwarder(state, Client(Timeouts()))  # the request never reaches it
    await serve_completion(state, unused, answer, b"/v1/chat/completions", raw, [])
    assert answer.status == 404, answer.body
    assert json.loads(answer.body)["error"]["message"] == "The model 'm' does not exist"
    assert memo.hits == 1


# ---------------------------------------------------------------------------- request ids


def test_fresh_request_ids_are_distinct_in_forked_workers() -> None:
    import os

    from router.service.request_identity import request_id_of

    parent = [request_id_of([]) for _ in range(300)]  # crosses a 4 KiB buffer refill
    assert len(set(parent)) == 300
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in parent)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child draws from where the parent's buffer stood
        os.write(write, "".join(request_id_of([]) for _ in range(8)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 4096).decode()
    os.close(read)
    after = [request_id_of([]) for _ in range(8)]
    child_ids = {child[i : i + 32] for i in range(0, len(child), 32)}
    assert len(child_ids) == 8 and not child_ids & set(after)


@pytest.mark.parametrize("engine", ["fast"])
async def test_an_id_already_in_flight_is_made_unique(engine: str) -> None:
    async for fleet in make_fleet(engine=engine):
        for b in fleet.backends:
            b.delay_s = 0.3
        body = {"model": MODEL, "messages": conversation(1), "max_tokens": 4}
        hdr = {"X-Request-Id": "client-id-1"}
        first, second = await asyncio.gather(
            fleet.post("/v1/chat/completions", body, headers=hdr),
            fleet.post("/v1/chat/completions", body, headers=hdr),
        )
        assert first.status == second.status == 200
        ids = sorted(r["headers"]["x-request-id"] for b in fleet.backends for r in b.received)
        assert ids[0] == "client-id-1"
        assert re.fullmatch(r"client-id-1-[0-9a-f]{8}", ids[1]), ids
        # both requests were accounted for and are finished: nothing left in flight
        page = await (await fleet.http.get(fleet.url + "/metrics")).text()
        in_flight = re.findall(r"^kvrouter_in_flight_requests\{[^}]*\} (\S+)$", page, re.M)
        assert in_flight and all(float(v) == 0 for v in in_flight)
        # a later request may use the id again as it is
        third = await fleet.post("/v1/chat/completions", body, headers=hdr)
        assert third.status == 200
        ids = [r["headers"]["x-request-id"] for b in fleet.backends for r in b.received]
        assert ids.count("client-id-1") == 2 and len(ids) == 3
