"""An engine-side KV-event publisher in vLLM's wire format (used by the mock replica and tests).

PUB socket: multipart ``[topic, seq (8-byte big-endian), payload]``. ROUTER replay socket:
a request ``[client, b"", start_seq (8 bytes BE)]`` is answered with
``[client, b"", topic, seq, payload]`` for every buffered batch with ``seq >= start_seq``, then
``[client, b"", b"", -1 (8 bytes BE, signed), b""]``, as ``vllm.distributed.kv_events`` does
since vLLM 0.26 (SGLang 0.5.22). ``replay_topic=False`` answers in the older layout without
the topic frame (vLLM <= 0.25, SGLang <= 0.5.21).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

import zmq
import zmq.asyncio

from router.events.encode import Encoding, encode_batch
from router.events.model import EngineBatch, EngineEvent

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """Publishes batches; ``drop_next`` makes the next N batches skip the PUB socket (they
    stay in the replay buffer), ``drop_replay`` names seqs the next replay answer leaves
    out (as an engine's ROUTER drops replies past its high-water mark, mid-burst), and
    ``trim_after_replay`` makes the buffer forget its oldest N batches after the next
    answer (as a busy engine's buffer moves on), to exercise subscribers' gap recovery."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        encoding: Encoding = "vllm",
        buffer_steps: int = 10_000,
        replay_topic: bool = True,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.ctx = context or zmq.asyncio.Context.instance()
        self.topic = topic.encode()
        self.encoding: Encoding = encoding
        self.replay_topic = replay_topic
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        try:
            self.pub.bind(endpoint)
            self.endpoint = str(self.pub.getsockopt_string(zmq.LAST_ENDPOINT))
            if replay_endpoint:
                self.replay = self.ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.bind(replay_endpoint)
                self.replay_endpoint = str(self.replay.getsockopt_string(zmq.LAST_ENDPOINT))
        except zmq.ZMQError:
            self.pub.close(0)
            if self.replay is not None:
                self.replay.close(0)
            raise
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = -1
        self.drop_next = 0
        self.drop_replay: set[int] = set()
        self.trim_after_replay = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.replay is not None and self._task is None:
            self._task = asyncio.create_task(self._serve_replay(), name="kv-event-replay")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)

    async def publish(
        self, events: list[EngineEvent] | tuple[EngineEvent, ...], dp_rank: int | None = None
    ) -> int:
        """Encode and send one batch; returns its seq."""
        payload = encode_batch(EngineBatch(time.time(), tuple(events), dp_rank), self.encoding)
        return await self.publish_raw(payload)

    async def publish_raw(self, payload: bytes) -> int:
        self.seq += 1
        seq = self.seq
        self.buffer.append((seq, payload))
        if self.drop_next > 0:
            self.drop_next -= 1
            return seq
        await self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        return seq

    async def _serve_replay(self) -> None:
        assert self.replay is not None
        while True:
            frames = await self.replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            topic = (self.topic,) if self.replay_topic else ()
            head: tuple[bytes, ...] = (client, b"", *topic)
            end: tuple[bytes, ...] = (client, b"", b"") if self.replay_topic else (client, b"")
            dropped, self.drop_replay = self.drop_replay, set()
            for seq, payload in list(self.buffer):
                if seq >= start and seq not in dropped:
                    await self.replay.send_multipart((*head, seq.to_bytes(8, "big"), payload))
            await self.replay.send_multipart((*end, END_SEQ, b""))
            for _ in range(min(self.trim_after_replay, len(self.buffer))):
                self.buffer.popleft()
            self.trim_after_replay = 0
