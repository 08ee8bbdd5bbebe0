"""Images in chat requests: where their placeholder tokens go and what the engine calls them.

vLLM keys every prefix-cache block an image's placeholder tokens overlap with the image's
multimodal hash (``mm_feature.identifier``), so the router must know, for each OpenAI
``image_url`` part: (1) its hash, computed as vLLM 0.33 computes it, (2) how many placeholder
tokens the model's processor expands it to and (3) where they start in the prompt.

1. ``vllm_image_hash``: ``MultiModalHasher.hash_kwargs(model_id=..., image=...)`` of vLLM
   0.33 over the image's original bytes (an image part with a ``uuid`` is named by it
   instead, as vLLM 0.34 names it: ``image_uuids``) (the base64-decoded ``data:`` URL), with the
   ``io_config`` vLLM adds when loading changes the image (a mode other than RGB, or
   transparency): blake3 by default (``--mm-hasher-algorithm`` sha256 / sha512 too). Exact.
   ``model_id`` is the engine's ``--model`` (its ``model_config.model``), not the served name.
2. ``ImageSettings.count``: ``fixed:N`` (e.g. LLaVA-1.5: 576), or ``qwen2_vl`` (Qwen2-VL /
   Qwen2.5-VL: the processor's ``smart_resize`` to multiples of 28 within
   ``min_pixels``..``max_pixels``, one token per 28x28). Exact for those processors with the
   configured pixel bounds (take them from the model's ``preprocessor_config.json``); other
   processors are not modelled: configure ``fixed:N`` only where it holds.
3. Placement follows the template's content format (router.tokenize.content_format). In
   the "string" format a message whose content has image parts becomes its texts joined
   with newlines, with a placeholder in front for each image the text does not already
   hold one for (vLLM's ``get_full_multimodal_text_prompt``: a client may place its images
   by writing the placeholder itself); with ``interleave`` (vLLM's
   ``--interleave-mm-strings``) each image's placeholder goes where its part is, between
   the texts. The chat template renders that; in the "openai" format (Qwen2-VL's own
   template, say) each image part reaches the template as ``{"type": "image"}`` where it
   is, and the template writes its placeholder
   (``placeholder`` is then unused). Every ``token`` in the result is expanded to the
   image's count.

An image the router cannot hash (an ``http(s)`` URL it does not fetch, a request's own
``mm_processor_kwargs`` or image ``media_io_kwargs``: ``own_image_kwargs``) makes the
prompt's blocks from that image on unknown: the request is routed on the blocks before it
(``first_unknown``). A ``data:`` URL that is not base64, over :data:`MAX_IMAGE_BYTES`, not an
image, or whose header declares more pixels than Pillow opens (a decompression bomb) is a
bad request (400), as the engine's loader refuses it too.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from router.core.errors import BadRequest
from router.core.hashing import MmItem
from router.tokenize.content_format import medium, part_text
from router.tokenize.request_fields import truncated

MAX_IMAGE_BYTES = 32 * 2**20
_IMAGE_PART_TYPES = ("image_url", "input_image", "image")


@dataclass(slots=True, frozen=True)
class ImageSettings:
    """How one model's engine turns an image into placeholder tokens (module docstring)."""

    # inserted per image into string content, e.g. "<|vision_start|><|image_pad|><|vision_end|>"
    placeholder: str
    token: str  # the placeholder token the processor repeats, e.g. "<|image_pad|>"
    tokens: str = "qwen2_vl"  # "qwen2_vl" or "fixed:N"
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    model_id: str | None = None  # the engine's --model; None: the routed model name
    hash_algorithm: str = "blake3"
    # vLLM's --interleave-mm-strings: string content places each image where its part is
    interleave: bool = False

    def __post_init__(self) -> None:
        if not self.placeholder or not self.token or self.token not in self.placeholder:
            raise ValueError("image placeholder must contain the image token")
        if self.hash_algorithm not in ("blake3", "sha256", "sha512"):
            raise ValueError("image hash_algorithm: blake3, sha256 or sha512")
        if self.tokens != "qwen2_vl" and not _fixed(self.tokens):
            raise ValueError("image tokens: 'qwen2_vl' or 'fixed:N' with N >= 1")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError("image min_pixels / max_pixels: 0 < min <= max")

    def count(self, width: int, height: int) -> int:
        """Placeholder tokens of an image of ``width`` x ``height`` pixels."""
        fixed = _fixed(self.tokens)
        if fixed:
            return fixed
        h, w = qwen2_vl_resize(height, width, 28, self.min_pixels, self.max_pixels)
        return (h // 28) * (w // 28)


def _fixed(spec: str) -> int:
    if spec.startswith("fixed:") and spec[6:].isdigit() and int(spec[6:]) > 0:
        return int(spec[6:])
    return 0


def qwen2_vl_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """``smart_resize`` of the Qwen2-VL image processor (transformers 5.22.2, the newest
    release vLLM 0.34 takes)."""
    if max(height, width) / max(1, min(height, width)) > 200:
        raise BadRequest("image aspect ratio above 200 is refused by the model's processor")
    # (a side rounding to no patch is caught by the min_pixels branch, as in transformers)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# ---------------------------------------------------------------------- request parts


def image_url(part: Mapping[str, Any]) -> str | None:
    """The URL of an image content part (OpenAI ``image_url``, Responses ``input_image``),
    None for other parts."""
    kind = part.get("type")
    if kind not in _IMAGE_PART_TYPES:
        return None
    raw = part.get("image_url", part.get("image"))
    if isinstance(raw, Mapping):
        raw = raw.get("url")
    if not isinstance(raw, str):
        raise BadRequest(f"an {kind} content part needs an image URL string")
    return raw


def _modelled_image(part: Mapping[str, Any]) -> bool:
    """An image part the router can place and hash: typed, with an URL (a ``uuid`` names
    it, :func:`image_uuids`, but its size is the image's)."""
    if part.get("type") not in _IMAGE_PART_TYPES:
        return False
    raw = part.get("image_url", part.get("image"))
    return isinstance(raw.get("url") if isinstance(raw, Mapping) else raw, str)


def first_unmodelled(messages: Sequence[Mapping[str, Any]]) -> int | None:
    """The index of the first message with a medium the router does not model (audio,
    video, embeddings, an image given by uuid alone or without ``type``): its token count
    is the engine's processor's, so nothing from there on can be hashed."""
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list) and any(
            medium(p) is not None and not (isinstance(p, Mapping) and _modelled_image(p))
            for p in content
        ):
            return i
    return None


