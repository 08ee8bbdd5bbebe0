"""The mock replica's generating routes: the engine model's answer to a completion.

``POST /v1/chat/completions`` and ``/v1/completions`` (streaming or not, ``n`` > 1 and
completion batches as vLLM serves them: router/mock/multi.py; the answers' bodies and
chunks for one sequence and several: router/mock/openai_answer.py; every field of
vLLM 0.34's answers, ``usage`` with ``prompt_tokens_details.cached_tokens``,
``stream_options.include_usage`` and ``continuous_usage_stats``, the filler's logprobs,
prompt logprobs and ``echo`` when asked (router/mock/logprobs.py), vLLM's error types and
statuses; for a hybrid profile
``prompt_tokens_details.kv_hit_tokens`` too, a mock-only field: the KV-only hit before the
hybrid-state rule), the Anthropic Messages API's ``POST /v1/messages`` (streaming or not,
in vLLM's format: router/mock/anthropic.py) and the OpenAI Responses API's
``POST /v1/responses`` (streaming or not, router/mock/responses.py). The app of
router/mock/server.py routes them here.

Prefill/decode disaggregation: vLLM's ``kv_transfer_params`` protocol, either role, with the
KV and recurrent-state pull timed by the link between the two replicas' sites
(router/mock/pd.py).

Prompts are tokenized by a ``MockTokenizer`` (router/mock/request.py reads a request as the
engine sees it) and hashed exactly as the router hashes them
(``root_hash(model, cache_salt)``, the router's block size, an image's identifier keyed into
the block its placeholders start in: router/mock/images.py), so hits are real; the answer is
filler text, one word per token, timed by the engine model (TTFT, inter-token gaps). Should
the engine model raise, the requests in flight and every later one get HTTP 500 naming the
error (``EngineFailed``), never an answer that does not come.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Any

from aiohttp import web

from router import jsonload
from router.core.errors import BadRequest
from router.mock import anthropic, multi, pd, sampling
from router.mock import logprobs as lp
from router.mock import openai_answer as oa
from router.mock import request as rq
from router.mock import responses as resp
from router.mock.driver import EngineFailed
from router.mock.preprocess import ModelNotServed, not_served
from router.mock.preprocess import error_response as _error
from router.mock.state import STATE, MockState
from router.tokenize.responses import stores


async def _read(request: web.Request) -> tuple[MockState, dict[str, Any]]:
    """The request's body, a JSON object naming the model served."""
    state = request.app[STATE]
    try:
        body = await request.json(loads=jsonload.loads)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    error = not_served(body.get("model"), state.settings.model)
    if error is not None:
        raise error
    return state, body


async def _outputs(state: MockState, req: Any) -> AsyncIterator[Any]:
    queue = state.driver.submit(req)
    done = False
    try:
        while True:
            out = await queue.get()
            if isinstance(out, EngineFailed):
                done = True
                raise out
            yield out
            if type(out).__name__ in ("Finished", "Rejected"):
                done = True
                return
    finally:
        if not done:
            state.driver.cancel(req.request_id)


