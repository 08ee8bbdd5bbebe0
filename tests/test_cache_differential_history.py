"""The incremental tokenization / render cache (router/tokenize/incremental.py) against a
fresh state, on what tests/test_cache_differential.py does not vary: history that changes
under the cache (an earlier message or the system prompt edited to text of the same length,
whose message keys collide; tool results reordered; messages swapped or dropped; a message
rewritten to another Unicode normal form), templates of every kind the cache handles
(message-local, with state carried between messages, whose head reads the whole
conversation, not message-local, without special tokens between messages) on models sharing
one tokenizer, and requests processed on several threads at once (the service processes
large bodies on worker threads). Every request must get the token count and block hashes a
fresh state gives it."""

from __future__ import annotations

import json
import random
import threading
import unicodedata
from typing import Any

import pytest

from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.pipeline import PromptProcessor
from router.tokenize.template import ChatTemplate
from tests.test_cache_differential import _files
from tests.test_cache_differential import _message as _any_message
from tests.test_tokenize_local import LOCAL, STATEFUL

TEMPLATES = {
    "kimi": LOCAL["kimi"],
    "kimi_k3_style": STATEFUL["kimi_k3_style"],
    "last_query_split": STATEFUL["last_query_split"],  # the head reads the whole list
    "history_suffix_split": STATEFUL["history_suffix_split"],
    "slice_expression_loop": STATEFUL["slice_expression_loop"],
    "prefill_drops_last": STATEFUL["prefill_drops_last"],
    "counter_in_macro": STATEFUL["counter_in_macro"],
    # not message-local (a ``set`` block in the loop): the rendered-text cache
    "not_local": (
        "{% for m in messages %}{% set r %}{{ m.role }}{% endset %}<|im_user|>{{ r }}"
        "<|im_middle|>{{ m.content }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}"
        "<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
    ),
    # no special token between messages: no exact cut anywhere but in the content
    "no_separators": (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    ),
}

TEXT_CACHED = ["not_local", "no_separators"]

# pieces of text: special tokens and their fragments, combining marks (NFC / NFD differ)
_WORDS = ["alpha", "beta", " ", "\n", "<|im_end|>", "漢字", "0123", "🙂", "\n\n", "x.y", "<|"]
_WORDS += ["é", "e\u0301", "<|im_user|>", "  ", "ab", "Å"]
_SYSTEM = {"role": "system", "content": "Keep answers short. " * 900}  # the cached paths


def _message(r: random.Random) -> dict[str, Any]:
    """A random message (tests/test_cache_differential.py's), its text of :data:`_WORDS`."""
    return _any_message(r, _WORDS, parts=False)


def _same_length_edit(r: random.Random, m: dict[str, Any]) -> dict[str, Any]:
    """``m`` with one character of its content changed (its message key stays the same when
    the change is past the first and before the last 64 characters)."""
    content = m.get("content")
    if not isinstance(content, str) or not content:
        return m
    lo, hi = (64, len(content) - 65) if len(content) > 200 else (0, len(content) - 1)
    i = r.randint(lo, hi)
    return {**m, "content": content[:i] + ("Z" if content[i] != "Z" else "Y") + content[i + 1 :]}


