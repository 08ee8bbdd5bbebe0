"""Build hook: ``KVROUTER_COMPILE=1`` builds the hot path compiled with mypyc into the wheel.

Everything else about the package is in pyproject.toml. Without the variable the wheel is
pure Python, as always. With it (a C compiler, the Python headers, and mypy + setuptools in
the build environment, hence ``--no-build-isolation``)::

    pip install mypy setuptools wheel .   # the dependencies too: mypyc type-checks against them
    KVROUTER_COMPILE=1 pip wheel --no-build-isolation --no-deps -w dist .

the wheel carries the extensions ``make compile`` builds in place (the same module list,
router/compile.py), so an image or a host gets the compiled router from ``pip install``.
"""

from __future__ import annotations

import os
import sys

from setuptools import setup

# Only a build needs the extensions: mypyc type-checks and generates C each time it is asked
# for them (half a minute), and pip asks for the metadata (egg_info / dist_info) first.
_METADATA_ONLY = {"egg_info", "dist_info", "sdist", "--name", "--version"}

ext_modules = []
if os.environ.get("KVROUTER_COMPILE") == "1" and not _METADATA_ONLY & set(sys.argv[1:]):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from router.compile import extensions

    ext_modules = extensions()

# the extensions build in parallel: each group's shared library is one C file (router/compile.py)
setup(ext_modules=ext_modules, options={"build_ext": {"parallel": os.cpu_count() or 1}})
