"""The sampling parameters of a chat or completion request, checked as vLLM 0.34 checks them
before it answers: the request models' ``check_logprobs`` validators
(vllm/entrypoints/openai/*/protocol.py) and ``SamplingParams._verify_args`` /
``_verify_greedy_sampling`` (vllm/sampling_params.py), in their order and words.

The mock samples nothing (its answer is filler), but a request vLLM refuses must be refused:
a 400 ``BadRequestError`` before any stream opens, the message vLLM's, and where vLLM's
``VLLMValidationError`` names the parameter, its ``param`` (and its
``(parameter=..., value=...)`` suffix). Values are read as vLLM's lax pydantic fields read
them (``"0.5"`` is 0.5); one pydantic refuses is a 400 naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from router.core.errors import BadRequest
from router.tokenize.lax import INVALID, lax_bool, lax_int

_SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy sampling
_MAX_N = 16384  # VLLM_MAX_N_SEQUENCES' default
# the request models' defaults (_DEFAULT_SAMPLING_PARAMS) of the fields a null leaves unset
_DEFAULTS = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "min_p": 0.0,
}


class Refused(BadRequest):
    """vLLM's refusal of a sampling parameter; ``param``: the parameter it names (or None)."""

    def __init__(self, message: str, param: str | None = None, value: Any = None) -> None:
        extras = [f"parameter={param}"] if param is not None else []
        if value is not None:
            extras.append(f"value={value}")
        super().__init__(f"{message} ({', '.join(extras)})" if extras else message)
        self.param = param


class EngineRefused(Refused):
    """A refusal of vLLM's engine (``SamplingParams.verify``, when it takes the request):
    vLLM has opened a stream by then, so a stream gets it as its error event."""


def _float(body: Mapping[str, Any], name: str) -> float:
    """A float field as pydantic reads it (a number or a numeric string), its default if
    absent or null."""
    value = body.get(name)
    if value is None:
        return _DEFAULTS[name]
    if type(value) in (int, float):
        return float(value)
    if type(value) is str:
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise Refused(f"{name}: Input should be a valid number", name)


def _int(body: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value = lax_int(body.get(name))
    if value is INVALID:
        raise Refused(f"{name}: Input should be a valid integer", name)
    return default if value is None else value


def _check_logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    """The request model's ``check_logprobs`` (before pydantic reads the fields); the
    number of sample logprobs asked (``SamplingParams.logprobs``), None: none."""
    name = "top_logprobs" if chat else "logprobs"
    raw = body.get(name)
    if raw is not None and (type(raw) not in (int, float)):
        raise Refused(f"`{name}` must be an integer.", name, raw)
    if chat:
        if raw is not None:
            if raw < 0 and raw != -1:
                raise Refused("`top_logprobs` must be a positive value or -1.", name, raw)
            if (raw == -1 or raw > 0) and not body.get("logprobs"):
                raise Refused("when using `top_logprobs`, `logprobs` must be set to true.", name)
        return (_int(body, name, 0) or 0) if lax_bool(body.get("logprobs")) is True else None
    if raw is not None and raw < 0 and raw != -1:
        raise Refused("`logprobs` must be a positive value or -1.", name, raw)
    return _int(body, name, None)


def check(body: Mapping[str, Any], kind: str, max_tokens: int) -> None:
    """Refuse (:class:`Refused`) the sampling parameters of a chat or completion ``body``
    vLLM refuses; ``max_tokens``: the output budget the request runs with."""
    if kind not in ("chat", "completion"):
        return
    logprobs = _check_logprobs(body, kind == "chat")
    n = _int(body, "n", 1)
    assert n is not None
    if n < 1:
        raise Refused(f"n must be at least 1, got {n}.")
    if n > _MAX_N:
        raise Refused(
            f"n must be at most {_MAX_N}, got {n}. To increase this limit, set the "
            "VLLM_MAX_N_SEQUENCES environment variable."
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = _float(body, name)
        if not -2.0 <= value <= 2.0:
            raise Refused(f"{name} must be in [-2, 2], got {value}.")
    repetition = _float(body, "repetition_penalty")
    if not math.isfinite(repetition):
        raise Refused(f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise Refused(f"repetition_penalty must be greater than zero, got {repetition}.")
    temperature = _float(body, "temperature")
    if not math.isfinite(temperature):
        raise Refused(
            f"temperature must be a finite number, got {temperature}.", "temperature", temperature
        )
    if temperature < 0.0:
        raise Refused(
            f"temperature must be non-negative, got {temperature}.", "temperature", temperature
        )
    if temperature > 2.0:
        raise Refused(
            f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature
        )
    top_p = _float(body, "top_p")
    if not 0.0 < top_p <= 1.0:
        raise Refused(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    top_k = _int(body, "top_k", 0)
    assert top_k is not None
    if top_k < -1:
        raise Refused(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = _float(body, "min_p")
    if not 0.0 <= min_p <= 1.0:
        raise Refused(f"min_p must be in [0, 1], got {min_p}.")
    min_tokens = _int(body, "min_tokens", 0)
    assert min_tokens is not None
    if min_tokens < 0:
        raise Refused(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > max_tokens:
        raise Refused(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )
    if logprobs is not None and logprobs != -1 and logprobs < 0:
        raise Refused(f"logprobs must be non-negative or -1, got {logprobs}.", "logprobs", logprobs)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if any(not s for s in stops):
        raise Refused("stop cannot contain an empty string.")
    if temperature < _SAMPLING_EPS and n > 1:
        raise Refused(f"n must be 1 when using greedy sampling, got {n}.")


def check_engine(body: Mapping[str, Any], kind: str, max_logprobs: int) -> None:
    """Refuse (:class:`EngineRefused`) the logprobs vLLM's engine refuses
    (``SamplingParams._validate_logprobs``, in its words): more sample logprobs (chat's
    ``top_logprobs`` with ``logprobs``, completions' ``logprobs``) or prompt logprobs
    (``prompt_logprobs``, or with ``echo`` the sample count's field) than ``max_logprobs``
    (vLLM's ``--max-logprobs``). -1 (all of the vocabulary) is refused too, named as asked:
    the mock has no model vocabulary size."""
    if kind not in ("chat", "completion"):
        return
    chat = kind == "chat"
    sample = _check_logprobs(body, chat)
    prompt = _int(body, "prompt_logprobs", None)
    if prompt is None and lax_bool(body.get("echo")) is True:
        prompt = _int(body, "top_logprobs", 0) if chat else _int(body, "logprobs", None)
    for value, name, what in (
        (sample, "logprobs", "sample"),
        (prompt, "prompt_logprobs", "prompt"),
    ):
        if value and (value == -1 or value > max_logprobs):
            raise EngineRefused(
                f"Requested {what} logprobs of {value}, which is greater than max allowed: "
                f"{max_logprobs}",
                name,
                value,
            )
