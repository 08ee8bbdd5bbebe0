# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast, overload

from vllm.exceptions import VLLMValidationError
from vllm.inputs import EmbedsPrompt, TextPrompt, TokensPrompt
from vllm.logger import init_logger
from vllm.multimodal.media.connector import merge_media_io_kwargs
from vllm.tokenizers import TokenizerLike
from vllm.utils.import_utils import LazyLoader

if TYPE_CHECKING:
    import torch

    from vllm.renderers.chat_utils import ChatTemplateContentFormatOption
else:
    torch = LazyLoader("torch", globals(), "torch")

    ChatTemplateContentFormatOption = object

logger = init_logger(__name__)


_S = TypeVar("_S", list[int], "torch.Tensor")

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]

# Prompt keys whose entry i describes token i of the prompt, so they must be
# reduced with the same slice as the prompt tokens themselves. Anything added
# here is truncated by `TokenizeParams.apply_post_tokenization`.
_PARALLEL_TO_PROMPT_TOKENS = (
    "prompt_token_offsets",
    "prompt_is_token_ids",
)


def merge_kwargs(
    defaults: dict[str, Any] | None,
    overrides: dict[str, Any] | None,
    /,
    *,
    unset_values: tuple[object, ...] = (None, "auto"),
) -> dict[str, Any]:
    if defaults is None:
        defaults = {}
    if overrides is None:
        overrides = {}

    return defaults | {k: v for k, v in overrides.items() if v not in unset_values}


def map_reasoning_effort(
    effort: str | None,
    effort_map: dict[str, str] | None,
) -> str | None:
    """Rewrite a requested effort to the one the chat template supports."""
    if effort is None or not effort_map:
        return effort

    return effort_map.get(effort, effort)


def recursively_merge_kwargs(
    defaults: dict[str, Any] | None,
    overrides: dict[str, Any] | None,
    /,
    *,
    unset_values: tuple[object, ...] = (None, "auto"),
) -> dict[str, Any]:
    if defaults is None:
        defaults = {}
    if overrides is None:
        overrides = {}

    merged = dict(defaults)

    for k, v in overrides.items():
        if v in unset_values:
            continue

        if k in merged and isinstance(merged[k], dict) and isinstance(v, dict):
            merged[k] = recursively_merge_kwargs(
                merged[k], v, unset_values=unset_values
            )
        else:
            merged[k] = v

    return merged


@dataclass(frozen=True)
class ChatParams:
    """Configuration to control how to parse chat messages."""

    chat_template: str | None = None
    """The chat template to apply."""

    chat_template_content_format: "ChatTemplateContentFormatOption" = "auto"
    """The format of the chat template."""

    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """The kwargs to pass to the chat template."""

    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    """Per-modality kwargs for media I/O (loading/decoding images, videos, etc.)."""

    mm_processor_kwargs: dict[str, Any] | None = None
    """The kwargs to pass to the multi-modal processor."""

    tool_choice: Any | None = None
    """Request-level tool choice for renderers that need API metadata."""

    response_format: Any | None = None
    """Request-level response format for renderers that need API metadata."""

    def with_defaults(
        self,
        default_chat_template_kwargs: dict[str, Any] | None = None,
        default_media_io_kwargs: dict[str, dict[str, Any]] | None = None,
        default_mm_processor_kwargs: dict[str, Any] | None = None,
    ):
        if (
            not default_chat_template_kwargs
            and not default_media_io_kwargs
            and not default_mm_processor_kwargs
        ):
            return self

        return ChatParams(
            chat_template=self.chat_template,
            chat_template_content_format=self.chat_template_content_format,
            chat_template_kwargs=merge_kwargs(
                default_chat_template_kwargs,
                self.chat_template_kwargs,
            ),
            media_io_kwargs=merge_media_io_kwargs(
                default_media_io_kwargs,
                self.media_io_kwargs,
            ),
            mm_processor_kwargs=recursively_merge_kwargs(
                default_mm_processor_kwargs,
                self.mm_processor_kwargs,
            ),
            tool_choice=self.tool_choice,
            response_format=self.response_format,
        )

    def get_apply_chat_template_kwargs(self) -> dict[str, Any]:
        """The arguments to pass to `tokenizer.apply_chat_template`."""
        return merge_kwargs(
            self.chat_template_kwargs,
            dict(chat_template=self.chat_template, return_dict=False),
        )


