"""A completion request as the mock replica's engine sees it, read as vLLM 0.34 reads it:
the prompt's token ids (rendered by the replica's tokenizer for every API: chat, completions,
the Anthropic Messages API, the OpenAI Responses API), the output budget, vLLM's
``priority``, the sampling parameters vLLM refuses (router/mock/sampling.py), the engine
request (the prompt's block hashes, as the router hashes them: an image's identifier keys
the block its placeholder tokens start in, router/mock/images.py), and the answer's id.
BadRequest, in vLLM's words, where vLLM refuses the request.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router.core.errors import BadRequest
from router.core.hashing import hash_prompt, mm_block_extras, root_hash
from router.mock import logprobs as lp
from router.mock import responses as resp
from router.mock import sampling
from router.mock.images import MockPrompt
from router.mock.tokenizer import MockTokenizer
from router.tokenize.anthropic import to_chat_body

if TYPE_CHECKING:
    from router.mock.state import MockSettings, MockState


def max_tokens(body: Mapping[str, Any], settings: MockSettings, kind: str, prompt: int) -> int:
    """The output budget: chat's ``max_completion_tokens`` else ``max_tokens`` (vLLM's
    order; completions have only ``max_tokens``), the Responses API's
    ``max_output_tokens``; at most what the context leaves (vLLM's ``get_max_tokens``)."""
    value = body.get("max_completion_tokens") if kind == "chat" else None
    if value is None:
        value = body.get("max_tokens")
    if value is None:
        value = body.get("max_output_tokens")  # the Responses API's
    if value is None:
        value = settings.default_max_tokens
    elif lp.echo_only(body, kind):
        return 1  # vLLM's echo_without_generation: the engine runs one token
    elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadRequest("'max_tokens' must be a positive integer")
    return max(1, min(value, settings.max_model_len - prompt))


# the field naming a request's output budget, by kind (chat: max_completion_tokens first)
_BUDGET_FIELDS = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "messages": ("max_tokens",),
    "completion": ("max_tokens",),
    "responses": ("max_output_tokens",),
}


def check_budget(body: Mapping[str, Any], settings: MockSettings, kind: str) -> None:
    """vLLM's refusal of an output budget above the context, before the prompt is read
    (``TokenizeParams.__post_init__``, vllm/renderers/params.py; the field is
    ``build_tok_params``' ``max_output_tokens_param``); BadRequest in vLLM's words."""
    for name in _BUDGET_FIELDS[kind]:
        value = body.get(name)
        if value is None:
            continue
        limit = settings.max_model_len
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            raise BadRequest(
                f"{name}={value} cannot be greater than max_model_len={limit}. "
                "Please request fewer output tokens."
            )
        return


def tokens_of(
    tokenizer: MockTokenizer,
    kind: str,
    body: dict[str, Any],
    store: resp.ResponseStore | None = None,
) -> MockPrompt:
    """The prompt (token ids, images) of a body of ``kind`` (``chat``, ``completion``,
    ``messages``: an Anthropic body, rendered as its chat conversion; ``responses``: a
    Responses API body, likewise, with the history of its previous response in ``store``)."""
    if kind == "responses":
        chat = resp.chat_body(store or resp.ResponseStore(), body)
        return tokenizer.chat_prompt(chat, from_responses=True)
    if kind == "messages":
        return tokenizer.chat_prompt(to_chat_body(body).body, from_messages=True)
    if kind == "chat":
        return tokenizer.chat_prompt(body)
    return MockPrompt(tokenizer.completion(body))


def engine_request(state: MockState, body: dict[str, Any], kind: str) -> tuple[Any, list[int]]:
    """The engine request of ``body``'s prompt (one prompt: a batch's is its own body) and
    the prompt's token ids; BadRequest as vLLM refuses the prompt or the request."""
    check_budget(body, state.settings, kind)
    try:
        prompt = tokens_of(state.tokenizer, kind, body, state.responses)
    except UnicodeEncodeError:  # a lone surrogate (``"\ud800"``): no text to tokenize
        raise BadRequest("the prompt is not valid Unicode text (a lone surrogate)") from None
    tokens = prompt.tokens
    if not tokens:
        raise BadRequest("the prompt is empty")
    limit = state.settings.max_model_len
    if len(tokens) > limit:  # vLLM's words (TokenizeParams._token_len_check)
        raise BadRequest(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {len(tokens)} input tokens, which exceeds this limit even without any "
            "output tokens. Please reduce the length of the input prompt."
        )
    salt = body.get("cache_salt")
    check_salt(salt)
    bs = state.settings.block_size
    extras = mm_block_extras([im.mm for im in prompt.images], bs) if prompt.images else None
    hashes = hash_prompt(tokens, bs, root_hash(state.settings.model, salt), extras=extras)
    state.encoder.learn(hashes.hashes, tokens, salt, prompt.images)
    from sim.engine import EngineRequest  # the mock is the simulator's engine on a wall clock

    prefix = {"chat": "chatcmpl-", "completion": "cmpl-", "messages": "msg_", "responses": "resp_"}[
        kind
    ]
    req = EngineRequest(
        request_id=f"{prefix}{uuid.uuid4().hex[:20]}",
        block_hashes=hashes.hashes,
        prompt_tokens=len(tokens),
        max_output_tokens=max_tokens(body, state.settings, kind, len(tokens)),
        reads_cache=not lp.check(body, kind),
        priority=priority(body),
    )
    sampling.check(body, kind, req.max_output_tokens)  # vLLM's SamplingParams, built here
    sampling.check_engine(body, kind, state.settings.max_logprobs)  # and the engine's checks
    return req, tokens


def check_salt(salt: object) -> None:
    """vLLM's ``validate_cache_salt`` (vllm/entrypoints/generate/base/protocol.py), in its
    words: a non-empty string of at most 128 characters without '@', '/', '\\' or NUL."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise sampling.Refused(
            "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    if len(salt) > 128 or any(c in "@/\\\x00" for c in salt):
        raise sampling.Refused(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL.",
            "cache_salt",
        )


def priority(body: dict[str, Any]) -> int:
    """The request's ``priority`` (vLLM's field: an int, lower first; default 0), which an
    engine run with ``--scheduling-policy priority`` orders its queue by."""
    if "priority" not in body:
        return 0
    value = body["priority"]  # read as vLLM's pydantic model does (lax mode): 1.0, "3", true
    integral = isinstance(value, bool) or (isinstance(value, float) and value.is_integer())
    if integral or (isinstance(value, str) and value.strip().lstrip("+-").isdigit()):
        value = int(value)
    if type(value) is not int or not -(2**63) <= value < 2**63:
        raise BadRequest("priority: Input should be a valid integer")
    return value


def answer_id(request: web.Request, body: Mapping[str, Any], kind: str) -> str:
    """The id vLLM gives the answer (``_base_request_id``): ``chatcmpl-`` (chat and, carried
    over, the Anthropic answer) or ``cmpl-`` + the ``X-Request-Id`` header, else the body's
    ``request_id``, else a random one; the Responses API's is the body's ``request_id``
    (``resp_`` + random by default). The engine's own id stays unique: a client may send one
    id with concurrent requests."""
    given = body.get("request_id")
    given = given if isinstance(given, str) else None
    if kind == "responses":
        return given or f"resp_{uuid.uuid4().hex}"
    header = request.headers.get("X-Request-Id")
    base = header if header is not None else given or uuid.uuid4().hex
    return f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{base}"
