"""The token ids vLLM 0.34 prefills for a prompt's text, against the ids the router hashes:
special tokens (``add_special_tokens``) and truncation (``truncate_prompt_tokens``,
``truncation_side``) of completion and chat prompts.

The engine side runs vLLM's own ``TokenizeParams`` (vllm/renderers/params.py, vendored
unmodified: tests/engines/README.md): its ``get_encode_kwargs`` decide how the tokenizer
encodes the text, its ``apply_post_tokenization`` cuts the ids. Between them, transformers'
fast tokenizer encodes: it hands truncation to the ``tokenizers`` backend on the tokenizer's
side, which vLLM sets to "left" for generating models (vllm/tokenizers/registry.py), and the
backend keeps the special tokens its post-processor adds (a BOS) and cuts the text. The
tokenizer here is an HF ``tokenizer.json`` with a BOS post-processor, as Llama-style models
ship it; the router serves it with ``add_bos_to_completions``.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest

from router.core.hashing import hash_prompt, root_hash
from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.pipeline import PromptProcessor
from router.tokenize.responses import responses_prompt, to_chat_body
from router.tokenize.template import ChatTemplate
from router.tokenize.tokenizers import load_tokenizer_dir
from tests.engines.anthropic_ref import load

CONTEXT = 400
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False)
    corpus = ["the quick brown fox jumps over the lazy dog 12345"] * 200
    backend.train_from_iterator(corpus, trainer)
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    d = tmp_path_factory.mktemp("bos_model")
    backend.save(str(d / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def processor(model_dir: Path) -> PromptProcessor:
    files = load_tokenizer_dir(model_dir)
    template = ChatTemplate.from_tokenizer_config(files.config, model_dir)
    return PromptProcessor(
        "m",
        1,
        tokenizer=IncrementalTokenizer(files.tokenizer),
        template=template,
        add_bos_to_completions=True,
        context_length=CONTEXT,
    )


def vllm_ids(model_dir: Path, text: str, body: dict[str, Any], *, chat: bool) -> list[int]:
    """The ids vLLM 0.34 hands the engine for the rendered ``text`` of a completion or chat
    ``body``: its request model's ``build_tok_params``."""
    params = load()["vllm.renderers.params"].TokenizeParams(
        max_total_tokens=CONTEXT,
        # a completion's max_tokens defaults to 16, a chat's to None (build_tok_params)
        max_output_tokens=body.get("max_tokens", None if chat else 16),
        truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
        truncation_side=body.get("truncation_side"),
        add_special_tokens=body.get("add_special_tokens", not chat),
    )
    return encoded(model_dir, text, params)


def encoded(model_dir: Path, text: str, params: Any) -> list[int]:
    """``Renderer._tokenize_singleton_prompt`` of ``text`` with the ``TokenizeParams``
    ``params``: encode, then cut."""
    from tokenizers import Tokenizer

    kwargs = params.get_encode_kwargs()
    backend = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    if kwargs["truncation"]:  # transformers: the backend truncates, on the tokenizer's side
        backend.enable_truncation(kwargs["max_length"], direction="left")
    ids = backend.encode(text, add_special_tokens=kwargs["add_special_tokens"]).ids
    tokenizer = types.SimpleNamespace(truncation_side="left")
    return list(
        params.apply_post_tokenization(tokenizer, {"prompt_token_ids": ids})["prompt_token_ids"]
    )


TEXT = "the quick brown fox jumps over the lazy dog " * 12

COMPLETIONS = {
    "plain": {},
    "no_special_tokens": {"add_special_tokens": False},
    "cut": {"truncate_prompt_tokens": 20},
    "cut_left": {"truncate_prompt_tokens": 20, "truncation_side": "left"},
    "cut_right": {"truncate_prompt_tokens": 20, "truncation_side": "right"},
    "cut_no_special_tokens": {"truncate_prompt_tokens": 20, "add_special_tokens": False},
    "cut_to_context": {"truncate_prompt_tokens": -1, "$times": 6},
    "cut_longer_than_prompt": {"truncate_prompt_tokens": 390},
    # a prompt that writes the BOS itself gets a second one (vLLM does not look)
    "own_bos": {"$bos": True},
    "own_bos_cut": {"$bos": True, "truncate_prompt_tokens": 20},
    "own_bos_no_special_tokens": {"$bos": True, "add_special_tokens": False},
}


def _body(extra: dict[str, Any], text: str) -> tuple[dict[str, Any], str]:
    fields = {k: v for k, v in extra.items() if not k.startswith("$")}
    return fields, ("<s>" if extra.get("$bos") else "") + text * extra.get("$times", 1)