@dataclass(frozen=True)
class TokenizeParams:
    """Configuration to control how prompts are tokenized."""

    max_total_tokens: int | None
    """
    Maximum allowed number of input + output tokens.
    
    Usually, this refers to the model's context length.
    """

    max_output_tokens: int | None = 0
    """Maximum requested output tokens; ``None`` means no explicit limit.

    Zero indicates a request that does not need generated tokens, such as pooling.
    """

    pad_prompt_tokens: int | None = None
    """
    Number of tokens to pad to:
    - `None` means no padding.
    - `-1` maps to `max_input_tokens`.
    """

    truncate_prompt_tokens: int | None = None
    """
    Number of tokens to keep:
    - `None` means no truncation.
    - `-1` maps to `max_input_tokens`.
    """

    truncation_side: Literal["left", "right"] | None = None
    """
    Which side to truncate from when ``truncate_prompt_tokens`` is active:
    - ``"right"`` keeps the first N tokens (truncate from the end).
    - ``"left"``  keeps the last  N tokens (truncate from the start).
    - ``None``    falls back to the tokenizer default.
    """

    do_lower_case: bool = False
    """Whether to normalize text to lower case before tokenization."""

    add_special_tokens: bool = True
    """Whether to add special tokens."""

    return_token_offsets: bool = False
    """If true, request char-level (start, end) offsets per token. Honored
    only for Fast (Rust-backed) tokenizers with text input and no multimodal
    data; otherwise silently ignored."""

    needs_detokenization: bool = False
    """
    Whether the tokenized prompt needs to contain the original text.

    Not to be confused with `SamplingParams.detokenize` which deals
    with the output generated by the model.
    """

    max_total_tokens_param: str = "max_total_tokens"
    """Override this to edit the message for validation errors."""

    max_output_tokens_param: str = "max_output_tokens"
    """Override this to edit the message for validation errors."""

    truncate_prompt_tokens_param: str = "truncate_prompt_tokens"
    """Override this to edit the message for validation errors."""

    @property
    def max_input_tokens(self) -> int | None:
        """Maximum allowed number of input tokens.

        ``max_output_tokens`` is *not* subtracted here: the value represents the
        actual model context length, not a reservation of output space.
        Downstream clamping of the sampling ``max_tokens`` is handled by
        ``get_max_tokens()`` in the entrypoint layer.
        """
        if self.max_total_tokens is None:
            return None

        return self.max_total_tokens

    @property
    def max_truncation_tokens(self) -> int | None:
        """Maximum prompt length that truncation may reduce a prompt to.

        For generative requests this is `max_input_tokens` less one, holding a
        token of context back for output.  Truncating to the full
        `max_total_tokens` would leave `get_max_tokens()` clamping the sampling
        budget to 0, turning an over-long prompt into a silent zero-token
        generation.

        Pooling requests set `max_output_tokens = 0` and emit an embedding
        rather than generated tokens, so they keep the full input budget.
        """
        max_input_tokens = self.max_input_tokens
        if max_input_tokens is None:
            return None
        if self.max_output_tokens == 0:
            return max_input_tokens

        return max(0, max_input_tokens - 1)

    def __post_init__(self) -> None:
        max_total_tokens = self.max_total_tokens
        max_output_tokens = self.max_output_tokens
        max_input_tokens = self.max_input_tokens
        truncate_prompt_tokens = self.truncate_prompt_tokens

        if self.truncation_side not in (None, "left", "right"):
            raise VLLMValidationError(
                "`truncation_side` must be either 'left' or 'right'.",
                parameter="truncation_side",
                value=self.truncation_side,
            )

        if (
            max_output_tokens is not None
            and max_total_tokens is not None
            and max_output_tokens > max_total_tokens
        ):
            raise VLLMValidationError(
                f"{self.max_output_tokens_param}={max_output_tokens} "
                f"cannot be greater than "
                f"{self.max_total_tokens_param}={max_total_tokens}. "
                f"Please request fewer output tokens.",
                parameter=self.max_output_tokens_param,
                value=max_output_tokens,
            )

        if (
            max_input_tokens is not None
            and truncate_prompt_tokens is not None
            and truncate_prompt_tokens > max_input_tokens
        ):
            raise VLLMValidationError(
                f"{self.truncate_prompt_tokens_param}={truncate_prompt_tokens} "
                f"cannot be greater than {self.max_total_tokens_param} "
                f"= {max_input_tokens}. "
                f"Please request a smaller truncation size.",
                parameter=self.truncate_prompt_tokens_param,
                value=truncate_prompt_tokens,
            )

    def with_kwargs(self, **tokenization_kwargs: Any):
        has_max_length = "max_length" in tokenization_kwargs
        max_length = tokenization_kwargs.pop("max_length", self.max_input_tokens)
        pad_prompt_tokens = tokenization_kwargs.pop(
            "pad_prompt_tokens", self.pad_prompt_tokens
        )
        truncate_prompt_tokens = tokenization_kwargs.pop(
            "truncate_prompt_tokens", self.truncate_prompt_tokens
        )
        truncation_side = tokenization_kwargs.pop(
            "truncation_side", self.truncation_side
        )
        do_lower_case = tokenization_kwargs.pop("do_lower_case", self.do_lower_case)
        add_special_tokens = tokenization_kwargs.pop(
            "add_special_tokens", self.add_special_tokens
        )
        needs_detokenization = tokenization_kwargs.pop(
            "needs_detokenization", self.needs_detokenization
        )

        # https://huggingface.co/docs/transformers/en/pad_truncation
        if padding := tokenization_kwargs.pop("padding", None):
            if padding == "max_length":
                pad_prompt_tokens = max_length
            elif padding in (False, "do_not_pad"):
                pad_prompt_tokens = None
            else:
                # To emit the below warning
                tokenization_kwargs["padding"] = padding

        if truncation := tokenization_kwargs.pop("truncation", None):
            if truncation in (True, "longest_first"):
                truncate_prompt_tokens = max_length
            elif truncation in (False, "do_not_truncate"):
                truncate_prompt_tokens = None
            else:
                # To emit the below warning
                tokenization_kwargs["truncation"] = truncation

        if tokenization_kwargs:
            logger.warning(
                "The following tokenization arguments are not supported "
                "by vLLM Renderer and will be ignored: %s",
                tokenization_kwargs,
            )

        max_total_tokens = self.max_total_tokens

        if has_max_length and max_total_tokens is not None and max_length is not None:
            max_output_tokens = max_total_tokens - max_length
        else:
            # No explicit ``max_length`` override: preserve the original output
            # budget instead of recomputing it from ``max_input_tokens`` (which
            # is now the full context length).
            max_output_tokens = self.max_output_tokens

        return TokenizeParams(
            max_total_tokens=max_total_tokens,
            max_output_tokens=max_output_tokens,
            pad_prompt_tokens=pad_prompt_tokens,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
            do_lower_case=do_lower_case,
            add_special_tokens=add_special_tokens,
            needs_detokenization=needs_detokenization,
        )

    def get_encode_kwargs(self) -> dict[str, Any]:
        """The arguments to pass to `tokenizer.encode`."""
        max_length = self.truncate_prompt_tokens
        if max_length is not None and max_length < 0:
            max_length = self.max_truncation_tokens
        elif max_length is None and self.max_input_tokens is not None:
            # This prevents tokenization from taking up more resources than necessary
            # while still failing `self._token_len_check` as expected by users
            max_length = self.max_input_tokens + 1

        # Explicit truncation-side overrides require the full token sequence
        # so we can slice from the requested side in _token_truncation.
        # Disable tokenizer-level truncation because its default side may
        # differ from the requested side.  The defense against unbounded
        # tokenization lives in _text_len_check (character-level pre-trim).
        if self.truncation_side is not None and self.truncate_prompt_tokens is not None:
            return dict(
                truncation=False,
                add_special_tokens=self.add_special_tokens,
            )

        return dict(
            truncation=max_length is not None,
            max_length=max_length,
            add_special_tokens=self.add_special_tokens,
        )

    def _text_len_check(self, tokenizer: TokenizerLike | None, text: str) -> str:
        """Apply length checks to prompt text if necessary."""
        max_input_tokens = self.max_input_tokens
        if max_input_tokens is None or tokenizer is None:
            return text

        max_input_chars = max_input_tokens * tokenizer.max_chars_per_token

        if self.truncate_prompt_tokens is None:
            if len(text) > max_input_chars:
                raise VLLMValidationError(
                    f"This model's maximum context length is "
                    f"{self.max_total_tokens} tokens. However, your prompt "
                    f"contains {len(text)} characters (more than "
                    f"{max_input_chars} characters, which is the upper bound "
                    f"for {max_input_tokens} input tokens). "
                    f"Please reduce the length of the input prompt.",
                    parameter="input_text",
                    value=len(text),
                )
        elif self.truncation_side is not None and len(text) > max_input_chars:
            if self.truncation_side == "left":
                text = text[-max_input_chars:]
            else:
                text = text[:max_input_chars]

        return text

    def _get_text_truncation_offset(
        self, tokenizer: TokenizerLike | None, text: str
    ) -> int:
        """Return the number of source characters removed from the left.

        ``_text_len_check`` pre-truncates long text before tokenization when
        an explicit truncation side is requested. Fast-tokenizer offsets are
        then relative to that shortened string, so callers need this prefix
        length to map them back to the original prompt.
        """
        max_input_tokens = self.max_input_tokens
        if (
            max_input_tokens is None
            or tokenizer is None
            or self.truncate_prompt_tokens is None
            or self.truncation_side != "left"
        ):
            return 0

        max_input_chars = max_input_tokens * tokenizer.max_chars_per_token
        if max_input_chars <= 0:
            return 0

        return max(len(text) - max_input_chars, 0)

    def _text_lowercase(self, tokenizer: TokenizerLike | None, text: str) -> str:
        """Apply lowercase to prompt text if necessary."""
        return text.lower() if self.do_lower_case else text

    def _validate_text(self, tokenizer: TokenizerLike | None, text: str) -> str:
        """Apply all validators to prompt text."""
        for validator in (
            self._text_len_check,
            self._text_lowercase,
        ):
            text = validator(tokenizer, text)

        return text

    def apply_pre_tokenization(
        self,
        tokenizer: TokenizerLike | None,
        prompt: TextPrompt,
    ) -> TextPrompt:
        """Ensure that the prompt meets the requirements set out by this config.
        If that is not possible, raise a `VLLMValidationError`.

        This method is run before tokenization occurs.
        """
        prompt["prompt"] = self._validate_text(tokenizer, prompt["prompt"])

        return prompt

    def _token_padding(self, tokenizer: TokenizerLike | None, tokens: _S) -> _S:
        """Apply padding to prompt tokens if necessary."""
        pad_length = self.pad_prompt_tokens
        if pad_length is not None and pad_length < 0:
            pad_length = self.max_input_tokens

        if pad_length is None or pad_length <= len(tokens):
            return tokens

        if tokenizer is None:
            raise VLLMValidationError(
                "Cannot pad tokens when `skip_tokenizer_init=True`",
                parameter="pad_prompt_tokens",
            )
        if not isinstance(tokens, list):
            raise VLLMValidationError(
                "Cannot pad tokens for embedding inputs",
                parameter="pad_prompt_tokens",
            )

        return tokens + [tokenizer.pad_token_id] * (pad_length - len(tokens))

    def _truncation_slice(
        self, tokenizer: TokenizerLike | None, length: int
    ) -> slice | None:
        """The slice truncation applies to a sequence of `length` tokens.

        `None` means no truncation. Anything parallel to the prompt tokens
        must be reduced with this same slice to stay aligned with them; list
        such keys in `_PARALLEL_TO_PROMPT_TOKENS`.
        """
        max_length = self.truncate_prompt_tokens
        if max_length is not None and max_length < 0:
            max_length = self.max_truncation_tokens

        if max_length is None or max_length >= length:
            return None
        if max_length == 0:
            return slice(0, 0)

        side = self.truncation_side or (
            tokenizer.truncation_side if tokenizer is not None else None
        )
        if side == "left":
            return slice(-max_length, None)

        return slice(0, max_length)

    def _token_truncation(self, tokenizer: TokenizerLike | None, tokens: _S) -> _S:
        """Apply truncation to prompt tokens if necessary."""
        truncation = self._truncation_slice(tokenizer, len(tokens))
        if truncation is None:
            return tokens

        return tokens[truncation]

    def _token_len_check(self, tokenizer: TokenizerLike | None, tokens: _S) -> _S:
        """Apply length checks to prompt tokens if necessary."""
        max_input_tokens = self.max_input_tokens
        if max_input_tokens is None:
            return tokens

        if len(tokens) > max_input_tokens:
            token_count = len(tokens)
            # The tokenizer may have truncated the prompt to
            # max_input_tokens + 1 (see get_encode_kwargs), so the
            # actual prompt length could be larger.
            qualifier = "at least " if token_count == max_input_tokens + 1 else ""
            raise VLLMValidationError(
                f"This model's maximum context length is "
                f"{self.max_total_tokens} tokens. However, your prompt "
                f"contains {qualifier}{token_count} input tokens, which "
                f"exceeds this limit even without any output tokens. "
                f"Please reduce the length of the input prompt.",
                parameter="input_tokens",
                value=token_count,
            )

        return tokens

    def _validate_tokens(self, tokenizer: TokenizerLike | None, tokens: _S) -> _S:
        """Apply all validators to a token sequence."""
        # Truncation runs before padding, matching the Transformers pipeline
        # these parameters are named after. Padding first would let a
        # subsequent left-side truncation keep only the pad tokens it just
        # appended, discarding the prompt entirely.
        for validator in (
            self._token_truncation,
            self._token_padding,
            self._token_len_check,
        ):
            tokens = validator(tokenizer, tokens)

        return tokens

    @overload
    def apply_post_tokenization(
        self,
        tokenizer: TokenizerLike | None,
        prompt: TokensPrompt,
    ) -> TokensPrompt: ...

    @overload
    def apply_post_tokenization(
        self,
        tokenizer: TokenizerLike | None,
        prompt: EmbedsPrompt,
    ) -> EmbedsPrompt: ...

    def apply_post_tokenization(
        self,
        tokenizer: TokenizerLike | None,
        prompt: TokensPrompt | EmbedsPrompt,
    ) -> TokensPrompt | EmbedsPrompt:
        """Ensure that the prompt meets the requirements set out by this config.
        If that is not possible, raise a `VLLMValidationError`.

        This method is run after tokenization occurs.
        """
        if "prompt_token_ids" in prompt:
            prompt["prompt_token_ids"] = self._validate_tokens(
                tokenizer,
                prompt["prompt_token_ids"],
            )
        if "prompt_embeds" in prompt:
            prompt["prompt_embeds"] = self._validate_tokens(  # type: ignore[typeddict-unknown-key]
                tokenizer,
                prompt["prompt_embeds"],  # type: ignore[typeddict-item]
            )
        prompt_dict = cast(dict, prompt)
        for key in _PARALLEL_TO_PROMPT_TOKENS:
            parallel = prompt_dict.get(key)
            if parallel is None:
                continue
            truncation = self._truncation_slice(tokenizer, len(parallel))
            if truncation is not None:
                prompt_dict[key] = parallel[truncation]

        return prompt
