"""``kvrouter demo``: the main job on an embedded default, no external services.

Until the live demo (mock replicas behind the router) lands, the demo replays the bundled
Mooncake trace through the simulator for the main policies side by side: the same policy
code the router runs, against 8 modelled replicas.
"""

from __future__ import annotations

import argparse

from router.cli import main as cli_main


def run(args: argparse.Namespace) -> int:
    return cli_main(
        [
            "sim", "replay", "mooncake", "--replicas", "8", "--block-size", "64",
            "--kv-blocks", "16384", "--speedup", str(args.speedup),
            "--policy", "round_robin,least_loaded,dynamo,llmd,ours",
        ]
    )  # fmt: skip


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="run the main job on an embedded default")
    p.add_argument("--speedup", type=float, default=2.0, help="arrival speed-up of the trace")
    p.set_defaults(handler=run)
