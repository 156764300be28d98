"""weight-sync settings (environment `TRACE_*`, optional YAML via `TRACE_CONFIG_FILE`)."""

from __future__ import annotations

from pydantic import Field

from trace_common.service import ServiceSettings


class WeightSyncSettings(ServiceSettings):
    grpc_port: int = Field(50052, ge=0, le=65535)
    http_port: int = Field(8052, ge=0, le=65535)
    keep_versions: int = Field(2, ge=1, description="complete versions kept in memory (last K)")
    max_version_bytes: int = Field(64 << 30, gt=0, description="larger pushes: RESOURCE_EXHAUSTED")
    chunk_bytes: int = Field(4 << 20, gt=0, description="PullVersion chunk size")
    heartbeat_timeout_seconds: float = Field(
        30.0, gt=0, description="a replica silent this long is reported dead"
    )
