"""A call a service makes to another one fails (the rollout writing records to quant-cache):
the error reaches the caller with the upstream's code, not UNKNOWN. In-process server, real
gRPC over loopback."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from services.weight_sync.registry import ReplicaRegistry
from services.weight_sync.servicer import WeightSyncServicer
from services.weight_sync.versions import VersionStore
from trace_common.clients import WeightSyncClient
from trace_common.clients.data_path import DirectPathError
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2_grpc
from trace_common.service import Metrics, ServiceSettings, from_upstream, invalid
from trace_common.service.errors import MAX_DETAILS_CHARS
from trace_common.service.grpc_server import GrpcServer

C = grpc.StatusCode


@pytest.mark.parametrize(
    ("upstream", "mapped"),
    [
        (C.UNAVAILABLE, C.UNAVAILABLE),
        (C.RESOURCE_EXHAUSTED, C.RESOURCE_EXHAUSTED),
        (C.INVALID_ARGUMENT, C.INVALID_ARGUMENT),
        (C.DATA_LOSS, C.DATA_LOSS),
        (C.DEADLINE_EXCEEDED, C.DEADLINE_EXCEEDED),
        (C.UNAUTHENTICATED, C.FAILED_PRECONDITION),  # our credentials, not the caller's
        (C.PERMISSION_DENIED, C.FAILED_PRECONDITION),
        (C.UNKNOWN, C.INTERNAL),
    ],
)
def test_from_upstream_keeps_the_code(upstream: grpc.StatusCode, mapped: grpc.StatusCode) -> None:
    err = from_upstream(DirectPathError(upstream, "Redis is full"), "quant-cache")
    assert err.code == mapped
    assert err.message == f"quant-cache answered {upstream.name}: Redis is full"


class _Failing(WeightSyncServicer):
    """ListVersions fails the way a store client does when its upstream call fails."""

    def ListVersions(self, request, context):
        raise DirectPathError(C.RESOURCE_EXHAUSTED, "Redis is at its memory bound")

    def ListReplicas(self, request, context):
        raise invalid("a long message " + "x" * 100_000)


@pytest.fixture()
def address() -> Iterator[str]:
    settings = ServiceSettings(auth_token="t", grpc_host="127.0.0.1", grpc_port=0)
    metrics = Metrics("weight_sync")
    server = GrpcServer(settings, metrics)
    servicer = _Failing(
        VersionStore(1), ReplicaRegistry(5.0), metrics, max_version_bytes=1 << 20, chunk_bytes=1024
    )
    server.add(weightsync_pb2_grpc.add_WeightSyncServicer_to_server, servicer, "x")
    port = server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_an_upstream_failure_reaches_the_caller_with_its_code(address: str) -> None:
    client = WeightSyncClient(address, "t")
    with pytest.raises(grpc.RpcError) as err:
        client.versions()
    assert err.value.code() == C.RESOURCE_EXHAUSTED  # was UNKNOWN
    assert "RESOURCE_EXHAUSTED: Redis is at its memory bound" in err.value.details()


def test_a_long_status_message_is_cut_and_keeps_its_code(address: str) -> None:
    """A message over the client's metadata limit would reach it as RESOURCE_EXHAUSTED."""
    client = WeightSyncClient(address, "t")
    with pytest.raises(grpc.RpcError) as err:
        client.replicas()
    assert err.value.code() == C.INVALID_ARGUMENT
    details = err.value.details()
    assert details.startswith("a long message xxx") and details.endswith("...")
    assert len(details) == MAX_DETAILS_CHARS
