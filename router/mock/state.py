"""What one mock replica holds while it runs, and the settings it is built from.

:class:`MockSettings` configures a replica (``create_app`` in router/mock/server.py takes it,
and that module is where callers import both from); :class:`MockState`, the app's value
under :data:`STATE`, holds its engine driver, event encoder and publisher, tokenizer,
stored responses and the :class:`MockCounters` its ``/metrics`` and ``/load`` answer from.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router.mock import responses as resp
from router.mock.driver import EngineDriver
from router.mock.images import DEFAULT_IMAGE_TOKENS
from router.mock.kv_events import EngineEventEncoder
from router.mock.latency import RequestLatency
from router.mock.tokenizer import MockTokenizer

if TYPE_CHECKING:  # (ZMQ loads only in a replica that publishes: router/mock/server.py)
    from router.events.zmq_pub import KVEventPublisher


VLLM_VERSION = "0.34.0"  # the release whose HTTP surface the mock serves


@dataclass(slots=True, frozen=True)
class MockSettings:
    """``profile``: a ``sim/profiles`` name or TOML path. ``engine_block_size`` must divide
    or be a multiple of ``block_size`` (the router's). ``zmq_endpoint`` empty: no events."""

    model: str = "mock-model"
    replica: str = "mock-0"
    profile: str = "dense-70b"
    block_size: int = 64
    engine_block_size: int = 16
    kv_blocks: int | None = None
    cpu_blocks: int | None = None
    zmq_endpoint: str = ""
    replay_endpoint: str = ""
    encoding: str = "vllm"
    topic: str = ""
    tokenizer_dir: str | None = None
    bpe_file: str | None = None
    # placeholder tokens an image part expands to: fixed:N or qwen2_vl (router/mock/images.py)
    image_tokens: str = DEFAULT_IMAGE_TOKENS
    # with tokenizer_dir: the router's [models.NAME.images] placeholder / token (both, or
    # no images served)
    image_placeholder: str = ""
    image_token: str = ""
    default_max_tokens: int = 16
    max_logprobs: int = 20  # vLLM's --max-logprobs: more logprobs asked are refused
    # the context length (/v1/models, /tokenize): longer prompts, or more output, are refused
    max_model_len: int = 1_048_576
    max_body_mb: float = 1024.0  # vLLM has no body cap; aiohttp's default is 1 MiB
    time_scale: float = 1.0  # wall seconds per modelled second (router.mock.driver)
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy: fcfs or priority
    rack: str = ""  # where it runs: times the KV pulls of disaggregated requests
    region: str = ""
    fault: str = "none"  # router/mock/faults.py: how the completion endpoints misbehave
    fault_rate: float = 1.0
    fault_retry_after_s: int = 1
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class MockCounters:
    requests: int = 0
    prompt_tokens: int = 0
    # prompt tokens of requests that looked the prefix cache up (vLLM counts no other)
    queried_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    rejected: int = 0
    bad_requests: int = 0
    kv_event_batches: int = 0
    prefill_legs: int = 0  # disaggregated requests prefilled here for another replica
    decode_legs: int = 0  # disaggregated requests decoded here (KV pulled from elsewhere)
    pulled_bytes: float = 0.0
    # decode legs refused before reaching the engine: vLLM frees the prefill replica's
    # blocks for them at once (router/mock/pd.py ``refuses_stream_with_beam_search``)
    released_transfers: int = 0
    # the engine model's own TTFT summed over finished requests (model time in wall seconds):
    # against vllm:time_to_first_token_seconds, the mock's lag behind its model
    model_ttft_s: float = 0.0
    in_flight: int = 0  # requests on the generating routes not yet answered (vLLM's /load)


def system_fingerprint(settings: MockSettings) -> str:
    """The ``system_fingerprint`` of the replica's OpenAI answers as vLLM's default
    (``--fingerprint-mode full``) writes it: ``vllm-<version>-<hash8>``, the hash of the
    configuration the engine computes with (vLLM's ``hash_config``; here the model, profile,
    block and context sizes), the same for every answer of one configuration."""
    engine = (settings.model, settings.profile, settings.engine_block_size)
    digest = hashlib.sha256(repr((*engine, settings.max_model_len)).encode()).hexdigest()
    return f"vllm-{VLLM_VERSION}-{digest[:8]}"


@dataclass(slots=True)
class MockState:
    settings: MockSettings
    driver: EngineDriver
    encoder: EngineEventEncoder
    tokenizer: MockTokenizer
    publisher: KVEventPublisher | None
    counters: MockCounters = field(default_factory=MockCounters)
    latency: RequestLatency = field(default_factory=RequestLatency)
    ids: Any = field(default_factory=lambda: itertools.count(1))
    responses: resp.ResponseStore = field(default_factory=resp.ResponseStore)
    fingerprint: str = field(init=False)  # the OpenAI answers' system_fingerprint

    def __post_init__(self) -> None:
        self.fingerprint = system_fingerprint(self.settings)


STATE = web.AppKey("mock_state", MockState)
