"""vLLM 0.34's chat message parsing, run unmodified without torch, a model or a server.

``load()`` executes the vendored copy (README.md) of ``vllm/renderers/chat_utils/
chat_message.py``: ``parse_chat_messages`` turns a validated ``ChatCompletionRequest``'s
``messages`` into the conversation vLLM hands the chat template (content in the "string" or
"openai" format, tool-call arguments parsed, a tool result's text parts joined, ``name`` /
``task`` / ``tool_call_id`` / ``reasoning`` / a developer message's ``tools`` carried). The
request model itself is the vendored one that ``anthropic_ref.load()`` runs. What the module
imports from the rest of vLLM is a stand-in: the multimodal item tracker and its content
parser (they record media items, which text-only conversations and the "openai" format's
``{"type": "image"}`` parts do not need: no placeholder is stored), the model config (prompt
embeddings off) and the logger.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

from tests.engines import anthropic_ref

HERE = Path(__file__).parent
NAME = "vllm.renderers.chat_utils.chat_message"
FILE = "vllm_0_34_0_chat_message.py"


class _Parser:
    """vllm.renderers.chat_utils.content_parser's parser: records nothing; no placeholder
    (what the "string" format puts for an image depends on the model's processor)."""

    model_config = types.SimpleNamespace(enable_prompt_embeds=False)

    def mm_placeholder_storage(self) -> dict[str, list[Any]]:
        return {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("parse_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


class _Tracker:
    """vllm.renderers.chat_utils.item_tracker.MultiModalItemTracker, holding no item."""

    def __init__(self, model_config: Any, media_io_kwargs: Any = None) -> None:
        self.model_config = model_config

    def create_parser(self, mm_processor_kwargs: Any = None) -> _Parser:
        return _Parser()

    def get_num_items(self, modality: str) -> int:
        return 0

    def resolve_items(self) -> tuple[None, None]:
        return None, None


def _stubs(types_module: types.ModuleType) -> dict[str, types.ModuleType]:
    def module(name: str, **attrs: Any) -> types.ModuleType:
        mod = anthropic_ref._Stub(name)
        mod.__path__ = []
        mod.__dict__.update(attrs)
        return mod

    error = type("VLLMValidationError", (ValueError,), {"__init__": _error_init})
    return {
        "vllm": module("vllm"),
        "vllm.config": module("vllm.config"),
        "vllm.exceptions": module("vllm.exceptions", VLLMValidationError=error),
        "vllm.inputs": module("vllm.inputs"),
        "vllm.logger": module("vllm.logger", init_logger=anthropic_ref._init_logger),
        "vllm.renderers": module("vllm.renderers"),
        "vllm.renderers.chat_utils": module("vllm.renderers.chat_utils"),
        "vllm.renderers.chat_utils.types": types_module,
        "vllm.renderers.chat_utils.content_parser": module(
            "vllm.renderers.chat_utils.content_parser",
            MODALITY_PLACEHOLDERS_MAP={
                "image": "<##IMAGE##>",
                "audio": "<##AUDIO##>",
                "video": "<##VIDEO##>",
                "prompt_embeds": "<##PROMPT_EMBEDS##>",
            },
            PROMPT_EMBEDS_PLACEHOLDER_TOKEN="<|vllm_prompt_embeds|>",
            make_prompt_embeds_placeholder=lambda index: f"__prompt_embeds_{index}__",
        ),
        "vllm.renderers.chat_utils.item_tracker": module(
            "vllm.renderers.chat_utils.item_tracker",
            MultiModalItemTracker=_Tracker,
            AsyncMultiModalItemTracker=_Tracker,
            BaseMultiModalItemTracker=_Tracker,
        ),
    }


def _error_init(self: ValueError, message: str = "", **kwargs: Any) -> None:
    ValueError.__init__(self, message)


_loaded: dict[str, types.ModuleType] = {}


def load() -> dict[str, types.ModuleType]:
    """``anthropic_ref.load()``'s modules and the vendored chat message parsing
    ("vllm.renderers.chat_utils.chat_message")."""
    if _loaded:
        return _loaded
    base = anthropic_ref.load()
    stubs = _stubs(base["vllm.renderers.chat_utils.types"])
    saved = {name: sys.modules.get(name) for name in [*stubs, NAME]}
    try:
        sys.modules.update(stubs)
        spec = importlib.util.spec_from_file_location(NAME, HERE / FILE)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[NAME] = mod
        spec.loader.exec_module(mod)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    _loaded.update(base)
    _loaded[NAME] = mod
    return _loaded


def conversation(body: dict[str, Any], content_format: str = "string") -> list[dict[str, Any]]:
    """The conversation vLLM 0.34 builds from a chat completion request ``body``: the body
    validated as its ``ChatCompletionRequest``, its messages parsed by
    ``parse_chat_messages`` in ``content_format``."""
    mods = load()
    request = mods["vllm.entrypoints.openai.chat_completion.protocol"].ChatCompletionRequest(**body)
    config = types.SimpleNamespace(multimodal_config=None, enable_prompt_embeds=False)
    conv, _, _ = mods[NAME].parse_chat_messages(request.messages, config, content_format)
    return [dict(m) for m in conv]
