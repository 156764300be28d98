"""Start a service as a real subprocess for integration tests and benchmarks.

    with ServiceProcess("services.quant_cache", {"TRACE_AUTH_TOKEN": "t"}) as svc:
        client = QuantCacheClient(svc.grpc_address, "t")

Ports are chosen by the OS (port 0) and read back from the file the runtime writes
(`TRACE_PORTS_FILE`); `start` returns once grpc.health.v1 reports SERVING.
"""

from __future__ import annotations

import pathlib
import tempfile
from collections.abc import Mapping

from trace_common.service.grpc_client import ClientTLS
from trace_common.service.process import LocalService

START_TIMEOUT_S = 30.0


class ServiceProcess(LocalService):
    """A `LocalService` whose log lives in a private temporary folder, removed on `stop`."""

    def __init__(
        self,
        module: str,
        env: Mapping[str, str],
        *,
        timeout: float = START_TIMEOUT_S,
        tls: ClientTLS | None = None,
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="trace-svc-")
        self.timeout = timeout
        name = module.rsplit(".", 1)[-1]
        super().__init__(name, module, env, pathlib.Path(self._tmp.name), tls=tls)

    def start(self, *, serving: bool = True, timeout: float | None = None) -> ServiceProcess:
        super().start(serving=serving, timeout=self.timeout if timeout is None else timeout)
        return self

    def stop(self, timeout: float = 15.0) -> int | None:
        code = super().stop(timeout)
        self._tmp.cleanup()
        return code
