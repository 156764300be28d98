"""quant-cache settings (environment `TRACE_*`, optional YAML via `TRACE_CONFIG_FILE`)."""

from __future__ import annotations

from pydantic import Field

from trace_common.service import ServiceSettings
from trace_common.stores.redis_local import DEFAULT_MAXMEMORY_BYTES, DEFAULT_POLICY


class QuantCacheSettings(ServiceSettings):
    grpc_port: int = Field(50051, ge=0, le=65535)
    http_port: int = Field(8051, ge=0, le=65535)
    redis_url: str | None = Field(
        None, description="redis://host:port/db; unset = start a local redis-server (laptop/tests)"
    )
    redis_maxmemory_bytes: int | None = Field(
        None,
        gt=0,
        description="apply this maxmemory to Redis at start (CONFIG SET); local Redis default 256 MiB",
    )
    redis_maxmemory_policy: str = Field(
        DEFAULT_POLICY,
        description="eviction at the bound: volatile-ttl (oldest first) or noeviction",
    )
    ttl_seconds: int = Field(3600, gt=0, description="records expire this long after their put")
    max_record_bytes: int = Field(256 << 20, gt=0, description="larger puts: RESOURCE_EXHAUSTED")
    max_batch: int = Field(4096, gt=0, description="most sample_ids in one GetRecords")
    chunk_bytes: int = Field(
        1 << 20, gt=0, description="GetRecords message size (and Redis GETRANGE piece size)"
    )
    key_prefix: str = Field("trace:qc", description="Redis key namespace")
    sweep_seconds: float = Field(
        30.0,
        ge=0,
        description="every this many seconds, give every record key the TTL and delete values "
        "over max_record_bytes or not strings, whoever wrote them (the direct path's clients "
        "too); 0 = never",
    )
    data_plane_enabled: bool = Field(
        True,
        description="hand authenticated clients the Redis coordinates (GetDataPlane) so they "
        "read and write records directly; false = clients use the gRPC path",
    )
    data_plane_redis_url: str | None = Field(
        None,
        description="Redis URL handed to clients (e.g. an ACL user limited to key_prefix, or "
        "an address they reach Redis by); unset = a user the service creates in Redis, "
        "limited to key_prefix and to data commands (ACL SETUSER), and no direct path when "
        "Redis refuses to create it",
    )


LOCAL_MAXMEMORY_BYTES = DEFAULT_MAXMEMORY_BYTES
