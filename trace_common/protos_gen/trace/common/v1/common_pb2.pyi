from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes", "crc32")
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
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class PolicyVersionInfo(_message.Message):
    __slots__ = ("version", "total_bytes", "num_tensors", "metadata_json", "published_at", "cuda_ipc_node", "offer_only", "broadcast_group_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_AT_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_NODE_FIELD_NUMBER: _ClassVar[int]
    OFFER_ONLY_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    total_bytes: int
    num_tensors: int
    metadata_json: str
    published_at: float
    cuda_ipc_node: str
    offer_only: bool
    broadcast_group_id: str
    def __init__(self, version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., num_tensors: _Optional[int] = ..., metadata_json: _Optional[str] = ..., published_at: _Optional[float] = ..., cuda_ipc_node: _Optional[str] = ..., offer_only: _Optional[bool] = ..., broadcast_group_id: _Optional[str] = ...) -> None: ...
