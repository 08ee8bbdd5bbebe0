"""``python -m sim ...`` is ``kvrouter sim ...`` (handy when only the simulator is wanted)."""

from __future__ import annotations

import argparse
import sys

from sim.cli import register


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    register(sub)
    args = parser.parse_args(["sim", *(sys.argv[1:] if argv is None else argv)])
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
