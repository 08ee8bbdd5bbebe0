"""``kvrouter publish``: run the publisher sidecar next to one engine.

Example (vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'``)::

    kvrouter publish --replica rack3-r2 --model kimi-k3 --url http://10.0.3.2:8000 \\
        --zmq tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558 \\
        --engine-metrics http://127.0.0.1:8000/metrics --redis redis://:pw@redis:6379/0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from aiohttp import web

    from router.events.endpoints import EndpointSpec
    from router.publisher.publisher import Publisher

# the routers' master secret, under the router's name for it (server.redis_signing_master)
SIGNING_MASTER = "KVROUTER_SERVER__REDIS_SIGNING_MASTER"
_OLD_SIGNING_MASTER = "KVROUTER_SIGNING_MASTER"  # its name before the convention was unified


async def _endpoints(args: argparse.Namespace) -> tuple[EndpointSpec, ...]:
    """The endpoints to follow: as given, or with ``--zmq auto`` asked of the engine at
    ``--url`` until it answers (router.events.discovery)."""
    from router.events.endpoints import engine_endpoints

    if args.zmq == ["auto"]:
        if args.replay or not args.url:
            raise ValueError("--zmq auto needs --url and no --replay")
        from router.events.discovery import ask

        return await ask(args.url, args.replica)
    return engine_endpoints(args.zmq or [], args.replay or [], args.dp_ranks, args.topic)


async def _serve_metrics(publisher: Publisher, port: int) -> web.AppRunner:
    from aiohttp import web
    from prometheus_client import CollectorRegistry, generate_latest

    from router.publisher.publisher import PublisherCollector

    registry = CollectorRegistry()
    registry.register(PublisherCollector(publisher))

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner


async def _main(args: argparse.Namespace) -> int:
    from router.publisher.publisher import Publisher, PublisherSettings
    from router.service.security import redact
    from router.store.base import ReplicaInfo
    from router.store.redis_store import RedisStore
    from router.store.schema import KeySchema

    info = ReplicaInfo(
        replica=args.replica,
        url=args.url,
        model=args.model,
        rack=args.rack,
        region=args.region,
        dp_ranks=tuple(args.dp_ranks),
        block_size=args.block_size,
        state_interval_blocks=args.state_interval,
        engine=args.engine,
        role=args.role,
    )
    settings = PublisherSettings(
        info=info,
        endpoints=await _endpoints(args),
        engine_metrics_url=args.engine_metrics,
        lease_ttl_s=args.lease_ttl,
        heartbeat_s=args.heartbeat,
        flush_interval_s=args.flush_interval,
        ask_sources=args.zmq == ["auto"],
        lora_base=args.lora_base,
        max_backlog_bytes=max(1, int(args.max_event_backlog_mb * 2**20)),
    )
    signing_hex = args.signing_key
    store = RedisStore.from_url(
        args.redis,
        KeySchema(args.key_prefix, args.stream_shards),
        signing_key=bytes.fromhex(signing_hex) if signing_hex is not None else None,
    )
    publisher = Publisher(settings, store)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    import zmq

    # the metrics port first: a port taken must stop the command before it registers the
    # replica (routers would keep a replica whose publisher died until its lease ran out)
    runner = None
    if args.metrics_port:
        try:
            runner = await _serve_metrics(publisher, args.metrics_port)
        except OSError as exc:
            await store.close()
            print(
                f"kvrouter publish: cannot serve --metrics-port {args.metrics_port}: {exc}",
                file=sys.stderr,
            )
            return 2
    try:
        await publisher.start()
    except zmq.ZMQError as exc:
        await publisher.stop()  # deregisters the replica it registered
        if runner is not None:
            await runner.cleanup()
        await store.close()
        print(
            f"kvrouter publish: cannot subscribe to the engine's KV events: {exc}", file=sys.stderr
        )
        return 2
    logging.getLogger("kvrouter.publish").info(
        "publishing %s (%d endpoints) to %s",
        info.replica,
        len(settings.endpoints),
        redact(args.redis),  # never log the password (one holding "@" too)
    )
    await stop.wait()
    await publisher.stop()
    if runner is not None:
        await runner.cleanup()
    await store.close()
    return 0


def check_timing(args: argparse.Namespace) -> None:
    """Raise ValueError naming a timing, port, block-size, Redis URL or --lora-base flag
    that cannot work: a heartbeat not shorter than the lease lets the lease lapse between renewals
    (routers drop the replica, it registers again, over and over); a zero or negative
    interval spins against Redis, an infinite one never flushes (or is a lease Redis
    refuses)."""
    for flag, value in (
        ("--lease-ttl", args.lease_ttl),
        ("--heartbeat", args.heartbeat),
        ("--flush-interval", args.flush_interval),
    ):
        if not (math.isfinite(value) and value > 0):  # NaN too; inf: never flushed / a
            # lease Redis cannot take
            raise ValueError(f"{flag} must be > 0 seconds and finite, got {value}")
    mb = args.max_event_backlog_mb
    if not (math.isfinite(mb) and mb > 0):
        raise ValueError(f"--max-event-backlog-mb must be > 0 and finite, got {mb}")
    if args.heartbeat >= args.lease_ttl:
        raise ValueError(
            f"--heartbeat ({args.heartbeat} s) must be shorter than --lease-ttl "
            f"({args.lease_ttl} s): the lease would lapse between renewals"
        )
    if not 0 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    if args.block_size <= 0:
        raise ValueError(f"--block-size must be positive, got {args.block_size}")
    if args.lora_base is not None and (not args.lora_base or args.lora_base == args.model):
        raise ValueError(
            f"--lora-base: names --model itself ({args.model!r}); give the base model the "
            "engine serves the adapter on (omit it for a base model)"
            if args.lora_base
            else "--lora-base: expected the base model's name"
        )
    if args.redis is not None:
        from router.core.errors import ConfigError
        from router.store.schema import check_redis_url

        try:
            check_redis_url(args.redis)
        except ConfigError as exc:
            raise ValueError(f"--redis: {exc}") from None


def check_keys(args: argparse.Namespace) -> None:
    """Raise ValueError naming a ``--signing-key``, ``--key-prefix`` or ``--stream-shards``
    the routers could not follow: a signing key that is empty (the publisher would write
    unsigned entries), not hex, or not the 32 bytes ``kvrouter signing-key`` derives (every
    entry signed with a key no router derives, all refused); a key schema Redis would
    refuse (router/store/schema.py, the routers' own rules)."""
    from router.store.schema import prefix_problem, shards_problem

    key = args.signing_key
    if key is not None:
        if not key.strip():
            raise ValueError("--signing-key: empty; give the key or leave the flag out")
        try:
            size = len(bytes.fromhex(key))
        except ValueError:
            raise ValueError("--signing-key: not hex (kvrouter signing-key prints it)") from None
        if size != 32:
            raise ValueError(
                f"--signing-key: {size} bytes, not the 32 of a key kvrouter signing-key "
                "derives; the routers would refuse every entry signed with it"
            )
    if problem := prefix_problem(args.key_prefix):
        raise ValueError(f"--key-prefix: {problem}")
    if problem := shards_problem(args.stream_shards):
        raise ValueError(f"--stream-shards: {problem}")


def validate(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Every check of the command line and its environment, before anything connects:
    ValueError naming the flag or variable."""
    from router.publisher.env import check

    check(args, environ)
    check_ranks(args)
    check_timing(args)
    check_keys(args)


def check_ranks(args: argparse.Namespace) -> None:
    """Raise ValueError for ``--dp-ranks`` given with ``--zmq auto`` (on the command line or
    in the environment): the engine names its ranks then, and they would be ignored (an
    operator giving both means one of them, and a warning in a sidecar's log is read too
    late). Else fill in the default, rank 0 (``--dp-ranks`` parses to None when not given,
    so that a given ``0`` is told from it)."""
    if args.dp_ranks is None:
        args.dp_ranks = [0]
    elif args.zmq == ["auto"]:
        ranks = " ".join(map(str, args.dp_ranks))
        raise ValueError(
            f"--dp-ranks ({ranks}) cannot be given with --zmq auto: the ranks are the ones "
            "the engine names (GET /kv_event_sources); drop --dp-ranks "
            "(or KVROUTER_PUBLISHER__DP_RANKS), or give the endpoints instead of auto"
        )


def _secrets(args: argparse.Namespace) -> list[str]:
    """The literal secrets of the command line, for the log filter: the Redis password (as
    redis-py reads it: the host follows the last "@") and the signing key."""
    from urllib.parse import urlsplit

    try:
        password = urlsplit(args.redis or "").password
    except ValueError:
        password = None
    return [s for s in (password, args.signing_key) if s]


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    from router.core.errors import ConfigError
    from router.service.security import install_log_redaction

    try:
        validate(args, os.environ)
    except ValueError as exc:
        print(f"kvrouter publish: {exc}", file=sys.stderr)
        return 2
    install_log_redaction(_secrets(args))  # (the environment's secrets read by check)
    if not args.zmq:
        print("kvrouter publish: at least one --zmq endpoint is required", file=sys.stderr)
        return 2

    try:
        return asyncio.run(_main(args))
    except (ConfigError, ValueError) as exc:
        print(f"kvrouter publish: {exc}", file=sys.stderr)
        return 2


def _derive(args: argparse.Namespace) -> int:
    from router.store.codec import MIN_MASTER_BYTES, master_secret, replica_signing_key

    master = args.master or os.environ.get(SIGNING_MASTER)
    if not master and os.environ.get(_OLD_SIGNING_MASTER):
        logging.getLogger("kvrouter").warning(
            "%s is read as %s (the router's own variable); rename it",
            _OLD_SIGNING_MASTER,
            SIGNING_MASTER,
        )
        master = os.environ[_OLD_SIGNING_MASTER]
    if not master:
        raise ValueError(f"give --master HEX or set {SIGNING_MASTER}")
    try:
        secret = master_secret(master)
    except ValueError as exc:
        flag = "--master" if args.master else SIGNING_MASTER
        raise ValueError(
            f"{flag}: not a hex secret of {MIN_MASTER_BYTES} bytes or more ({exc})"
        ) from None
    print(replica_signing_key(secret, args.replica).hex())
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser(
        "signing-key",
        help="derive a replica's change-signing key from the routers' master secret",
    )
    d.add_argument("--replica", required=True)
    d.add_argument("--master", help=f"hex master secret (or {SIGNING_MASTER})")
    d.set_defaults(handler=_derive)
    p = sub.add_parser(
        "publish",
        help="publish one engine's KV events and load to Redis",
        epilog="Every flag can also be set as KVROUTER_PUBLISHER__<FLAG> (--engine-metrics: "
        "KVROUTER_PUBLISHER__ENGINE_METRICS; lists comma-separated); flags win.",
    )
    p.add_argument(
        "--signing-key",
        help="hex key from `kvrouter signing-key`: sign change entries",
    )
    p.add_argument("--replica", required=True, help="replica id (unique in the fleet)")
    p.add_argument("--model", required=True, help="served model name (hash namespace)")
    p.add_argument(
        "--lora-base",
        default=None,
        metavar="BASE_MODEL",
        help="--model is a LoRA adapter the engine serves on BASE_MODEL: only blocks stored "
        "with the adapter are published for it (unset: learned from its first such block)",
    )
    p.add_argument("--url", default="", help="the engine's OpenAI-compatible base URL")
    p.add_argument("--rack", default="")
    p.add_argument("--region", default="")
    p.add_argument(
        "--role",
        default="both",
        choices=("prefill", "decode", "both"),
        help="the replica's role under prefill/decode disaggregation (docs/pd.md)",
    )
    p.add_argument("--engine", default="vllm", help="engine kind, for information")
    p.add_argument(
        "--zmq",
        action="append",
        help="engine KV-event PUB endpoint (repeatable); 'auto': ask the engine at --url "
        "(vLLM >= 0.34's GET /kv_event_sources: every rank's endpoints)",
    )
    p.add_argument("--replay", action="append", help="replay ROUTER endpoint per --zmq")
    p.add_argument("--topic", default="", help="ZMQ topic (vLLM default: empty)")
    p.add_argument(
        "--dp-ranks",
        type=int,
        nargs="+",
        default=None,  # rank 0; None tells "not given" (refused with --zmq auto)
        help="the engine's dp ranks (default: 0): with one --zmq, rank N publishes on its "
        "port + N (and --replay port + N), as vLLM and SGLang assign them; else one --zmq "
        "per rank (not with --zmq auto: the ranks the engine names)",
    )
    p.add_argument("--block-size", type=int, default=64, help="router (canonical) block size")
    p.add_argument(
        "--state-interval",
        type=int,
        default=0,
        help="hybrid: the engine's state checkpoint grid in router blocks (0: learned)",
    )
    p.add_argument("--engine-metrics", default=None, help="engine /metrics URL to scrape load")
    p.add_argument(
        "--redis",
        default="redis://127.0.0.1:6379/0",
        help="redis://, rediss:// or redis+cluster:// URL",
    )
    p.add_argument("--key-prefix", default="kvr")
    p.add_argument(
        "--stream-shards",
        type=int,
        default=8,
        help="change stream shards, stored in Redis when none is yet; a stored count wins",
    )
    p.add_argument("--lease-ttl", type=float, default=10.0)
    p.add_argument("--heartbeat", type=float, default=2.0)
    p.add_argument("--flush-interval", type=float, default=0.02)
    p.add_argument(
        "--max-event-backlog-mb",
        type=float,
        default=64.0,
        help="live KV event batches buffered per endpoint before they are dropped (and "
        "refilled from --replay, or counted lost)",
    )
    p.add_argument("--metrics-port", type=int, default=0, help="serve own /metrics here")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(handler=run)
    from router.publisher.env import apply

    apply(p, os.environ)  # every flag as KVROUTER_PUBLISHER__<FLAG> (router/publisher/env.py)
