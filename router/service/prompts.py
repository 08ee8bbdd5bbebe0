"""The prompt processor of each model, built once at start-up from its settings: tokenizer
files (shared between models naming the same ones), chat template, image token."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from router.core.errors import ConfigError
from router.service.settings import ModelSettings
from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.pipeline import PromptProcessor
from router.tokenize.responses import is_harmony
from router.tokenize.tokenizers import adds_bos, load_tokenizer_dir, read_tokenizer_config

if TYPE_CHECKING:
    from router.tokenize.template import ChatTemplate

_log = logging.getLogger("router.service.state")


def build_processor(
    model: ModelSettings, tokenizers: dict[tuple[Any, ...], IncrementalTokenizer]
) -> PromptProcessor:
    """The prompt processor of one model; tokenizers with the same files and ``cache_mb`` are
    shared (their incremental cache with them)."""
    block = model.routing.block_size
    if model.tokenizer is None:
        template = None
        if model.chat_template:
            template = _template_file(
                model.chat_template, content_format=model.chat_template_content_format
            )
        return PromptProcessor(
            model.name,
            block,
            template=template,
            chars_per_token=model.chars_per_token,
            default_kwargs=model.chat_template_kwargs,
            effort_map=model.reasoning_effort_map,
            context_length=model.context_length,
            exclude_tools_when_none=model.exclude_tools_when_tool_choice_none,
            disabled_thinking_effort=model.anthropic_disabled_thinking_effort,
            mm_loras=model.default_mm_loras,
            prompt_embeds=model.enable_prompt_embeds,
        )
    # models naming the same files share one incremental cache when their budgets agree
    # (each model's cache_mb holds: 0 turns it off for that model only)
    spec = (model.tokenizer, model.bpe_file, model.pattern, model.num_reserved, model.cache_mb)
    directory = Path(model.tokenizer)
    files = load_tokenizer_dir(
        directory, bpe_file=model.bpe_file, pattern=model.pattern, num_reserved=model.num_reserved
    )
    inc = tokenizers.get(spec)
    if inc is None:
        inc = tokenizers[spec] = IncrementalTokenizer(
            files.tokenizer, budget_bytes=int(model.cache_mb * 2**20)
        )
    # Jinja2 and the template machinery load here, at start-up, for a model with a tokenizer
    # or a template file: a model with neither never imports them
    from router.tokenize.template import ChatTemplate

    fmt = model.chat_template_content_format
    if model.chat_template:
        template = _template_file(model.chat_template, read_tokenizer_config(directory), fmt)
    else:
        template = ChatTemplate.from_tokenizer_config(files.config, directory, fmt)
    if template is not None:
        _log.info(
            "model %s: chat template is %s; message content in vLLM's %r format",
            model.name,
            "message-local: long conversations render only their new messages"
            if template.local_for(None) is not None
            else "not message-local: long conversations are rendered whole each turn",
            template.content_format,
        )
    if model.images is not None and model.images.token not in files.tokenizer.special_tokens:
        raise ConfigError(
            f"models.{model.name}.images.token: {model.images.token!r} is not a special token "
            "of the tokenizer"
        )
    return PromptProcessor(
        model.name,
        block,
        tokenizer=inc,
        template=template,
        add_bos_to_completions=(
            adds_bos(files)
            if model.add_bos_to_completions is None
            else model.add_bos_to_completions
        ),
        chars_per_token=model.chars_per_token,
        images=model.images,
        default_kwargs=model.chat_template_kwargs,
        effort_map=model.reasoning_effort_map,
        context_length=model.context_length,
        exclude_tools_when_none=model.exclude_tools_when_tool_choice_none,
        disabled_thinking_effort=model.anthropic_disabled_thinking_effort,
        mm_loras=model.default_mm_loras,
        harmony=is_harmony(model.name) or _model_type(directory) == "gpt_oss",
        prompt_embeds=model.enable_prompt_embeds,
    )


def _model_type(directory: Path) -> str | None:
    """The ``model_type`` of ``directory/config.json`` (vLLM renders a ``gpt_oss`` model's
    chats with openai_harmony: ``OnlineRenderer.use_harmony``); None when there is none."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    found = config.get("model_type") if isinstance(config, dict) else None
    return found if isinstance(found, str) else None


def _template_file(
    path: str, config: Mapping[str, Any] | None = None, content_format: str = "auto"
) -> ChatTemplate:
    from router.tokenize.template import ChatTemplate

    try:
        source = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read chat template {path}: {exc.strerror}") from None
    found = ChatTemplate.from_tokenizer_config(
        {**(config or {}), "chat_template": source}, content_format=content_format
    )
    assert found is not None
    return found
