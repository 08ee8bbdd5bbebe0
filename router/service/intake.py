"""A hot endpoint's body before routing: parsed, checked and its prompt processed.

:func:`admit` is everything the front door (router.service.handling) does to a body of
``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/messages`` or ``/v1/responses``
before routing it: a pure function of the body and the settings, which the body memo keeps
(router/service/body_memo.py). gRPC Pick processes its bodies and prompts through the same
functions (:func:`admit`, :func:`checked_prompt`, :func:`json_value`).

The router validates only what it needs (model, messages / prompt, stream flag, a few
types); the body is forwarded untouched.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar, cast

from router import jsonload
from router.core.admission import parse_service_tier
from router.core.errors import BadRequest
from router.service import disagg, pd_serve
from router.service.body_memo import Admitted
from router.service.request_identity import body_session, session_key
from router.service.security import check_prompt_tokens
from router.service.state import BODY_MEMO_MAX_BYTES, RouterState
from router.service.stream_usage import usage_patch
from router.tokenize.anthropic import check_thinking_budget, messages_prompt
from router.tokenize.anthropic import session_of as anthropic_session
from router.tokenize.keying import ProcessedPrompt
from router.tokenize.lax import INVALID, lax_bool, lax_int
from router.tokenize.request_fields import asks_prompt_logprobs, sampled_sequences
from router.tokenize.responses import previous_response, responses_prompt, stores

# Bodies this large or larger are tokenized on a worker thread, off the event loop.
THREAD_MIN_BODY = BODY_MEMO_MAX_BYTES

_A = TypeVar("_A")


def json_value(raw: bytes | str, what: str) -> Any:
    """The JSON value of ``raw`` (router/jsonload.py); BadRequest naming ``what`` when it is
    not valid JSON or is nested deeper than the parser recurses. The one parse of client
    JSON for every front end (a request body here, gRPC Pick's JSON fields)."""
    try:
        return jsonload.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest(f"{what} is nested too deeply") from None


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object (:func:`json_value`)."""
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    body = json_value(raw, "request body")
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def body_model(body: dict[str, Any], default_model: str | None = None) -> str:
    """The request's model: a missing or empty ``model`` is the one model served (vLLM's
    served model; the router's ``default_model``, when it routes exactly one; None where
    vLLM requires a model: the Anthropic Messages API's bodies). The one field a
    passed-through body (router.service.pass_through) is read for."""
    model = body.get("model")
    if model is None or model == "":
        if default_model is None:
            raise BadRequest("'model' is a required property")
        model = default_model
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    return model


def field_types(
    body: dict[str, Any], default_model: str | None = None, kind: str = "chat"
) -> tuple[str, bool]:
    """The request's model and stream flag, read as vLLM reads them (router.service.lax):
    a missing or empty ``model`` is the one model served (vLLM's served model; the router's
    ``default_model``, when it routes exactly one); ``"stream": "yes"`` is a stream. Its
    output limits are checked too, the fields of its ``kind``'s vLLM 0.34 request model
    only (:data:`_LIMIT_FIELDS`; vLLM ignores the others): a Messages API body's
    ``max_tokens`` is required and positive (``AnthropicMessagesRequest``), as vLLM
    refuses it otherwise; a Responses API body's ``max_output_tokens`` is checked by
    :func:`max_output_tokens`."""
    model = body_model(body, default_model)
    stream = lax_bool(body.get("stream", False))
    if stream is INVALID:
        raise BadRequest("'stream' must be a boolean")
    for key in _LIMIT_FIELDS.get(kind, ()):
        v = lax_int(body.get(key))
        if v is INVALID or (v is not None and v < 0):
            raise BadRequest(f"'{key}' must be a non-negative integer")
        if kind == "messages" and not v:  # (its one field, max_tokens)
            raise BadRequest(
                f"'{key}' is a required property" if v is None else f"{key} must be positive"
            )
    return model, bool(stream)


# the output limits of each kind's vLLM 0.34 request model the router reads (chat:
# ChatCompletionRequest, completion: CompletionRequest, messages: AnthropicMessagesRequest;
# the Responses API's max_output_tokens: max_output_tokens)
_LIMIT_FIELDS = {
    "chat": ("max_tokens", "max_completion_tokens"),
    "completion": ("max_tokens",),
    "messages": ("max_tokens",),
}


MAX_OUTPUT_TOKENS = 1 << 53
"""The most output tokens the router's load and cost models count for one request: beyond
any context length, and exact as a float. A larger limit (JSON integers have no bound; the
engine refuses it or stops at its context) is counted as this many: the models multiply it
with floats, which an integer past about 1e308 cannot become."""


COMPLETION_MAX_TOKENS = 16
"""vLLM's ``max_tokens`` of a completion whose body leaves it out or sends null: its
request model's default (vLLM 0.34 ``CompletionRequest``, whose
``normalize_null_max_tokens`` validator puts the default in place of a null)."""


def max_output_tokens(body: dict[str, Any], kind: str = "chat") -> int | None:
    """``max_completion_tokens`` when not null, else ``max_tokens`` (as :func:`field_types`
    checked them), as vLLM's chat reads them; a completion's ``max_tokens``,
    ``COMPLETION_MAX_TOKENS`` when absent or null (vLLM's completions have no
    ``max_completion_tokens``); a Messages API body's ``max_tokens`` (vLLM's has no other);
    for the Responses API (``kind`` ``responses``) its ``max_output_tokens``, checked here;
    at most ``MAX_OUTPUT_TOKENS`` (the body goes on as it came)."""
    if kind == "responses":
        found = lax_int(body.get("max_output_tokens"))
        if found is INVALID or (found is not None and found < 0):
            raise BadRequest("'max_output_tokens' must be a non-negative integer")
    elif kind == "completion":
        found = lax_int(body.get("max_tokens"))
        if found is None:
            found = COMPLETION_MAX_TOKENS
    elif kind == "messages":
        found = lax_int(body.get("max_tokens"))
    else:
        found = lax_int(body.get("max_completion_tokens"))
        if found is None:
            found = lax_int(body.get("max_tokens"))
    return min(found, MAX_OUTPUT_TOKENS) if type(found) is int else None


def default_model(state: RouterState) -> str | None:
    """The model a request naming none is for: the one model the router routes (vLLM serves
    one model and takes a request without ``model`` as one for it), None with several."""
    found = None
    for name in state.processors:
        if state.registry.keys_for(name):
            if found is not None:
                return None
            found = name
    return found


def default_if_unnamed(state: RouterState, body: dict[str, Any]) -> str | None:
    """:func:`default_model`, looked up only for a body naming no model."""
    named = body.get("model")
    return default_model(state) if named is None or named == "" else None


async def admit(state: RouterState, body: dict[str, Any], size: int, kind: str) -> Admitted:
    """Check and process the prompt of a parsed body (``size`` bytes raw) of ``kind``
    (``chat``, ``completion``, ``messages``: an Anthropic Messages API body, whose prompt is
    its chat conversion, router.tokenize.anthropic; ``responses``: an OpenAI Responses API
    body, likewise, router.tokenize.responses): everything before routing, a pure
    function of the body and the settings (what the body memo keeps); raises KVRouterError
    for a bad request."""
    messages = kind == "messages"
    # vLLM's Messages API requires a model (AnthropicMessagesRequest.validate_model)
    default = None if messages else default_if_unnamed(state, body)
    model, stream = field_types(body, default, kind)
    processor = state.processor(model)
    responses = kind == "responses"
    fn: Callable[[dict[str, Any]], ProcessedPrompt]
    if messages:
        fn = partial(messages_prompt, processor)
    elif responses:
        fn = partial(responses_prompt, processor)
    else:
        fn = processor.chat if kind == "chat" else processor.completion
    offload = size >= THREAD_MIN_BODY and not _token_ids(body)
    # a disaggregated model's bodies reach the engine without the client's
    # kv_transfer_params (service/pd_serve.py NO_TRANSFER): its prompt is the messages', not
    # ids forwarded there (router.tokenize.request_fields.forwarded_prompt_ids)
    seen = body
    if "kv_transfer_params" in body and state.disagg and state.disagg.get(model) is not None:
        seen = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if messages:  # (max_tokens: checked by field_types)
        check_thinking_budget(seen, cast(int, lax_int(body.get("max_tokens"))))
    prompt = await checked_prompt(state, model, fn, seen, offload=offload, kind=kind)
    max_out = max_output_tokens(body, kind)
    # the Messages API's service_tier ("standard_only") is Anthropic's, which vLLM ignores
    # (the Responses API's "scale" tier is OpenAI's, which vLLM ignores too)
    tier = body.get("service_tier")
    if messages or (responses and tier == "scale"):
        tier = None
    parse_service_tier(tier)  # a bad value is a 400, admission on or off
    if asks_prompt_logprobs(body, kind):
        prompt = replace(prompt, reads_cache=False)
    samples = sampled_sequences(body, kind)
    if samples > 1:
        prompt = replace(prompt, samples=samples)
    session = body_session(body)
    if messages and session is None:
        session = session_key(anthropic_session(body))
    return Admitted(
        model,
        prompt,
        session,
        max_out,
        # the engine reports usage on every Messages API stream (vLLM asks its chat
        # stream for it) and in every Responses API stream's final event: nothing to add,
        # and the body reaches the replica as sent
        None if messages or responses else usage_patch(body),
        tier,
        stream=stream,
        keep_local=disagg.keep_local(body, kind, max_out),
        prefill_caps=pd_serve.prefill_caps(body),
        previous_response=previous_response(body) if responses else None,
        stores=responses and stores(body),
    )


async def checked_prompt(
    state: RouterState,
    model: str,
    fn: Callable[[_A], ProcessedPrompt],
    arg: _A,
    *,
    offload: bool,
    kind: str | None = None,
) -> ProcessedPrompt:
    """``fn(arg)``, the processed prompt, within the limits of every front end (the model's
    context length, ``server.max_prompt_tokens``); ``offload``: processed on a worker
    thread, off the event loop (large prompts: the loop serves every other request
    meanwhile). The HTTP endpoints (:func:`admit`) and gRPC Pick both call it.

    ``kind`` ("chat" / "completion" / "messages": ``arg`` is such a request body): for a
    model rendered
    by the engine (router/service/render.py) the engine's render comes first; ``fn(arg)``
    stands in, marked provisional, when no engine answered.

    A body the parser took but nested too deeply to process (a chat template recursing
    through 1,000 nested arrays) is a BadRequest, as one too deep to parse is
    (:func:`json_value`), not an unexpected error."""
    try:
        return await _processed(state, model, fn, arg, offload=offload, kind=kind)
    except RecursionError:
        raise BadRequest("request is nested too deeply to process") from None


async def _processed(
    state: RouterState,
    model: str,
    fn: Callable[[_A], ProcessedPrompt],
    arg: _A,
    *,
    offload: bool,
    kind: str | None,
) -> ProcessedPrompt:
    """:func:`checked_prompt` but for its RecursionError."""
    renderer = state.renderer
    rendered = kind is not None and renderer is not None and renderer.serves(model)
    t0 = time.perf_counter() if rendered else 0.0
    if rendered:
        from_engine = await renderer.prompt(
            model, kind, arg, state.processor(model), offload=offload
        )
        if from_engine is not None:
            return _checked(state, model, from_engine)
    try:
        if offload:
            prompt = await asyncio.get_running_loop().run_in_executor(None, fn, arg)
        else:
            prompt = fn(arg)
    except BadRequest:
        if not rendered:
            raise
        # the router's own processing of a model it cannot render exactly routes the
        # request on what it gives, never refuses it (a template the router misreads)
        prompt = state.processor(model).unknown(cast(dict[str, Any], arg))
    if rendered:
        waited = time.perf_counter() - t0
        prompt = replace(prompt, exact=False, provisional=True, tokenize_s=waited)
    return _checked(state, model, prompt)


def _checked(state: RouterState, model: str, prompt: ProcessedPrompt) -> ProcessedPrompt:
    """``prompt`` within the model's context length and ``server.max_prompt_tokens``."""
    state.check_context(model, prompt)
    check_prompt_tokens(state.settings.server, prompt.prompt_tokens)
    return prompt


def _token_ids(body: dict[str, Any]) -> bool:
    """A completion whose prompt is token ids: processing it is a few array operations
    (no tokenizer that releases the GIL), so a worker thread would only add hand-offs."""
    prompt = body.get("prompt")
    return isinstance(prompt, list) and bool(prompt) and type(prompt[0]) is int
