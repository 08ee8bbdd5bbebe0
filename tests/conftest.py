"""Shared fixtures.

``redis_server``: one private redis-server for the whole test session (127.0.0.1, a free
port, no persistence, started from ``redis-server`` on PATH; never the machine's shared
instance); ``redis_url`` is its URL. ``redis_cluster``: a private 3-node Redis Cluster for the
session (formed with ``redis-cli --cluster create``); its ``url`` is a ``redis+cluster://``
URL. Tests sharing either keep to their own key prefix (``key_prefix``). ``private_redis``: a
redis-server of one test alone, which it may flush, restart or kill.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from router.bench.redis_server import LocalRedis, LocalRedisCluster
from router.compile import STALE_HINT, stale

_WATCHDOG_FILE = pytest.StashKey[IO[str]]()
_WATCHDOG_DEADLINE = pytest.StashKey[float]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuse to test compiled modules older than their sources (see router.compile.stale):
    the tests would pass or fail on code that is no longer in the tree."""
    if outdated := stale():
        raise pytest.UsageError(
            f"compiled modules older than their sources: {', '.join(outdated)}; {STALE_HINT}"
        )


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection made (every imported module, test function and parametrisation: the
    bulk of a worker's objects) lives as long as the process: ``gc.freeze`` moves it out of
    the collector's generations, so the full collections the tests' own garbage triggers
    walk only that garbage (the router does the same with its start-up objects)."""
    import gc

    gc.collect()
    gc.freeze()


# A test whose cleanup hangs after pytest-timeout failed it (its SIGALRM fires once) would hang
# the run: past the timeout and this grace, faulthandler writes every thread's stack to a file
# and ends the process, which pytest-xdist reports as a crashed test and replaces.
WATCHDOG_GRACE_S = float(os.environ.get("KVROUTER_TEST_WATCHDOG_GRACE_S", "60"))
_WATCHDOG_DIR = "kvrouter-hangs"


def _watchdog_dir(config: pytest.Config) -> Path | None:
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    return None if cache is None else cache.mkdir(_WATCHDOG_DIR)


def pytest_configure(config: pytest.Config) -> None:
    if (folder := _watchdog_dir(config)) is None:
        return
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker is None:  # the controller (or a run without xdist): start from no dumps
        for old in folder.glob("*.txt"):
            old.unlink()
        worker = "main"
    config.stash[_WATCHDOG_FILE] = open(folder / f"{worker}.txt", "w")  # noqa: SIM115


def pytest_unconfigure(config: pytest.Config) -> None:
    if (dump := config.stash.get(_WATCHDOG_FILE, None)) is not None:
        dump.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    config = terminalreporter.config
    if (folder := _watchdog_dir(config)) is None or hasattr(config, "workerinput"):
        return
    for path in sorted(folder.glob("*.txt")):
        if text := path.read_text().strip():
            terminalreporter.write_sep(
                "=", f"hung past timeout + {WATCHDOG_GRACE_S:g} s: {path.name}"
            )
            terminalreporter.write_line(text)


def _arm_watchdog(item: pytest.Item) -> None:
    import faulthandler

    dump = item.config.stash[_WATCHDOG_FILE]
    dump.seek(0)
    dump.truncate()
    dump.write(f"--- {item.nodeid}\n")
    dump.flush()
    remaining = item.config.stash[_WATCHDOG_DEADLINE] - time.monotonic()
    faulthandler.dump_traceback_later(max(remaining, 1.0), exit=True, file=dump)


def _disarm_watchdog(config: pytest.Config) -> None:
    import faulthandler

    faulthandler.cancel_dump_traceback_later()
    if _WATCHDOG_DEADLINE in config.stash:
        del config.stash[_WATCHDOG_DEADLINE]
    if (dump := config.stash.get(_WATCHDOG_FILE, None)) is not None:
        dump.seek(0)
        dump.truncate()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Disarms the watchdog once the test's setup, call and teardown are all done."""
    yield
    _disarm_watchdog(item.config)


@pytest.hookimpl(trylast=True)
def pytest_exception_interact(node: pytest.Item | pytest.Collector) -> None:
    """pytest's faulthandler plugin (and pytest-timeout) cancel pending dumps when a test
    fails, before the teardown that may be the part that hangs: re-arm for what is left."""
    if isinstance(node, pytest.Item) and _WATCHDOG_DEADLINE in node.config.stash:
        _arm_watchdog(node)


@pytest.hookimpl(hookwrapper=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> Iterator[None]:
    """When pytest-timeout fails a hung test by SIGALRM it prints every thread's stack; an
    async test hangs in an await, which only the event loop's tasks show: print their stacks
    first (the report's captured stdout), then let pytest-timeout fail the test. Arms the
    watchdog (WATCHDOG_GRACE_S) too."""
    yield
    if item.config.stash.get(_WATCHDOG_FILE, None) is not None:
        deadline = time.monotonic() + float(settings.timeout) + WATCHDOG_GRACE_S
        item.config.stash[_WATCHDOG_DEADLINE] = deadline
        _arm_watchdog(item)
    import signal

    chained = signal.getsignal(signal.SIGALRM)
    if not callable(chained):
        return

    def dump_tasks_then_fail(signum: int, frame: object) -> None:
        import asyncio
        import sys

        loop = asyncio._get_running_loop()
        for task in asyncio.all_tasks(loop) if loop is not None else ():
            print(f"--- {task!r}", file=sys.stdout)
            task.print_stack(limit=12, file=sys.stdout)
        chained(signum, frame)

    signal.signal(signal.SIGALRM, dump_tasks_then_fail)


# Test modules of the tokenizer itself build every tokenizer and template afresh (below).
_OWN_BUILDS_PREFIX = "tests.test_tokenize_"
_builds_shared = True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the test's fixtures: whether its routers may share compiled templates and BPE
    cores with earlier routers of this process (``_compiled_once``)."""
    global _builds_shared
    module = getattr(item, "module", None)
    _builds_shared = not getattr(module, "__name__", "").startswith(_OWN_BUILDS_PREFIX)


def _jinja_env_key(env: Any) -> tuple[Any, ...]:
    """What a Jinja environment's compiled code depends on (lexer, parser, code generator)."""
    return (
        type(env), env.code_generator_class, env.block_start_string, env.block_end_string,
        env.variable_start_string, env.variable_end_string, env.comment_start_string,
        env.comment_end_string, env.line_statement_prefix, env.line_comment_prefix,
        env.trim_blocks, env.lstrip_blocks, env.newline_sequence, env.keep_trailing_newline,
        tuple(sorted((name, type(ext)) for name, ext in env.extensions.items())),
        env.optimized, env.finalize, env.autoescape, env.is_async,
        tuple(sorted(env.filters)), tuple(sorted(env.tests)),
    )  # fmt: skip


def _node_key(value: Any) -> Any:
    """A Jinja syntax tree as a hashable value: node types, fields and line numbers."""
    from jinja2 import nodes

    if isinstance(value, nodes.Node):
        fields = tuple(_node_key(getattr(value, f, None)) for f in value.fields)
        return (type(value), getattr(value, "lineno", None), fields)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_node_key(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _node_key(v)) for k, v in value.items()))
    return (type(value), repr(value))


