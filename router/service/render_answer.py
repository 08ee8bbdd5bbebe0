"""What vLLM's render endpoints say, read: the token ids and multimodal features of a
``/v1/chat/completions/render`` or ``/v1/completions/render`` answer, and the kinds of
non-200 answers (router/service/render.py acts on them).

A chat (or Anthropic messages) answer is one object (vLLM's ``GenerateRequest``:
``token_ids``, ``features`` with ``mm_hashes`` and ``mm_placeholders`` per modality,
parallel lists, or null), a completion answer a list of them, one per prompt of a batch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from router import jsonload
from router.core.hashing import MmItem, as_u32_array


class RenderFailed(Exception):
    """No usable answer from a render target. ``rest``: the target itself is failing (no
    answer, a 5xx, no render route): others should not ask it for a while."""

    def __init__(self, message: str, *, rest: bool) -> None:
        super().__init__(message)
        self.rest = rest


Rendered = list[tuple[np.ndarray, list[MmItem]]]


def parse_rendered(kind: str, payload: Any) -> Rendered:
    """The prompts of a render answer (module docstring); raises RenderFailed for anything
    else."""
    entries = payload if kind == "completion" else [payload]
    if not isinstance(entries, list) or not entries:
        raise RenderFailed("malformed answer: not a list of prompts", rest=False)
    out = []
    for entry in entries:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("token_ids"), list):
            raise RenderFailed("malformed answer: a prompt without token_ids", rest=False)
        try:
            ids = as_u32_array(entry["token_ids"])
        except ValueError as exc:
            raise RenderFailed(f"malformed answer: token_ids {exc}", rest=False) from None
        out.append((ids, _mm_items(entry.get("features"))))
    return out


def decode_answer(kind: str, raw: bytes) -> Rendered:
    """:func:`parse_rendered` of a render answer's body."""
    try:
        payload = jsonload.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise RenderFailed("malformed answer: not JSON", rest=False) from None
    except RecursionError:
        raise RenderFailed("malformed answer: nested too deeply", rest=False) from None
    return parse_rendered(kind, payload)


def _mm_items(features: Any) -> list[MmItem]:
    """Multimodal items of ``features``, by placeholder offset."""
    if features is None:
        return []
    if not isinstance(features, Mapping):
        raise RenderFailed("malformed answer: features is not an object", rest=False)
    hashes, places = features.get("mm_hashes") or {}, features.get("mm_placeholders") or {}
    if not isinstance(hashes, Mapping) or not isinstance(places, Mapping):
        raise RenderFailed("malformed answer: mm_hashes / mm_placeholders", rest=False)
    items = []
    for modality, idents in hashes.items():
        ranges = places.get(modality)
        if (
            not isinstance(idents, list)
            or not isinstance(ranges, list)
            or len(idents) != len(ranges)
        ):
            raise RenderFailed(f"malformed answer: {modality} hashes / placeholders", rest=False)
        for ident, where in zip(idents, ranges, strict=True):
            offset = where.get("offset") if isinstance(where, Mapping) else None
            if not _text(ident) or type(offset) is not int or offset < 0:
                raise RenderFailed(f"malformed answer: a {modality} item", rest=False)
            items.append(MmItem(offset, ident))
    return sorted(items, key=lambda item: item.start)


def _text(value: Any) -> bool:
    """A string that is text (hashed as UTF-8): not one with lone surrogates, which JSON's
    escapes can spell."""
    if not isinstance(value, str):
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def dumps(body: Mapping[str, Any]) -> bytes:
    """``body`` as JSON (orjson; the standard library for what it refuses, such as integers
    beyond 64 bits, which a parsed body may hold)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body).encode()


def error_body(raw: bytes) -> Mapping[str, Any]:
    """An error answer's JSON object ({} when it is none, or nested past what the parser
    follows)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    return body if isinstance(body, Mapping) else {}


def error_message(status: int, raw: bytes) -> str:
    """The message of an engine's error body (OpenAI-style, FastAPI ``detail``, or text)."""
    body = error_body(raw)
    error = body.get("error")
    for found in (
        error.get("message") if isinstance(error, Mapping) else error,
        body.get("message"),
        body.get("detail"),
    ):
        if isinstance(found, str) and found:
            return found
    text = raw[:500].decode("utf-8", "replace").strip()
    return text or f"HTTP {status}"


def is_unknown_model(raw: bytes) -> bool:
    """A 404 of vLLM's model check (``NotFoundError``, ``param: "model"``: the target serves
    the model under another name), not of a missing route (``{"detail": "Not Found"}``)."""
    error = error_body(raw).get("error")
    return isinstance(error, Mapping) and (
        error.get("param") == "model" or error.get("type") == "NotFoundError"
    )


def renderable(kind: str, body: Mapping[str, Any]) -> bool:
    """Whether the render endpoints take ``body`` as the replica will: they refuse beam
    search, a completion of ``prompt_embeds`` has no token ids to render, and
    ``/v1/responses/render`` is stateless (no ``previous_response_id``)."""
    if body.get("use_beam_search"):
        return False
    if kind == "responses" and body.get("previous_response_id") is not None:
        return False
    return not (kind == "completion" and body.get("prompt_embeds") is not None)
