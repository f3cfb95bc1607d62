from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ProfileRequest(_message.Message):
    __slots__ = ("start",)
    START_FIELD_NUMBER: _ClassVar[int]
    start: bool
    def __init__(self, start: _Optional[bool] = ...) -> None: ...

class ProfileResponse(_message.Message):
    __slots__ = ("worker_id", "trace_path")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_PATH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    trace_path: str
    def __init__(self, worker_id: _Optional[str] = ..., trace_path: _Optional[str] = ...) -> None: ...
