from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaInfo(_message.Message):
    __slots__ = ("replica", "dp_rank", "endpoint", "model", "rack", "region", "healthy", "draining", "in_flight", "queued_prefill_tokens", "kv_entries", "state_entries", "engine_running", "engine_waiting", "engine_kv_usage")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RACK_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    STATE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_RUNNING_FIELD_NUMBER: _ClassVar[int]
    ENGINE_WAITING_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    replica: str
    dp_rank: int
    endpoint: str
    model: str
    rack: str
    region: str
    healthy: bool
    draining: bool
    in_flight: int
    queued_prefill_tokens: int
    kv_entries: int
    state_entries: int
    engine_running: int
    engine_waiting: int
    engine_kv_usage: float
    def __init__(self, replica: _Optional[str] = ..., dp_rank: _Optional[int] = ..., endpoint: _Optional[str] = ..., model: _Optional[str] = ..., rack: _Optional[str] = ..., region: _Optional[str] = ..., healthy: _Optional[bool] = ..., draining: _Optional[bool] = ..., in_flight: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., kv_entries: _Optional[int] = ..., state_entries: _Optional[int] = ..., engine_running: _Optional[int] = ..., engine_waiting: _Optional[int] = ..., engine_kv_usage: _Optional[float] = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("replica", "dp_rank", "all_ranks")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    ALL_RANKS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    dp_rank: int
    all_ranks: bool
    def __init__(self, replica: _Optional[str] = ..., dp_rank: _Optional[int] = ..., all_ranks: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("changed",)
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    changed: int
    def __init__(self, changed: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("replicas", "kv_entries", "state_entries", "speculative_entries", "unique_kv_blocks", "in_flight", "decisions")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    KV_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    STATE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    UNIQUE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    replicas: int
    kv_entries: int
    state_entries: int
    speculative_entries: int
    unique_kv_blocks: int
    in_flight: int
    decisions: int
    def __init__(self, replicas: _Optional[int] = ..., kv_entries: _Optional[int] = ..., state_entries: _Optional[int] = ..., speculative_entries: _Optional[int] = ..., unique_kv_blocks: _Optional[int] = ..., in_flight: _Optional[int] = ..., decisions: _Optional[int] = ...) -> None: ...
