"""vLLM 0.34's Anthropic Messages API conversion, run unmodified without torch or a server.

``load()`` executes the vendored copies (README.md) of vLLM's Anthropic request models
(``vllm/entrypoints/anthropic/protocol.py``), its serving handler
(``vllm/entrypoints/anthropic/serving.py``, whose ``to_chat_completion_request`` and helpers
are classmethods that need no engine), the chat request model it builds
(``vllm/entrypoints/openai/chat_completion/protocol.py``, with the base models and tool /
response-format models of ``generate/base/protocol.py`` and ``serve/engine/protocol.py``),
the message types that validate the chat messages (``renderers/chat_utils/types.py``) and
the renderer parameters (``renderers/params.py``: ``ChatParams``, ``merge_kwargs``,
``map_reasoning_effort``), each under its own module name. Everything else those modules
import (engine client, renderers, sampling parameters, logging, fastapi, torch) is a small
stand-in: the request models use such names only as field types of fields the conversion
leaves unset, or in methods the conversion does not call. ``extract_prompt_components``
(``vllm/renderers/inputs/preprocess.py``) reads a rendered prompt's text and token ids,
as the real one does for a decoder-only prompt: ``DisabledThinkingEffortResolver`` compares
them, given a renderer (the tests' stand-in renders with the router's template).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from pathlib import Path
from typing import Any

from pydantic_core import core_schema

HERE = Path(__file__).parent

# (module name in vLLM, vendored file), in import order
FILES = (
    ("vllm.entrypoints.serve.engine.protocol", "vllm_0_34_0_engine_protocol.py"),
    ("vllm.renderers.chat_utils.types", "vllm_0_34_0_chat_types.py"),
    ("vllm.renderers.params", "vllm_0_34_0_renderer_params.py"),
    ("vllm.entrypoints.generate.base.protocol", "vllm_0_34_0_generate_protocol.py"),
    ("vllm.entrypoints.openai.chat_completion.protocol", "vllm_0_34_0_chat_completion_protocol.py"),
    ("vllm.entrypoints.openai.completion.protocol", "vllm_0_34_0_completion_protocol.py"),
    ("vllm.entrypoints.anthropic.protocol", "vllm_0_34_0_anthropic_protocol.py"),
    ("vllm.entrypoints.anthropic.serving", "vllm_0_34_0_anthropic_serving.py"),
)
PREFIX = "anthropic_ref."  # the vendored modules live under this name, not vllm's


class _Placeholder:
    """A stand-in class; as a pydantic field type it accepts anything (the conversion
    leaves such fields unset)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        return core_schema.any_schema()


class _Stub(types.ModuleType):
    """A stand-in module: explicit attributes, anything else a fresh placeholder class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (_Placeholder,), {})
        setattr(self, name, value)
        return value


class _ValidationError(ValueError):
    """vLLM's ``VLLMValidationError`` (vllm/exceptions.py): the message, and the parameter
    and value it names, as keywords."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value


class _Logger(logging.Logger):
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        self.warning(*args, **kwargs)

    def info_once(self, *args: Any, **kwargs: Any) -> None:
        self.info(*args, **kwargs)

    def debug_once(self, *args: Any, **kwargs: Any) -> None:
        self.debug(*args, **kwargs)


def _init_logger(name: str) -> logging.Logger:
    return _Logger(name)


def _extract_prompt_components(model_config: Any, prompt: Any) -> types.SimpleNamespace:
    """vllm.renderers.inputs.preprocess.extract_prompt_components for a decoder-only prompt
    (a mapping): its ``prompt`` text and ``prompt_token_ids``."""
    return types.SimpleNamespace(
        text=prompt.get("prompt"),
        token_ids=prompt.get("prompt_token_ids"),
        embeds=prompt.get("prompt_embeds"),
    )


class _OpenAIServingChat:
    """vllm.entrypoints.openai.chat_completion.serving.OpenAIServingChat: the base of the
    Anthropic handler, whose conversion classmethods do not use it."""