@pytest.mark.parametrize("case", sorted(COMPLETIONS))
def test_completion_text_ids_are_vllms(
    case: str, model_dir: Path, processor: PromptProcessor
) -> None:
    fields, text = _body(COMPLETIONS[case], TEXT)
    want = vllm_ids(model_dir, text, fields, chat=False)
    got = processor.completion({"prompt": text, **fields})
    assert got.prompt_tokens == len(want)
    assert got.block_hashes == hash_prompt(want, 1, root_hash("m")).hashes


CHATS = {
    "plain": {},
    "cut": {"truncate_prompt_tokens": 30},
    "cut_right": {"truncate_prompt_tokens": 30, "truncation_side": "right"},
    # the template writes the BOS: add_special_tokens adds another
    "special_tokens": {"add_special_tokens": True},
    "special_tokens_cut": {"add_special_tokens": True, "truncate_prompt_tokens": 30},
    "special_tokens_cut_left": {
        "add_special_tokens": True,
        "truncate_prompt_tokens": 30,
        "truncation_side": "left",
    },
    "special_tokens_cut_right": {
        "add_special_tokens": True,
        "truncate_prompt_tokens": 30,
        "truncation_side": "right",
    },
    "special_tokens_cut_to_context": {
        "add_special_tokens": True,
        "truncate_prompt_tokens": -1,
        "$times": 6,
    },
}


@pytest.mark.parametrize("case", sorted(CHATS))
def test_chat_ids_are_vllms(case: str, model_dir: Path, processor: PromptProcessor) -> None:
    fields, text = _body(CHATS[case], TEXT)
    body = {"messages": [{"role": "user", "content": text}], **fields}
    rendered, _ = processor.render_chat(body)
    want = vllm_ids(model_dir, rendered, fields, chat=True)
    got = processor.chat(body)
    assert got.prompt_tokens == len(want)
    assert got.block_hashes == hash_prompt(want, 1, root_hash("m")).hashes


RESPONSES = {
    "plain": {},
    "auto_truncation": {"truncation": "auto", "$times": 6},
    "auto_truncation_short": {"truncation": "auto"},
    # no output asked: cut to the whole context (TokenizeParams.max_truncation_tokens)
    "auto_truncation_no_output": {"truncation": "auto", "max_output_tokens": 0, "$times": 6},
    "disabled_truncation": {"truncation": "disabled"},
}


@pytest.mark.parametrize("case", sorted(RESPONSES))
def test_responses_ids_are_vllms(case: str, model_dir: Path, processor: PromptProcessor) -> None:
    """A Responses body is rendered as a chat and tokenized with
    ``ResponsesRequest.build_tok_params`` (vllm/entrypoints/openai/responses/protocol.py):
    the tokenizer's special tokens added (the ``TokenizeParams`` default) and, for a
    ``truncation`` other than "disabled", cut to the context (-1)."""
    fields, text = _body(RESPONSES[case], TEXT)
    body = {"model": "m", "instructions": "be brief", "input": text, **fields}
    rendered, _ = processor.render_chat(to_chat_body(body).body)
    params = load()["vllm.renderers.params"].TokenizeParams(
        max_total_tokens=CONTEXT,
        max_output_tokens=body.get("max_output_tokens"),
        truncate_prompt_tokens=-1 if body.get("truncation", "disabled") != "disabled" else None,
        max_total_tokens_param="max_model_len",
        max_output_tokens_param="max_output_tokens",
    )
    want = encoded(model_dir, rendered, params)
    got = responses_prompt(processor, body)
    assert got.prompt_tokens == len(want)
    assert got.block_hashes == hash_prompt(want, 1, root_hash("m")).hashes


@pytest.mark.parametrize("add_bos_token", [None, True, False])
def test_a_model_without_the_setting_adds_the_bos_its_tokenizer_adds(
    model_dir: Path, tmp_path: Path, add_bos_token: bool | None
) -> None:
    """With ``add_bos_to_completions`` unset, a completion's prompt starts as vLLM's does:
    transformers 5.22 (``TokenizersBackend.__init__``) encodes with ``tokenizer.json``'s
    post-processor (here a BOS first), rebuilt from ``tokenizer_config.json``'s
    ``add_bos_token`` when that is set."""
    import shutil

    from router.service.prompts import build_processor
    from router.service.settings import ModelSettings

    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    proc = build_processor(ModelSettings(name="m", tokenizer=str(tmp_path)), {})
    want = vllm_ids(model_dir, TEXT, {"add_special_tokens": add_bos_token is not False}, chat=False)
    got = proc.completion({"prompt": TEXT})
    assert got.block_hashes == hash_prompt(want, proc.block_size, root_hash("m")).hashes
    assert got.prompt_tokens == len(want)


