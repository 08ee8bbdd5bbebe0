"""What a Pick asks for, read and checked as the HTTP endpoints read a request: its prompt
(``prompt_reader``: the model's prompt processing for token ids, text or chat messages;
``admitted_body``: a whole HTTP request body, admitted as its HTTP endpoint admits it), its
size against the HTTP limits (``prompt_bytes``, ``check_id_size``), and the replicas it may
be routed to (``candidate_keys``, ``pinned_holders``, ``whole_pools``, tried in turn by
``first_routed``). Nothing here books or routes: the Router service does
(router/rpc/router_service.py). Errors are the core's (``BadRequest``,
``NoReplicaAvailable``), which end a Pick with the status of router/rpc/calls.py
``status_of``.
"""

from __future__ import annotations

import array
from collections.abc import Callable
from typing import Any

from router.core.errors import BadRequest, NoReplicaAvailable
from router.core.types import ReplicaKey
from router.recorder import ENDPOINTS
from router.rpc.gen import router_pb2
from router.service.body_memo import Admitted
from router.service.disagg import ModelDisagg
from router.service.handling import KINDS, holder_keys
from router.service.intake import admit, json_value
from router.service.registry import Endpoint
from router.service.state import Routed, RouterState
from router.tokenize.keying import ProcessedPrompt

MAX_CANDIDATES = 4096


def check_id_size(request_id: str, max_header_kb: float) -> None:
    """BadRequest for a ``request_id`` over the HTTP header block's limit
    (``server.max_header_kb``; 0: unlimited), which bounds an HTTP ``X-Request-Id``: a
    decision keeps its id up to its TTL, so the message size (megabytes) is no bound."""
    limit = int(max_header_kb * 1024)
    size = len(request_id.encode())
    if limit and size > limit:
        raise BadRequest(
            f"request_id is {size} bytes; the limit is {limit} (server.max_header_kb, as "
            "for an HTTP request's headers)"
        )


def prompt_bytes(request: router_pb2.PickRequest) -> int:
    """The size of a Pick's prompt fields in bytes (UTF-8), as an HTTP body holding them
    would at least be (its JSON, or the text and messages it would carry); 0 for token ids
    (``server.max_prompt_tokens`` and the context length bound those)."""
    which = request.WhichOneof("prompt")
    if which == "request_json":
        return _utf8_size(request.request_json)
    if which == "text":
        return _utf8_size(request.text)
    if which == "messages_json":
        return _utf8_size(request.messages_json) + _utf8_size(request.tools_json)
    return 0


def _utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def first_routed(route: Callable[..., Routed], pools: list[list[ReplicaKey] | None]) -> Routed:
    """``route`` among the first of ``pools`` that can take the request (the last one's
    NoReplicaAvailable when none can)."""
    for pool in pools[:-1]:
        try:
            return route(replicas=pool)
        except NoReplicaAvailable:
            pass
    return route(replicas=pools[-1])


def _serves(endpoint: Endpoint | None, model: str) -> bool:
    return endpoint is not None and endpoint.model == model


def prompt_reader(
    state: RouterState, request: router_pb2.PickRequest
) -> tuple[Callable[[Any], ProcessedPrompt], Any, int]:
    """(the model's prompt processing, its argument, the prompt's size in characters:
    0 for token ids, which are processed on the loop as the HTTP endpoints do)."""
    proc = state.processor(request.model)
    which = request.WhichOneof("prompt")
    if which == "token_ids":
        if not request.token_ids.ids:
            raise BadRequest("token_ids must not be empty")
        # array('I') copies the repeated uint32 field in C; no per-id Python work.
        return proc.token_array, array.array("I", request.token_ids.ids), 0
    if which == "text":
        if not request.text:
            raise BadRequest("text must not be empty")
        return (
            proc.completion,
            {"model": request.model, "prompt": request.text},
            len(request.text),
        )
    if which == "messages_json":
        # the model named as an HTTP body names it (an engine's render endpoint reads it)
        body: dict[str, Any] = {
            "model": request.model,
            "messages": json_value(request.messages_json, "messages_json"),
        }
        if request.tools_json:
            body["tools"] = json_value(request.tools_json, "tools_json")
        return proc.chat, body, len(request.messages_json) + len(request.tools_json)
    raise BadRequest("one of token_ids, text, messages_json or request_json is required")


