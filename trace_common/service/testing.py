"""Start a service as a real subprocess for integration tests and benchmarks.

    with ServiceProcess("services.quant_cache", {"TRACE_AUTH_TOKEN": "t"}) as svc:
        client = QuantCacheClient(svc.grpc_address, "t")

Ports are chosen by the OS (port 0) and read back from the file the runtime writes
(`TRACE_PORTS_FILE`); `start` returns once grpc.health.v1 reports SERVING.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trace_common.service.grpc_client import ClientTLS
from trace_common.service.runtime import PORTS_FILE_ENV

START_TIMEOUT_S = 30.0


class ServiceProcess:
    """`python -m <module>` with the given environment (added to a TRACE_-free copy of ours)."""

    def __init__(
        self,
        module: str,
        env: Mapping[str, str],
        *,
        timeout: float = START_TIMEOUT_S,
        tls: ClientTLS | None = None,
    ) -> None:
        self.module = module
        self.tls = tls  # how to reach a TLS/mTLS server for the health check
        self.timeout = timeout
        self._tmp = tempfile.TemporaryDirectory(prefix="trace-svc-")
        self.ports_file = pathlib.Path(self._tmp.name) / "ports.json"
        self.log_file = pathlib.Path(self._tmp.name) / "service.log"
        base = {k: v for k, v in os.environ.items() if not k.startswith("TRACE_")}
        self.env = {
            **base,
            "TRACE_GRPC_HOST": "127.0.0.1",
            "TRACE_HTTP_HOST": "127.0.0.1",
            "TRACE_GRPC_PORT": "0",
            "TRACE_HTTP_PORT": "0",
            PORTS_FILE_ENV: str(self.ports_file),
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.grpc_port = 0
        self.http_port = 0

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.log_file.read_text() if self.log_file.exists() else ""

    def start(self) -> ServiceProcess:
        with open(self.log_file, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + self.timeout
        while not self.ports_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.module} exited with {self.proc.returncode}:\n{self.log()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.module} did not start in {self.timeout}s:\n{self.log()}")
            time.sleep(0.05)
        ports = json.loads(self.ports_file.read_text())
        self.grpc_port, self.http_port = ports["grpc"], ports["http"]
        self._wait_serving(deadline)
        return self

    def _wait_serving(self, deadline: float) -> None:
        channel = (
            grpc.insecure_channel(self.grpc_address)
            if self.tls is None
            else grpc.secure_channel(self.grpc_address, self.tls.credentials())
        )
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.module} never became SERVING:\n{self.log()}")
                time.sleep(0.05)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (graceful shutdown), SIGKILL after `timeout`; returns the exit code."""
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            code = self.proc.returncode
        self._tmp.cleanup()
        return code

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
