"""mTLS over a real socket: certificates made with the openssl CLI, weight-sync in a subprocess."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import grpc
import pytest

from trace_common.clients import WeightSyncClient
from trace_common.service import ClientTLS, RetryPolicy
from trace_common.service.testing import ServiceProcess

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


def test_mtls_requires_client_certificate(tmp_path: pathlib.Path) -> None:
    make_pki(tmp_path)
    env = {
        "TRACE_AUTH_TOKEN": TOKEN,
        "TRACE_TLS_CERT_FILE": str(tmp_path / "server.pem"),
        "TRACE_TLS_KEY_FILE": str(tmp_path / "server.key"),
        "TRACE_TLS_CLIENT_CA_FILE": str(tmp_path / "ca.pem"),
    }
    mtls = ClientTLS(
        ca_file=tmp_path / "ca.pem",
        cert_file=tmp_path / "client.pem",
        key_file=tmp_path / "client.key",
    )
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
