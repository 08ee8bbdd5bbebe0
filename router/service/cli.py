"""``kvrouter serve``: run the router (its own HTTP server on uvloop, router.service.app).

Configuration: ``--config FILE`` (TOML or YAML) or ``$KVROUTER_CONFIG``, then ``KVROUTER_*``
environment variables, then these flags. ``--workers N`` starts N processes sharing the port
(``server.listener``: each binds it with SO_REUSEPORT, or all accept from one socket the
parent binds); each has its own index and load view (see docs/service.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import socket
    from collections.abc import Callable

    from aiohttp import web

    from router.service.settings import Settings


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    from router.service.config_env import parse_replica_list

    server: dict[str, Any] = {}
    for flag, key in (
        ("host", "host"),
        ("port", "port"),
        ("workers", "workers"),
        ("admin_token", "admin_token"),
        ("max_body_mb", "max_body_mb"),
        ("log_level", "log_level"),
        ("grpc_port", "grpc_port"),
        ("record", "record_path"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            server[key] = value
    if args.debug_header:
        server["debug_header"] = True
    if getattr(args, "http_engine", None):
        server["http_engine"] = args.http_engine
    out: dict[str, Any] = {"server": server} if server else {}
    if args.replica:
        out["replicas"] = parse_replica_list(args.replica)
    return out


def settings_from_args(args: argparse.Namespace) -> Settings:
    """What ``serve`` runs with: the file, the tuned policy file, the environment, then the
    flags (``--policy`` names every model's policy, discovered replicas' models included)."""
    from router.core.errors import ConfigError
    from router.service.config import load_settings

    if args.config is not None and not args.config.strip():
        raise ConfigError("--config: empty; give a file or leave the flag out")
    return load_settings(
        args.config, overrides=_overrides(args), policy_file=args.policy_file, policy=args.policy
    )


def serve(args: argparse.Namespace) -> int:

    from router.core.errors import ConfigError
    from router.startup import building

    try:
        with building():  # the collector off while this imports and builds (router/startup.py)
            from router.service.app import create_app

            settings = settings_from_args(args)
            if args.check:  # what start-up would refuse too: tokenizer files, limits, tokens
                create_app(settings)
                print(
                    f"configuration OK: {len(settings.replicas)} replica(s), "
                    f"{len({*settings.models, *(r.model for r in settings.replicas)})} model(s)"
                )
                return 0
            logging.basicConfig(
                level=settings.server.log_level.upper(),
                format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
            )
            from router.service.security import install_log_redaction, server_secrets

            install_log_redaction(server_secrets(settings.server))
            from router.compile import STALE_HINT, stale

            if outdated := stale():
                logging.getLogger("kvrouter.service").warning(
                    "compiled modules older than their sources (the edits do not run): %s; %s",
                    ", ".join(outdated),
                    STALE_HINT,
                )
            workers = settings.server.workers
            # workers > 1: each builds its own app, after the fork (the parent supervises)
            app = None if workers > 1 else create_app(settings)
        if app is None:
            return _serve_workers(settings, workers)
    except ConfigError as exc:
        # printed before log redaction is installed: a URL's password, say, masked here
        from router.service.security import redact

        print(f"kvrouter serve: configuration error: {redact(str(exc))}", file=sys.stderr)
        return 2
    _run(app, settings.server.host, settings.server.port, reuse_port=False)
    return 0


def _run(
    app: web.Application,
    host: str,
    port: int,
    *,
    reuse_port: bool,
    sock: socket.socket | None = None,
    on_started: Callable[[], None] | None = None,
    cut_signal: int | None = None,
) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency; fall back quietly
        pass
    import gc

    gc.freeze()  # start-up objects (vocabularies, templates) never need collecting
    from router.service.app import run
    from router.service.keys import SETTINGS

    # SIGTERM: stop accepting, let in-flight requests finish up to this deadline, exit 0
    run(
        app,
        host,
        port,
        reuse_port=reuse_port,
        sock=sock,
        shutdown_timeout=float(app[SETTINGS].server.shutdown_timeout_s),
        on_started=on_started,
        cut_signal=cut_signal,
    )


def _serve_workers(settings: Settings, workers: int) -> int:
    """Fork ``workers`` processes that each run the app on the same port (SO_REUSEPORT, or
    ``server.listener = "shared"``: all accept from one socket bound here, before the fork),
    replace the ones that die and stop them all on SIGTERM / SIGINT
    (router.service.supervisor: the control directory, the exit status)."""
    import traceback

    from router.cli import failure_code
    from router.service.app import create_app
    from router.service.control import join_workers
    from router.service.supervisor import (
        check_port_free,
        heartbeat,
        heartbeat_interval,
        shared_socket,
        supervise,
    )
    from router.service.workers import Workers
    from router.startup import building
    from router.tokenize.tokenizers import pool_threads_for, set_pool_threads

    parent = os.getpid()
    hang_s = float(settings.server.worker_hang_s)
    host, port = settings.server.host, settings.server.port
    # OSError (the port taken): kvrouter serve: error: ..., status 2
    shared = shared_socket(host, port) if settings.server.listener == "shared" else None
    if shared is None:
        check_port_free(host, port, "server.port")
    if (grpc_port := settings.server.grpc_port) is not None:  # (the workers' SO_REUSEPORT)
        check_port_free(settings.server.grpc_host or host, grpc_port, "server.grpc_port")

    def work(group: Workers, index: int, ready: int, replacing: bool) -> None:
        code = 1
        try:
            # each worker's share of the CPUs: encoding threads beyond it would only
            # hold more tiktoken copies (one vocabulary each) for cores others use
            with building():
                set_pool_threads(pool_threads_for(workers))
                app = create_app(settings)
                join_workers(app, group, index, parent, replacing=replacing)

            def listening() -> None:
                os.write(ready, b"1")
                if hang_s > 0:  # the parent watches: beat from this event loop
                    heartbeat(asyncio.get_running_loop(), ready, heartbeat_interval(hang_s))
                else:
                    os.close(ready)

            _run(
                app,
                host,
                port,
                reuse_port=shared is None,
                sock=shared,
                on_started=listening,
                cut_signal=signal.SIGQUIT,  # (the parent's, on a second stop signal)
            )
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except BaseException as exc:  # as main() would say it: os._exit skips that
            failed = failure_code("serve", exc)
            if failed is None:
                traceback.print_exc()
            code = 1 if failed is None else failed
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    return supervise(workers, port, work, hang_s, listening=shared)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the router in front of model replicas")
    p.add_argument("--config", help="TOML or YAML settings file (default: $KVROUTER_CONFIG)")
    p.add_argument("--policy-file", help="simulator-tuned policy TOML merged into [models]")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--workers", type=int, help="processes sharing the port (server.listener)")
    p.add_argument(
        "--replica", action="append", metavar="MODEL=URL", help="add a replica (repeatable)"
    )
    p.add_argument("--policy", help="policy for every configured model (overrides the file)")
    p.add_argument("--admin-token", dest="admin_token")
    p.add_argument("--record", help="append every request to this rotating JSONL trace")
    p.add_argument(
        "--grpc-port", dest="grpc_port", type=int, help="serve the gRPC API on this port too"
    )
    p.add_argument("--max-body-mb", dest="max_body_mb", type=float)
    p.add_argument("--debug-header", action="store_true", help="add X-KVRouter-Decision")
    p.add_argument(
        "--http-engine",
        dest="http_engine",
        choices=("aiohttp", "fast"),
        help="obsolete (server.http_engine): the router has one HTTP server",
    )
    p.add_argument("--log-level", dest="log_level")
    p.add_argument("--check", action="store_true", help="validate the configuration and exit")
    p.set_defaults(handler=serve)
