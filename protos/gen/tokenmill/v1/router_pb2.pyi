from tokenmill.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole

class PlaceRequest(_message.Message):
    __slots__ = ("meta", "prompt_token_ids", "max_tokens", "exclude_workers")
    META_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    exclude_workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., exclude_workers: _Optional[_Iterable[str]] = ...) -> None: ...

class PlaceStreamRequest(_message.Message):
    __slots__ = ("id", "request", "trace")
    class TraceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    id: int
    request: PlaceRequest
    trace: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[int] = ..., request: _Optional[_Union[PlaceRequest, _Mapping]] = ..., trace: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PlaceStreamReply(_message.Message):
    __slots__ = ("id", "placement", "error_code", "error_message")
    ID_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    id: int
    placement: Placement
    error_code: int
    error_message: str
    def __init__(self, id: _Optional[int] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class WorkerRef(_message.Message):
    __slots__ = ("worker_id", "address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("prefill", "decode", "cached_blocks", "reason")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    prefill: WorkerRef
    decode: WorkerRef
    cached_blocks: int
    reason: str
    def __init__(self, prefill: _Optional[_Union[WorkerRef, _Mapping]] = ..., decode: _Optional[_Union[WorkerRef, _Mapping]] = ..., cached_blocks: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class KvEvents(_message.Message):
    __slots__ = ("stored", "removed", "reset")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    reset: bool
    def __init__(self, stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., reset: _Optional[bool] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("worker_id", "address", "role", "model_id", "block_size", "free_blocks", "total_blocks", "running", "waiting", "queued_prefill_tokens", "kv_events", "draining", "heartbeat")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    role: WorkerRole
    model_id: str
    block_size: int
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    queued_prefill_tokens: int
    kv_events: KvEvents
    draining: bool
    heartbeat: bool
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., kv_events: _Optional[_Union[KvEvents, _Mapping]] = ..., draining: _Optional[bool] = ..., heartbeat: _Optional[bool] = ...) -> None: ...

class ReportAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerLoad]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerLoad, _Mapping]]] = ...) -> None: ...