@pytest.mark.parametrize("suffix", ["def f():\n    return 1\n", ""])
@pytest.mark.parametrize("prompt", [TEXT, [TEXT, TEXT]])
def test_a_completion_with_a_suffix_is_not_hashed_as_its_prompt(
    processor: PromptProcessor, prompt: Any, suffix: str
) -> None:
    """vLLM 0.34 runs a completion with a ``suffix`` (empty too: ``is not None``) as the
    renderer's fill-in-the-middle prompt (``OnlineRenderer.render_completion``:
    ``render_completion_suffix``, DeepSeek V4's ``<FIM_BEGIN>prompt<FIM_HOLE>suffix
    <FIM_END>``) and refuses it for any other renderer: the prompt's own ids are never the
    engine's. The router, which does not know the engine's renderer, hashed the prompt as
    if no suffix were sent."""
    got = processor.completion({"prompt": prompt, "suffix": suffix})
    assert got.block_hashes == [] and not got.exact
    # a null suffix is none
    plain = processor.completion({"prompt": prompt, "suffix": None})
    assert plain.block_hashes and plain.exact


def _request_tok_params(body: dict[str, Any], chat: bool) -> Any:
    """``build_tok_params`` of vLLM 0.34's own request model (vendored, unmodified) for
    ``body`` on a server of context ``CONTEXT``."""
    mods = load()
    if chat:
        model = mods["vllm.entrypoints.openai.chat_completion.protocol"].ChatCompletionRequest
    else:
        model = mods["vllm.entrypoints.openai.completion.protocol"].CompletionRequest
    request = model.model_validate({"model": "m", **body})
    return request.build_tok_params(types.SimpleNamespace(max_model_len=CONTEXT))


NO_OUTPUT = {
    "completion max_tokens 0": ({"max_tokens": 0}, False),
    "completion echo max_tokens 0": ({"max_tokens": 0, "echo": True}, False),
    "completion max_tokens null": ({"max_tokens": None}, False),
    "completion max_completion_tokens 0 (not a completion field)": (
        {"max_completion_tokens": 0},
        False,
    ),
    "chat max_completion_tokens 0": ({"max_completion_tokens": 0}, True),
    "chat max_tokens 0": ({"max_tokens": 0}, True),
    "chat max_tokens 0 under max_completion_tokens": (
        {"max_tokens": 0, "max_completion_tokens": 5},
        True,
    ),
}


@pytest.mark.parametrize("case", list(NO_OUTPUT))
def test_truncation_to_the_context_keeps_it_whole_for_no_output(
    case: str, model_dir: Path, processor: PromptProcessor
) -> None:
    """``truncate_prompt_tokens`` -1 cuts to the context less the token held back for
    output, but to the whole context for a request asking no output tokens (vLLM 0.34
    ``TokenizeParams.max_truncation_tokens``: ``max_output_tokens == 0``, a completion's
    ``max_tokens or 0``, a chat's ``max_completion_tokens`` else ``max_tokens``: the
    scoring requests with ``echo`` and ``max_tokens`` 0). The router cut one token more,
    every block a wrong hash."""
    fields, chat = NO_OUTPUT[case]
    fields = {**fields, "truncate_prompt_tokens": -1, "add_special_tokens": False}
    text = TEXT * 6
    root = root_hash("m")
    params = _request_tok_params(
        {**fields, "messages": [{"role": "user", "content": text}]}
        if chat
        else {**fields, "prompt": text},
        chat,
    )
    if chat:
        body = {"messages": [{"role": "user", "content": text}], **fields}
        rendered, _ = processor.render_chat(body)
        got = processor.chat(body)
    else:
        body, rendered = {"prompt": text, **fields}, text
        got = processor.completion(body)
    want = encoded(model_dir, rendered, params)
    assert got.block_hashes == hash_prompt(want, 1, root).hashes
    if not chat:  # the same prompt as token ids: cut after tokenization alone
        assert processor.tokenizer is not None
        ids = processor.tokenizer.encode_text(text).tolist()
        got = processor.completion({**body, "prompt": ids})
        tokenizer = types.SimpleNamespace(truncation_side="left")
        cut = params.apply_post_tokenization(tokenizer, {"prompt_token_ids": ids})
        assert got.block_hashes == hash_prompt(cut["prompt_token_ids"], 1, root).hashes
