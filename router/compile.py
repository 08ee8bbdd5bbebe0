"""``python -m router.compile``: compile ``router/core`` with mypyc, in place (``make compile``).

Each module of the pure routing core gets a C extension beside its source, which Python
imports instead of the ``.py`` (extension modules come first on the import path), plus one
shared library of the group, ``router/core__mypyc*.so``. ``python -m router.compile --clean``
(``make uncompile``) removes them. The source stays the only copy of the logic: the simulator
and the service run the same code either way, compiled or not (``router.core.COMPILED``).

Measured: +36 % proxy requests a second per core, the routing step 20 -> 13 us
(docs/bench-service.md, "what compiling router/core buys"). Needs a C compiler and the
Python headers; mypyc comes with mypy (the test extras).
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "router" / "core"


def compiled() -> bool:
    """Whether ``router.core`` imports compiled (the figure benchmarks print beside theirs)."""
    import importlib.util

    spec = importlib.util.find_spec("router.core.routing")
    return spec is not None and spec.origin is not None and not spec.origin.endswith(".py")


def built() -> list[Path]:
    """The extension files a compile left in the tree."""
    return sorted([*CORE.glob("*.so"), *(ROOT / "router").glob("core__mypyc*.so")])


def clean() -> int:
    for path in built():
        path.unlink()
    return 0


def compile_core() -> int:
    from mypyc.build import mypycify
    from setuptools import setup

    os.chdir(ROOT)
    paths = sorted(p for p in glob.glob("router/core/*.py") if not p.endswith("__init__.py"))
    setup(
        name="kvrouter-core",
        ext_modules=mypycify(paths, group_name="router.core", opt_level="3"),
        script_args=["build_ext", "--inplace", "--build-temp", "build/mypyc"],
    )
    return 0


if __name__ == "__main__":
    sys.exit(clean() if "--clean" in sys.argv[1:] else compile_core())
