from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

from trace_common.protos_gen.trace.common.v1 import common_pb2 as _common_pb2

DESCRIPTOR: _descriptor.FileDescriptor

class VersionHeader(_message.Message):
    __slots__ = ("metadata_json", "tensors", "total_bytes", "version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    metadata_json: str
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorSpec]
    total_bytes: int
    def __init__(
        self,
        version: int | None = ...,
        metadata_json: str | None = ...,
        tensors: _Iterable[_common_pb2.TensorSpec | _Mapping] | None = ...,
        total_bytes: int | None = ...,
    ) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("data", "offset", "tensor_index")
    TENSOR_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    tensor_index: int
    offset: int
    data: bytes
    def __init__(
        self, tensor_index: int | None = ..., offset: int | None = ..., data: bytes | None = ...
    ) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("chunk", "header")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: VersionHeader
    chunk: TensorChunk
    def __init__(
        self,
        header: VersionHeader | _Mapping | None = ...,
        chunk: TensorChunk | _Mapping | None = ...,
    ) -> None: ...

class PushVersionResponse(_message.Message):
    __slots__ = ("dropped_versions", "published")
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    published: _common_pb2.PolicyVersionInfo
    dropped_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(
        self,
        published: _common_pb2.PolicyVersionInfo | _Mapping | None = ...,
        dropped_versions: _Iterable[int] | None = ...,
    ) -> None: ...

class PullVersionRequest(_message.Message):
    __slots__ = ("replica_id", "version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    replica_id: str
    def __init__(self, version: int | None = ..., replica_id: str | None = ...) -> None: ...

class PullChunk(_message.Message):
    __slots__ = ("chunk", "header")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: VersionHeader
    chunk: TensorChunk
    def __init__(
        self,
        header: VersionHeader | _Mapping | None = ...,
        chunk: TensorChunk | _Mapping | None = ...,
    ) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("address", "replica_id")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    def __init__(self, replica_id: str | None = ..., address: str | None = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_timeout_seconds", "latest_version")
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    heartbeat_timeout_seconds: float
    def __init__(
        self, latest_version: int | None = ..., heartbeat_timeout_seconds: float | None = ...
    ) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("replica_id", "version_held")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_HELD_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    version_held: int
    def __init__(self, replica_id: str | None = ..., version_held: int | None = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("latest_version",)
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    def __init__(self, latest_version: int | None = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: str | None = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = (
        "address",
        "alive",
        "replica_id",
        "seconds_since_heartbeat",
        "version_held",
        "version_lag",
    )
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_HELD_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    VERSION_LAG_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    version_held: int
    alive: bool
    seconds_since_heartbeat: float
    version_lag: int
    def __init__(
        self,
        replica_id: str | None = ...,
        address: str | None = ...,
        version_held: int | None = ...,
        alive: bool | None = ...,
        seconds_since_heartbeat: float | None = ...,
        version_lag: int | None = ...,
    ) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("latest_version", "replicas")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    latest_version: int
    def __init__(
        self,
        replicas: _Iterable[ReplicaInfo | _Mapping] | None = ...,
        latest_version: int | None = ...,
    ) -> None: ...

class ListVersionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListVersionsResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[_common_pb2.PolicyVersionInfo]
    def __init__(
        self, versions: _Iterable[_common_pb2.PolicyVersionInfo | _Mapping] | None = ...
    ) -> None: ...
