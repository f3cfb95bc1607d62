from tokenmill.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("meta", "prompt_token_ids", "params", "lease_id")
    META_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    lease_id: str
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., lease_id: _Optional[str] = ...) -> None: ...

class PrefillResult(_message.Message):
    __slots__ = ("first_token_id", "first_logprob", "kv", "cached_tokens", "finish_reason")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    kv: _common_pb2.KvHandle
    cached_tokens: int
    finish_reason: _common_pb2.FinishReason
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., kv: _Optional[_Union[_common_pb2.KvHandle, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "unclaimed_only")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    UNCLAIMED_ONLY_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    unclaimed_only: bool
    def __init__(self, lease_id: _Optional[str] = ..., unclaimed_only: _Optional[bool] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ("hold_ms",)
    HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    hold_ms: int
    def __init__(self, hold_ms: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class KvCompat(_message.Message):
    __slots__ = ("protocol_version", "model_id", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_size", "layout")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout: str
    def __init__(self, protocol_version: _Optional[int] = ..., model_id: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., layout: _Optional[str] = ...) -> None: ...

class KvHandshakeRequest(_message.Message):
    __slots__ = ("peer_agent", "peer_metadata", "compat")
    PEER_AGENT_FIELD_NUMBER: _ClassVar[int]
    PEER_METADATA_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    peer_agent: str
    peer_metadata: bytes
    compat: KvCompat
    def __init__(self, peer_agent: _Optional[str] = ..., peer_metadata: _Optional[bytes] = ..., compat: _Optional[_Union[KvCompat, _Mapping]] = ...) -> None: ...

class KvHandshakeResponse(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "kv_descriptors", "compat")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    KV_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    kv_descriptors: bytes
    compat: KvCompat
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., kv_descriptors: _Optional[bytes] = ..., compat: _Optional[_Union[KvCompat, _Mapping]] = ...) -> None: ...
