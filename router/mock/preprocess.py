"""vLLM's prompt-preparation endpoints on the mock replica, so peers use it as they use vLLM.

vllm-router (and other routers that hash token ids themselves) ask the engine how it will
tokenize a request before choosing a replica: ``POST /v1/chat/completions/render`` and
``/v1/completions/render`` (the token ids of the request as the engine renders them:
``{"token_ids": [...]}``, a list of those for completions), falling back to ``POST /tokenize``
(``{"count", "max_model_len", "tokens"}``), and ``POST /detokenize`` turns ids back into
text. The Anthropic Messages API has ``POST /v1/messages/render`` (the body's chat
conversion rendered, as vLLM renders it) and ``/v1/messages/count_tokens``
(``{"input_tokens", "context_management": {"original_input_tokens"}}``, Anthropic-style
errors), and the OpenAI Responses API ``POST /v1/responses/render`` (its chat conversion
rendered; no ``previous_response_id``). Every answer comes from the mock's own tokenizer,
the one its completions use, so the ids a peer hashes are the ids the mock caches under; a
chat's images are answered in ``features`` as vLLM answers them (``mm_hashes``,
``mm_placeholders``: router/mock/images.py), the keys the mock's cache and events use.
Errors are OpenAI-style bodies, as on the completion endpoints (vLLM's render routes too).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from router.core.errors import BadRequest
from router.mock import anthropic
from router.mock.images import MockPrompt, features
from router.tokenize.anthropic import to_chat_body
from router.tokenize.responses import to_chat_body as responses_chat

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ModelNotServed(BadRequest):
    """A ``model`` the replica does not serve (vLLM: 404 ``NotFoundError``)."""


def not_served(model: object, served: str) -> ModelNotServed | None:
    """The error for a body naming another ``model`` than the one served (vLLM's
    ``_check_model``: a body naming none is for the served one)."""
    if model and model != served:
        return ModelNotServed(f"The model `{model}` does not exist. Valid aliases: {served}.")
    return None


# vLLM's ``create_error_response`` types by status (serve/exception_handling)
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


def error_response(
    status: int, message: str, kind: str | None = None, param: str | None = None
) -> web.Response:
    """vLLM's ``ErrorResponse`` body: ``type`` as vLLM names it for ``status``."""
    kind = kind or _ERROR_TYPES.get(status, "BadRequestError")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _prompts(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """One completion body per prompt of a (possibly batched) ``prompt``."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return [{**body, "prompt": p} for p in prompt]
    return [body]


def handlers(
    tokenizer_of: Callable[[web.Request], Any], max_model_len: int, model: str
) -> dict[str, Handler]:
    """Path -> handler; ``tokenizer_of(request)`` gives the mock's ``MockTokenizer``;
    ``model``: the one served (a body naming another is a 404, as vLLM answers)."""

    async def _body(request: web.Request) -> dict[str, Any]:
        body = await _json(request)
        error = not_served(body.get("model"), model)
        if error is not None:
            raise error
        return body

    def guarded(fn: Callable[[web.Request], Awaitable[Any]]) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                return web.json_response(await fn(request))
            except ModelNotServed as exc:
                return error_response(404, str(exc))
            except BadRequest as exc:
                return error_response(400, str(exc))

        return handle

    def check(ids: list[int]) -> list[int]:
        if len(ids) > max_model_len:
            raise BadRequest(
                f"the prompt has {len(ids)} tokens, more than max_model_len {max_model_len}"
            )
        return ids

    def rendered(prompt: MockPrompt) -> dict[str, Any]:
        return {"token_ids": check(prompt.tokens), "features": features(prompt.images)}

    async def render_chat(request: web.Request) -> Any:
        return rendered(tokenizer_of(request).chat_prompt(await _body(request)))

    async def render_messages(request: web.Request) -> Any:
        body = to_chat_body(await _body(request)).body
        return rendered(tokenizer_of(request).chat_prompt(body, from_messages=True))

    async def render_responses(request: web.Request) -> Any:
        body = await _body(request)
        if body.get("previous_response_id") is not None:  # vLLM's words
            raise BadRequest(
                "previous_response_id is not supported by the stateless render endpoint."
            )
        chat = responses_chat(body).body
        return rendered(tokenizer_of(request).chat_prompt(chat))

    async def count_tokens(request: web.Request) -> web.StreamResponse:
        try:
            body = to_chat_body(await _body(request)).body
            n = len(tokenizer_of(request).chat(body, from_messages=True))
        except BadRequest as exc:
            return anthropic.error(400, str(exc))
        return web.json_response(
            {"input_tokens": n, "context_management": {"original_input_tokens": n}}
        )

    async def render_completions(request: web.Request) -> Any:
        tokenizer = tokenizer_of(request)
        body = await _body(request)
        return [
            {"token_ids": check(tokenizer.completion(one)), "features": None}
            for one in _prompts(body)
        ]

    async def tokenize(request: web.Request) -> Any:
        tokenizer = tokenizer_of(request)
        body = await _body(request)
        if "messages" not in body and not isinstance(body.get("prompt"), str):
            # vLLM's TokenizeCompletionRequest.prompt is a str: ids and batches fail its schema
            raise BadRequest("prompt: Input should be a valid string")
        ids = tokenizer.chat(body) if "messages" in body else tokenizer.completion(body)
        strs = None
        if body.get("return_token_strs"):  # vLLM's TokenizeResponse.token_strs
            strs = [tokenizer.decode([t]) for t in ids]
        return {
            "count": len(ids),
            "max_model_len": max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    async def detokenize(request: web.Request) -> Any:
        body = await _body(request)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < 2**63 for t in ids):
            raise BadRequest("'tokens' must be an array of token ids in [0, 2**63)")  # vLLM's
        if any(t >= 2**32 for t in ids):  # HF tokenizers' decode takes u32 ids
            raise BadRequest("number too large to fit in target type")  # its OverflowError
        return {"prompt": tokenizer_of(request).decode(ids)}

    return {
        "/v1/chat/completions/render": guarded(render_chat),
        "/v1/completions/render": guarded(render_completions),
        "/v1/messages/render": guarded(render_messages),
        "/v1/responses/render": guarded(render_responses),
        "/v1/messages/count_tokens": count_tokens,
        "/tokenize": guarded(tokenize),
        "/detokenize": guarded(detokenize),
    }
