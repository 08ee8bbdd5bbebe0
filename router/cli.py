"""The ``kvrouter`` command. Each subcommand lives in its own module, which exposes
``register(subparsers)``; heavy imports happen inside the handlers, so ``kvrouter --help``
stays fast. This is the only place that dispatches into ``sim`` from ``router``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from router.core.errors import KVRouterError
from router.sigterm import stopped_by_sigterm

# (module, attribute) pairs that add subcommands; a missing module is skipped so that
# optional parts can be absent from a slim install.
_SUBCOMMANDS: tuple[str, ...] = (
    "router.bench.cli",
    "router.service.cli",
    "router.publisher.cli",
    "router.mock.cli",
    "router.trace_merge",
    "sim.cli",
    "router.demo",
)


# The command each module adds: a command line naming one imports only its module (the
# benchmarks' registration alone costs about a second of imports, paid by every `serve`,
# `mock-replica` and `publish` process otherwise).
_MODULE_OF: dict[str, str] = {
    "bench": "router.bench.cli",
    "serve": "router.service.cli",
    "publish": "router.publisher.cli",
    "signing-key": "router.publisher.cli",
    "mock-replica": "router.mock.cli",
    "trace": "router.trace_merge",
    "sim": "sim.cli",
    "demo": "router.demo",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or (``command`` one of ``_MODULE_OF``) only that command's."""
    parser = argparse.ArgumentParser(
        prog="kvrouter", description="KV-cache-aware request router for LLM inference fleets"
    )
    parser.add_argument("--version", action="version", version="kvrouter 0.1.0")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    only = _MODULE_OF.get(command or "")
    for module_name in _SUBCOMMANDS if only is None else (only,):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.register(sub)
    return parser


# The commands that start processes of their own (replicas, routers, vllm-router, Redis):
# each stops them in a ``finally`` (see router.sigterm).
_SPAWNING = frozenset({"bench", "demo"})
# ``serve`` until its event loop takes SIGTERM over for the graceful drain, and ``publish``
# until its own does (with ``--zmq auto`` it waits for its engine to come up): as PID 1 of a
# container (the image's entrypoint) the kernel drops a signal left to its default action,
# so a pod deleted while it starts would run on until its grace period's SIGKILL.
_SIGTERM_RAISES = _SPAWNING | {"serve", "publish"}


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_in[0] if args_in else None)
    args = parser.parse_args(args_in)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        with stopped_by_sigterm(args.command in _SIGTERM_RAISES):
            return int(handler(args) or 0)
    except BaseException as exc:
        code = failure_code(args.command, exc)
        if code is None:
            raise
        return code


def failure_code(command: str, exc: BaseException) -> int | None:
    """The exit status of ``kvrouter COMMAND`` stopped by ``exc``, its one-line message
    printed; None when ``exc`` must keep its traceback (a bug, or ``KVROUTER_DEBUG=1``).
    Also used by the worker processes of ``serve --workers N``, whose exceptions never
    reach :func:`main`."""
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, BrokenPipeError):
        return 0
    if isinstance(exc, KVRouterError | ValueError | OSError):
        # Bad settings, arguments or files: one clear line, no traceback (KVROUTER_DEBUG=1
        # shows it). Anything else is a bug and keeps its traceback.
        if os.environ.get("KVROUTER_DEBUG"):
            return None
        print(f"kvrouter {command}: error: {exc}", file=sys.stderr)
        return 2
    return None


if __name__ == "__main__":
    sys.exit(main())
