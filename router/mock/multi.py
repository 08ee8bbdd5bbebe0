"""Chat and completion requests of several sequences, served as vLLM 0.34 serves them: ``n``
> 1 samples of a prompt, and a ``/v1/completions`` batch (``prompt`` a list of strings or
of token-id lists). One sequence of one prompt is router/mock/server.py's own path.

The engine (vLLM 0.34 ``completion/serving.py``, ``chat_completion/serving.py``,
``v1/engine/async_llm.py``, ``parallel_sampling.py``):

* A batch's prompts are requests of their own (vLLM: ``{request id}-{i}``), each its own
  prefix, max tokens and engine request; ``n`` samples of a prompt are ``n`` engine
  requests (vLLM's child requests), submitted together by ``sim.engine.sampled``, the
  simulator's own: the first prefills, the others reuse its blocks. Every sequence is in
  the replica's queue, batch, counters (``vllm:request_success``, ``vllm:prompt_tokens``,
  prefix-cache queries and hits: per sequence, as vLLM counts its child requests) and
  latency histograms.

The answer:

* A choice per sequence, prompt ``i``'s sample ``j`` at index ``i * n + j``, each with its
  own text, logprobs, ``echo`` (its prompt's) and ``finish_reason``.
* ``usage``: ``prompt_tokens`` counts each prompt once (``n`` does not multiply it),
  ``completion_tokens`` sums every sequence's. ``prompt_tokens_details.cached_tokens`` (and
  the mock's ``kv_hit_tokens``, chat's ``created_cache_tokens``) is one sequence's, as
  vLLM's: a stream's first sequence to answer (``num_cached_tokens`` of its first output),
  else the last prompt's sequence that finished last (its ``RequestOutput`` completed the
  answer).
* A stream: one choice a chunk, in the order the engine emits the sequences' tokens;
  chat first sends a role chunk for every choice (and its ``echo``), as vLLM does;
  each choice ends with a chunk of its own carrying its ``finish_reason`` (the mock's
  convention, as for one sequence); ``continuous_usage_stats`` give the chunk's prompt and
  its choice's tokens so far; ``include_usage`` ends with the whole usage.

The sequences share one output queue (``EngineDriver.submit``), so their chunks come in
the model's order; a client gone cancels every sequence still running.

Refused (400), never answered short: ``n`` above ``MAX_SAMPLES``; several sequences with
``kv_transfer_params`` (a disaggregated leg is one sequence of one prompt here; the router
never disaggregates such requests: docs/pd.md); a batch mixing strings and token ids; a
sequence the engine cannot hold (the whole request).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from router.core.errors import BadRequest
from router.mock import logprobs as lp
from router.mock import pd
from router.mock.driver import EngineFailed
from router.mock.preprocess import error_response as _error
from router.mock.server import MockState, _usage, _word, end_stream, engine_request
from router.tokenize.lax import lax_int
from router.tokenize.request_fields import MAX_SAMPLES
from sim.engine import EngineRequest, sampled


@dataclass(slots=True, frozen=True)
class Prompt:
    """One prompt of the request: its own body (a batch's: the request's with this prompt),
    token ids and engine requests (its ``n`` sequences, the first the prompt's own)."""

    body: dict[str, Any]
    tokens: list[int]
    sequences: list[EngineRequest]


@dataclass(slots=True, frozen=True)
class Many:
    """A request of several sequences: its body, kind, state, prompts and ``n``."""

    state: MockState
    body: dict[str, Any]
    kind: str
    prompts: list[Prompt]
    samples: int


def _batch(prompt: Any) -> list[Any] | None:
    """A completions ``prompt`` that is a batch of several (strings or token-id lists)."""
    if not (isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], list | str)):
        return None
    if not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        raise BadRequest(
            "'prompt' must be a string, token ids, or an array of strings or of token-id arrays"
        )
    return prompt


