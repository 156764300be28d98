from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

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
    __slots__ = ("policy_version", "run_id", "sample_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    sample_id: str
    def __init__(
        self,
        run_id: str | None = ...,
        policy_version: int | None = ...,
        sample_id: str | None = ...,
    ) -> None: ...

class PutRecordsChunk(_message.Message):
    __slots__ = ("crc32", "data", "key", "total_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: RecordKey
    total_bytes: int
    crc32: int
    data: bytes
    def __init__(
        self,
        key: RecordKey | _Mapping | None = ...,
        total_bytes: int | None = ...,
        crc32: int | None = ...,
        data: bytes | None = ...,
    ) -> None: ...

class PutRecordsResponse(_message.Message):
    __slots__ = ("key", "stored_bytes", "ttl_seconds")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    key: RecordKey
    stored_bytes: int
    ttl_seconds: int
    def __init__(
        self,
        key: RecordKey | _Mapping | None = ...,
        stored_bytes: int | None = ...,
        ttl_seconds: int | None = ...,
    ) -> None: ...

class GetRecordsRequest(_message.Message):
    __slots__ = ("policy_version", "run_id", "sample_ids")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    sample_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(
        self,
        run_id: str | None = ...,
        policy_version: int | None = ...,
        sample_ids: _Iterable[str] | None = ...,
    ) -> None: ...

class GetRecordsChunk(_message.Message):
    __slots__ = ("crc32", "data", "detail", "offset", "sample_id", "status", "total_bytes")
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
    def __init__(
        self,
        sample_id: str | None = ...,
        status: RecordStatus | str | None = ...,
        total_bytes: int | None = ...,
        crc32: int | None = ...,
        offset: int | None = ...,
        data: bytes | None = ...,
        detail: str | None = ...,
    ) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("policy_version", "run_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    def __init__(self, run_id: str | None = ..., policy_version: int | None = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted_records",)
    DELETED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    deleted_records: int
    def __init__(self, deleted_records: int | None = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = (
        "bytes_got_total",
        "bytes_put_total",
        "corrupt_total",
        "hits_total",
        "max_record_bytes",
        "misses_total",
        "records_got_total",
        "records_put_total",
        "redis_evicted_keys_total",
        "redis_expired_keys_total",
        "redis_keys",
        "redis_maxmemory_bytes",
        "redis_maxmemory_policy",
        "redis_used_memory_bytes",
        "ttl_seconds",
    )
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
    def __init__(
        self,
        records_put_total: int | None = ...,
        bytes_put_total: int | None = ...,
        records_got_total: int | None = ...,
        bytes_got_total: int | None = ...,
        hits_total: int | None = ...,
        misses_total: int | None = ...,
        corrupt_total: int | None = ...,
        redis_used_memory_bytes: int | None = ...,
        redis_maxmemory_bytes: int | None = ...,
        redis_maxmemory_policy: str | None = ...,
        redis_evicted_keys_total: int | None = ...,
        redis_expired_keys_total: int | None = ...,
        redis_keys: int | None = ...,
        ttl_seconds: int | None = ...,
        max_record_bytes: int | None = ...,
    ) -> None: ...