async def _handle(request: web.Request, kind: str) -> web.StreamResponse:
    """Serve a completion of ``kind``: ``chat``, ``completion``, or ``messages`` (the
    Anthropic Messages API: a chat whose answer is written as vLLM writes Anthropic's,
    router/mock/anthropic.py)."""
    clock = asyncio.get_running_loop().time
    arrived = clock()  # vLLM's latency histograms start at the request's arrival
    chat = kind != "completion"
    messages = kind == "messages"
    responses = kind == "responses"
    fail = anthropic.error if messages else _error

    body: dict[str, Any] = {}
    try:
        state, body = await _read(request)
        if pd.refused_first(body, kind):
            if pd.is_decode_leg(pd.transfer_params(body)):
                state.counters.released_transfers += 1
            raise BadRequest(pd.STREAM_WITH_BEAM_SEARCH)
        many = multi.prepare(state, body, kind)  # None: one sequence of one prompt
        req: Any = None
        prompt_ids: list[int] = []
        if many is None:
            req, prompt_ids = rq.engine_request(state, body, kind)
        stream = body.get("stream", False)
        opts = {} if messages or responses else body.get("stream_options") or {}
        if not isinstance(stream, bool) or not isinstance(opts, dict):
            raise BadRequest("'stream' must be a boolean and 'stream_options' an object")
        if opts and not stream:  # vLLM's words (validate_stream_options)
            raise BadRequest("Stream options can only be defined when `stream=True`.")
    except resp.UnknownResponse as exc:
        return resp.not_found(str(exc))
    except ModelNotServed as exc:
        request.app[STATE].counters.bad_requests += 1
        return fail(404, str(exc)) if messages else _error(404, str(exc), param="model")
    except sampling.EngineRefused as exc:  # vLLM's engine refuses it once a stream is open
        request.app[STATE].counters.bad_requests += 1
        if body.get("stream") is not True:
            return _error(400, str(exc), param=exc.param)
        refusal = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await refusal.prepare(request)
        await refusal.write(oa.stream_error(str(exc), exc.param))
        await refusal.write_eof()
        return refusal
    except BadRequest as exc:
        request.app[STATE].counters.bad_requests += 1
        if isinstance(exc, sampling.Refused) and not messages:
            return _error(400, str(exc), param=exc.param)
        return fail(400, str(exc))
    answer_id = rq.answer_id(request, body, kind)
    if many is not None:
        return await multi.serve(request, many, answer_id, stream, opts, arrived)
    params = pd.transfer_params(body)
    prefill_leg = pd.is_prefill_leg(params)
    if params is not None and pd.is_decode_leg(params):
        req = _pull(state, req, params)
    created = int(time.time())
    model = state.settings.model
    cached = 0
    kv_hit = 0
    produced = 0
    finish_reason = "length"
    response: web.StreamResponse | None = None

    openai_api = not (messages or responses)
    with_logprobs = openai_api and lp.asks_logprobs(body, chat)
    decode = state.tokenizer.decode
    prompt_logprobs = lp.prompt_entries(prompt_ids, decode) if not req.reads_cache else None
    echo = ""  # the text echoed before the answer's (vLLM's ``echo``)
    if openai_api and lp.echoes(body):
        echo = lp.chat_echo(body) if chat else lp.completion_echo(body, prompt_ids, decode)
    oai = oa.Answer(
        answer_id,
        chat,
        created,
        model,
        decode,
        fingerprint=state.fingerprint,
        with_logprobs=with_logprobs,
        top_logprobs=lp.top_shown(body, chat),
        role=lp.answered_role(body),
        echo_only=lp.echo_only(body, kind),
        # completions' logprobs with echo list the prompt's tokens first
        echo_logprobs=with_logprobs and not chat and lp.echoes(body),
        include_usage=bool(opts.get("include_usage")),
        # vLLM's continuous_usage_stats: every chunk carries the usage so far
        continuous=bool(opts.get("include_usage") and opts.get("continuous_usage_stats")),
    )
    # the one choice's chunks (chat's echo is in its opening chunks)
    seq = oa.ChoiceStream(oai, 0, prompt_ids, "" if chat else echo)

    words: list[str] = []
    rids = (answer_id, f"msg_{uuid.uuid4().hex}")
    writer = resp.EventWriter(rids)
    first_at = finished_at = arrived
    queued_s = model_ttft_s = 0.0
    submitted = state.driver.now()  # model time: the engine gets the request at once
    if responses and stream:  # vLLM opens the stream before the engine's first output
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        opened = resp.response(body, rids, model, None, "in_progress", None, req.max_output_tokens)
        await response.write(writer.opening(opened))
    try:
        async for out in _outputs(state, req):
            name = type(out).__name__
            if name == "Rejected":
                state.counters.rejected += 1
                reason = f"request cannot be served: {out.reason}"
                if response is not None:  # an opened stream ends with its error event
                    error = writer.event(
                        "error", code="BadRequestError", message=reason, param=None
                    )
                    await response.write(error)
                    await response.write_eof()
                    return response
                return fail(400, reason)
            if response is None and stream:
                response = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await response.prepare(request)
            if name == "FirstToken":  # carries the first output token
                first_at = clock()
                queued_s = out.queued_s * state.driver.time_scale
                model_ttft_s = (out.time - submitted) * state.driver.time_scale
                cached = out.cached_tokens
                kv_hit = out.kv_hit_tokens
                produced = 1
                if response is not None and messages:
                    first = anthropic.usage(req.prompt_tokens, cached, 0)
                    start = anthropic.start_events(answer_id, model, first)
                    await response.write(start + anthropic.text_event(oa.word(0)))
                elif response is not None and responses:
                    await response.write(writer.first_output() + writer.delta(oa.word(0)))
                    words.append(oa.word(0))
                elif response is not None:
                    opening = oai.opening([0], req.prompt_tokens, cached, echo) if chat else b""
                    last = oa.last_reason(produced, req.max_output_tokens)
                    await response.write(opening + seq.tokens([oa.word(0)], produced, last))
                else:
                    words.append(oa.word(0))
            elif name == "TokensEmitted":
                new = [oa.word(produced + i) for i in range(out.count)]
                produced += out.count
                if response is not None and responses:
                    await response.write(writer.delta("".join(new)))
                    words.extend(new)
                elif response is not None:
                    await response.write(
                        anthropic.text_event("".join(new))
                        if messages
                        else seq.tokens(
                            new, produced, oa.last_reason(produced, req.max_output_tokens)
                        )
                    )
                else:
                    words.extend(new)
            elif name == "Finished":
                finished_at = clock()
                cached = out.cached_tokens
                produced = out.output_tokens
                finish_reason = "length" if produced >= req.max_output_tokens else "stop"
    except EngineFailed as exc:
        if response is not None:
            raise  # the stream breaks off: the client sees an incomplete answer
        return fail(500, str(exc))
    if params is not None and pd.is_decode_leg(params):  # the hit was the prefill replica's
        cached, kv_hit = pd.remote_hit(params, cached, kv_hit)
    c = state.counters
    c.requests += 1
    c.prompt_tokens += req.prompt_tokens
    if req.reads_cache:
        c.queried_tokens += req.prompt_tokens
    c.cached_tokens += cached
    c.generation_tokens += produced
    state.latency.observe(first_at - arrived, finished_at - arrived, queued_s, produced)
    c.model_ttft_s += model_ttft_s
    hybrid = state.driver.model.hybrid
    ebs = state.settings.engine_block_size
    # chat's created_cache_tokens: the prompt's full engine blocks it computed (vLLM's
    # PrefillStats.num_cache_creation_tokens)
    made = max(0, req.prompt_tokens // ebs * ebs - cached) if chat else None
    usage = oa.usage(req.prompt_tokens, cached, produced, kv_hit if hybrid else None, made)
    # a prefill leg's answer names its blocks for the decode leg, on every API (vLLM's)
    transfer: dict[str, Any] | None = None
    if prefill_leg:
        c.prefill_legs += 1
        s = state.settings
        blocks = [range(-(-req.prompt_tokens // s.block_size))]
        if state.driver.model.hybrid:
            blocks.append(range(1))  # the recurrent state's group: its running-state slot
        transfer = pd.answer_params(
            s.replica,
            req.request_id,
            request.url.host or "",
            request.url.port or 0,
            pd.Site(s.region, s.rack),
            blocks,
            req.prompt_tokens,
            cached,
            kv_hit,
        )
    if responses:
        status = "incomplete" if finish_reason == "length" else "completed"
        used = resp.usage(req.prompt_tokens, cached, produced)
        text = "".join(words)
        answer = resp.response(body, rids, model, text, status, used, req.max_output_tokens)
        answer |= {"kv_transfer_params": transfer, "ec_transfer_params": None}
        if stores(body):
            history = resp.chat_body(state.responses, body)["messages"]
            state.responses.put(rids[0], resp.Stored(history, answer))
        if response is not None:
            await response.write(writer.end(answer))
            await response.write_eof()
            return response
        return web.json_response(answer)
    if messages:
        final = anthropic.usage(req.prompt_tokens, cached, produced)
        if response is not None:
            await response.write(anthropic.end_events(finish_reason, final))
            await response.write_eof()
            return response
        text = "".join(words)
        answer = anthropic.answer(answer_id, model, text, finish_reason, final)
        if transfer is not None:  # vLLM dumps the answer without its None fields
            answer["kv_transfer_params"] = transfer
        return web.json_response(answer)
    if response is not None:
        ending = seq.finish(finish_reason, produced)
        if ending:  # (an empty write ends the body)
            await response.write(ending)
        return await oa.end_stream(response, oai, usage if opts.get("include_usage") else None)
    text = oai.text(echo, words)
    one = oai.choice(0, text, oai.logprobs(prompt_ids, words), finish_reason, prompt_logprobs)
    return web.json_response(oai.body([one], usage, prompt_logprobs, transfer))


def _pull(state: MockState, req: Any, params: Mapping[str, Any]) -> Any:
    """A decode leg: the request as remote-prefilled, with the time its pull of what this
    replica lacks takes (router/mock/pd.py), which the engine model starts at admission."""
    model = state.driver.model
    held = 0
    for h in req.block_hashes:
        if not model.has_block(h):
            break
        held += 1
    missing = max(req.prompt_tokens - held * state.settings.block_size, 0)
    profile = model.profile
    sizes = pd.TransferSizes(profile.kv_bytes_per_token, profile.state_bytes)
    s = state.settings
    moved = pd.pull(params, pd.Site(s.region, s.rack), s.replica, missing, sizes, model.hybrid)
    state.counters.decode_legs += 1
    state.counters.pulled_bytes += moved.nbytes
    return replace(req, remote_prefilled=True, pull_s=moved.seconds)


async def _tracked(request: web.Request, kind: str) -> web.StreamResponse:
    """``_handle``, counted in flight until answered (vLLM's ``load_aware_call``)."""
    counters = request.app[STATE].counters
    counters.in_flight += 1
    try:
        return await _handle(request, kind)
    finally:
        counters.in_flight -= 1


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _tracked(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _tracked(request, "completion")


async def messages(request: web.Request) -> web.StreamResponse:
    return await _tracked(request, "messages")


async def responses(request: web.Request) -> web.StreamResponse:
    return await _tracked(request, "responses")
