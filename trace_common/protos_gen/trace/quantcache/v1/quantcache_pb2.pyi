from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RecordStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECORD_STATUS_UNSPECIFIED: _ClassVar[RecordStatus]
    RECORD_STATUS_OK: _ClassVar[RecordStatus]
    RECORD_STATUS_MISSING: _ClassVar[RecordStatus]
    RECORD_STATUS_CORRUPT: _ClassVar[RecordStatus]
RECORD_STATUS_UNSPECIFIED: RecordStatus
RECORD_STATUS_OK: RecordStatus
RECORD_STATUS_MISSING: RecordStatus
RECORD_STATUS_CORRUPT: RecordStatus

class RecordKey(_message.Message):
    __slots__ = ("run_id", "policy_version", "sample_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    sample_id: str
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., sample_id: _Optional[str] = ...) -> None: ...

class PutRecordsChunk(_message.Message):
    __slots__ = ("key", "total_bytes", "crc32", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: RecordKey
    total_bytes: int
    crc32: int
    data: bytes
    def __init__(self, key: _Optional[_Union[RecordKey, _Mapping]] = ..., total_bytes: _Optional[int] = ..., crc32: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutRecordsResponse(_message.Message):
    __slots__ = ("stored_bytes", "ttl_seconds", "records")
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    stored_bytes: int
    ttl_seconds: int
    records: int
    def __init__(self, stored_bytes: _Optional[int] = ..., ttl_seconds: _Optional[int] = ..., records: _Optional[int] = ...) -> None: ...

class GetRecordsRequest(_message.Message):
    __slots__ = ("run_id", "policy_version", "sample_ids")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    sample_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., sample_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetRecordsChunk(_message.Message):
    __slots__ = ("sample_id", "status", "total_bytes", "crc32", "offset", "data", "detail")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    status: RecordStatus
    total_bytes: int
    crc32: int
    offset: int
    data: bytes
    detail: str
    def __init__(self, sample_id: _Optional[str] = ..., status: _Optional[_Union[RecordStatus, str]] = ..., total_bytes: _Optional[int] = ..., crc32: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., detail: _Optional[str] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("run_id", "policy_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted_records",)
    DELETED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    deleted_records: int
    def __init__(self, deleted_records: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("records_put_total", "bytes_put_total", "records_got_total", "bytes_got_total", "hits_total", "misses_total", "corrupt_total", "redis_used_memory_bytes", "redis_maxmemory_bytes", "redis_maxmemory_policy", "redis_evicted_keys_total", "redis_expired_keys_total", "redis_keys", "ttl_seconds", "max_record_bytes")
    RECORDS_PUT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_PUT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RECORDS_GOT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_GOT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HITS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MISSES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REDIS_USED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    REDIS_MAXMEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    REDIS_MAXMEMORY_POLICY_FIELD_NUMBER: _ClassVar[int]
    REDIS_EVICTED_KEYS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REDIS_EXPIRED_KEYS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REDIS_KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_RECORD_BYTES_FIELD_NUMBER: _ClassVar[int]
    records_put_total: int
    bytes_put_total: int
    records_got_total: int
    bytes_got_total: int
    hits_total: int
    misses_total: int
    corrupt_total: int
    redis_used_memory_bytes: int
    redis_maxmemory_bytes: int
    redis_maxmemory_policy: str
    redis_evicted_keys_total: int
    redis_expired_keys_total: int
    redis_keys: int
    ttl_seconds: int
    max_record_bytes: int
    def __init__(self, records_put_total: _Optional[int] = ..., bytes_put_total: _Optional[int] = ..., records_got_total: _Optional[int] = ..., bytes_got_total: _Optional[int] = ..., hits_total: _Optional[int] = ..., misses_total: _Optional[int] = ..., corrupt_total: _Optional[int] = ..., redis_used_memory_bytes: _Optional[int] = ..., redis_maxmemory_bytes: _Optional[int] = ..., redis_maxmemory_policy: _Optional[str] = ..., redis_evicted_keys_total: _Optional[int] = ..., redis_expired_keys_total: _Optional[int] = ..., redis_keys: _Optional[int] = ..., ttl_seconds: _Optional[int] = ..., max_record_bytes: _Optional[int] = ...) -> None: ...

class GetDataPlaneRequest(_message.Message):
    __slots__ = ("layout_version",)
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    layout_version: int
    def __init__(self, layout_version: _Optional[int] = ...) -> None: ...

class GetDataPlaneResponse(_message.Message):
    __slots__ = ("redis_url", "key_prefix", "ttl_seconds", "max_record_bytes", "layout_version", "piece_bytes")
    REDIS_URL_FIELD_NUMBER: _ClassVar[int]
    KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_RECORD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PIECE_BYTES_FIELD_NUMBER: _ClassVar[int]
    redis_url: str
    key_prefix: str
    ttl_seconds: int
    max_record_bytes: int
    layout_version: int
    piece_bytes: int
    def __init__(self, redis_url: _Optional[str] = ..., key_prefix: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., max_record_bytes: _Optional[int] = ..., layout_version: _Optional[int] = ..., piece_bytes: _Optional[int] = ...) -> None: ...