def _edited(r: random.Random, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with its history changed in one way."""
    out = list(messages)
    change = r.choice(["message", "system", "tool_order", "swap", "drop", "normal_form"])
    if change == "message" and len(out) > 1:
        at = r.randrange(1, len(out))
        out[at] = _same_length_edit(r, out[at])
    elif change == "system":
        out[0] = _same_length_edit(r, out[0])
    elif change == "tool_order":
        tools = [i for i, m in enumerate(out) if m["role"] == "tool"]
        if len(tools) >= 2:
            a, b = r.sample(tools, 2)
            out[a], out[b] = out[b], out[a]
    elif change == "swap" and len(out) > 3:
        at = r.randrange(1, len(out) - 1)
        out[at], out[at + 1] = out[at + 1], out[at]
    elif change == "drop" and len(out) > 3:
        del out[r.randrange(1, len(out))]
    elif change == "normal_form":
        at = r.randrange(len(out))
        content = out[at].get("content")
        if isinstance(content, str):
            form = r.choice(["NFC", "NFD"])
            out[at] = {**out[at], "content": unicodedata.normalize(form, content)}
    return out


def _names(r: random.Random) -> list[str]:
    """Three templates, one of them served by the rendered-text cache."""
    names = r.sample(sorted(set(TEMPLATES) - set(TEXT_CACHED)), 2)
    names.insert(r.randrange(3), r.choice(TEXT_CACHED))
    return names


def _processors(names: list[str], inc: IncrementalTokenizer) -> dict[str, PromptProcessor]:
    """One model per template name, all on ``inc`` (one tokenizer and its cache)."""
    return {
        f"m{i}": PromptProcessor(
            f"m{i}",
            (16, 32)[i % 2],
            tokenizer=inc,
            template=ChatTemplate.build(TEMPLATES[name]),
            context_length=1_000_000,
        )
        for i, name in enumerate(names)
    }


def _fresh(names: list[str], model: str) -> PromptProcessor:
    return _processors(names, IncrementalTokenizer(_files().tokenizer))[model]


def _view(proc: PromptProcessor, body: dict[str, Any]) -> tuple[Any, ...] | str:
    try:
        got = proc.chat(body)
    except Exception as exc:  # (the same refusal warm and fresh)
        return type(exc).__name__
    return (got.prompt_tokens, got.block_hashes)


def _session(r: random.Random, models: list[str], turns: int) -> list[dict[str, Any]]:
    """The bodies of one session: it grows turn by turn, its history sometimes changes
    under it, and some requests change the model (another template on the same
    tokenizer), the tools, the template arguments, the generation prompt or the salt."""
    own = r.choice(models)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages = [_SYSTEM]
    bodies = []
    for _ in range(turns):
        messages = messages + [_message(r) for _ in range(r.randint(1, 3))]
        if r.random() < 0.3:
            messages = _edited(r, messages)
        body: dict[str, Any] = {"model": own if r.random() < 0.8 else r.choice(models)}
        body["messages"] = messages
        if r.random() < 0.3:
            name = "f" if r.random() < 0.7 else "g"
            body["tools"] = [{**tools[0], "function": {"name": name, "parameters": {}}}]
        if r.random() < 0.1:
            body["add_generation_prompt"] = False
        if r.random() < 0.1:
            body["chat_template_kwargs"] = {"x": r.choice([1, True, 1.0, "1"])}
        if r.random() < 0.2:
            body["cache_salt"] = r.choice(["s1", "s2"])
        bodies.append(json.loads(json.dumps(body)))  # each request parses its own body
    return bodies


@pytest.mark.parametrize("budget", [256 * 2**20, 150_000], ids=["roomy", "one-conversation"])
def test_changed_history_gets_its_cold_prompt(budget: int) -> None:
    """Three sessions interleaved on three models (templates drawn from every kind) that
    share a tokenizer cache, their histories edited under it: each request equals a fresh
    state's, also with a budget that evicts entries all along."""
    hits = 0
    for seed in range(5):
        r = random.Random(seed)
        names = _names(r)
        inc = IncrementalTokenizer(_files().tokenizer, budget_bytes=budget)
        warm = _processors(names, inc)
        sessions = [_session(r, list(warm), 12) for _ in range(3)]
        order = [s for s in range(3) for _ in range(12)]
        r.shuffle(order)
        for s in order:
            body = sessions[s].pop(0)
            got = _view(warm[body["model"]], body)
            assert got == _view(_fresh(names, body["model"]), body), (seed, names, body.keys())
        hits += inc.hits
    assert hits >= 5  # the warm cache served many of them


def _on_threads(
    warm: dict[str, PromptProcessor], sessions: list[list[dict[str, Any]]]
) -> list[list[Any]]:
    """What ``warm`` gives each session's bodies, one thread a session, all at once."""
    got: list[list[Any]] = [[] for _ in sessions]
    start = threading.Barrier(len(sessions))

    def run(i: int) -> None:
        start.wait()
        for body in sessions[i]:
            got[i].append(_view(warm[body["model"]], body))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def test_requests_on_threads_get_their_cold_prompt() -> None:
    """Four sessions processed on four threads at once, sharing the models and their
    tokenizer cache (worker threads, as the service runs large bodies): each request equals
    a fresh state's."""
    hits = 0
    for seed in range(2):
        r = random.Random(seed)
        names = _names(r)
        budget = r.choice([256 * 2**20, 300_000])
        inc = IncrementalTokenizer(_files().tokenizer, budget_bytes=budget)
        warm = _processors(names, inc)
        sessions = [_session(r, list(warm), 10) for _ in range(4)]
        got = _on_threads(warm, sessions)
        for i, bodies in enumerate(sessions):
            assert len(got[i]) == len(bodies)
            for body, seen in zip(bodies, got[i], strict=True):
                assert seen == _view(_fresh(names, body["model"]), body), (seed, i)
        hits += inc.hits
    assert hits >= 5
