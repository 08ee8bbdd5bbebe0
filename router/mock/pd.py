"""The mock replica's side of vLLM's disaggregated protocol (docs/pd.md).

Either role, decided per request by its ``kv_transfer_params`` (as a vLLM engine with a
``kv_both`` connector does):

* ``do_remote_decode: true`` (a prefill leg): the request runs as usual (the proxy asked for
  one token) and the answer carries ``kv_transfer_params`` for the decode side, the fields
  vLLM 0.34's NIXL connector answers (``nixl/pull_scheduler.py`` ``request_finished``):
  ``do_remote_prefill: true``, ``remote_engine_id`` (this replica), ``remote_request_id``,
  ``remote_block_ids`` (one list per KV cache group), ``remote_host`` / ``remote_port``,
  ``tp_size`` / ``dcp_size`` / ``pp_size``, ``remote_num_tokens``,
  ``remote_blocks_expiry_time``, ``remote_registration_generation``, ``transfer_mode``, and
  the scheduler's ``remote_prefill_cached_tokens`` (the prefill's hit, which the decode
  answer's ``usage`` reports as the request's: vLLM's ``v1/engine/output_processor.py``);
  plus mock-only ``remote_rack`` / ``remote_region`` (where the blocks are, so the decode
  side can time the pull) and ``remote_kv_hit_tokens`` (the prefill's KV-only hit);
* ``do_remote_prefill: true`` (a decode leg): the replica "pulls" the prompt's KV it does not
  hold (``kv_bytes_per_token`` of the profile a token) and the recurrent state at the prompt
  end (``state_bytes``, hybrid profiles) over the link between the two sites
  (router.core.disagg.LinkModel: NVLink in a rack, network across racks), sized when it
  arrives; the engine model admits the request as ``remote_prefilled`` with that
  ``pull_s``: the pull starts when the request reaches the head of the queue with a running
  slot free (its blocks allocated, no slot held), and the request decodes once its KV has
  arrived, with no prefill compute, the blocks named and published as KV events
  (sim/engine.py "Decode legs", as vLLM 0.34 schedules them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from router.core.disagg import LinkModel, Site, TransferSizes

__all__ = ["Site", "TransferSizes", "answer_params", "pull", "transfer_params"]

LINKS = LinkModel()

# vLLM 0.34's words for a streamed beam search (``completion/serving.py``
# ``_create_completion``, its first check)
STREAM_WITH_BEAM_SEARCH = "Streaming is not currently supported with beam search"


@dataclass(slots=True, frozen=True)
class Pull:
    """A decode leg's transfer: bytes moved and modelled seconds."""

    nbytes: float
    seconds: float
    link: str


def transfer_params(body: Mapping[str, Any]) -> Mapping[str, Any] | None:
    params = body.get("kv_transfer_params")
    return params if isinstance(params, Mapping) else None


def is_prefill_leg(params: Mapping[str, Any] | None) -> bool:
    return bool(params and params.get("do_remote_decode"))


def is_decode_leg(params: Mapping[str, Any] | None) -> bool:
    return bool(params and params.get("do_remote_prefill"))


def refused_first(body: Mapping[str, Any], kind: str) -> bool:
    """A completion vLLM 0.34 refuses before anything else (``stream`` with
    ``use_beam_search``: ``completion/serving.py`` ``_create_completion``), inside
    ``_with_kv_transfer_rejection_cleanup`` (``generate/base/serving.py``): a decode leg
    refused there has the prefill replica's blocks freed at once (the connector's
    ``request_finished`` on an ``abort_immediately`` request), which is how the router
    releases a transfer no decode replica can take (router/service/pd_serve.py)."""
    return kind == "completion" and bool(body.get("stream")) and bool(body.get("use_beam_search"))


def answer_params(
    replica: str,
    request_id: str,
    host: str,
    port: int,
    site: Site,
    block_ids: Sequence[Sequence[int]],
    computed: int,
    cached: int,
    kv_hit: int,
) -> dict[str, Any]:
    """What a prefill leg's answer carries for the decode request (module doc):
    ``block_ids`` one list per KV cache group, ``computed`` the prompt tokens computed."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(g) for g in block_ids],
        "remote_engine_id": replica,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": computed,
        "remote_blocks_expiry_time": None,
        "remote_registration_generation": 0,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": cached,
        "remote_rack": site.rack,
        "remote_region": site.region,
        "remote_kv_hit_tokens": kv_hit,
    }


def remote_hit(params: Mapping[str, Any], cached: int, kv_hit: int) -> tuple[int, int]:
    """(cached, KV-only hit) a decode leg reports: the prefill replica's when its answer
    said (``remote_prefill_cached_tokens``, vLLM's; ``remote_kv_hit_tokens``, the mock's),
    else this replica's own."""
    c, k = params.get("remote_prefill_cached_tokens"), params.get("remote_kv_hit_tokens")
    return (c if type(c) is int else cached), (k if type(k) is int else kv_hit)


def pull(
    params: Mapping[str, Any],
    here: Site,
    replica: str,
    missing_tokens: int,
    sizes: TransferSizes,
    hybrid: bool,
) -> Pull:
    """The decode leg's pull of ``missing_tokens`` of KV (and the state) from the site the
    prefill answer named."""
    there = Site(str(params.get("remote_region") or ""), str(params.get("remote_rack") or ""))
    same = params.get("remote_engine_id") == replica
    link = LINKS.link(there, here, same_replica=same)
    nbytes = 0.0 if same else sizes.total(missing_tokens, hybrid)
    return Pull(nbytes, LINKS.seconds(link, nbytes), link.value)
