"""mTLS over a real socket: certificates made with the openssl CLI, weight-sync in a subprocess."""

from __future__ import annotations

import pathlib
import shutil
import socket
import subprocess

import grpc
import pytest
import torch

from trace_common.clients import WeightSyncClient
from trace_common.clients.weight_sync import receive_version
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2_grpc as pb_grpc
from trace_common.service import ClientTLS, RetryPolicy
from trace_common.service.testing import ServiceProcess
from trace_common.stores import ws_data_plane as wire

TOKEN = "tls-test-token"
ONCE = RetryPolicy(max_attempts=2)  # expected failures: do not wait through backoff
pytestmark = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="needs the openssl CLI to make certificates"
)


def _openssl(*args: str, cwd: pathlib.Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: pathlib.Path) -> None:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=trace-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=d,
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=d,
        )
        extra = ["-extfile", "san.ext"] if name == "server" else []
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-out",
            f"{name}.pem",
            *extra,
            cwd=d,
        )


def mtls_setup(d: pathlib.Path) -> tuple[dict[str, str], ClientTLS]:
    """The PKI in `d`, weight-sync's environment for mTLS, and a client's ClientTLS."""
    make_pki(d)
    env = {
        "TRACE_AUTH_TOKEN": TOKEN,
        "TRACE_TLS_CERT_FILE": str(d / "server.pem"),
        "TRACE_TLS_KEY_FILE": str(d / "server.key"),
        "TRACE_TLS_CLIENT_CA_FILE": str(d / "ca.pem"),
    }
    mtls = ClientTLS(ca_file=d / "ca.pem", cert_file=d / "client.pem", key_file=d / "client.key")
    return env, mtls


def test_mtls_requires_client_certificate(tmp_path: pathlib.Path) -> None:
    env, mtls = mtls_setup(tmp_path)
    with ServiceProcess("services.weight_sync", env, tls=mtls) as svc:
        ok = WeightSyncClient(svc.grpc_address, TOKEN, tls=mtls, timeout=5)
        assert ok.register("r0", "x:1").latest_version == -1
        # TLS but no client certificate: the handshake fails.
        no_cert = WeightSyncClient(
            svc.grpc_address,
            TOKEN,
            tls=ClientTLS(ca_file=tmp_path / "ca.pem"),
            timeout=5,
            retry=ONCE,
        )
        with pytest.raises(grpc.RpcError) as err:
            no_cert.replicas()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # Plaintext against the TLS port fails too.
        with pytest.raises(grpc.RpcError) as err:
            WeightSyncClient(svc.grpc_address, TOKEN, timeout=5, retry=ONCE).replicas()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # A valid certificate does not replace the token.
        with pytest.raises(grpc.RpcError) as err:
            WeightSyncClient(svc.grpc_address, "wrong", tls=mtls, timeout=5).replicas()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_data_plane_uses_the_same_mtls(tmp_path: pathlib.Path) -> None:
    """With TLS on, weight-sync's bulk data plane is TLS too (same certificates, client
    certificate required): a direct pull over it is exact, a cleartext or certificate-less
    connection gets no bytes."""
    env, mtls = mtls_setup(tmp_path)
    policy = {"w": torch.arange(100_000, dtype=torch.int32), "b": torch.ones(7).bfloat16()}
    with ServiceProcess("services.weight_sync", env, tls=mtls) as svc:
        ws = WeightSyncClient(svc.grpc_address, TOKEN, tls=mtls, timeout=5, data_path="direct")
        ws.push_version(1, policy, {})
        version, tensors, _ = ws.pull_version(replica_id="r0")
        assert version == 1 and ws.path == "direct"
        assert all(torch.equal(tensors[k], v) for k, v in policy.items())
        stub = pb_grpc.WeightSyncStub(ws.channel)
        reply = stub.GetPullTicket(
            pb.PullTicketRequest(replica_id="r0"), metadata=ws.metadata, timeout=5
        )
        # Cleartext: the ticket goes into a TLS handshake; no reply, only a close or reset.
        with socket.create_connection(("127.0.0.1", reply.data_port), 5) as sock:
            sock.sendall(wire.encode_request(reply.ticket))
            try:
                answer = wire.recv_exact(sock, wire.REPLY_BYTES)
            except ConnectionResetError:
                answer = b""
            assert not answer.startswith(wire.REPLY_MAGIC)
        # TLS without a client certificate: the handshake fails.
        no_cert = ClientTLS(ca_file=tmp_path / "ca.pem").ssl_context()
        with (
            pytest.raises(OSError),  # ssl.SSLError, or a reset, depending on timing
            socket.create_connection(("127.0.0.1", reply.data_port), 5) as raw,
            no_cert.wrap_socket(raw, server_hostname="127.0.0.1") as sock,
        ):
            sock.sendall(wire.encode_request(reply.ticket))
            wire.recv_exact(sock, wire.REPLY_BYTES)
        # The ticket was never redeemed by either: it still pulls, over mTLS.
        with (
            socket.create_connection(("127.0.0.1", reply.data_port), 5) as raw,
            mtls.ssl_context().wrap_socket(raw, server_hostname="127.0.0.1") as sock,
        ):
            got = receive_version(sock, reply.ticket, reply.header, "test")
        assert all(torch.equal(got[k], v) for k, v in policy.items())
