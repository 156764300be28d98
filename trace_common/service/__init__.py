"""The service runtime shared by every TRACE service: typed config, JSON logs, Prometheus
metrics, gRPC server/client helpers (auth, TLS, limits, retries, health, reflection) and the
HTTP health/metrics/status app. See `runtime.ServiceRuntime` for the few lines a service needs."""

from __future__ import annotations

from trace_common.service.config import ServiceSettings, load_settings
from trace_common.service.errors import (
    ServiceError,
    check_id,
    check_non_negative,
    exhausted,
    failed_precondition,
    from_upstream,
    invalid,
    is_not_registered,
    not_found,
    not_registered,
)
from trace_common.service.grpc_client import ClientTLS, GrpcClient, RetryPolicy, resolve_token
from trace_common.service.metrics import Metrics
from trace_common.service.retry import Backoff, retry_transient
from trace_common.service.runtime import ServiceRuntime

__all__ = [
    "Backoff",
    "ClientTLS",
    "GrpcClient",
    "Metrics",
    "RetryPolicy",
    "ServiceError",
    "ServiceRuntime",
    "ServiceSettings",
    "check_id",
    "check_non_negative",
    "exhausted",
    "failed_precondition",
    "from_upstream",
    "invalid",
    "is_not_registered",
    "load_settings",
    "not_found",
    "not_registered",
    "resolve_token",
    "retry_transient",
]
