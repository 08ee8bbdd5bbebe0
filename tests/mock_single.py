"""The mock replica's answers to one sequence of one prompt (``n`` absent or 1, a single
prompt or a batch of one), normalised so that runs compare: ids and ``created`` dropped, a
stream as what does not depend on how its tokens fell into chunks (``_stream``); then the
engine's counters.
tests/fixtures/mock_single_answers.json holds them as the mock answered before it served
``n`` > 1 and batches (tests/test_mock_sampling.py checks they are unchanged)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

PROMPT = list(range(100, 140))  # 40 tokens: two full 16-token blocks, hit on a repeat
CHAT = [{"role": "user", "content": "hello there"}]

# (path, body) of each request, sent in this order to one fresh mock (model "m",
# block_size 16, default settings otherwise)
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 1}),  # a repeat: cached
    ("/v1/completions", {"prompt": "hello world", "max_tokens": 2, "logprobs": 1, "echo": True}),
    ("/v1/completions", {"prompt": [[1, 2, 3, 4]], "max_tokens": 2}),
    ("/v1/completions", {"prompt": ["ab cd"], "max_tokens": 2, "n": 1}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "n": 1}),
    (
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    (
        "/v1/completions",
        {"prompt": ["xy"], "max_tokens": 3, "stream": True, "echo": True, "logprobs": 0},
    ),
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 4,
            "n": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
]


# the engine's counters after them (their vLLM names)
COUNTERS = (
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)


def _bare(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("id", "created")}


def _merged_logprobs(into: Any, more: Any) -> Any:
    """Two chunks' logprobs as one (completions: lists side by side; chat: ``content``)."""
    if into is None or more is None:
        return more if into is None else into
    return {key: (into.get(key) or []) + (more.get(key) or []) for key in into.keys() | more}


def _stream(events: list[Any]) -> dict[str, Any]:
    """A stream as what does not depend on how its tokens fell into chunks (a reader that
    lags gets several tokens in one): the chunks' envelope, the text and logprobs of all
    its choice chunks together, their key sets, the last finish_reason, the last running
    usage (``continuous_usage_stats``) and the final usage chunk."""
    chunks = [_bare(e) for e in events if e != "[DONE]"]
    final = chunks.pop() if chunks and not chunks[-1]["choices"] else None
    text, logprobs, finish, running = "", None, None, None
    keys, role = set(), None
    for c in chunks:
        choice = c["choices"][0]
        keys.add(json.dumps(sorted(choice)))
        delta = choice.get("delta") or {}
        role = role or delta.get("role")
        text += choice.get("text") or delta.get("content") or ""
        logprobs = _merged_logprobs(logprobs, choice.get("logprobs"))
        finish = choice.get("finish_reason") or finish
        running = c.get("usage", running)
    return {
        "envelope": sorted({json.dumps(sorted(k for k in c if k != "usage")) for c in chunks}),
        "object": chunks[0]["object"],
        "role": role,
        "text": text,
        "logprobs": logprobs,
        "keys": sorted(keys),
        "finish_reason": finish,
        "running_usage": running,
        "final": final,
        "done": events[-1] == "[DONE]",
    }


async def answers(url: str, model: str = "m") -> list[Any]:
    """Each of :data:`REQUESTS`' answers from the mock at ``url``, normalised."""
    out: list[Any] = []
    async with aiohttp.ClientSession() as http:
        for path, body in REQUESTS:
            async with http.post(url + path, json={"model": model, **body}) as r:
                assert r.status == 200, await r.text()
                if not body.get("stream"):
                    out.append(_bare(await r.json()))
                    continue
                text = await r.text()
            events = [b[len("data: ") :] for b in text.split("\n\n") if b.startswith("data: ")]
            out.append(_stream([e if e == "[DONE]" else json.loads(e) for e in events]))
        async with http.get(url + "/metrics") as r:
            page = await r.text()
    counted = {}
    for line in page.splitlines():
        name = line.split("{")[0]
        if name in COUNTERS:
            counted[name] = float(line.rsplit(" ", 1)[1])
    out.append(counted)
    return out