async def admitted_body(
    state: RouterState, request: router_pb2.PickRequest
) -> tuple[Admitted, str]:
    """A ``request_json`` body admitted as the HTTP endpoint of ``request_path`` admits
    it (router.service.intake ``admit``: one path for every front end), and that
    endpoint's kind (``chat``, ``completion``, ...: router.service.handling KINDS)."""
    path = request.request_path
    kind = _KIND_OF_PATH.get(path) if path else None
    if path and kind is None:
        raise BadRequest(f"request_path must be one of {', '.join(_KIND_OF_PATH)}")
    whole = json_value(request.request_json, "request_json")
    if not isinstance(whole, dict):
        raise BadRequest("request_json must be a JSON object")
    named = whole.get("model")
    # (null or "" names none, as the HTTP endpoints read it: intake.body_model)
    if named is not None and named != "" and named != request.model:
        raise BadRequest(f"request_json names model {named!r}, not {request.model!r}")
    if kind is None:
        kind = "chat" if "messages" in whole else "completion"
    whole["model"] = request.model
    return await admit(state, whole, len(request.request_json), kind), kind


async def pinned_holders(
    state: RouterState, request: router_pb2.PickRequest, admitted: Admitted
) -> list[ReplicaKey]:
    """The replicas holding the stored response a Responses body continues, within the
    caller's candidates (empty: nobody holds it, routed as any other request). A holder
    the candidates leave out is refused as HTTP refuses a holder that cannot take it
    (NoReplicaAvailable naming it: UNAVAILABLE with the retry trailers): a candidate
    could only answer that the response does not exist."""
    if admitted.previous_response is None:
        return []
    await state.response_share.find(admitted.previous_response)
    pinned = holder_keys(state, admitted)
    allowed = candidate_keys(state, request)
    if allowed is None or not pinned:
        return pinned
    kept = [k for k in pinned if k in allowed]
    if not kept:
        raise NoReplicaAvailable(
            f"replica {pinned[0].replica!r}, the only one holding response "
            f"{admitted.previous_response!r}, is not among the candidates: any of them "
            "could only answer that the response does not exist"
        )
    return kept


def candidate_keys(state: RouterState, request: router_pb2.PickRequest) -> list[ReplicaKey] | None:
    if not request.candidates:
        return None
    if len(request.candidates) > MAX_CANDIDATES:
        raise BadRequest(f"at most {MAX_CANDIDATES} candidates")
    registry, model = state.registry, request.model
    keys: list[ReplicaKey] = []
    for text in request.candidates:  # O(candidates): nothing scans the fleet per call
        found = [k for k in registry.find(text) if _serves(registry.endpoint(k), model)]
        if not found:
            raise BadRequest(f"candidate {text!r} does not serve model {request.model!r}")
        keys.extend(found)
    return list(dict.fromkeys(keys))


def whole_pools(
    state: RouterState, request: router_pb2.PickRequest
) -> list[list[ReplicaKey] | None]:
    """The replicas Pick may name, pools tried in turn (None: all of the model's). Of a
    model with prefill/decode disaggregation, only those that serve a request whole, as
    the HTTP endpoints' local flows (router/core/disagg.py ``plan``): ``both`` replicas,
    then (none of them available) every decode-capable one; Pick answers one endpoint,
    and a ``prefill`` one decodes nothing."""
    keys = candidate_keys(state, request)
    md: ModelDisagg | None = state.disagg.get(request.model)
    if md is None:
        return [keys]
    dec: list[ReplicaKey]
    both: list[ReplicaKey]
    _pre, dec, both = md.pd.pools(
        keys if keys is not None else state.registry.keys_for(request.model)
    )
    if not dec:
        if keys is not None:
            raise BadRequest("no candidate can decode (role prefill only)")
        raise NoReplicaAvailable("no replica can decode")
    return [both, dec] if both and len(both) < len(dec) else [dec]


_KIND_OF_PATH = {path.decode(): kind for path, kind in KINDS.items()}
# a kind's endpoint as a recorded row names it (router.recorder ENDPOINTS)
ENDPOINT_OF_KIND = {kind: ENDPOINTS[path] for path, kind in KINDS.items() if path in ENDPOINTS}
