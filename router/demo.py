"""``kvrouter demo``: the main job on an embedded default, no external services.

Until the full demo (mock replicas + live router) exists, it runs the most end-to-end
piece available: the prefix index benchmark on a small anchor workload.
"""

from __future__ import annotations

import argparse

from router.cli import main as cli_main


def run(args: argparse.Namespace) -> int:
    return cli_main(
        [
            "bench",
            "index",
            "--replicas",
            "16",
            "--blocks",
            "2000",
            "--shared",
            "500",
            "--query",
            "1000",
            "--reps",
            "50",
        ]
    )


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="run the main job on an embedded default")
    p.set_defaults(handler=run)