@pytest.fixture(scope="session", autouse=True)
def _compiled_once() -> Iterator[None]:
    """Routers built inside the test process (a few hundred) compile the same chat templates
    and build the same tiktoken BPE cores again and again (~15 ms and ~70 ms of CPU each,
    a tenth of the suite's). Both results are immutable: a Jinja environment's compiled
    code object for the same source (or syntax tree) and settings, and tiktoken's native
    ``CoreBPE`` for the same ranks, pattern and special tokens (tiktoken itself shares one
    ``Encoding`` per name). Each router still builds its own ``Template``, ``Encoding`` and
    tokenizer around them, and a template that does not compile raises every time. The
    tokenizer's own tests (``_OWN_BUILDS_PREFIX``) build everything afresh."""
    import jinja2
    import tiktoken.core

    from router.tokenize.tokenizers import _RANKS

    compile_ = jinja2.Environment.compile
    compiled: dict[tuple[Any, ...], Any] = {}

    def compile_once(
        self: jinja2.Environment,
        source: Any,
        name: str | None = None,
        filename: str | None = None,
        raw: bool = False,
        defer_init: bool = False,
    ) -> Any:
        if not _builds_shared:
            return compile_(self, source, name, filename, raw, defer_init)
        text = source if isinstance(source, str) else _node_key(source)
        key = (_jinja_env_key(self), text, name, filename, raw, defer_init)
        if key not in compiled:
            compiled[key] = compile_(self, source, name, filename, raw, defer_init)
        return compiled[key]

    native = tiktoken.core._tiktoken
    cores: dict[tuple[Any, ...], Any] = {}

    class SharedCores:
        """``tiktoken.core``'s view of its native module: ``CoreBPE`` built once per
        BPE file (as the router parsed it), pattern and special tokens."""

        def __getattr__(self, attr: str) -> Any:
            return getattr(native, attr)

        @staticmethod
        def CoreBPE(ranks: dict[bytes, int], specials: dict[str, int], pattern: str) -> Any:
            # the ranks the router parsed from a file (shared read-only, per path, size and
            # mtime: router.tokenize.tokenizers._bpe_ranks) name that file
            files = [key for key, shared in _RANKS.items() if shared is ranks]
            if not _builds_shared or not files:
                return native.CoreBPE(ranks, specials, pattern)
            key = (files[0], pattern, tuple(sorted(specials.items())))
            if key not in cores:
                cores[key] = native.CoreBPE(ranks, specials, pattern)
            return cores[key]

    jinja2.Environment.compile = compile_once  # type: ignore[method-assign,assignment]
    tiktoken.core._tiktoken = SharedCores()  # type: ignore[assignment]
    try:
        yield
    finally:
        jinja2.Environment.compile = compile_  # type: ignore[method-assign]
        tiktoken.core._tiktoken = native


