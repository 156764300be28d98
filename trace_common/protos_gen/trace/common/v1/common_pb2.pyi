from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("crc32", "dtype", "name", "nbytes", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    crc32: int
    def __init__(
        self,
        name: str | None = ...,
        dtype: str | None = ...,
        shape: _Iterable[int] | None = ...,
        nbytes: int | None = ...,
        crc32: int | None = ...,
    ) -> None: ...

class PolicyVersionInfo(_message.Message):
    __slots__ = ("metadata_json", "num_tensors", "published_at", "total_bytes", "version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_AT_FIELD_NUMBER: _ClassVar[int]
    version: int
    total_bytes: int
    num_tensors: int
    metadata_json: str
    published_at: float
    def __init__(
        self,
        version: int | None = ...,
        total_bytes: int | None = ...,
        num_tensors: int | None = ...,
        metadata_json: str | None = ...,
        published_at: float | None = ...,
    ) -> None: ...
