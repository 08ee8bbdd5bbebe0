"""transformers' chat template rendering, run unmodified without the rest of transformers.

``load()`` executes the vendored copy (README.md) of ``transformers/utils/chat_template_utils.py``
from transformers 5.22.2, the newest release vLLM 0.34 accepts (``transformers<5.23.0``),
as ``transformers_ref.transformers.utils.chat_template_utils``. Its imports into the rest of
transformers are stand-ins: ``logging`` (a logger with ``warning_once``) and
``import_utils`` (jinja available; torch and vision not, so no tensor or image types are
involved). ``render(...)`` is ``PreTrainedTokenizerBase.apply_chat_template(...,
tokenize=False)`` for one conversation: the tokenizer's named special tokens, then the
caller's keyword arguments (which win), through ``render_jinja_template``.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
FILE = "transformers_5_22_2_chat_template_utils.py"
PACKAGE = "transformers_ref.transformers.utils"

_loaded: types.ModuleType | None = None


class _Logger(logging.Logger):
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        self.warning(*args, **kwargs)


def _package(name: str, **attrs: Any) -> types.ModuleType:
    mod = sys.modules.get(name)
    if mod is None:
        mod = types.ModuleType(name)
        mod.__path__ = []
        sys.modules[name] = mod
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def load() -> types.ModuleType:
    """The vendored ``chat_template_utils`` module (loaded once)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    _package("transformers_ref")
    _package("transformers_ref.transformers")
    logging_mod = _package(PACKAGE + ".logging", get_logger=lambda name: _Logger(name))
    imports = _package(
        PACKAGE + ".import_utils",
        is_jinja_available=lambda: True,
        is_torch_available=lambda: False,
        is_vision_available=lambda: False,
    )
    _package(PACKAGE, logging=logging_mod, import_utils=imports)
    name = PACKAGE + ".chat_template_utils"
    spec = importlib.util.spec_from_file_location(name, HERE / FILE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    _loaded = mod
    return mod


def render(
    chat_template: str,
    conversation: list[dict[str, Any]],
    *,
    special_tokens: dict[str, str],
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    **kwargs: Any,
) -> str:
    """What ``apply_chat_template(conversation, tools=..., documents=..., tokenize=False,
    ...)`` renders (transformers 5.22.2, tokenization_utils_base.py): ``special_tokens`` is
    the tokenizer's ``special_tokens_map`` (its named tokens: ``bos_token``, ...)."""
    if continue_final_message and add_generation_prompt:
        # apply_chat_template's own check before it renders (tokenization_utils_base.py)
        raise ValueError("continue_final_message and add_generation_prompt are not compatible.")
    mod = load()
    rendered, _ = mod.render_jinja_template(
        conversations=[conversation],
        tools=tools,
        documents=documents,
        chat_template=chat_template,
        continue_final_message=continue_final_message,
        add_generation_prompt=add_generation_prompt,
        **{**special_tokens, **kwargs},
    )
    return str(rendered[0])


QWEN2_VL_FILE = "transformers_5_22_2_image_processing_pil_qwen2_vl.py"
QWEN2_VL_PACKAGE = "transformers_ref.transformers"
_qwen2_vl: types.ModuleType | None = None


def load_qwen2_vl() -> types.ModuleType:
    """The vendored ``models/qwen2_vl/image_processing_pil_qwen2_vl.py`` (README.md; its
    ``smart_resize`` is the fast image processor's, copied), loaded once. Its imports into the
    rest of transformers are stand-ins: a plain base class for ``PilBackend``, typing's
    ``TypedDict`` / ``Unpack`` for ``ImagesKwargs`` / ``Unpack``, ``auto_docstring`` as the
    identity; only the module's own functions are used."""
    global _qwen2_vl
    if _qwen2_vl is not None:
        return _qwen2_vl
    import typing

    _package("transformers_ref")
    _package(QWEN2_VL_PACKAGE)
    _package(QWEN2_VL_PACKAGE + ".models")
    _package(QWEN2_VL_PACKAGE + ".models.qwen2_vl")
    _package(QWEN2_VL_PACKAGE + ".image_processing_backends", PilBackend=type("PilBackend", (), {}))
    _package(QWEN2_VL_PACKAGE + ".image_processing_utils", BatchFeature=dict)
    _package(
        QWEN2_VL_PACKAGE + ".image_utils",
        OPENAI_CLIP_MEAN=(0.0,),
        OPENAI_CLIP_STD=(1.0,),
        ImageInput=typing.Any,
        PILImageResampling=types.SimpleNamespace(BICUBIC=3),
        SizeDict=dict,
    )
    _package(
        QWEN2_VL_PACKAGE + ".processing_utils",
        ImagesKwargs=typing.TypedDict("ImagesKwargs", {}, total=False),
        Unpack=typing.Unpack,
    )
    _package(QWEN2_VL_PACKAGE + ".utils", TensorType=str, auto_docstring=lambda cls: cls)
    name = QWEN2_VL_PACKAGE + ".models.qwen2_vl.image_processing_pil_qwen2_vl"
    spec = importlib.util.spec_from_file_location(name, HERE / QWEN2_VL_FILE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = QWEN2_VL_PACKAGE + ".models.qwen2_vl"
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    _qwen2_vl = mod
    return mod


def qwen2_vl_image_tokens(width: int, height: int, min_pixels: int, max_pixels: int) -> int:
    """Placeholder tokens of a ``width`` x ``height`` image for Qwen2-VL / Qwen2.5-VL, as vLLM
    0.34 counts them: the image processor's ``get_number_of_image_patches`` (its
    ``smart_resize``) over ``merge_size ** 2`` (vllm/model_executor/models/qwen2_vl.py)."""
    cls = load_qwen2_vl().Qwen2VLImageProcessorPil
    processor = types.SimpleNamespace(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        patch_size=cls.patch_size,
        merge_size=cls.merge_size,
    )
    patches = cls.get_number_of_image_patches(processor, height, width)
    return int(patches) // cls.merge_size**2
