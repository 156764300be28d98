"""weight-sync settings (environment `TRACE_*`, optional YAML via `TRACE_CONFIG_FILE`)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from services.weight_sync.data_plane import parse_advertise
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
    replica_expire_seconds: float = Field(
        300.0,
        gt=0,
        description="a replica silent this long is forgotten (its metric series too); it "
        "registers again by itself if it comes back",
    )
    max_replicas: int = Field(
        1024, ge=1, description="replicas registered at once at most (more: RESOURCE_EXHAUSTED)"
    )
    data_plane_max_tickets_per_replica: int = Field(
        4,
        ge=1,
        description="outstanding tickets per replica_id at most; past either bound a "
        "client pulls over gRPC (PullVersion) instead",
    )
    data_plane_enabled: bool = Field(
        True,
        description="serve pulls over the bulk data plane (GetPullTicket + a TCP/TLS "
        "listener); false = replicas pull over gRPC (PullVersion)",
    )
    data_plane_port: int = Field(
        50062,
        ge=0,
        le=65535,
        description="data-plane TCP port (0 = any free port); binds grpc_host",
    )
    data_plane_advertise: str = Field(
        "",
        description="address handed to replicas: host or host:port; empty = the host they "
        "reach gRPC by, with data_plane_port",
    )
    data_plane_ticket_seconds: float = Field(
        30.0, gt=0, description="a pull ticket is refused after this long"
    )
    data_plane_max_tickets: int = Field(
        1024, ge=1, description="outstanding tickets at most (more: RESOURCE_EXHAUSTED)"
    )

    @model_validator(mode="after")
    def _check_expiry(self) -> WeightSyncSettings:
        if self.replica_expire_seconds < self.heartbeat_timeout_seconds:
            raise ValueError(
                f"TRACE_REPLICA_EXPIRE_SECONDS={self.replica_expire_seconds} must be >= "
                f"TRACE_HEARTBEAT_TIMEOUT_SECONDS={self.heartbeat_timeout_seconds}"
            )
        return self

    @field_validator("data_plane_advertise")
    @classmethod
    def _check_advertise(cls, value: str) -> str:
        parse_advertise(value, 0)  # ValueError names the value
        return value
