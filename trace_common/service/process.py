"""Run a TRACE service as a local child process: the embedded default (`trace-rl demo`), the
integration and e2e tests, and the store benchmarks all start services through this one class.

Each service is `python -m services.<name>` with `TRACE_*` settings in its environment. It binds
OS-chosen ports (0) and reports them through `TRACE_PORTS_FILE`; `start()` returns once the
ports are known and, if asked, once grpc.health.v1 reports SERVING. Output goes to a log file.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trace_common.service.grpc_client import ClientTLS
from trace_common.service.runtime import PORTS_FILE_ENV

START_TIMEOUT_S = 120.0  # generous: a loaded 2-core box imports torch slowly
POLL_S = 0.05
LOG_TAIL_CHARS = 4000  # how much of the log an error message quotes


class LocalService:
    """One service child process with its log file and ports.

    ``env`` is added to a copy of this process's environment with every ``TRACE_*`` variable
    removed, so a setting never leaks from the caller into a child by accident. ``tls`` is how
    to reach a TLS/mTLS server for the health check (None: plaintext). ``argv`` replaces the
    default command ``python -m <module>`` (e.g. the console script ``trace-rl serve <name>``).
    """

    def __init__(
        self,
        name: str,
        module: str,
        env: Mapping[str, str],
        log_dir: pathlib.Path,
        *,
        tls: ClientTLS | None = None,
        argv: Sequence[str] | None = None,
    ) -> None:
        self.name = name
        self.module = module
        self.tls = tls
        self.argv = list(argv) if argv is not None else [sys.executable, "-m", module]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self.ports_file = log_dir / f".{name}.ports.json"
        base = {k: v for k, v in os.environ.items() if not k.startswith("TRACE_")}
        self.env = {
            **base,
            "TRACE_GRPC_HOST": "127.0.0.1",
            "TRACE_HTTP_HOST": "127.0.0.1",
            "TRACE_GRPC_PORT": "0",
            "TRACE_HTTP_PORT": "0",
            "TRACE_DATA_PLANE_PORT": "0",  # weight-sync's bulk listener (others ignore it)
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
        return self.log_path.read_text() if self.log_path.exists() else ""

    def _fail(self, what: str) -> RuntimeError:
        return RuntimeError(f"{self.name} {what}:\n{self.log()[-LOG_TAIL_CHARS:]}")

    def launch(self) -> LocalService:
        """Start the process without waiting (RuntimeError while the last one still runs:
        starting it again would lose track of that one, which would outlive its caller)."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is already running (pid {self.proc.pid})")
        self.ports_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    def wait_ports(self, timeout: float = START_TIMEOUT_S) -> LocalService:
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while not self.ports_file.exists():
            if self.proc.poll() is not None:
                raise self._fail(f"exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise self._fail(f"did not start in {timeout:.0f}s")
            time.sleep(POLL_S)
        ports = json.loads(self.ports_file.read_text())
        self.grpc_port, self.http_port = ports["grpc"], ports["http"]
        return self

    def _channel(self) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(self.grpc_address)
        return grpc.secure_channel(self.grpc_address, self.tls.credentials())

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> LocalService:
        deadline = time.monotonic() + timeout
        with self._channel() as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            req = health_pb2.HealthCheckRequest(service="")
            while True:
                try:
                    if stub.Check(req, timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass  # not listening yet, or still starting up
                if self.proc is not None and self.proc.poll() is not None:
                    raise self._fail(f"exited with {self.proc.returncode}")
                if time.monotonic() > deadline:
                    raise self._fail("never became SERVING")
                time.sleep(POLL_S)

    def start(self, *, serving: bool = True, timeout: float = START_TIMEOUT_S) -> LocalService:
        """Launch and wait for the ports (and SERVING); a failed start stops the process."""
        try:
            self.launch().wait_ports(timeout)
            return self.wait_serving(timeout) if serving else self
        except BaseException:
            self.stop()
            raise

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the crash a fault-tolerance test simulates."""
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (graceful shutdown), SIGKILL after ``timeout``; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.ports_file.unlink(missing_ok=True)
        return self.proc.returncode

    def __enter__(self) -> LocalService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def local_stores(
    token: str, log_dir: pathlib.Path, *, keep_versions: int = 2, redis_bytes: int = 1 << 30
) -> Iterator[dict[str, str]]:
    """A local Redis, quant-cache and weight-sync for as long as the block runs (benchmarks,
    GPU tests). Yields the settings a rollout or trainer needs to reach them (token and
    both addresses, as TRACE_* variables); everything is stopped at the end."""
    from trace_common.stores.redis_local import LocalRedis, LocalRedisConfig

    redis = LocalRedis(LocalRedisConfig(maxmemory_bytes=redis_bytes)).start()
    qc = LocalService("quant-cache", "services.quant_cache",
                      {"TRACE_AUTH_TOKEN": token, "TRACE_REDIS_URL": redis.url}, log_dir)  # fmt: skip
    ws = LocalService("weight-sync", "services.weight_sync",
                      {"TRACE_AUTH_TOKEN": token, "TRACE_KEEP_VERSIONS": str(keep_versions)},
                      log_dir)  # fmt: skip
    try:
        for svc in (qc.launch(), ws.launch()):
            svc.wait_ports().wait_serving()
        yield {
            "TRACE_AUTH_TOKEN": token,
            "TRACE_WEIGHT_SYNC_ADDRESS": ws.grpc_address,
            "TRACE_QUANT_CACHE_ADDRESS": qc.grpc_address,
        }
    finally:
        for svc in (ws, qc):
            svc.stop()
        redis.stop()
