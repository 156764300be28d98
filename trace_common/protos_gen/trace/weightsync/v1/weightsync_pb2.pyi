from trace_common.protos_gen.trace.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VersionHeader(_message.Message):
    __slots__ = ("version", "metadata_json", "tensors", "total_bytes", "base_version", "deltas", "delta_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    DELTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    metadata_json: str
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorSpec]
    total_bytes: int
    base_version: int
    deltas: _containers.RepeatedCompositeFieldContainer[TensorDelta]
    delta_bytes: int
    def __init__(self, version: _Optional[int] = ..., metadata_json: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[_common_pb2.TensorSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., base_version: _Optional[int] = ..., deltas: _Optional[_Iterable[_Union[TensorDelta, _Mapping]]] = ..., delta_bytes: _Optional[int] = ...) -> None: ...

class TensorDelta(_message.Message):
    __slots__ = ("kind", "payload_bytes", "changed", "base_crc32", "planes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    BASE_CRC32_FIELD_NUMBER: _ClassVar[int]
    PLANES_FIELD_NUMBER: _ClassVar[int]
    kind: int
    payload_bytes: int
    changed: int
    base_crc32: int
    planes: _containers.RepeatedCompositeFieldContainer[PlaneDelta]
    def __init__(self, kind: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., changed: _Optional[int] = ..., base_crc32: _Optional[int] = ..., planes: _Optional[_Iterable[_Union[PlaneDelta, _Mapping]]] = ...) -> None: ...

class PlaneDelta(_message.Message):
    __slots__ = ("kind", "changed")
    KIND_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    kind: int
    changed: int
    def __init__(self, kind: _Optional[int] = ..., changed: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("tensor_index", "offset", "data")
    TENSOR_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    tensor_index: int
    offset: int
    data: bytes
    def __init__(self, tensor_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: VersionHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[VersionHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class PushVersionResponse(_message.Message):
    __slots__ = ("published", "dropped_versions")
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    published: _common_pb2.PolicyVersionInfo
    dropped_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, published: _Optional[_Union[_common_pb2.PolicyVersionInfo, _Mapping]] = ..., dropped_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class PullVersionRequest(_message.Message):
    __slots__ = ("version", "replica_id", "base_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    replica_id: str
    base_version: int
    def __init__(self, version: _Optional[int] = ..., replica_id: _Optional[str] = ..., base_version: _Optional[int] = ...) -> None: ...

class PullChunk(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: VersionHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[VersionHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class PullTicketRequest(_message.Message):
    __slots__ = ("version", "replica_id", "base_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    replica_id: str
    base_version: int
    def __init__(self, version: _Optional[int] = ..., replica_id: _Optional[str] = ..., base_version: _Optional[int] = ...) -> None: ...

class PullTicketResponse(_message.Message):
    __slots__ = ("data_host", "data_port", "ticket", "expires_in_seconds", "header")
    DATA_HOST_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    data_host: str
    data_port: int
    ticket: bytes
    expires_in_seconds: float
    header: VersionHeader
    def __init__(self, data_host: _Optional[str] = ..., data_port: _Optional[int] = ..., ticket: _Optional[bytes] = ..., expires_in_seconds: _Optional[float] = ..., header: _Optional[_Union[VersionHeader, _Mapping]] = ...) -> None: ...

class CudaIpcBuffer(_message.Message):
    __slots__ = ("node_id", "device_uuid", "memory_handle", "allocation_offset", "buffer_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "tensor_offsets")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_HANDLE_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    device_uuid: str
    memory_handle: bytes
    allocation_offset: int
    buffer_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node_id: _Optional[str] = ..., device_uuid: _Optional[str] = ..., memory_handle: _Optional[bytes] = ..., allocation_offset: _Optional[int] = ..., buffer_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., tensor_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class BroadcastGroup(_message.Message):
    __slots__ = ("group_id", "store_host", "store_port", "backend", "members", "timeout_seconds", "buffer_bytes", "tensor_offsets", "checksummed", "source_node_id", "source_device_uuid")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMMED_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    store_host: str
    store_port: int
    backend: str
    members: _containers.RepeatedScalarFieldContainer[str]
    timeout_seconds: float
    buffer_bytes: int
    tensor_offsets: _containers.RepeatedScalarFieldContainer[int]
    checksummed: bool
    source_node_id: str
    source_device_uuid: str
    def __init__(self, group_id: _Optional[str] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., backend: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., timeout_seconds: _Optional[float] = ..., buffer_bytes: _Optional[int] = ..., tensor_offsets: _Optional[_Iterable[int]] = ..., checksummed: _Optional[bool] = ..., source_node_id: _Optional[str] = ..., source_device_uuid: _Optional[str] = ...) -> None: ...

class OfferVersionRequest(_message.Message):
    __slots__ = ("header", "buffer", "broadcast", "new_group")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_FIELD_NUMBER: _ClassVar[int]
    NEW_GROUP_FIELD_NUMBER: _ClassVar[int]
    header: VersionHeader
    buffer: CudaIpcBuffer
    broadcast: BroadcastGroup
    new_group: bool
    def __init__(self, header: _Optional[_Union[VersionHeader, _Mapping]] = ..., buffer: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ..., broadcast: _Optional[_Union[BroadcastGroup, _Mapping]] = ..., new_group: _Optional[bool] = ...) -> None: ...

class OfferVersionResponse(_message.Message):
    __slots__ = ("broadcast",)
    BROADCAST_FIELD_NUMBER: _ClassVar[int]
    broadcast: BroadcastGroup
    def __init__(self, broadcast: _Optional[_Union[BroadcastGroup, _Mapping]] = ...) -> None: ...

class GetOfferRequest(_message.Message):
    __slots__ = ("version", "replica_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    replica_id: str
    def __init__(self, version: _Optional[int] = ..., replica_id: _Optional[str] = ...) -> None: ...

class GetOfferResponse(_message.Message):
    __slots__ = ("header", "buffer", "broadcast")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_FIELD_NUMBER: _ClassVar[int]
    header: VersionHeader
    buffer: CudaIpcBuffer
    broadcast: BroadcastGroup
    def __init__(self, header: _Optional[_Union[VersionHeader, _Mapping]] = ..., buffer: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ..., broadcast: _Optional[_Union[BroadcastGroup, _Mapping]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("replica_id", "address", "broadcast_backend", "node_id", "device_uuid")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_BACKEND_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    broadcast_backend: str
    node_id: str
    device_uuid: str
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., broadcast_backend: _Optional[str] = ..., node_id: _Optional[str] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("latest_version", "heartbeat_timeout_seconds")
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    heartbeat_timeout_seconds: float
    def __init__(self, latest_version: _Optional[int] = ..., heartbeat_timeout_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("replica_id", "version_held")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_HELD_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    version_held: int
    def __init__(self, replica_id: _Optional[str] = ..., version_held: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("latest_version",)
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    def __init__(self, latest_version: _Optional[int] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("replica_id", "address", "version_held", "alive", "seconds_since_heartbeat", "version_lag")
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
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., version_held: _Optional[int] = ..., alive: _Optional[bool] = ..., seconds_since_heartbeat: _Optional[float] = ..., version_lag: _Optional[int] = ...) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("replicas", "latest_version")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    latest_version: int
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ..., latest_version: _Optional[int] = ...) -> None: ...

class ListVersionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListVersionsResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[_common_pb2.PolicyVersionInfo]
    def __init__(self, versions: _Optional[_Iterable[_Union[_common_pb2.PolicyVersionInfo, _Mapping]]] = ...) -> None: ...
