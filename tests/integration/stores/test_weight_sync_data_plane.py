"""weight-sync's bulk data plane over real sockets, the service in a subprocess: exact pulls
to two replicas, ticket refusals, RPC errors, truncated/corrupted transfers (through a
proxy that damages the stream) and the fallback to gRPC."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
import torch
from test_weight_sync_service import TOKEN, WS, _assert_exact, _policy

from trace_common.clients import DirectPathError, WeightSyncClient
from trace_common.clients.weight_sync import receive_version
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2_grpc as pb_grpc
from trace_common.service.grpc_server import AUTH_HEADER
from trace_common.service.testing import ServiceProcess
from trace_common.stores import ws_data_plane as wire

MD = ((AUTH_HEADER, f"Bearer {TOKEN}"),)


def _metric(svc: ServiceProcess, line_start: str, want: float | None = None) -> float:
    """The value of the first /metrics line starting with `line_start` (0 if none); with
    `want`, polls up to 5 s for it (the sending thread counts a pull after its last send)."""
    deadline = time.monotonic() + 5.0
    while True:
        value = 0.0
        for line in httpx.get(f"{svc.http_url}/metrics").text.splitlines():
            if line.startswith(line_start):
                value = float(line.rsplit(" ", 1)[1])
                break
        if want is None or value == want or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


@pytest.fixture()
def service() -> Iterator[ServiceProcess]:
    with ServiceProcess(WS, {"TRACE_AUTH_TOKEN": TOKEN}) as svc:
        yield svc


def test_direct_pull_reaches_two_replicas_byte_exact_and_is_counted(
    service: ServiceProcess,
) -> None:
    policy = _policy(1)
    WeightSyncClient(service.grpc_address, TOKEN).push_version(1, policy, {"step": 1})
    results: dict[str, tuple] = {}

    def pull(replica_id: str) -> None:
        client = WeightSyncClient(service.grpc_address, TOKEN, data_path="direct")
        try:
            results[replica_id] = client.pull_version(1, replica_id=replica_id)
        except BaseException as exc:  # reported below
            results[replica_id] = (exc,)

    threads = [threading.Thread(target=pull, args=(f"rollout-{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    total = sum(t.numel() * t.element_size() for t in policy.values())
    for replica_id in ("rollout-0", "rollout-1"):
        got = results[replica_id]
        assert len(got) == 3, got
        version, tensors, meta = got
        assert version == 1 and meta == {"step": 1}
        _assert_exact(tensors, policy)
        counted = _metric(
            service, f'trace_weight_sync_pull_bytes_total{{replica_id="{replica_id}"}}', total
        )
        assert counted == total, f"{replica_id}: data-plane pull counted {counted} of {total} bytes"
    assert _metric(service, "trace_weight_sync_pull_seconds_count", 2) == 2


def test_tickets_single_use_unforgeable_and_refusals_counted(service: ServiceProcess) -> None:
    WeightSyncClient(service.grpc_address, TOKEN).push_version(1, _policy(1), {})
    stub = pb_grpc.WeightSyncStub(grpc.insecure_channel(service.grpc_address))
    reply = stub.GetPullTicket(pb.PullTicketRequest(replica_id="r0"), metadata=MD, timeout=5)
    assert reply.data_port > 0 and reply.header.version == 1 and reply.expires_in_seconds == 30

    def pull(ticket: bytes) -> dict[str, torch.Tensor]:
        with socket.create_connection(("127.0.0.1", reply.data_port), 5) as sock:
            return receive_version(sock, ticket, reply.header, "test")

    _assert_exact(pull(reply.ticket), _policy(1))
    with pytest.raises(DirectPathError, match="ticket already used") as err:
        pull(reply.ticket)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    forged = bytearray(reply.ticket)
    forged[0] ^= 1
    with pytest.raises(DirectPathError, match="unknown ticket") as err:
        pull(bytes(forged))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    refused = "trace_weight_sync_data_plane_refused_total"
    assert _metric(service, f'{refused}{{reason="used"}}', 1) == 1
    assert _metric(service, f'{refused}{{reason="unknown"}}', 1) == 1


def test_ticket_rpc_status_codes(service: ServiceProcess) -> None:
    stub = pb_grpc.WeightSyncStub(grpc.insecure_channel(service.grpc_address))
    cases = [
        (
            pb.PullTicketRequest(replica_id="r0"),
            MD,
            grpc.StatusCode.NOT_FOUND,
            "no version has been published",
        ),
        (
            pb.PullTicketRequest(version=-3, replica_id="r0"),
            MD,
            grpc.StatusCode.INVALID_ARGUMENT,
            "version=-3",
        ),
        (pb.PullTicketRequest(replica_id="a/b"), MD, grpc.StatusCode.INVALID_ARGUMENT, "'a/b'"),
        (pb.PullTicketRequest(replica_id="r0"), (), grpc.StatusCode.UNAUTHENTICATED, ""),
        (
            pb.PullTicketRequest(replica_id="r0"),
            ((AUTH_HEADER, "Bearer no"),),
            grpc.StatusCode.UNAUTHENTICATED,
            "",
        ),
    ]
    for request, md, code, text in cases:
        with pytest.raises(grpc.RpcError) as err:
            stub.GetPullTicket(request, metadata=md, timeout=5)
        assert err.value.code() == code and text in err.value.details(), (request, md)
    WeightSyncClient(service.grpc_address, TOKEN).push_version(1, _policy(1), {})
    with pytest.raises(grpc.RpcError) as err:
        stub.GetPullTicket(pb.PullTicketRequest(version=7, replica_id="r0"), metadata=MD, timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "version 7" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        WeightSyncClient(service.grpc_address, TOKEN, data_path="direct").pull_version(
            7, replica_id="r0"
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


class DamagingProxy:
    """Forwards data-plane connections to `upstream`, damaging the service's stream as
    `mode` says: "pass", "truncate" (drops the last byte) or "flip" (one bit of byte 1000)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.upstream = 0
        self.mode = "pass"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        """One connection at a time (a test pulls one version at a time)."""
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, socket.create_connection(("127.0.0.1", self.upstream)) as up:
                up.sendall(wire.recv_exact(conn, wire.REQUEST_BYTES))
                head = wire.recv_exact(up, wire.REPLY_BYTES)
                body = bytearray(wire.recv_exact(up, wire.decode_reply(head)[1]))
                if self.mode == "truncate":
                    body = body[:-1]
                elif self.mode == "flip":
                    body[1000] ^= 0x10
                conn.sendall(head + body)

    def close(self) -> None:
        self.sock.close()


