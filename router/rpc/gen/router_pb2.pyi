from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PickRequest(_message.Message):
    __slots__ = ("model", "token_ids", "text", "messages_json", "request_json", "request_path", "tools_json", "session_id", "candidates", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_JSON_FIELD_NUMBER: _ClassVar[int]
    REQUEST_JSON_FIELD_NUMBER: _ClassVar[int]
    REQUEST_PATH_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: TokenIds
    text: str
    messages_json: str
    request_json: str
    request_path: str
    tools_json: str
    session_id: str
    candidates: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[str] = ..., messages_json: _Optional[str] = ..., request_json: _Optional[str] = ..., request_path: _Optional[str] = ..., tools_json: _Optional[str] = ..., session_id: _Optional[str] = ..., candidates: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ...) -> None: ...

class PickResponse(_message.Message):
    __slots__ = ("decision_id", "replica", "dp_rank", "endpoint", "prompt_tokens", "usable_hit_tokens", "kv_hit_tokens", "policy", "score", "terms", "fallbacks")
    class TermsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USABLE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    decision_id: str
    replica: str
    dp_rank: int
    endpoint: str
    prompt_tokens: int
    usable_hit_tokens: int
    kv_hit_tokens: int
    policy: str
    score: float
    terms: _containers.ScalarMap[str, float]
    fallbacks: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, decision_id: _Optional[str] = ..., replica: _Optional[str] = ..., dp_rank: _Optional[int] = ..., endpoint: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., usable_hit_tokens: _Optional[int] = ..., kv_hit_tokens: _Optional[int] = ..., policy: _Optional[str] = ..., score: _Optional[float] = ..., terms: _Optional[_Mapping[str, float]] = ..., fallbacks: _Optional[_Iterable[str]] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("decision_id", "phase", "cached_tokens", "output_tokens", "http_status")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PHASE_UNSPECIFIED: _ClassVar[ReportRequest.Phase]
        FIRST_TOKEN: _ClassVar[ReportRequest.Phase]
        COMPLETED: _ClassVar[ReportRequest.Phase]
        FAILED: _ClassVar[ReportRequest.Phase]
        REFUSED: _ClassVar[ReportRequest.Phase]
        CANCELLED: _ClassVar[ReportRequest.Phase]
    PHASE_UNSPECIFIED: ReportRequest.Phase
    FIRST_TOKEN: ReportRequest.Phase
    COMPLETED: ReportRequest.Phase
    FAILED: ReportRequest.Phase
    REFUSED: ReportRequest.Phase
    CANCELLED: ReportRequest.Phase
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HTTP_STATUS_FIELD_NUMBER: _ClassVar[int]
    decision_id: str
    phase: ReportRequest.Phase
    cached_tokens: int
    output_tokens: int
    http_status: int
    def __init__(self, decision_id: _Optional[str] = ..., phase: _Optional[_Union[ReportRequest.Phase, str]] = ..., cached_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., http_status: _Optional[int] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...