@pytest.fixture(scope="session", autouse=True)
def _one_default_client_ssl_context() -> Iterator[None]:
    """Every ``openai.AsyncOpenAI`` a test makes (one or more a test, for plain-HTTP
    servers on loopback) built a default SSL context, loading the machine's CA bundle (~40
    ms of CPU each). Clients verifying with the default trust (``verify=True``, no client
    certificate) now share the one context of their trust settings, as an application that
    reuses a context does; any other ``verify`` or ``cert`` builds its own as before."""
    import httpx2._transports.default as transports

    create = transports.create_ssl_context
    contexts: dict[tuple[Any, ...], Any] = {}

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is not True or cert is not None:
            return create(verify=verify, cert=cert, trust_env=trust_env)
        env = tuple(os.environ.get(k) for k in ("SSL_CERT_FILE", "SSL_CERT_DIR"))
        key = (trust_env, env if trust_env else None)
        if key not in contexts:
            contexts[key] = create(verify=verify, cert=cert, trust_env=trust_env)
        return contexts[key]

    transports.create_ssl_context = create_ssl_context  # type: ignore[assignment]
    try:
        yield
    finally:
        transports.create_ssl_context = create


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    """A redis-server for the whole session; its ``url`` is ``redis://127.0.0.1:<port>/0``."""
    server = LocalRedis(tmp_path_factory.mktemp("redis-session"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    cluster = LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_url(redis_server: LocalRedis) -> str:
    return redis_server.url


@pytest.fixture
def key_prefix() -> str:
    """A key prefix no other test uses, for tests that share ``redis_server``."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[LocalRedis]:
    """A redis-server of this test alone: flush it, restart it, kill it."""
    server = LocalRedis(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()
