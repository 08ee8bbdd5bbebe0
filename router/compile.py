"""``python -m router.compile``: compile the hot path with mypyc, in place (``make compile``).

Compiled: every module of the pure routing core, and the service modules a proxied request
runs through (:data:`SERVICE_MODULES`). Each gets a C extension beside its source, which
Python imports instead of the ``.py`` (extension modules come first on the import path),
plus the shared libraries of the two groups, ``router/hot_core__mypyc*.so`` and
``router/hot_service__mypyc*.so``. ``python -m router.compile
--clean`` (``make uncompile``) removes them. The source stays the only copy of the logic:
the simulator and the service run the same code either way, compiled or not.

Compiled code checks annotations at run time, so what the hot modules declare about other
libraries must be true at run time too (uvloop's ``Server.sockets`` is a list where typeshed
says tuple: read untyped), and an exception class with two builtin bases cannot be compiled
(router/service/upstream_errors.py stays interpreted). CI runs the whole suite on the sources
and the tests of the compiled modules (:data:`TESTS`) on the compiled build.

What it gains: docs/benchmarks.md, "Proxy" (pure and compiled). Needs a C compiler and the
Python headers; mypyc comes with mypy (the test extras).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# the service modules on a proxied request's path (the fast engine's): server and its
# connections, handling (the front door, its body intake and request identity), request
# values, body memo, routing state, metrics, proxy (its dispatch and its answer relay) and
# upstream client
SERVICE_MODULES = (
    "answer_book",
    "answer_relay",
    "answers",
    "body_memo",
    "fast_server",
    "gate",
    "handling",
    "http_connection",
    "http_head",
    "http_sink",
    "http_types",
    "intake",
    "loop_metrics",
    "proxy",
    "request_identity",
    "state",
    "upstream",
    "wire",
)


# The tests whose subject is what this compiles: CI runs them again against the compiled
# build (``make test-compiled``) after the whole suite ran on the sources (``make test``).
# Compiled code differs from the sources only inside the compiled modules (mypyc checks types
# at run time, fixes attribute sets, ...), so these are the tests that drive those modules:
# a new test file of a compiled module, or a new compiled module's tests, belongs here.
TESTS = (
    # router/core: hashing, the index, load, policies and the routing step
    "tests/test_hashing.py",
    "tests/test_index.py",
    "tests/test_engine_hits.py",  # what engines hold and grant (router/core/engine_hits.py)
    "tests/test_eagle_lookahead.py",  # EAGLE engines with lookahead hashes drop no block
    "tests/test_policies.py",
    "tests/test_vllm_cache_aware.py",  # vllm-router's cache_aware (router/core/vllm_router.py)
    "tests/test_turnover.py",  # cache turnover and the eviction term
    "tests/test_admission.py",
    "tests/test_routing_columns.py",
    "tests/test_pd_core.py",  # prefill/decode disaggregation's decision
    # peer load in the tracker (its simulated three-router run is the source pass's)
    "tests/test_load_peer.py::test_peer_load_is_added_to_views_and_own_leaves_it_out",
    "tests/test_load_peer.py::test_a_new_report_replaces_the_last_and_bad_figures_are_clamped",
    "tests/test_load_peer.py::test_the_array_mirror_carries_peer_load_too",
    "tests/test_load_samples.py",  # every sequence of a request with n > 1 counted
    "tests/test_load_reports.py",  # engine reports that stopped coming are dropped
    "tests/test_load_accounting.py",  # own, peer, phantom and engine counts combined
    "tests/test_gc_retention.py",
    "tests/test_sim_cache.py",  # the index's bulk event ingestion
    "tests/test_sim_run.py",  # whole simulated runs through the routing core
    # the service's hot modules, in process on both HTTP engines
    "tests/test_service_api.py",
    "tests/test_service_fast.py",
    "tests/test_front_request_line.py",  # the head checks beyond llhttp (http_head)
    "tests/test_front_smuggling.py",  # request framing against smuggling
    "tests/test_service_body_memo.py",
    "tests/test_service_stream_writes.py",
    "tests/test_proxy_usage.py",
    "tests/test_proxy_faults.py",
    "tests/test_proxy_integrity.py",
    "tests/test_upstream_stale.py",  # pooled connections that close before answering
    "tests/test_service_messages.py",  # the Anthropic Messages API through the hot path
    "tests/test_service_responses.py",  # the Responses API through the hot path
    "tests/test_responses_split_id.py",  # a response id read across stream pieces
    # stored-response ids found across workers and pods (handling's and the forwarder's part)
    "tests/test_responses_shared.py",
    "tests/test_pass_through.py",  # routes passed to a replica from the front door
    "tests/test_cache_reads.py",  # prompt-logprobs requests: no cache read, end to end
    "tests/test_tokenize_anthropic.py",  # its usage reading and stream end (answer_relay)
    "tests/test_loop_metrics.py",
    "tests/test_audit_input.py",
    "tests/test_audit_metrics.py",
    "tests/test_health_probes.py",
    # ... and in a real ``kvrouter serve`` process (the fast server's start and shutdown; the
    # rest of that file is about the publisher and the Redis store, which stay interpreted)
    "tests/test_fault_lifecycle.py::test_sigterm_drains_in_flight_streams_and_exits_0",
    "tests/test_fault_lifecycle.py::test_sigterm_deadline_cuts_long_streams",
    "tests/test_serve_listen.py",
    # the build itself
    "tests/test_build_info.py",
    "tests/test_compile_stale.py",
)


def _imports_compiled(module: str) -> bool:
    import importlib.util

    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin is not None and not spec.origin.endswith(".py")


def compiled() -> bool:
    """Whether ``router.core`` imports compiled (the figure benchmarks print beside theirs)."""
    return _imports_compiled("router.core.routing")


def service_compiled() -> bool:
    """Whether the service's hot modules import compiled."""
    return _imports_compiled("router.service.proxy")


