"""Replay a Mooncake-format trace (with ``session_id`` / ``delay`` rows: closed loop) through
the router over real HTTP.

Prompts are rebuilt as token ids with the simulator's rule (token ``j`` of trace block id
``k`` is ``(k * 512 + j) mod 2**32``), so the router, the mock replicas and the simulator all
hash exactly the same tokens; the trace is read as the simulator reads it
(sim.workload.mooncake_rows: arrival order from 0, dense block ids, the first ``limit``
arrivals). An open-loop request goes out at its arrival, a closed-loop turn ``delay`` after
the request the simulator ties it to finished (both divided by the speed-up).
Each request goes to the endpoint its row names (``endpoint``: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/responses``, ``/v1/messages``), streamed or not as recorded
(``stream``), with its ``n``, decoding its recorded output whole (``ignore_eos``, the
Messages API's ``min_tokens``: a real engine stops at its end-of-sequence token long before,
on prompts that are no text); a row without them (an older recording, a Mooncake trace) is a
streamed completion. The rows of one completions batch (``batch``: the recorder's row per
prompt) are one request, as the router received and routed them: at the first row's arrival
(and, closed loop, its tie), its ``prompt`` the rows' prompts in row order, with the first
row's ``n``, ``stream``, session and max tokens (a batch's rows share them: each decodes the
batch's largest output, sim.workload ``batch_outputs``, as the simulator runs it); the answer
holds a choice per sequence (prompt ``i``'s sample ``j`` at index ``i * n + j``), its
usage sums every prompt's, and a turn tied to any of its rows follows the whole answer.
Completions carry the token ids; the other endpoints take text, so
their prompt is a stand-in (:func:`prompt_text`: one ASCII character a token, a function of
its id, so shared blocks are shared text; the mock replica's byte tokenizer makes it one
token each, plus the chat's role tokens; a real tokenizer's lengths differ). OpenAI streams
ask ``stream_options.include_usage``. Each carries its session in ``X-Session-Id`` (and
``user``; the Messages API: ``metadata.user_id``). The client measures TTFT at the first SSE
event that carries a token (not a keep-alive comment, a role-only or empty chunk; only for
streams) and E2E at the stream's last event (OpenAI's ``[DONE]``, the Responses API's final
response event, the Messages API's ``message_stop``: a stream cut short of it is a failure,
as is an event that is not a JSON object: that request fails, the replay goes on) or the end
of the whole answer, both from just before the request is sent, and reads the engine's
prompt, cached and output tokens (and the mock's KV-only ``kv_hit_tokens``) from the usage,
in the endpoint's shape (a stream or an answer without one is a failure: nothing to judge it
by), and the router's predicted hit from the ``X-KVRouter-Decision`` header (kvrouter only).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np

from router.core.slo import answered_as, sequence_tokens

if TYPE_CHECKING:
    from sim.workload import TraceRow

TRACE_BLOCK = 512
CONNECT_FAILED = "connect failed: "


@dataclass(slots=True, frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    body: bytes
    session_id: str | None = None
    delay_s: float | None = None  # closed loop: this long after request ``after`` finished
    after: int | None = None  # closed loop: the index of the request it follows
    path: str = "/v1/completions"  # the endpoint it goes to (PATHS)
    samples: int = 1  # the sequences it samples for each prompt (its ``n``)
    prompts: int = 1  # the prompts it sends (a batch's rows; ``prompt_tokens`` their sum)


@dataclass(slots=True)
class Outcome:
    ok: bool
    ttft_s: float = float("nan")
    prompt_tokens: int = 0
    cached_tokens: int = 0
    kv_hit_tokens: int = 0  # the mock's KV-only hit (before the hybrid-state rule)
    predicted_tokens: int = 0
    error: str = ""
    e2e_s: float = float("nan")
    last_s: float = float("nan")  # a stream's last token (its TPOT's end, as vLLM's)
    output_tokens: int = 0  # the usage's: every sequence's tokens
    samples: int = 1  # the sequences the request sampled for each prompt (its ``n``)
    prompts: int = 1  # its prompts (a completions batch's), their sequences decoded side by side

    def tpot_s(self) -> float | None:
        """One sequence's time per output token after the first (the usage sums the
        ``samples`` x ``prompts`` sequences'); None without a TTFT (an answer not streamed)
        or for sequences of at most one token."""
        return self.judged()[2]

    def judged(self) -> tuple[int, float, float | None]:
        """The answered request as the SLO judges it (``router.core.slo.Answered``): a
        stream's TPOT from its first token to its last (``last_s``; not to the usage chunk
        or the stream's end after it); an answer not streamed has no TTFT, its first token
        reached the client with the whole answer: judged by its E2E, its TPOT not judged."""
        sequences = max(self.samples, 1) * max(self.prompts, 1)
        streamed = self.ttft_s == self.ttft_s
        one = sequence_tokens(self.output_tokens, sequences)
        last = self.last_s if self.last_s == self.last_s else None
        return answered_as(self.prompt_tokens, self.ttft_s, self.e2e_s, one, streamed, last)


def count_requests(path: Path, limit: int) -> int:
    """How many requests :func:`load_requests` gives for ``path`` and ``limit`` (a
    completions batch's rows are one)."""
    return len(_requests_of(_trace_rows(path, limit)))


def _trace_rows(path: Path, limit: int) -> list[TraceRow]:
    """The rows of a Mooncake / recorded trace as the simulator reads them
    (sim.workload.mooncake_rows). A Bailian trace is an error: the simulator reads it in
    its format (seconds, 16-token blocks: sim.workload ``sniff_format``), and read here as
    Mooncake rows it would be another workload."""
    from router.core.errors import ConfigError
    from sim.workload import mooncake_rows, sniff_format

    if sniff_format(path) == "bailian":
        raise ConfigError(
            f"{path} is a Bailian trace: the live replay reads Mooncake and recorded traces"
        )
    return mooncake_rows(path, trace_block=TRACE_BLOCK, limit=limit)


def _requests_of(rows: Sequence[TraceRow]) -> list[list[int]]:
    """The requests ``rows`` (in arrival order) make, as lists of row indices
    (sim.workload ``by_batch``: the trace reader takes ``batch`` on completions rows alone)."""
    from sim.workload import by_batch

    return by_batch(range(len(rows)), lambda i: rows[i].batch)


PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


def prompt_text(tokens: np.ndarray) -> str:
    """A text stand-in for token ids, for the endpoints that take no token ids: one
    printable ASCII character a token (one token each to the mock replica's byte
    tokenizer), a function of the token id alone, so prompts sharing blocks share text."""
    mixed = (tokens.astype("<u4") * np.uint32(0x9E3779B1)) >> np.uint32(25)  # 0..127
    return (mixed % np.uint32(94) + np.uint32(33)).astype(np.uint8).tobytes().decode("ascii")


def request_body(
    endpoint: str,
    model: str,
    tokens: np.ndarray | Sequence[np.ndarray],
    output: int,
    stream: bool,
    samples: int,
) -> dict[str, Any]:
    """The body of a replayed request at ``endpoint``: completions carry the token ids (a
    sequence of several prompts: a batch, ``prompt`` a list of them), the others
    :func:`prompt_text` as one user message (the Responses API: as its input). It asks
    ``output`` tokens exactly (``ignore_eos``; the Messages API: ``min_tokens``)."""
    body: dict[str, Any] = {"model": model}
    if not isinstance(tokens, np.ndarray):
        if endpoint != "completions":
            raise ValueError(f"a batch of prompts goes to completions, not {endpoint}")
        body["prompt"] = [t.tolist() for t in tokens]
    elif endpoint == "completions":
        body["prompt"] = tokens.tolist()
    elif endpoint == "responses":
        body["input"] = prompt_text(tokens)
        body["store"] = False
    else:
        body["messages"] = [{"role": "user", "content": prompt_text(tokens)}]
    body["max_output_tokens" if endpoint == "responses" else "max_tokens"] = output
    # exactly ``output`` tokens, as recorded: a real engine would stop at its end of sequence
    # (vLLM and SGLang read ``ignore_eos``; vLLM's Messages API only ``min_tokens``)
    if endpoint == "messages":
        body["min_tokens"] = output
    else:
        body["ignore_eos"] = True
    if samples > 1:  # only the OpenAI endpoints sample several sequences
        body["n"] = samples
    body["stream"] = stream
    if stream and endpoint in ("completions", "chat"):
        body["stream_options"] = {"include_usage": True}
    return body


def load_requests(path: Path, limit: int, model: str, max_output: int) -> list[TraceRequest]:
    """The requests of the first ``limit`` rows of a Mooncake / recorded trace as the
    simulator reads them (sim.workload.mooncake_rows: arrival order from 0, dense block ids,
    closed-loop turns tied to the same requests), outputs capped at ``max_output``, each
    sent to the row's endpoint, streamed or not and with its ``n`` as recorded (rows without
    them: streamed completions); a completions batch's rows as one request (module doc),
    ``after`` the index of the request a turn follows in the list returned."""
    rows = _trace_rows(path, limit)
    groups = _requests_of(rows)
    request_of = {i: k for k, group in enumerate(groups) for i in group}
    out: list[TraceRequest] = []
    offsets = np.arange(TRACE_BLOCK, dtype="<u4")

    def tokens_of(row: TraceRow) -> np.ndarray:
        ids = np.asarray(row.block_ids, dtype="<u4")
        return (ids[:, None] * np.uint32(TRACE_BLOCK) + offsets).reshape(-1)[: row.prompt_tokens]

    for group in groups:
        row = rows[group[0]]
        members = [rows[i] for i in group]
        # one max_tokens for a batch: its rows carry its largest output (sim.workload
        # ``batch_outputs``, as the simulator decodes each of them)
        output = max(1, min(row.output_tokens, max_output))
        tokens = tokens_of(row) if len(group) == 1 else [tokens_of(r) for r in members]
        body = request_body(row.endpoint, model, tokens, output, row.stream, row.samples)
        if row.session_id is not None:
            if row.endpoint == "messages":
                body["metadata"] = {"user_id": row.session_id}
            else:
                body["user"] = row.session_id  # the router's session id
        after = None if row.after is None else request_of[row.after]
        out.append(
            TraceRequest(
                row.arrival_s,
                sum(r.prompt_tokens for r in members),
                output,
                json.dumps(body).encode(),
                row.session_id,
                row.delay_s if after is not None else None,
                after,
                PATHS[row.endpoint],
                row.samples,
                len(group),
            )
        )
    return out


def _predicted(header: str | None) -> int:
    for part in (header or "").split(";"):
        key, _, value = part.strip().partition("=")
        if key == "usable_tokens" and value.isdigit():
            return int(value)
    return 0


# a stream's last event, by endpoint: OpenAI's closing ``[DONE]``; the Responses API's final
# response event; the Messages API's ``message_stop``
FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed", "message_stop")


def _has_token(chunk: dict[str, Any]) -> bool:
    """Whether a stream's chunk carries output: a choice with text, or the one that ends it
    (a first token that is the end of the answer has no text); a Responses API text delta;
    a Messages API content delta; not a role-only, empty or usage-only chunk."""
    kind = chunk.get("type")
    if kind in ("response.output_text.delta", "content_block_delta"):
        return True
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or choice.get("finish_reason"):
            return True
    return False


def _read_usage(out: Outcome, usage: dict[str, Any]) -> None:
    """The engine's counts from a usage object: OpenAI's (``prompt_tokens``, ...), the
    Responses API's (``input_tokens``, ``input_tokens_details.cached_tokens``) or the
    Messages API's (``input_tokens`` the uncached part, ``cache_read_input_tokens``; a
    stream's ``message_start`` has the prompt's, its ``message_delta`` the output's)."""
    if "prompt_tokens" in usage or "completion_tokens" in usage:
        out.prompt_tokens = usage.get("prompt_tokens", 0)
        out.output_tokens = usage.get("completion_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        out.cached_tokens = details.get("cached_tokens") or 0
        out.kv_hit_tokens = details.get("kv_hit_tokens", out.cached_tokens) or 0
        return
    if "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage:
        cached = usage.get("cache_read_input_tokens") or 0
        made = usage.get("cache_creation_input_tokens") or 0
        if "input_tokens" in usage:
            out.prompt_tokens = (usage.get("input_tokens") or 0) + cached + made
            out.cached_tokens = out.kv_hit_tokens = cached
    elif "input_tokens" in usage:
        out.prompt_tokens = usage.get("input_tokens") or 0
        details = usage.get("input_tokens_details") or {}
        out.cached_tokens = details.get("cached_tokens") or 0
        out.kv_hit_tokens = details.get("kv_hit_tokens", out.cached_tokens) or 0
    if "output_tokens" in usage:
        out.output_tokens = usage.get("output_tokens") or 0


def _usage_of(event: dict[str, Any]) -> dict[str, Any] | None:
    """The usage an answer or a stream's event carries (the Responses API's in its
    response, the Messages API's ``message_start`` in its message)."""
    for holder in (event, event.get("response"), event.get("message")):
        usage = holder.get("usage") if isinstance(holder, dict) else None
        if isinstance(usage, dict):
            return usage
    return None


async def _one(session: aiohttp.ClientSession, url: str, req: TraceRequest) -> Outcome:
    t0 = time.perf_counter()
    headers = {"Content-Type": "application/json"}
    if req.session_id is not None:
        headers["X-Session-Id"] = str(req.session_id)
    try:
        async with session.post(url, data=req.body, headers=headers) as resp:
            if resp.status != 200:
                text = await resp.text(errors="replace")
                return Outcome(False, error=f"HTTP {resp.status}: {text[:200]}")
            out = Outcome(
                True,
                predicted_tokens=_predicted(resp.headers.get("X-KVRouter-Decision")),
                samples=req.samples,
                prompts=req.prompts,
            )
            return await read_answer(resp, out, t0)
    except aiohttp.ClientConnectorError as exc:  # never reached the router: safe to resend
        return Outcome(False, error=f"{CONNECT_FAILED}{exc}")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Outcome(False, error=f"{type(exc).__name__}: {exc}")


async def read_answer(resp: aiohttp.ClientResponse, out: Outcome, t0: float) -> Outcome:
    """A 200 answer as the client sees it, timed from ``t0`` (``time.perf_counter``, just
    before the request was sent): a stream's TTFT at its first event with a token
    (:func:`_has_token`), its last token (``last_s``, where TPOT ends), its end at its last
    event and the usage it carries; an answer not streamed :func:`_answer`. ``out`` (ok)
    filled in, or a failed Outcome: the one reading of an answer every live figure
    (``kvrouter bench live``, the demo, ``kvrouter bench overload``) is made from."""
    if not resp.content_type.startswith("text/event-stream"):
        return await _answer(resp, out, t0)
    usage_seen = False
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        at = time.perf_counter() - t0
        data = line[5:].strip()
        if data == b"[DONE]":
            out.e2e_s = at
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict):  # one request's failure, not the replay's
            return Outcome(False, error=f"malformed event: {data[:200]!r}")
        if "error" in chunk and chunk.get("type") != "response.failed":
            return Outcome(False, error=str(chunk["error"])[:200])
        if _has_token(chunk):
            if out.ttft_s != out.ttft_s:
                out.ttft_s = at
            out.last_s = at
        usage = _usage_of(chunk)
        if usage:
            usage_seen = True
            _read_usage(out, usage)
        if chunk.get("type") in FINAL_EVENTS:
            out.e2e_s = at
            break
    if out.ttft_s != out.ttft_s:
        return Outcome(False, error="stream ended without a token")
    if out.e2e_s != out.e2e_s:  # cut short: no usage to judge it by, not an answer
        return Outcome(False, error="stream ended before its last event")
    if not usage_seen:  # no prompt or output length to judge it by: not an answer
        return Outcome(False, error="stream ended without its usage chunk")
    return out


async def _answer(resp: aiohttp.ClientResponse, out: Outcome, t0: float) -> Outcome:
    """A request that did not stream: its whole answer, E2E at its end (no TTFT: nothing
    comes before the whole answer) and the usage in it."""
    raw = await resp.read()
    out.e2e_s = time.perf_counter() - t0
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        return Outcome(False, error=f"malformed answer: {raw[:200]!r}")
    if "error" in answer and answer.get("error"):
        return Outcome(False, error=str(answer["error"])[:200])
    usage = _usage_of(answer)
    if not usage:  # no prompt or output length to judge it by: not an answer
        return Outcome(False, error="answer without its usage")
    _read_usage(out, usage)
    return out


async def replay(
    router_url: str,
    requests: list[TraceRequest],
    speedup: float,
    on_done: Callable[[int], None] | None = None,
    spread: Sequence[str] = (),
    in_flight: dict[str, int] | None = None,
) -> list[Outcome]:
    """Send open-loop requests at their (scaled) arrival times and closed-loop turns
    ``delay`` after the request they follow (``after``) finished; wait for all of them.

    ``spread``: several routers (pods) instead of ``router_url``, as a load balancer spreads
    requests: request ``i`` goes to ``spread[i % n]``; one that refuses the connection is
    taken out and the request goes to the next (it never reached a router: nothing is
    resent that a router had seen). ``in_flight`` (if given) counts the requests each base
    URL has outstanding, as they go."""
    urls = list(spread) or [router_url]
    down: set[str] = set()
    timeout = aiohttp.ClientTimeout(total=300)
    outcomes: list[Outcome | None] = [None] * len(requests)
    done = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()

        async def send(i: int) -> None:
            """Request ``i`` at its time, then the closed-loop turns that follow it."""
            nonlocal done
            req = requests[i]
            if req.after is None:
                wait = req.arrival_s / speedup - (time.perf_counter() - start)
            else:
                wait = (req.delay_s or 0.0) / speedup
            if wait > 0:
                await asyncio.sleep(wait)
            outcome = Outcome(False, error="no router left")
            for k in range(len(urls)):
                url = urls[(i + k) % len(urls)]
                if url in down and len(down) < len(urls):
                    continue
                if in_flight is not None:
                    in_flight[url] = in_flight.get(url, 0) + 1
                try:
                    outcome = await _one(session, url + req.path, req)
                finally:
                    if in_flight is not None:
                        in_flight[url] -= 1
                if len(urls) == 1 or not outcome.error.startswith(CONNECT_FAILED):
                    break
                down.add(url)
            outcomes[i] = outcome
            done += 1
            if on_done:
                on_done(done)
            await asyncio.gather(*(send(j) for j in followers[i]))

        followers: list[list[int]] = [[] for _ in requests]
        for i, req in enumerate(requests):
            if req.after is not None:
                followers[req.after].append(i)
        await asyncio.gather(*(send(i) for i, r in enumerate(requests) if r.after is None))
    return [o if o is not None else Outcome(False, error="not sent") for o in outcomes]


PROBE_TOKENS = 64


async def probe_ttft(router_url: str, model: str, count: int = 5) -> list[float]:
    """TTFT of ``count`` one-block, one-token requests sent one after another to an idle
    fleet: the engine's work for each is one short step, so what is left is the HTTP path's
    (client, router, engine and back). Prompts are fresh random token ids (never in a trace
    built by the simulator's rule, so nothing is hit); failures are left out."""
    rng = np.random.default_rng()
    timeout = aiohttp.ClientTimeout(total=30)
    url = router_url + "/v1/completions"
    out: list[float] = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for _ in range(count):
            body = {
                "model": model,
                "prompt": rng.integers(1 << 31, 1 << 32, PROBE_TOKENS).tolist(),
                "max_tokens": 1,
                "stream": True,
                "stream_options": {"include_usage": True},  # as every replayed request
            }
            req = TraceRequest(0.0, PROBE_TOKENS, 1, json.dumps(body).encode())
            outcome = await _one(session, url, req)
            if outcome.ok:
                out.append(outcome.ttft_s)
    return out


ENGINE_TTFT = "vllm:time_to_first_token_seconds"
MODEL_TTFT = "kvrouter_mock_model_ttft_seconds"


@dataclass(slots=True, frozen=True)
class EngineTtft:
    """The replicas' TTFT totals at one moment: ``seconds`` over ``requests`` from their own
    histograms, and ``model_seconds``, the same requests' TTFT in the mock's engine model
    (``None`` where a replica is not a ``kvrouter mock-replica``). The difference of two
    readings covers the requests finished in between."""

    seconds: float
    requests: int
    model_seconds: float | None

    def since(self, earlier: EngineTtft) -> EngineTtft:
        model = None
        if self.model_seconds is not None and earlier.model_seconds is not None:
            model = self.model_seconds - earlier.model_seconds
        return EngineTtft(self.seconds - earlier.seconds, self.requests - earlier.requests, model)


async def engine_ttft_totals(replica_urls: Sequence[str]) -> EngineTtft | None:
    """The replicas' own TTFT histograms summed, from each one's ``/metrics`` (vLLM's
    ``vllm:time_to_first_token_seconds``, which the mock keeps too); ``None`` if a replica
    does not answer or has no such histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    total, count, model = 0.0, 0, 0.0
    every_model = True
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for url in replica_urls:
            try:
                async with session.get(url + "/metrics") as resp:
                    page = await resp.text() if resp.status == 200 else ""
            except (aiohttp.ClientError, TimeoutError):
                return None
            values = {
                sample.name: sample.value
                for family in text_string_to_metric_families(page)
                if family.name in (ENGINE_TTFT, MODEL_TTFT)
                for sample in family.samples
            }
            if ENGINE_TTFT + "_sum" not in values:
                return None
            total += values[ENGINE_TTFT + "_sum"]
            count += int(values.get(ENGINE_TTFT + "_count", 0))
            if MODEL_TTFT + "_total" in values:
                model += values[MODEL_TTFT + "_total"]
            else:
                every_model = False
    return EngineTtft(total, count, model if every_model else None)


class ProgressBar:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, total: int, label: str) -> None:
        self.total = total
        self.label = label
        self.enabled = sys.stderr.isatty()

    def __call__(self, done: int) -> None:
        if not self.enabled:
            return
        width = 30
        filled = int(width * done / max(self.total, 1))
        sys.stderr.write(
            f"\r{self.label:<14} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}"
        )
        if done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()
