"""A client that cancels its call is counted as CANCELLED in the service's RPC metrics, not as
an error (INTERNAL) nor as a success (OK). weight-sync in a subprocess, gRPC over loopback,
the metric read from its /metrics."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
import torch

from trace_common.clients import WeightSyncClient
from trace_common.clients.tensors import tensor_to_wire
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2_grpc as pb_grpc
from trace_common.service.grpc_server import AUTH_HEADER
from trace_common.service.testing import ServiceProcess

TOKEN = "cancel-token"
MD = ((AUTH_HEADER, f"Bearer {TOKEN}"),)
METHOD = "/trace.weightsync.v1.WeightSync/"
# Large enough that the pull cannot have been sent whole (flow control) when it is cancelled.
POLICY = {"w": torch.zeros(64 << 20, dtype=torch.uint8)}


@pytest.fixture()
def service() -> Iterator[ServiceProcess]:
    env = {"TRACE_AUTH_TOKEN": TOKEN, "TRACE_CHUNK_BYTES": str(64 << 10)}
    with ServiceProcess("services.weight_sync", env) as svc:
        yield svc


def _codes(service: ServiceProcess, method: str) -> dict[str, float]:
    """{code: count} of trace_weight_sync_grpc_requests_total for `method`."""
    text = httpx.get(f"{service.http_url}/metrics").text
    pattern = rf'grpc_requests_total\{{code="(\w+)",method="{re.escape(METHOD + method)}"\}} (\S+)'
    return {code: float(n) for code, n in re.findall(pattern, text)}


def _wait_codes(
    service: ServiceProcess, method: str, want: dict[str, float], timeout: float = 10.0
) -> dict[str, float]:
    """The counts of `method` once they equal `want`, or as they stand after `timeout`."""
    deadline = time.monotonic() + timeout
    while (codes := _codes(service, method)) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return codes


def test_cancelled_streams_are_counted_as_cancelled(service: ServiceProcess) -> None:
    WeightSyncClient(service.grpc_address, TOKEN).push_version(1, POLICY, {})
    stub = pb_grpc.WeightSyncStub(grpc.insecure_channel(service.grpc_address))
    stub.Register(pb.RegisterRequest(replica_id="r0", address="r0:1"), metadata=MD, timeout=5)

    # Subscribe: the latest version arrives, then the replica goes away.
    subscription = stub.Subscribe(pb.SubscribeRequest(replica_id="r0"), metadata=MD)
    assert next(subscription).version == 1
    subscription.cancel()
    want = {"CANCELLED": 1.0}
    assert _wait_codes(service, "Subscribe", want) == want

    # PullVersion: cancelled after its first chunk.
    pull = stub.PullVersion(pb.PullVersionRequest(replica_id="r0"), metadata=MD)
    next(pull), next(pull)
    pull.cancel()
    assert _wait_codes(service, "PullVersion", want) == want

    # PushVersion: the trainer cancels half way through its stream.
    spec, view = tensor_to_wire("w", POLICY["w"])
    header = pb.VersionHeader(version=2, metadata_json="{}", tensors=[spec], total_bytes=len(view))
    sent, never = threading.Event(), threading.Event()

    def messages() -> Iterator[pb.PushChunk]:
        yield pb.PushChunk(header=header)
        yield pb.PushChunk(chunk=pb.TensorChunk(tensor_index=0, offset=0, data=bytes(1024)))
        sent.set()
        never.wait(10)

    future = stub.PushVersion.future(messages(), metadata=MD)
    assert sent.wait(5)
    time.sleep(0.3)  # the chunk reached the service
    future.cancel()
    want = {"OK": 1.0, "CANCELLED": 1.0}  # OK: the first push
    codes = _wait_codes(service, "PushVersion", want)
    never.set()
    assert codes == want
    assert "Traceback" not in service.log()