def prepare(state: MockState, body: dict[str, Any], kind: str) -> Many | None:
    """``body`` as several sequences (BadRequest where refused: module doc), or None when it
    asks one sequence of one prompt (the mock's own path, with its own checks)."""
    if kind not in ("chat", "completion"):
        return None  # the Messages and Responses APIs have no n nor batch
    n = lax_int(body.get("n"))
    samples = n if type(n) is int and n > 1 else 1  # what else vLLM refuses: the one path
    batch = _batch(body.get("prompt")) if kind == "completion" else None
    if samples == 1 and batch is None:
        return None
    if samples > MAX_SAMPLES:
        raise BadRequest(f"the mock replica samples at most {MAX_SAMPLES} sequences: 'n' is {n}")
    if pd.transfer_params(body) is not None:
        raise BadRequest(
            "the mock replica serves a disaggregated leg ('kv_transfer_params') as one "
            "sequence of one prompt: 'n' must be 1 and 'prompt' not a batch"
        )
    bodies = [body] if batch is None else [body | {"prompt": p} for p in batch]
    prompts: list[Prompt] = []
    base = ""
    for i, one in enumerate(bodies):
        req, tokens = engine_request(state, one, kind)
        if batch is not None:  # vLLM's request id of a batch's prompt i
            base = base or req.request_id
            req = replace(req, request_id=f"{base}-{i}")
        prompts.append(Prompt(one, tokens, sampled(req, samples)))
    return Many(state, body, kind, prompts, samples)


@dataclass(slots=True)
class _Seq:
    """One sequence's progress: its choice ``index``, prompt, tokens so far and timings."""

    index: int
    prompt: Prompt
    req: EngineRequest
    words: list[str] = field(default_factory=list)
    cached: int = 0
    kv_hit: int = 0
    first_at: float = 0.0
    queued_s: float = 0.0
    model_ttft_s: float = 0.0
    finish: str | None = None
    done: bool = False  # finished or rejected: nothing to cancel
    offset: int = 0  # completions' streamed text offset (logprobs' ``text_offset``)
    echoed: bool = False