def has_images(messages: Sequence[Mapping[str, Any]]) -> bool:
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and part.get("type") in _IMAGE_PART_TYPES:
                    return True
    return False


def image_urls(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The image URLs of ``messages`` in prompt order (the "openai" content format, where
    the template places each image where its part is)."""
    urls: list[str] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and (url := image_url(part)) is not None:
                    urls.append(url)
    return urls


def image_uuids(messages: Sequence[Mapping[str, Any]]) -> list[str | None]:
    """The ``uuid`` of each image part of ``messages`` (as a string, as vLLM takes it; None
    where there is none), in the order of :func:`image_urls`. vLLM 0.34 names an image sent
    with a uuid by the uuid instead of its content's hash, unless the request has hash
    factors of its own (``ProcessorInputs.get_mm_hashes``; :func:`own_image_kwargs`)."""
    out: list[str | None] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and image_url(part) is not None:
                    uuid = part.get("uuid")
                    out.append(None if uuid is None else str(uuid))
    return out


def marked_images(messages: Sequence[Mapping[str, Any]], marker: str) -> list[Mapping[str, Any]]:
    """``messages`` with every image part a text part holding ``marker`` (the "openai"
    content format, to find where the first image starts when its tokens are not known)."""
    out: list[Mapping[str, Any]] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(
            isinstance(p, Mapping) and p.get("type") in _IMAGE_PART_TYPES for p in content
        ):
            parts = [
                {"type": "text", "text": marker}
                if isinstance(p, Mapping) and p.get("type") in _IMAGE_PART_TYPES
                else p
                for p in content
            ]
            m = {**m, "content": parts}
        out.append(m)
    return out


def with_placeholders(
    messages: Sequence[Mapping[str, Any]], placeholder: str, *, interleave: bool = False
) -> tuple[list[Mapping[str, Any]], list[str]]:
    """Messages with image parts turned into string content as vLLM renders them
    (:func:`string_content`), and the image URLs in prompt order."""
    out: list[Mapping[str, Any]] = []
    urls: list[str] = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        texts: list[str] = []
        images = 0
        for part in content:
            if isinstance(part, str):
                if part:
                    texts.append(part)
            elif isinstance(part, Mapping):
                url = image_url(part)
                if url is not None:
                    urls.append(url)
                    images += 1
                    if interleave:
                        texts.append(_INTERLEAVED)
                elif text := part_text(part):  # empty parts are left out, as vLLM does
                    texts.append(text)
        if not images:
            out.append(m)
            continue
        out.append({**m, "content": string_content(texts, images, placeholder, interleave)})
    return out, urls


# vLLM's stand-in for an image part among a message's texts when it interleaves them
# (``MODALITY_PLACEHOLDERS_MAP["image"]``)
_INTERLEAVED = "<##IMAGE##>"


def string_content(texts: list[str], images: int, placeholder: str, interleave: bool) -> str:
    """One message's string content: its ``texts`` (non-empty, in order; with
    ``interleave`` :data:`_INTERLEAVED` where each of its ``images`` is) joined with
    newlines, and a ``placeholder`` in front for each image the text does not hold one for:
    vLLM 0.34's ``get_full_multimodal_text_prompt``. A text holding more placeholders than
    the message has images is refused by vLLM; it is rendered as it is here."""
    if interleave:
        slots = images
        texts = list(texts)
        for i, text in enumerate(texts):
            if text == _INTERLEAVED and slots:
                texts[i] = placeholder
                slots -= 1
    text_prompt = "\n".join(texts)
    missing = [placeholder] * max(0, images - text_prompt.count(placeholder))
    return "\n".join([*missing, text_prompt] if text_prompt else missing)


def own_image_kwargs(body: Mapping[str, Any]) -> bool:
    """Whether a request brings its own image processing: ``mm_processor_kwargs`` (they may
    change an image's token count) or ``media_io_kwargs`` for images (vLLM 0.34 mixes them
    into the image's hash, ``ProcessorInputs.get_mm_hashes``, and loads it with them). vLLM
    takes either only with ``--trust-request-mm-kwargs``; the router does not model them."""
    media_io = body.get("media_io_kwargs")
    return bool(body.get("mm_processor_kwargs")) or (
        isinstance(media_io, Mapping) and bool(media_io.get("image"))
    )


def data_url_bytes(url: str) -> bytes | None:
    """The bytes of a base64 ``data:`` URL; None for other URLs (not fetched by the router).
    Raises BadRequest for a malformed data URL."""
    if not url.startswith("data:"):
        return None
    head, sep, body = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise BadRequest("image data URLs must be base64 ('data:<type>;base64,<data>')")
    if len(body) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise BadRequest(f"image larger than {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("image data URL is not valid base64") from None


# ---------------------------------------------------------------------- vLLM's hash


@dataclass(slots=True, frozen=True)
class ImageFacts:
    """What the router needs of one image: its size as the processor sees it (EXIF
    orientation applied) and whether loading it to RGB changes it (vLLM's ``io_config``)."""

    width: int
    height: int
    converted: bool


def image_facts(data: bytes) -> ImageFacts:
    """Read the image header (Pillow; no pixel decoding). Raises BadRequest when it is not
    an image, or when its header declares more pixels than Pillow opens (twice
    ``Image.MAX_IMAGE_PIXELS``: a decompression bomb, which the engine's image loader, Pillow
    too, refuses as well)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            try:
                orientation = img.getexif().get(0x0112)
            except Exception:  # malformed EXIF: vLLM ignores it too
                orientation = None
            if orientation in (5, 6, 7, 8):
                width, height = height, width
            converted = img.mode != "RGB" or "transparency" in img.info
    except Image.DecompressionBombError:
        raise BadRequest(
            f"image content part declares more than {2 * (Image.MAX_IMAGE_PIXELS or 0)} "
            "pixels (a decompression bomb to the image loader)"
        ) from None
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError):
        raise BadRequest("image content part is not a readable image") from None
    return ImageFacts(width, height, converted)


_TAG_NONE, _TAG_SEQUENCE, _TAG_MAPPING, _TAG_LEAF = b"\x00", b"\x01", b"\x02", b"\x03"


def _framed(chunk: bytes) -> Iterator[bytes]:
    yield len(chunk).to_bytes(8, "little")
    yield chunk


def _value(obj: object) -> Iterator[bytes]:
    """vLLM 0.33 ``MultiModalHasher.iter_value_to_bytes`` for the values used here."""
    if obj is None:
        yield _TAG_NONE
    elif isinstance(obj, (list, tuple)):
        yield _TAG_SEQUENCE
        yield len(obj).to_bytes(8, "little")
        for elem in obj:
            yield from _value(elem)
    elif isinstance(obj, dict):
        yield _TAG_MAPPING
        yield len(obj).to_bytes(8, "little")
        for k, v in obj.items():
            yield from _framed(str(k).encode("utf-8"))
            yield from _value(v)
    else:
        yield _TAG_LEAF
        if isinstance(obj, bytes):
            yield from _framed(obj)
        elif isinstance(obj, str):
            yield from _framed(obj.encode("utf-8"))
        elif isinstance(obj, int):
            yield from _framed(obj.to_bytes(8, "little", signed=True))  # np.array(int) bytes
        else:
            raise TypeError(f"no vLLM serialisation for {type(obj).__name__}")


def _item(key: str, obj: object) -> Iterator[bytes]:
    yield from _framed(key.encode("utf-8"))
    yield from _value(obj)


class _Hasher(Protocol):
    """hashlib's and blake3's hashers alike."""

    def update(self, data: bytes, /) -> object: ...

    def hexdigest(self) -> str: ...


def vllm_image_hash(data: bytes, converted: bool, model_id: str, algorithm: str = "blake3") -> str:
    """vLLM 0.33's multimodal hash of an image loaded from ``data`` (module docstring)."""
    if converted:
        io_config = {"image_mode": "RGB", "rgba_background_color": (255, 255, 255)}
        image: object = {"io_config": io_config, "data": data}
    else:
        image = data
    if algorithm == "blake3":
        from blake3 import blake3

        hasher: _Hasher = blake3()
    else:
        hasher = hashlib.new(algorithm)
    # hash_kwargs(model_id=..., image=item): keys sorted; the item (MediaWithBytes) is a
    # leaf whose serialisation is iter_item_to_bytes("image", original bytes or dict)
    for chunk in _framed(b"image"):
        hasher.update(chunk)
    hasher.update(_TAG_LEAF)
    for chunk in _item("image", image):
        hasher.update(chunk)
    for chunk in _item("model_id", model_id):
        hasher.update(chunk)
    return str(hasher.hexdigest())


# ---------------------------------------------------------------------- expansion


@dataclass(slots=True, frozen=True)
class ExpandedImages:
    """A rendered prompt's ids with each image token expanded to the image's count:
    ``items`` start where each image's placeholders do, ``lengths`` their counts;
    ``known_until``: tokens from there on are not known exactly (an URL not fetched, or
    image tokens the template placed otherwise than the images), None when all are."""

    tokens: npt.NDArray[Any]
    items: list[MmItem]
    lengths: list[int]
    known_until: int | None


def expand_images(
    tokens: npt.NDArray[Any],
    token_id: int,
    urls: Sequence[str],
    uuids: Sequence[str | None],
    settings: ImageSettings,
    model_id: str,
) -> ExpandedImages:
    """Expand each ``token_id`` of ``tokens`` (one per image, in prompt order) to its
    image's placeholder tokens as the engine's processor does, naming it as vLLM 0.34 does
    (the part's uuid, else :func:`vllm_image_hash` under ``model_id``)."""
    at = np.flatnonzero(tokens == token_id)
    pieces: list[npt.NDArray[Any]] = []
    items: list[MmItem] = []
    lengths: list[int] = []
    known_until: int | None = None
    prev = length = 0
    for k, pos in enumerate(at):
        pieces.append(tokens[prev:pos])
        length += int(pos) - prev
        prev = int(pos) + 1
        data = data_url_bytes(urls[k]) if k < len(urls) and known_until is None else None
        if data is None:  # an URL not fetched, or more image tokens than images
            known_until = length if known_until is None else known_until
            pieces.append(tokens[pos : pos + 1])
            length += 1
            continue
        facts = image_facts(data)
        count = settings.count(facts.width, facts.height)
        ident = uuids[k] if k < len(uuids) else None
        if ident is None:
            ident = vllm_image_hash(data, facts.converted, model_id, settings.hash_algorithm)
        items.append(MmItem(length, ident))
        lengths.append(count)
        pieces.append(np.full(count, token_id, dtype=tokens.dtype))
        length += count
    pieces.append(tokens[prev:])
    expanded = np.concatenate(pieces) if len(pieces) > 1 else tokens
    if len(at) != len(urls) and known_until is None:
        known_until = int(at[0]) if len(at) else 0  # the template placed them otherwise
    return ExpandedImages(expanded, items, lengths, known_until)


def cut_expanded(
    tokens: npt.NDArray[Any],
    items: list[MmItem],
    lengths: Sequence[int],
    keep: int,
    body: Mapping[str, Any],
) -> tuple[npt.NDArray[Any], list[MmItem]]:
    """An image prompt's expanded ids cut to ``keep`` as vLLM 0.34 cuts them
    (``BaseRenderer._truncate_expanded_prompt``: the ids were cut before the expansion, then
    are again after it, :func:`truncated`'s side) and its items moved with them. An image
    the cut would split or drop is refused, as vLLM refuses it."""
    cut = truncated(tokens, keep, body)  # (its side checked)
    start = len(tokens) - keep if body.get("truncation_side") in (None, "left") else 0
    for item, n in zip(items, lengths, strict=True):
        if item.start < start or item.start + n > start + keep:
            raise BadRequest(
                f"truncate_prompt_tokens={body.get('truncate_prompt_tokens')} would split or "
                f"drop an image, which spans tokens {item.start} to {item.start + n} of the "
                f"{len(tokens)}-token prompt"
            )
    moved = [MmItem(item.start - start, item.identifier) for item in items]
    return cut, moved