def compiled_parts() -> str:
    """What runs compiled, for ``kvrouter_build_info``: ``none``, ``core`` or ``core,service``
    (``service`` alone if only those extensions are present)."""
    parts = [name for name, on in (("core", compiled()), ("service", service_compiled())) if on]
    return ",".join(parts) or "none"


def sources() -> list[str]:
    """The modules ``make compile`` compiles, as paths relative to the repository root."""
    core_dir = ROOT / "router" / "core"
    core = sorted(
        str(p.relative_to(ROOT)) for p in core_dir.glob("*.py") if p.name != "__init__.py"
    )
    return core + [f"router/service/{name}.py" for name in SERVICE_MODULES]


def stale() -> list[str]:
    """Compiled modules older than their source: Python imports the extension, so an edit
    of such a ``.py`` after ``make compile`` would silently not run. Empty when nothing is
    compiled or every compiled source is older than the build.

    The build's time is its shared library's (``router/*__mypyc*.so``, which holds the code
    of every module and is rebuilt by each compile): a module's own extension is a small
    shim that setuptools may copy unchanged, with an older time, from an earlier build."""
    libs = list((ROOT / "router").glob("*__mypyc*.so"))
    built_at = max((lib.stat().st_mtime for lib in libs), default=float("-inf"))
    out = []
    for source in sources():
        py = ROOT / source
        compiled_here = py.exists() and any(py.parent.glob(py.stem + ".*.so"))
        if compiled_here and py.stat().st_mtime > built_at:
            out.append(source)
    return out


STALE_HINT = "run `make compile` again, or `make uncompile` to run the sources"


def built() -> list[Path]:
    """The extension files a compile left in the tree (this build's and older ones')."""
    router = ROOT / "router"
    return sorted(
        [*(router / "core").glob("*.so"), *(router / "service").glob("*.so")]
        + list(router.glob("*__mypyc*.so"))
    )


def clean() -> int:
    for path in built():
        path.unlink()
    return 0


def extensions() -> list[Any]:
    """The build's extension modules (``make compile`` and the wheel of setup.py): run from
    the repository root."""
    from mypyc.build import mypycify

    # Two shared libraries, the core's and the service's: each is one C file that a single
    # compiler process builds, so two build in parallel on two cores (setup.py, compile_hot);
    # the service calls into the core once or twice a request.
    core = [s for s in sources() if s.startswith("router/core/")]
    service = [s for s in sources() if not s.startswith("router/core/")]
    groups: list[tuple[list[str], str | None]] = [
        (core, "router.hot_core"),
        (service, "router.hot_service"),
    ]
    return list(mypycify(sources(), separate=groups, opt_level="3"))


def compile_hot() -> int:
    from setuptools import setup

    os.chdir(ROOT)
    clean()  # an older build's extensions would shadow modules this one leaves out
    setup(
        name="kvrouter-hot",
        ext_modules=extensions(),
        script_args=[
            "build_ext",
            "--inplace",
            "--build-temp",
            "build/mypyc",
            "--parallel",
            str(os.cpu_count() or 1),
        ],
    )
    return 0


def main(argv: list[str]) -> int:
    if "--clean" in argv:
        return clean()
    if "--list" in argv:  # what mypyc builds (`make lint` type-checks these with the rest)
        print(" ".join(sources()))
        return 0
    if "--tests" in argv:  # what `make test-compiled` runs
        print(" ".join(TESTS))
        return 0
    return compile_hot()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
