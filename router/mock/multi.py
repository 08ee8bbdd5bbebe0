"""Chat and completion requests of several sequences, served as vLLM 0.34 serves them: ``n``
> 1 samples of a prompt, and a ``/v1/completions`` batch (``prompt`` a list of strings or
of token-id lists). One sequence of one prompt is router/mock/generation.py's own path; both
write their answers with router/mock/openai_answer.py.

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
  each choice's last tokens come with its ``finish_reason``, as vLLM's last output
  (router/mock/openai_answer.py); ``continuous_usage_stats`` give the chunk's prompt and
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
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from router.core.errors import BadRequest
from router.mock import logprobs as lp
from router.mock import openai_answer as oa
from router.mock import pd
from router.mock.driver import EngineFailed
from router.mock.preprocess import error_response as _error
from router.mock.request import engine_request
from router.mock.state import MockState
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
    """One sequence's progress: its choice ``index``, prompt, streamed chunks, tokens so far
    and timings."""

    index: int
    prompt: Prompt
    req: EngineRequest
    chunks: oa.ChoiceStream
    words: list[str] = field(default_factory=list)
    cached: int = 0
    kv_hit: int = 0
    first_at: float = 0.0
    queued_s: float = 0.0
    model_ttft_s: float = 0.0
    finish: str | None = None
    done: bool = False  # finished or rejected: nothing to cancel


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
    echoes = lp.echoes(body)
    with_logprobs = lp.asks_logprobs(body, chat)
    decode = state.tokenizer.decode
    answer = oa.Answer(
        answer_id,
        chat,
        int(time.time()),
        state.settings.model,
        decode,
        fingerprint=state.fingerprint,
        with_logprobs=with_logprobs,
        top_logprobs=lp.top_shown(body, chat),
        role=lp.answered_role(body),
        echo_only=lp.echo_only(body, kind),
        echo_logprobs=with_logprobs and not chat and echoes,
        include_usage=bool(opts.get("include_usage")),
        continuous=bool(opts.get("include_usage") and opts.get("continuous_usage_stats")),
    )

    def echo_of(p: Prompt) -> str:
        if not echoes:
            return ""
        return lp.chat_echo(p.body) if chat else lp.completion_echo(p.body, p.tokens, decode)

    # chat's echo comes in its opening chunks, completions' before each choice's tokens
    seqs: list[_Seq] = []
    for i, p in enumerate(many.prompts):
        echo = "" if chat else echo_of(p)  # once a prompt: its samples share it
        for j, r in enumerate(p.sequences):
            index = i * many.samples + j
            seqs.append(_Seq(index, p, r, oa.ChoiceStream(answer, index, p.tokens, echo)))
    by_id = {s.req.request_id: s for s in seqs}

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
                await response.write(oa.stream_error(reason))
                await response.write_eof()
                return response
            if name == "FirstToken":
                s.first_at = clock()
                s.queued_s = out.queued_s * driver.time_scale
                s.model_ttft_s = (out.time - submitted) * driver.time_scale
                s.cached, s.kv_hit = out.cached_tokens, out.kv_hit_tokens
                s.words.append(oa.word(0))
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
                            first_prompt = seqs[0].prompt
                            await response.write(
                                answer.opening(
                                    [t.index for t in seqs],
                                    len(first_prompt.tokens),
                                    s.cached,
                                    echo_of(first_prompt),
                                )
                            )
                    ends = oa.last_reason(1, s.req.max_output_tokens)
                    await response.write(s.chunks.tokens([oa.word(0)], 1, ends))
            elif name == "TokensEmitted":
                produced = len(s.words)
                new = [oa.word(produced + i) for i in range(out.count)]
                s.words.extend(new)
                if response is not None:
                    produced = len(s.words)
                    ends = oa.last_reason(produced, s.req.max_output_tokens)
                    await response.write(s.chunks.tokens(new, produced, ends))
            elif name == "Finished":
                running -= 1
                s.done = True
                produced = len(s.words)
                finish = "length" if produced >= s.req.max_output_tokens else "stop"
                s.finish = finish
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
                ending = s.chunks.finish(finish, produced)
                if response is not None and ending:  # (an empty write ends the body)
                    await response.write(ending)
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
    usage = oa.usage(
        sum(len(p.tokens) for p in many.prompts),
        told.cached,
        sum(len(s.words) for s in seqs),
        told.kv_hit if driver.model.hybrid else None,
        made,
    )
    if response is not None:
        return await oa.end_stream(response, answer, usage if opts.get("include_usage") else None)
    return web.json_response(_answer(many, seqs, answer, usage, echo_of))


def _answer(
    many: Many,
    seqs: list[_Seq],
    answer: oa.Answer,
    usage: dict[str, Any],
    echo_of: Callable[[Prompt], str],
) -> dict[str, Any]:
    """The whole answer: a choice per sequence (module doc)."""
    decode = many.state.tokenizer.decode
    choices: list[dict[str, Any]] = []
    for s in seqs:
        text = answer.text(echo_of(s.prompt), s.words)
        entries = None
        if not answer.chat and not s.req.reads_cache:  # completions': the choice's own
            entries = lp.prompt_entries(s.prompt.tokens, decode)
        logprobs = answer.logprobs(s.prompt.tokens, s.words)
        choices.append(answer.choice(s.index, text, logprobs, s.finish, entries))
    prompt_logprobs = None
    if answer.chat:  # chat's: the answer's, its first prompt's
        first = many.prompts[0]
        if not first.sequences[0].reads_cache:
            prompt_logprobs = lp.prompt_entries(first.tokens, decode)
    return answer.body(choices, usage, prompt_logprobs)
