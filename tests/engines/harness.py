"""A data-parallel rank of an engine, as far as KV events go: the engine's own
``ZmqEventPublisher`` (its publisher thread, PUB socket, replay ROUTER and buffer) fed with
the engine's own event classes. Only the wire can be made lossy (``drop_next``), like a
subscriber that misses messages, to exercise replay."""

from __future__ import annotations

import atexit
import random
import socket
import time
from typing import Any

from tests.engines import load


def free_port_run(count: int) -> int:
    """A tcp port p with p .. p + count - 1 free on loopback now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        socks = []
        try:
            for i in range(count):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no run of free ports")


class _LossyWire:
    """Stands in for the publisher's PUB socket: drops the next ``drop`` sends."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.drop = 0

    def send_multipart(self, frames: Any, *args: Any, **kwargs: Any) -> Any:
        if self.drop > 0:
            self.drop -= 1
            return None
        return self.sock.send_multipart(frames, *args, **kwargs)

    def close(self, *args: Any, **kwargs: Any) -> Any:
        return self.sock.close(*args, **kwargs)


class RefEngine:
    """One rank of ``engine`` ("vllm-0.33.0", ...) publishing on ``tcp://*:port`` (+ rank,
    as the engine offsets it itself) with replay on ``replay_port`` (+ rank)."""

    def __init__(
        self,
        engine: str,
        port: int,
        replay_port: int | None,
        *,
        dp_rank: int = 0,
        block_size: int = 16,
        topic: str = "",
        seed: int = 0,
        buffer_steps: int = 10_000,
    ) -> None:
        self.engine = engine
        self.mod = load(engine)
        self.block_size = block_size
        self.dp_rank = dp_rank
        self.rng = random.Random(seed)
        self.pub = self.mod.ZmqEventPublisher(
            dp_rank,
            endpoint=f"tcp://*:{port}",
            replay_endpoint=None if replay_port is None else f"tcp://*:{replay_port}",
            buffer_steps=buffer_steps,
            topic=topic,
        )
        self.wire = _LossyWire(self.pub._pub)
        self.pub._pub = self.wire
        self.published = 0

    @property
    def is_sglang(self) -> bool:
        return self.engine.startswith("sglang")

    def prompt(self, n_blocks: int) -> list[int]:
        return [self.rng.randrange(1, 30_000) for _ in range(n_blocks * self.block_size)]

    def block_hash(
        self, tokens: list[int], i: int, salt: str | None = None, lora: str | None = None
    ) -> int:
        """The engine's hash of block ``i`` (a stand-in: any int64 determined by the prefix,
        the salt and the LoRA adapter)."""
        key = (salt, tuple(tokens[: (i + 1) * self.block_size]))
        return hash(key if lora is None else (lora, *key)) & (2**63 - 1)

    def stored(
        self,
        tokens: list[int],
        first: int = 0,
        last: int | None = None,
        *,
        salt: str | None = None,
        extra_keys: list[Any] | None = None,
        lora_name: str | None = None,
        group: dict[str, Any] | None = None,
    ) -> Any:
        """A ``BlockStored`` of blocks [first, last) of ``tokens``, in the engine's own class.
        ``salt``: SGLang's ``cache_salt`` field, or for vLLM the salt as block 0's extra key;
        ``lora_name``: the adapter's name, for vLLM also leading every block's extra keys (as
        vLLM 0.34's ``to_event_extra_keys`` publishes it);
        ``group``: vLLM's group fields (``group_idx``, ``kv_cache_spec_kind``, ...)."""
        be = self.block_size
        last = len(tokens) // be if last is None else last
        hashes = [self.block_hash(tokens, i, salt, lora_name) for i in range(first, last)]
        parent = self.block_hash(tokens, first - 1, salt, lora_name) if first else None
        fields: dict[str, Any] = {
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens[first * be : last * be],
            "block_size": be,
            "lora_id": None,
            "medium": "GPU",
        }
        if self.is_sglang:
            if salt is not None:
                fields["cache_salt"] = salt
            if lora_name is not None:
                fields["lora_name"] = lora_name
        else:
            fields["lora_name"] = lora_name
            keys = extra_keys
            if lora_name is not None:
                given = keys if keys is not None else [None] * len(hashes)
                keys = [(lora_name, *(k or ())) for k in given]
            if salt is not None and first == 0:
                keys = list(keys) if keys is not None else [None] * len(hashes)
                head = tuple(keys[0] or ())
                keys[0] = (*head, salt)
            fields["extra_keys"] = keys
            fields.update(group or {})
        return self.mod.BlockStored(**fields)

    def removed(
        self,
        tokens: list[int],
        first: int,
        last: int,
        salt: str | None = None,
        group_idx: int | None = None,
    ) -> Any:
        hashes = [self.block_hash(tokens, i, salt) for i in range(first, last)]
        if group_idx is not None:
            return self.mod.BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=group_idx)
        return self.mod.BlockRemoved(block_hashes=hashes, medium="GPU")

    def publish(self, *events: Any) -> None:
        self.pub.publish(self.mod.KVEventBatch(ts=time.time(), events=list(events)))
        self.published += 1

    def wait_sent(self, timeout: float = 5.0) -> None:
        """Until the publisher thread has sent (or dropped) everything published."""
        deadline = time.monotonic() + timeout
        while len(self.pub._buffer) < min(self.published, self.pub._buffer.maxlen or 1 << 30):
            if time.monotonic() > deadline:
                raise AssertionError("engine publisher did not send in time")
            time.sleep(0.005)

    def close(self) -> None:
        self.pub.shutdown()
        # SGLang also registers shutdown with atexit: a second call at exit waits a second
        atexit.unregister(self.pub.shutdown)
