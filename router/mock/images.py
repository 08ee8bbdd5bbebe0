"""Image content parts on the mock replica, as vLLM 0.34 treats them for its prefix cache.

vLLM expands each image part of a chat to the model's placeholder tokens and keys every
block those tokens overlap with the image's multimodal hash (``mm_feature.identifier``) and
its offset in the block (``generate_block_hash_extra_keys``); its KV events carry those keys
per block (``extra_keys``: ``(identifier, offset)`` pairs), and its render endpoints answer
them as ``features`` (``mm_hashes``, ``mm_placeholders``). The mock does the same so a peer
(the router's ``render = "engine"`` models, its re-blocker) sees an image as it would on vLLM:

* an image's token count is ``ImageSettings.count`` (``fixed:N``, or ``qwen2_vl`` from the
  image's size, router/tokenize/multimodal.py); its identifier the part's ``uuid`` when it has
  one (vLLM 0.34 ``image_uuids``), else vLLM's multimodal hash of the ``data:`` URL's image
  (``vllm_image_hash`` under the mock's ``--model``: what the router computes too). An
  ``http(s)`` URL is not fetched: with a ``fixed:N`` count it is named by a blake3 hash of
  the URL (the router never hashes such an image: it routes on the blocks before it); with
  ``qwen2_vl`` its size is unknown and the request is refused (400).
* a request's own ``mm_processor_kwargs`` / image ``media_io_kwargs`` (vLLM takes them only
  with ``--trust-request-mm-kwargs``) are not modelled: the image is counted and named as
  without them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from router.core.errors import BadRequest
from router.core.hashing import MmItem
from router.tokenize.multimodal import (
    ImageSettings,
    data_url_bytes,
    image_facts,
    vllm_image_hash,
)

# the byte tokenizer's stand-in image placeholder (its own template: no text form)
BYTE_IMAGE_TOKEN = "<|image|>"
DEFAULT_IMAGE_TOKENS = "fixed:40"


@dataclass(slots=True, frozen=True)
class ImageItem:
    """One image of a prompt: its placeholder tokens ``[start, start + length)``, named by
    ``identifier`` (vLLM's ``mm_feature``: ``mm_position`` and ``identifier``)."""

    start: int
    length: int
    identifier: str

    @property
    def mm(self) -> MmItem:
        """The router's view (the block where it starts keys the chain)."""
        return MmItem(self.start, self.identifier)


@dataclass(slots=True, frozen=True)
class MockPrompt:
    """A prompt's token ids and its images in prompt order."""

    tokens: list[int]
    images: tuple[ImageItem, ...] = ()


def byte_settings(tokens: str = DEFAULT_IMAGE_TOKENS) -> ImageSettings:
    """The byte tokenizer's image settings: ``tokens`` (``fixed:N`` or ``qwen2_vl``)."""
    return ImageSettings(BYTE_IMAGE_TOKEN, BYTE_IMAGE_TOKEN, tokens)


def image_of(
    part: Mapping[str, Any], url: str, settings: ImageSettings, model: str
) -> tuple[int, str]:
    """(placeholder tokens, identifier) of one image part whose URL is ``url``."""
    uuid = part.get("uuid")
    data = data_url_bytes(url)
    if data is None:
        fixed = settings.count(1, 1) if settings.tokens.startswith("fixed:") else 0
        if not fixed:
            raise BadRequest("the mock replica fetches no image URLs: send a data: URL")
        from blake3 import blake3

        return fixed, str(uuid) if uuid is not None else blake3(url.encode()).hexdigest()
    facts = image_facts(data)
    count = settings.count(facts.width, facts.height)
    if uuid is not None:
        return count, str(uuid)
    model_id = settings.model_id or model
    return count, vllm_image_hash(data, facts.converted, model_id, settings.hash_algorithm)


def block_keys(images: Sequence[ImageItem], start: int, end: int) -> list[tuple[str, int]]:
    """vLLM's multimodal extra keys of the block ``[start, end)`` as its events carry them
    (``to_event_extra_keys`` of ``_gen_mm_extra_hash_keys``): ``(identifier, offset of the
    image's start from the block's)`` for every image overlapping it, in prompt order."""
    return [
        (im.identifier, im.start - start)
        for im in images
        if im.start < end and im.start + im.length > start
    ]


def features(images: Sequence[ImageItem]) -> dict[str, Any] | None:
    """The render answer's ``features`` (vLLM 0.34: None without multimodal items)."""
    if not images:
        return None
    return {
        "mm_hashes": {"image": [im.identifier for im in images]},
        "mm_placeholders": {"image": [{"offset": im.start, "length": im.length} for im in images]},
        "kwargs_data": None,
    }
