"""vLLM's ``ModelCard``, an entry of ``GET /v1/models``: id, object, created, owned_by, root,
parent, max_model_len and permission (one ``ModelPermission``). The router answers it for
the models it lists (router/service/public.py) and the mock replica for its own
(router/mock/server.py)."""

from __future__ import annotations

import uuid
from typing import Any


def model_card(
    model: str, *, created: int, owned_by: str, max_model_len: int | None
) -> dict[str, Any]:
    """vLLM's card for ``model`` served under its own name (``root`` is the model, no
    ``parent``: no adapter). ``max_model_len`` None: not known (vLLM's field is optional)."""
    permission = {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": owned_by,
        "root": model,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [permission],
    }
