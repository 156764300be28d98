"""The HTTP side of every service: /healthz, /readyz, /metrics and a JSON /status (FastAPI),
served by uvicorn on a background thread next to the gRPC server."""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from trace_common.service.metrics import Metrics

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
HIDDEN = "hidden: send 'Authorization: Bearer <token>' to see it"


def build_app(
    component: str,
    metrics: Metrics,
    ready: Callable[[], bool],
    status: Callable[[], dict[str, Any]],
    live: Callable[[], bool] = lambda: True,
    *,
    token: str | None = None,
    private: Collection[str] = (),
) -> FastAPI:
    """FastAPI app: liveness (`live()`: the process is up and its work has not died, e.g.
    the trainer's loop), readiness (`ready()`), metrics, status JSON. A liveness probe
    restarts a process whose /healthz answers 503.

    /healthz, /readyz and /metrics stay open (probes, scraping). The `private` keys of
    /status (internal addresses) are shown only to a request bearing `token`, the services'
    shared bearer token; others see HIDDEN in their place."""
    bearer = None if token is None else f"bearer {token}".encode()

    def authorized(request: Request) -> bool:
        if bearer is None:
            return True
        got = request.headers.get("authorization", "").encode()
        return hmac.compare_digest(got[:7].lower() + got[7:], bearer)

    app = FastAPI(title=f"trace {component}", docs_url=None, redoc_url=None)
    started = time.time()

    @app.get("/healthz")
    def healthz() -> Response:
        try:
            ok = bool(live())
        except Exception:
            ok = False
        return JSONResponse(
            {"status": "ok" if ok else "failed", "component": component},
            status_code=200 if ok else 503,
        )

    @app.get("/readyz")
    def readyz() -> Response:
        ok = ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/status")
    def status_json(request: Request) -> dict[str, Any]:
        body = {"component": component, "uptime_seconds": time.time() - started, **status()}
        if private and not authorized(request):
            body.update({k: HIDDEN for k in private if k in body})
        return body

    return app


class HttpServer:
    """uvicorn on a daemon thread; `stop()` asks it to exit and waits."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="http", daemon=True)

    def start(self, timeout: float = 10.0) -> int:
        """Start and return the bound port."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("HTTP server failed to start (port in use?)")
            time.sleep(0.01)
        sockets = self._server.servers[0].sockets
        return sockets[0].getsockname()[1]

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
