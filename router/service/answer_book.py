"""Booking an answer, or a request that got none: its SLO judgement in
``kvrouter_slo_requests`` (:func:`count_slo`, as the simulator and the live replay judge
it), whether its engine's cached tokens measure the predicted hit (:func:`judged`), and its
rows of the live-traffic trace (:func:`record_request` and its two callers). The HTTP relay
(router.service.answer_relay) and gRPC Reports (router/rpc/router_service.py) both book
here."""

from __future__ import annotations

from collections.abc import Sequence

from router.core.slo import answered_as, sequence_tokens
from router.core.types import ReplicaKey, RouteRequest
from router.service.state import Routed, RouterState, route_request
from router.tokenize.keying import ProcessedPrompt

_SLO_RESULTS = {
    (True, True): "met",
    (False, True): "ttft_missed",
    (True, False): "tpot_missed",
    (False, False): "both_missed",
}


def count_slo(
    state: RouterState,
    model: str,
    prompt_tokens: int,
    ttft_factor: float,
    service_class: str,
    ttft: float,
    e2e: float,
    output_tokens: int | None,
    sequences: int = 1,
    streamed: bool = True,
    last: float | None = None,
) -> None:
    """Count an answer in ``kvrouter_slo_requests``: its prompt's SLO tier and which targets
    it met, judged as the simulator and the live replay judge it (router.core.slo
    ``answered_as``): a stream by its first token's TTFT and its TPOT, timed to its last
    token (``last``, seconds from its start as ``ttft``; None: to its end, ``e2e``; without
    an output length, TPOT is not judged), an answer not ``streamed`` by its E2E against
    the TTFT target, its TPOT not judged (``ttft`` is then unused). The forwarder's answers
    and gRPC Report (router/rpc/router_service.py: no last token reported, its end) both
    count here.

    ``output_tokens`` is the engine's usage: a request's ``sequences`` (``n`` of each of
    its prompts) decode side by side and it sums their tokens, so TPOT is judged on one
    sequence's share of them."""
    # one output token: no TPOT, as for an answer whose length is unknown
    tokens = 1 if output_tokens is None else sequence_tokens(output_tokens, sequences)
    prompt, judged_ttft, tpot = answered_as(prompt_tokens, ttft, e2e, tokens, streamed, last)
    tier, ttft_ok, tpot_ok = state.slos[model].judge(prompt, judged_ttft, tpot, ttft_factor)
    result = _SLO_RESULTS[ttft_ok, tpot_ok]
    state.metrics.model(model).slo(tier.label, result, service_class).inc()


def judged(routed: Routed) -> bool:
    """Whether the engine's cached tokens of ``routed``'s answer measure its predicted hit
    (``kvrouter_prediction_error_tokens``; the forwarder and gRPC Report both ask): an exact
    prompt of one sequence. A request of several reports one sequence's: a batch's, one of
    its prompts' (vLLM: the last to finish); ``n`` > 1 samples', one child request's, and
    the children after the first reuse the blocks the first just computed, so a prompt no
    replica held reports nearly all of itself cached."""
    request = routed.request
    return routed.prompt.exact and request.prompts == 1 and request.samples == 1


def record_answer(
    state: RouterState,
    routed: Routed,
    key: ReplicaKey,
    started: float,
    finished: float,
    completion_tokens: int | None,
    cached_tokens: int | None,
    first_at: float,
    stream: bool,
    endpoint: str | None,
) -> None:
    """Append an answered request to the live-traffic trace (router.recorder; the HTTP
    relay's answers and the gRPC Picks a COMPLETED Report ends): :func:`record_request`,
    with the replica that answered and the hit predicted there."""
    predicted = routed.decision.usable_tokens if key == routed.decision.replica else None
    record_request(
        state, routed.request, routed.prompt, started, finished, completion_tokens,
        cached_tokens, first_at, stream, endpoint,
        replica=f"{key.replica}/{key.dp_rank}", predicted=predicted,
    )  # fmt: skip


def record_request(
    state: RouterState,
    req: RouteRequest,
    prompt: ProcessedPrompt,
    started: float,
    finished: float,
    completion_tokens: int | None,
    cached_tokens: int | None,
    first_at: float,
    stream: bool | None,
    endpoint: str | None,
    *,
    replica: str | None = None,
    predicted: int | None = None,
    status: int | None = None,
) -> None:
    """Append a request to the live-traffic trace: one row per prompt of a completions
    batch (each its own prompt and blocks, one ``batch`` id on all of them), ``n`` on each.
    The output length is one sequence's: the replica's reported output tokens
    (``completion_tokens``, the sum over every sequence of every prompt) shared out over
    them, else the request's max tokens, else 1. A batch's rows carry no predicted or
    engine-cached tokens: the router predicted its longest prompt's, and the usage holds
    one prompt's cached tokens, not each's. ``status`` (a request that got no answer): the
    status its client learnt (the router's refusal when it served no replica: a shed, none
    available; a replica's error status; the router's 502 / 504 for an answer that broke
    off, timed out or ended with the engine's error event, or when no replica answered;
    router.recorder ``CLIENT_CLOSED``: its client left, :meth:`AnswerRelay.record_cancelled`):
    offered load a replay keeps, without the outcome (``replica``, hits, TTFT; the output
    is the request's max tokens, unless the engine's usage came: a whole answer its client
    left while the router handed it over). Times are the event loop's (``first_at`` 0:
    no first token seen)."""
    recorder = state.recorder
    assert recorder is not None
    sequences = max(req.samples, 1) * max(req.prompts, 1)
    out = completion_tokens
    if out is None:
        out = req.max_output_tokens or 1
    else:
        out = max(1, -(-out // sequences))
    parts: Sequence[tuple[int, Sequence[int]]] = prompt.batch
    batch = len(parts) > 1
    if not batch:
        parts = ((req.prompt_tokens, req.block_hashes),)
    batch_id = recorder.next_batch() if batch else None
    for tokens, hashes in parts:
        recorder.record(
            arrived_at=started,
            model=req.model,
            input_length=max(tokens, 1),
            output_length=out,
            block_hashes=hashes,
            block_size=req.block_size,
            session_id=req.session_id,
            finished_at=finished,
            replica=replica,
            predicted_hit=None if batch else predicted,
            cached_tokens=None if batch else cached_tokens,
            first_token_at=first_at or None,
            samples=req.samples,
            stream=stream,
            endpoint=endpoint,
            batch=batch_id,
            status=status,
        )


def record_refused(
    state: RouterState,
    model: str,
    prompt: ProcessedPrompt,
    session_id: str | None,
    max_output_tokens: int | None,
    stream: bool | None,
    endpoint: str | None,
    started: float,
    now: float,
    status: int,
) -> None:
    """Append a request the router answered ``status`` without sending it to a replica
    (shed by admission, none could take it: handling.refused_load) to the live-traffic trace,
    as the row of offered load it is (:func:`record_request`: no replica, no outcome), so a
    replay offers it again."""
    req = route_request(model, prompt, "", session_id, max_output_tokens)
    record_request(
        state, req, prompt, started, now, None, None, 0.0, stream, endpoint, status=status
    )
