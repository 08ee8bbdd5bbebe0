"""``kvrouter mock-replica``: run one mock replica (HTTP + ZMQ KV events)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from router.cliargs import at_least, fraction, port

if TYPE_CHECKING:
    from aiohttp import web


def run(args: argparse.Namespace) -> int:
    from router.startup import building

    with building():  # the collector off while this imports and builds (router/startup.py)
        built = _build(args)
    if isinstance(built, int):
        return built
    from aiohttp import web

    # the KV-event sockets, bound at start-up (ZMQ loads only in a replica that publishes)
    unbound: tuple[type[Exception], ...] = ()
    if args.zmq or args.replay:
        import zmq

        unbound = (zmq.ZMQError,)
    # a client that goes away cancels its request (as engines abort it), so a SIGTERM does
    # not wait on streams nobody reads
    try:
        web.run_app(built, host=args.host, port=args.port, print=None, handler_cancellation=True)
    except unbound as exc:
        given = f"--zmq {args.zmq}" + (f" / --replay {args.replay}" if args.replay else "")
        print(f"kvrouter mock-replica: cannot bind {given}: {exc}", file=sys.stderr)
        return 2
    return 0


def _build(args: argparse.Namespace) -> web.Application | int:
    """The mock replica's application, or the exit status of a refused setting."""
    from router.core.errors import ConfigError
    from router.mock.server import MockSettings, create_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    settings = MockSettings(
        model=args.model,
        replica=args.replica,
        profile=args.profile,
        block_size=args.block_size,
        engine_block_size=args.engine_block_size,
        kv_blocks=args.kv_blocks,
        cpu_blocks=args.cpu_blocks,
        zmq_endpoint=args.zmq,
        replay_endpoint=args.replay,
        encoding=args.encoding,
        topic=args.topic,
        tokenizer_dir=args.tokenizer,
        bpe_file=args.bpe_file,
        image_tokens=args.image_tokens,
        image_placeholder=args.image_placeholder,
        image_token=args.image_token,
        default_max_tokens=args.default_max_tokens,
        max_logprobs=args.max_logprobs,
        time_scale=args.time_scale,
        scheduling_policy=args.scheduling_policy,
        rack=args.rack,
        region=args.region,
        fault=args.fault,
        fault_rate=args.fault_rate,
        fault_retry_after_s=args.fault_retry_after,
    )
    try:
        return create_app(settings)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"kvrouter mock-replica: {exc}", file=sys.stderr)
        return 2


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("mock-replica", help="run a mock replica (OpenAI API + vLLM KV events)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8001)
    p.add_argument("--model", default="mock-model")
    p.add_argument("--replica", default="mock-0")
    p.add_argument("--profile", default="dense-70b", help="sim profile name or TOML path")
    p.add_argument(
        "--block-size", type=at_least(1), default=64, help="router (canonical) block size"
    )
    p.add_argument("--engine-block-size", type=at_least(1), default=16, help="block size in events")
    p.add_argument("--kv-blocks", type=at_least(1), default=None, help="override GPU KV capacity")
    p.add_argument(
        "--cpu-blocks", type=at_least(0), default=None, help="override host-tier capacity (0: none)"
    )
    p.add_argument("--zmq", default="", help="bind KV-event PUB here, e.g. tcp://*:5557")
    p.add_argument("--replay", default="", help="bind the replay ROUTER here, e.g. tcp://*:5558")
    p.add_argument(
        "--encoding",
        choices=("vllm", "array", "map"),
        default="vllm",
        help="KV event layout: current vLLM (default), vLLM < 0.24 (array) or maps",
    )
    p.add_argument("--topic", default="")
    p.add_argument("--tokenizer", default=None, help="HF-style tokenizer dir (router's config)")
    p.add_argument("--bpe-file", default=None, help="tiktoken BPE file for --tokenizer")
    p.add_argument(
        "--image-tokens",
        default="fixed:40",
        help="placeholder tokens per image part: fixed:N or qwen2_vl (from the image's size; "
        "the router's [models.NAME.images] tokens)",
    )
    p.add_argument(
        "--image-placeholder",
        default="",
        help="with --tokenizer: the text put per image (the router's [models.NAME.images] "
        "placeholder); without it and --image-token chats with images are refused",
    )
    p.add_argument(
        "--image-token", default="", help="with --tokenizer: the placeholder token repeated"
    )
    p.add_argument(
        "--default-max-tokens",
        type=at_least(1),
        default=16,
        help="output tokens of a request that names no limit",
    )
    p.add_argument(
        "--max-logprobs",
        type=at_least(0),
        default=20,
        help="vLLM's: requests asking more (sample or prompt) logprobs are refused",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="vLLM's: priority orders the queue by each request's 'priority' (lower first)",
    )
    p.add_argument("--rack", default="", help="its rack: times KV pulls of disaggregated requests")
    p.add_argument("--region", default="", help="its region (likewise)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per modelled second: 1 keeps the profile's timing, 0.05 runs it 20x "
        "faster (tests that do not measure the modelled durations)",
    )
    p.add_argument(
        "--fault",
        default="none",
        help="how the completion endpoints misbehave (router/mock/faults.py): none, a status "
        "(429, 500, 503 ...), hang, head-only, short-body, break-stream, error-event or "
        "slow:SECONDS; changed at run time "
        "with POST /admin/fault",
    )
    p.add_argument("--fault-rate", type=fraction, default=1.0, help="share of requests faulted")
    p.add_argument(
        "--fault-retry-after", type=at_least(0), default=1, help="Retry-After of 429 / 503"
    )
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(handler=run)
