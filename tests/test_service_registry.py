"""The replica registry: keys per DP rank, lookups by name, replacement and removal."""

from __future__ import annotations

from router.core.types import ReplicaKey
from router.service.registry import ReplicaRegistry
from router.service.settings import ReplicaSettings


def _replica(
    name: str, model: str = "m", ranks: int = 1, url: str = "http://h:1/"
) -> ReplicaSettings:
    return ReplicaSettings(url=url, model=model, name=name, dp_ranks=ranks)


def test_keys_per_rank_and_lookups_by_name() -> None:
    reg = ReplicaRegistry([_replica("a"), _replica("b", ranks=3), _replica("c", model="n")])
    b = [ReplicaKey("b", r) for r in range(3)]
    assert reg.keys_for("m") == (ReplicaKey("a"), *b)
    assert reg.keys_for("n") == (ReplicaKey("c"),)
    assert reg.find("b") == b
    assert reg.find("b#dp2") == [b[2]]
    assert reg.find("b#dp3") == [] and reg.find("zzz") == []
    ep = reg.endpoint(b[1])
    assert ep is not None and (ep.base_url, ep.model, ep.dp_rank) == ("http://h:1", "m", 1)
    a = reg.endpoint(ReplicaKey("a"))
    assert a is not None and a.dp_rank is None  # one rank: no rank header
    assert reg.models() == ["m", "n"]


def test_replacing_and_removing_a_replica() -> None:
    reg = ReplicaRegistry([_replica("a"), _replica("b", ranks=2)])
    before = reg.keys_for("m")
    # replaced with fewer ranks on another model: its old keys leave both places
    reg.upsert(_replica("b", model="n", ranks=1, url="http://other:2"))
    assert reg.keys_for("m") == (ReplicaKey("a"),) and reg.keys_for("m") is not before
    assert reg.keys_for("n") == (ReplicaKey("b"),)
    assert reg.endpoint(ReplicaKey("b", 1)) is None
    assert reg.find("b") == [ReplicaKey("b")]
    assert reg.remove("b") == [ReplicaKey("b")]
    assert reg.models() == ["m"] and reg.find("b") == [] and reg.remove("b") == []
    assert [e.key for e in reg.endpoints()] == [ReplicaKey("a")]
