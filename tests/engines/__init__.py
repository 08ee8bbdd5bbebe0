"""The engines' own KV-event code, loaded without torch or the rest of the engine.

The ``*_kv_events.py`` / ``*_kv_cache_utils.py`` / ``*_mm_hasher.py`` files beside this one
are unmodified copies of modules from the released wheels (Apache-2.0, see README.md for the
wheels and their sha256). ``load(name)`` executes one of them as a module of its own, with
small stand-ins registered for the imports it makes into the rest of its package (logging,
config dataclasses, network helpers, torch type checks): only the module's own code runs,
which is the part that publishes events, serves replay, derives extra keys and hashes media.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import socket
import sys
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
ENGINES = {
    "vllm-0.25.1": "vllm_0_25_1_kv_events.py",
    "vllm-0.33.0": "vllm_0_33_0_kv_events.py",
    "sglang-0.5.21": "sglang_0_5_21_kv_events.py",
    "sglang-0.5.23": "sglang_0_5_23_kv_events.py",
}
# replay replies carry the topic since vLLM 0.26 / SGLang 0.5.22
TOPIC_IN_REPLAY = {"vllm-0.25.1": False, "vllm-0.33.0": True}
TOPIC_IN_REPLAY |= {"sglang-0.5.21": False, "sglang-0.5.23": True}


class _Anything(types.ModuleType):
    """A stand-in module whose every attribute is a fresh placeholder class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {})
        setattr(self, name, value)
        return value


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = sys.modules.get(name)
    if mod is None:
        mod = _Anything(name)
        mod.__path__ = []  # a package, so submodules resolve
        sys.modules[name] = mod
    for key, value in attrs.items():
        setattr(mod, key, value)
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(_module(parent), child, mod)
    return mod


@dataclasses.dataclass
class _VllmKVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


class _NetworkAddress:
    """sglang.srt.utils.network.NetworkAddress, as far as the publisher uses it."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    @classmethod
    def parse(cls, text: str) -> _NetworkAddress:
        host, _, port = text.rpartition(":")
        return cls(host.strip("[]"), int(port))

    def to_tcp(self) -> str:
        return f"tcp://{self.host}:{self.port}"


def _stubs() -> None:
    _module("vllm.logger", init_logger=logging.getLogger)
    _module("vllm.config.kv_events", KVEventsConfig=_VllmKVEventsConfig)
    _module(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
        is_valid_ipv6_address=lambda ip: ":" in ip,
        split_zmq_path=lambda path: tuple(path.replace("//", "").split(":")),
    )
    # kv_events imports only this alias from kv_cache_utils
    _module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    _module("vllm.config.multimodal", MMHasherAlgorithm=str)
    _module("vllm.multimodal.media", MediaWithBytes=MediaWithBytes)
    _module("vllm.utils.hashing", xxhash=None, xxhash_cbor=None)
    _module("vllm.envs")
    _module("vllm.config")
    _module("vllm.multimodal.utils", get_mm_features_in_window=None)
    _module("vllm.utils.math_utils", cdiv=lambda a, b: -(-a // b))
    _module("vllm.v1.kv_cache_interface")
    _module("vllm.v1.kv_cache_spec_registry")
    _module("vllm.v1.request")
    _module("vllm.v1.utils", tensor_data=None)
    _module("torch", Tensor=type("Tensor", (), {}), bfloat16=object())

    class _Parallel:
        pp_rank = attn_tp_rank = attn_cp_rank = 0

    _module("sglang.srt.runtime_context", get_parallel=_Parallel)
    _module("sglang.srt.utils.network", NetworkAddress=_NetworkAddress)


@dataclasses.dataclass
class MediaWithBytes:
    """vllm.multimodal.media.base.MediaWithBytes (a decoded medium and its original bytes)."""

    media: Any
    original_bytes: bytes
    io_config: dict[str, Any] | None = None


_loaded: dict[str, types.ModuleType] = {}


def load_file(filename: str) -> types.ModuleType:
    """Execute ``filename`` (beside this module) as a module of its own; cached."""
    mod = _loaded.get(filename)
    if mod is not None:
        return mod
    _stubs()
    name = f"engine_ref_{Path(filename).stem}"
    spec = importlib.util.spec_from_file_location(
        name, HERE / filename, submodule_search_locations=None
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "vllm.multimodal" if "mm_hasher" in filename else ""
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    _loaded[filename] = mod
    return mod


def load(engine: str) -> types.ModuleType:
    """The KV-event module of ``engine`` (a key of ``ENGINES``)."""
    return load_file(ENGINES[engine])


def free_tcp() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"