def test_truncated_or_corrupted_transfer_is_an_error_never_a_version() -> None:
    proxy = DamagingProxy()
    env = {"TRACE_AUTH_TOKEN": TOKEN, "TRACE_DATA_PLANE_ADVERTISE": f"127.0.0.1:{proxy.port}"}
    try:
        with ServiceProcess(WS, env) as svc:
            proxy.upstream = httpx.get(f"{svc.http_url}/status").json()["data_plane_port"]
            policy = _policy(2)
            WeightSyncClient(svc.grpc_address, TOKEN).push_version(1, policy, {})
            for data_path in ("auto", "direct"):  # auto does not fall back on bad data
                client = WeightSyncClient(svc.grpc_address, TOKEN, data_path=data_path)
                proxy.mode = "truncate"
                with pytest.raises(DirectPathError, match="truncated transfer of version 1") as err:
                    client.pull_version(1, replica_id="r0")
                assert err.value.code() == grpc.StatusCode.DATA_LOSS
                proxy.mode = "flip"
                with pytest.raises(ValueError, match=r"crc32 0x[0-9a-f]+ != expected"):
                    client.pull_version(1, replica_id="r0")
                proxy.mode = "pass"
                _, tensors, _ = client.pull_version(1, replica_id="r0")
                _assert_exact(tensors, policy)
                assert client.path == "direct"
    finally:
        proxy.close()


def test_grpc_fallback_when_the_data_plane_is_off_or_unreachable() -> None:
    env = {"TRACE_AUTH_TOKEN": TOKEN, "TRACE_DATA_PLANE_ENABLED": "false"}
    with ServiceProcess(WS, env) as svc:
        assert httpx.get(f"{svc.http_url}/status").json()["data_plane_port"] is None
        policy = _policy(3)
        WeightSyncClient(svc.grpc_address, TOKEN).push_version(1, policy, {})
        auto = WeightSyncClient(svc.grpc_address, TOKEN)
        _assert_exact(auto.pull_version(1, replica_id="r0")[1], policy)
        assert auto.path == "grpc"
        with pytest.raises(grpc.RpcError) as err:
            WeightSyncClient(svc.grpc_address, TOKEN, data_path="direct").pull_version(
                1, replica_id="r0"
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "TRACE_DATA_PLANE_ENABLED=false" in err.value.details()

    closed = socket.create_server(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    env = {"TRACE_AUTH_TOKEN": TOKEN, "TRACE_DATA_PLANE_ADVERTISE": f"127.0.0.1:{dead_port}"}
    with ServiceProcess(WS, env) as svc:
        WeightSyncClient(svc.grpc_address, TOKEN).push_version(1, policy, {})
        auto = WeightSyncClient(svc.grpc_address, TOKEN)
        _assert_exact(auto.pull_version(1, replica_id="r0")[1], policy)
        assert auto.path == "grpc"
        with pytest.raises(DirectPathError, match=f"data plane at 127.0.0.1:{dead_port}") as err:
            WeightSyncClient(svc.grpc_address, TOKEN, data_path="direct").pull_version(
                1, replica_id="r0"
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
