"""ServiceRuntime: the few lines every service's `main` needs.

    settings = load_settings(MySettings)
    rt = ServiceRuntime("my_service", settings)
    rt.grpc.add(add_MyServicer_to_server, MyServicer(..., rt.metrics), "trace.my.v1.My")
    rt.run(ready=lambda: True, status=lambda: {...})   # blocks until SIGTERM/SIGINT

`run` starts gRPC and HTTP, keeps grpc.health.v1 in step with `ready()`, and on a signal
turns health to NOT_SERVING, drains in-flight RPCs for `grace_seconds`, then stops.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Collection
from typing import Any

from trace_common.service.config import ServiceSettings
from trace_common.service.grpc_server import GrpcServer
from trace_common.service.http import HttpServer, build_app
from trace_common.service.logs import setup_logging
from trace_common.service.metrics import Metrics

log = logging.getLogger(__name__)

READY_POLL_S = 1.0  # how often gRPC health follows ready()
PORTS_FILE_ENV = "TRACE_PORTS_FILE"  # optional: write {"grpc": p, "http": p} here once bound


class ServiceRuntime:
    """Owns the metrics registry, the gRPC server and the HTTP app of one service process."""

    def __init__(self, component: str, settings: ServiceSettings) -> None:
        setup_logging(component, settings.log_level, settings.log_json)
        self.component = component
        self.settings = settings
        self.metrics = Metrics(component)
        self.grpc = GrpcServer(settings, self.metrics)
        self.stopping = threading.Event()
        # Run before draining RPCs (e.g. end long-lived streams) and after the servers
        # stopped (e.g. stop a local Redis the service started).
        self.before_drain: list[Callable[[], None]] = []
        self.after_stop: list[Callable[[], None]] = []

    def run(
        self,
        ready: Callable[[], bool] = lambda: True,
        status: Callable[[], dict[str, Any]] = dict,
        *,
        live: Callable[[], bool] = lambda: True,
        private_status: Collection[str] = (),
        install_signals: bool = True,
    ) -> None:
        """Serve until SIGTERM/SIGINT (or `stopping` is set), then shut down gracefully.
        `live()` False turns /healthz to 503 (liveness: restart me); the `private_status`
        keys of /status are shown only with the bearer token."""
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stopping.set())
        grpc_port = self.grpc.start()
        http = None
        http_port = 0
        if self.settings.http_enabled:
            app = build_app(
                self.component, self.metrics, ready, status, live,
                token=self.settings.token(), private=private_status,
            )  # fmt: skip
            http = HttpServer(app, self.settings.http_host, self.settings.http_port)
            http_port = http.start()
        self._announce(grpc_port, http_port)
        was_ready = None
        while not self.stopping.is_set():
            now_ready = _safe(ready)
            if now_ready != was_ready:
                self.grpc.set_serving(now_ready)
                log.info("readiness changed", extra={"ready": now_ready})
                was_ready = now_ready
            self.stopping.wait(READY_POLL_S)
        log.info("shutting down", extra={"grace_seconds": self.settings.grace_seconds})
        for hook in self.before_drain:
            hook()
        self.grpc.stop()
        if http is not None:
            http.stop()
        for hook in self.after_stop:
            hook()
        log.info("stopped")

    def _announce(self, grpc_port: int, http_port: int) -> None:
        log.info("serving", extra={"grpc_port": grpc_port, "http_port": http_port})
        path = os.environ.get(PORTS_FILE_ENV)
        if path:
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                json.dump({"grpc": grpc_port, "http": http_port}, f)
            os.replace(tmp, path)


def _safe(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except Exception:
        log.exception("readiness check failed")
        return False
