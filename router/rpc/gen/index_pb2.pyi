from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GPU: _ClassVar[Tier]
    CPU: _ClassVar[Tier]
    DISK: _ClassVar[Tier]

class BlockKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV: _ClassVar[BlockKind]
    STATE: _ClassVar[BlockKind]
GPU: Tier
CPU: Tier
DISK: Tier
KV: BlockKind
STATE: BlockKind

class IndexEvent(_message.Message):
    __slots__ = ("type", "hashes", "tier", "kind")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STORED: _ClassVar[IndexEvent.Type]
        REMOVED: _ClassVar[IndexEvent.Type]
        ALL_CLEARED: _ClassVar[IndexEvent.Type]
    STORED: IndexEvent.Type
    REMOVED: IndexEvent.Type
    ALL_CLEARED: IndexEvent.Type
    TYPE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    type: IndexEvent.Type
    hashes: _containers.RepeatedScalarFieldContainer[int]
    tier: Tier
    kind: BlockKind
    def __init__(self, type: _Optional[_Union[IndexEvent.Type, str]] = ..., hashes: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[Tier, str]] = ..., kind: _Optional[_Union[BlockKind, str]] = ...) -> None: ...

class IndexEventBatch(_message.Message):
    __slots__ = ("replica", "dp_rank", "seq", "events")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    dp_rank: int
    seq: int
    events: _containers.RepeatedCompositeFieldContainer[IndexEvent]
    def __init__(self, replica: _Optional[str] = ..., dp_rank: _Optional[int] = ..., seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[IndexEvent, _Mapping]]] = ...) -> None: ...

class PublishAck(_message.Message):
    __slots__ = ("replica", "dp_rank", "seq", "outcome")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        APPLIED: _ClassVar[PublishAck.Outcome]
        DUPLICATE: _ClassVar[PublishAck.Outcome]
        GAP: _ClassVar[PublishAck.Outcome]
    APPLIED: PublishAck.Outcome
    DUPLICATE: PublishAck.Outcome
    GAP: PublishAck.Outcome
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    replica: str
    dp_rank: int
    seq: int
    outcome: PublishAck.Outcome
    def __init__(self, replica: _Optional[str] = ..., dp_rank: _Optional[int] = ..., seq: _Optional[int] = ..., outcome: _Optional[_Union[PublishAck.Outcome, str]] = ...) -> None: ...