def _names() -> dict[str, dict[str, Any]]:
    """Stand-in modules (by vLLM name) and their explicit attributes. Everything is built
    under ``PREFIX`` so that nothing here collides with other tests' vllm stand-ins."""
    return {
        "vllm": {},
        "vllm.envs": {"VLLM_MAX_STOP_STRINGS": 4},  # its default
        "vllm.logger": {"init_logger": _init_logger},
        "vllm.utils": {"random_uuid": lambda: "0" * 32},
        "vllm.utils.collection_utils": {},
        "vllm.config": {},
        "vllm.config.utils": {},
        "vllm.exceptions": {"VLLMValidationError": _ValidationError},
        "vllm.logprobs": {},
        "vllm.outputs": {},
        "vllm.inputs": {},
        "vllm.tokenizers": {},
        "vllm.multimodal": {},
        "vllm.multimodal.media": {},
        "vllm.multimodal.media.connector": {},
        "vllm.utils.import_utils": {},
        "vllm.sampling_params": {"ThinkingTokenBudget": int | None},
        "vllm.engine": {},
        "vllm.engine.protocol": {},
        "vllm.entrypoints": {},
        "vllm.entrypoints.openai": {},
        "vllm.entrypoints.openai.chat_completion": {},
        "vllm.entrypoints.openai.chat_completion.serving": {
            "OpenAIServingChat": _OpenAIServingChat
        },
        "vllm.entrypoints.openai.completion": {},
        "vllm.entrypoints.openai.models": {},
        "vllm.entrypoints.openai.models.serving": {},
        "vllm.entrypoints.serve": {},
        "vllm.entrypoints.serve.engine": {},
        "vllm.entrypoints.serve.exception_handling": {},
        "vllm.entrypoints.serve.exception_handling.utils": {},
        "vllm.entrypoints.serve.utils": {},
        "vllm.entrypoints.serve.utils.request_logger": {},
        "vllm.entrypoints.generate": {},
        "vllm.entrypoints.generate.base": {},
        "vllm.entrypoints.anthropic": {},
        "vllm.renderers": {},  # (its __init__ imports every renderer)
        "vllm.renderers.chat_utils": {"make_tool_call_id": lambda *a, **k: "chatcmpl-tool-0"},
        "vllm.renderers.hf": {},
        "vllm.renderers.inputs": {},
        "vllm.renderers.inputs.preprocess": {
            "extract_prompt_components": _extract_prompt_components
        },
        "vllm.renderers.online_renderer": {},
        "openai_harmony": {},
        "fastapi": {},
    }


_loaded: dict[str, types.ModuleType] = {}


def load() -> dict[str, types.ModuleType]:
    """The vendored modules by vLLM name ("vllm.entrypoints.anthropic.serving", ...)."""
    if _loaded:
        return _loaded
    saved = {name: sys.modules.get(name) for name, _ in _names().items()}
    saved |= {name: sys.modules.get(name) for name, _ in FILES}
    try:
        for name, attrs in _names().items():
            mod = _Stub(name)
            mod.__path__ = []
            mod.__dict__.update(attrs)
            sys.modules[name] = mod
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, mod)
        renderers = sys.modules["vllm.renderers"]
        for name, filename in FILES:
            spec = importlib.util.spec_from_file_location(PREFIX + name, HERE / filename)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = sys.modules[PREFIX + name] = mod
            spec.loader.exec_module(mod)
            _loaded[name] = mod
            if name == "vllm.renderers.chat_utils.types":
                chat_utils = sys.modules["vllm.renderers.chat_utils"]
                for key in mod.__all__:
                    setattr(chat_utils, key, getattr(mod, key))
            if name == "vllm.renderers.params":
                for key in ("ChatParams", "ReasoningEffort", "TokenizeParams"):
                    setattr(renderers, key, getattr(mod, key))
                renderers.map_reasoning_effort = mod.map_reasoning_effort
                renderers.merge_kwargs = mod.merge_kwargs
    finally:
        # the loaded modules keep their imports; other tests see sys.modules as it was
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
    return _loaded