async def serve(
    request: web.Request,
    many: Many,
    answer_id: str,
    stream: bool,
    opts: Mapping[str, Any],
    arrived: float,
) -> web.StreamResponse:
    """Run every sequence of ``many`` on the engine and answer them (module doc)."""
    state, body, kind = many.state, many.body, many.kind
    chat = kind == "chat"
    clock = asyncio.get_running_loop().time
    driver = state.driver
    seqs = [
        _Seq(i * many.samples + j, p, r)
        for i, p in enumerate(many.prompts)
        for j, r in enumerate(p.sequences)
    ]
    by_id = {s.req.request_id: s for s in seqs}
    created = int(time.time())
    model = state.settings.model
    object_type = "chat.completion" if chat else "text_completion"
    continuous = bool(opts.get("include_usage") and opts.get("continuous_usage_stats"))
    with_logprobs = lp.asks_logprobs(body, chat)
    echoes = lp.echoes(body)
    echo_logprobs = with_logprobs and not chat and echoes
    decode = state.tokenizer.decode

    def echo_of(p: Prompt) -> str:
        if not echoes:
            return ""
        return lp.chat_echo(p.body) if chat else lp.completion_echo(p.body, p.tokens, decode)

    def sse(obj: dict[str, Any]) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()

    def chunk(choice: dict[str, Any], usage: dict[str, Any] | None) -> bytes:
        obj: dict[str, Any] = {
            "id": answer_id,
            "object": f"{object_type}.chunk" if chat else object_type,
            "created": created,
            "model": model,
            "choices": [choice],
        }
        if usage is not None:
            obj["usage"] = usage
        return sse(obj)

    def running_usage(s: _Seq) -> dict[str, Any] | None:
        if not continuous:
            return None
        prompt, produced = len(s.prompt.tokens), len(s.words)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": produced,
            "total_tokens": prompt + produced,
        }

    def tokens_chunk(s: _Seq, new: list[str]) -> bytes:
        """A chunk of ``new`` tokens of sequence ``s`` (its first: after its echo)."""
        text = "".join(new)
        logprobs = None
        first = not s.echoed
        s.echoed = True
        if with_logprobs:
            if first and echo_logprobs:
                logprobs = lp.echoed(s.prompt.tokens, decode, new)
                s.offset += len("".join(logprobs["tokens"]))
            else:
                logprobs = lp.sampled(new, chat, s.offset)
                s.offset += len(text)
        if chat:
            return chunk(
                {"index": s.index, "delta": {"content": text}, "logprobs": logprobs}
                | {"finish_reason": None},
                running_usage(s),
            )
        if first and echoes:
            text = echo_of(s.prompt) + text
        choice = {"index": s.index, "text": text, "logprobs": logprobs}
        return chunk(choice | {"finish_reason": None, "stop_reason": None}, running_usage(s))

    def finish_chunk(s: _Seq) -> bytes:
        if chat:
            choice = {"index": s.index, "delta": {}, "logprobs": None}
        else:
            choice = {"index": s.index, "text": "", "logprobs": None}
        return chunk(choice | {"finish_reason": s.finish, "stop_reason": None}, running_usage(s))

    def opening(cached: int) -> bytes:
        """Chat's first chunks: every choice's role, then its echo (vLLM's first output)."""
        prompt = len(seqs[0].prompt.tokens)
        echo = echo_of(seqs[0].prompt)
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
        deltas += [{"content": echo}] if echo else []
        out = b""
        for k, delta in enumerate(deltas):
            for s in seqs:
                used: dict[str, Any] | None = None
                if continuous:
                    used = {"prompt_tokens": prompt, "completion_tokens": 0}
                    used["total_tokens"] = prompt
                    if k == 0:  # vLLM: the role chunks' usage has the prompt's split
                        used["prompt_tokens_details"] = {"cached_tokens": cached}
                choice = {"index": s.index, "delta": delta, "logprobs": None, "finish_reason": None}
                out += chunk(choice, used)
        return out

    queue: asyncio.Queue[Any] = asyncio.Queue()
    response: web.StreamResponse | None = None
    first: _Seq | None = None  # the first sequence to answer (a stream's usage)
    last: dict[int, _Seq] = {}  # each prompt's sequence that finished last, by prompt
    running = 0
    submitted = driver.now()  # model time: the engine gets the sequences at once
    c = state.counters
    for s in seqs:  # none starts unless all can (a stream's answer would open first)
        refused = driver.model.refusal(s.req)
        if refused is not None:
            c.rejected += 1
            return _error(400, f"request cannot be served: {refused}")
    try:
        for s in seqs:
            driver.submit(s.req, queue)
            running += 1
        while running:
            out = await queue.get()
            if isinstance(out, EngineFailed):
                raise out
            s = by_id[out.request_id]
            name = type(out).__name__
            if name == "Rejected":
                c.rejected += 1
                s.done = True
                reason = f"request cannot be served: {out.reason}"
                if response is None:
                    return _error(400, reason)
                error: dict[str, Any] = {"message": reason, "type": "BadRequestError"}
                error |= {"param": None, "code": 400}
                await response.write(sse({"error": error}) + b"data: [DONE]\n\n")
                await response.write_eof()
                return response
            if name == "FirstToken":
                s.first_at = clock()
                s.queued_s = out.queued_s * driver.time_scale
                s.model_ttft_s = (out.time - submitted) * driver.time_scale
                s.cached, s.kv_hit = out.cached_tokens, out.kv_hit_tokens
                s.words.append(_word(0))
                if first is None:
                    first = s
                if stream:
                    if response is None:
                        response = web.StreamResponse(
                            headers={
                                "Content-Type": "text/event-stream",
                                "Cache-Control": "no-cache",
                            }
                        )
                        await response.prepare(request)
                        if chat:
                            await response.write(opening(s.cached))
                    await response.write(tokens_chunk(s, [_word(0)]))
            elif name == "TokensEmitted":
                produced = len(s.words)
                new = [_word(produced + i) for i in range(out.count)]
                s.words.extend(new)
                if response is not None:
                    await response.write(tokens_chunk(s, new))
            elif name == "Finished":
                running -= 1
                s.done = True
                produced = len(s.words)
                s.finish = "length" if produced >= s.req.max_output_tokens else "stop"
                last[s.index // many.samples] = s
                req = s.req
                c.requests += 1
                c.prompt_tokens += req.prompt_tokens
                if req.reads_cache:
                    c.queried_tokens += req.prompt_tokens
                c.cached_tokens += s.cached
                c.generation_tokens += produced
                state.latency.observe(s.first_at - arrived, clock() - arrived, s.queued_s, produced)
                c.model_ttft_s += s.model_ttft_s
                if response is not None:
                    await response.write(finish_chunk(s))
    except EngineFailed as exc:
        if response is not None:
            raise  # the stream breaks off: the client sees an incomplete answer
        return _error(500, str(exc))
    finally:
        for s in seqs:
            if not s.done:
                driver.cancel(s.req.request_id)
    told = first if stream else last[len(many.prompts) - 1]
    assert told is not None
    ebs = state.settings.engine_block_size
    made = max(0, len(told.prompt.tokens) // ebs * ebs - told.cached) if chat else None
    usage = _usage(
        sum(len(p.tokens) for p in many.prompts),
        told.cached,
        sum(len(s.words) for s in seqs),
        told.kv_hit if driver.model.hybrid else None,
        made,
    )
    if response is not None:
        ids = (answer_id, f"{object_type}.chunk" if chat else object_type, created, model)
        return await end_stream(response, ids, usage if opts.get("include_usage") else None)
    return web.json_response(
        _answer(many, seqs, answer_id, created, usage, with_logprobs, echo_logprobs, echo_of)
    )


def _answer(
    many: Many,
    seqs: list[_Seq],
    answer_id: str,
    created: int,
    usage: dict[str, Any],
    with_logprobs: bool,
    echo_logprobs: bool,
    echo_of: Any,
) -> dict[str, Any]:
    """The whole answer, every field of vLLM's ChatCompletionResponse / CompletionResponse
    as it dumps them (as router/mock/server.py answers one sequence)."""
    chat = many.kind == "chat"
    decode = many.state.tokenizer.decode
    choices: list[dict[str, Any]] = []
    for s in seqs:
        text = echo_of(s.prompt) + "".join(s.words)
        logprobs: dict[str, Any] | None = None
        if with_logprobs:
            logprobs = (
                lp.echoed(s.prompt.tokens, decode, s.words)
                if echo_logprobs
                else lp.sampled(s.words, chat)
            )
        if chat:
            message = {"role": "assistant", "content": text, "refusal": None, "audio": None}
            message |= {"function_call": None, "reasoning": None}
            choice: dict[str, Any] = {"index": s.index, "message": message, "logprobs": logprobs}
        else:
            choice = {"index": s.index, "text": text, "logprobs": logprobs}
        choice |= {"finish_reason": s.finish, "stop_reason": None, "token_ids": None}
        if not chat:
            entries = None if s.req.reads_cache else lp.prompt_entries(s.prompt.tokens, decode)
            choice |= {"prompt_logprobs": entries, "prompt_token_ids": None}
        choice |= {"routed_experts": None, "weight_versions": None}
        choices.append(choice)
    extra: dict[str, Any] = {}
    if chat:
        first = many.prompts[0]
        reads = first.sequences[0].reads_cache
        extra = {
            "prompt_logprobs": None if reads else lp.prompt_entries(first.tokens, decode),
            "prompt_token_ids": None,
            "prompt_text": None,
        }
    return {
        "id": answer_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": many.state.settings.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
        **extra,
    }
