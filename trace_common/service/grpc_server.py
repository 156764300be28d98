"""gRPC server construction shared by every service: auth on every RPC, error mapping,
per-method metrics, message-size limits, health (grpc.health.v1), reflection, TLS/mTLS."""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from trace_common.service.config import ServiceSettings
from trace_common.service.errors import ServiceError, cut_details, from_upstream
from trace_common.service.metrics import Metrics

log = logging.getLogger(__name__)

AUTH_HEADER = "authorization"
BEARER = "bearer "
_EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


KEEPALIVE_MS = 30_000  # clients ping an idle connection (e.g. a quiet Subscribe) this often


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Client channel options: message limits and keepalive pings."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def server_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Server options: message limits, and accept the clients' keepalive pings (the default
    minimum of 5 minutes would answer them with GOAWAY too_many_pings)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


class _Malformed:
    """Stands in for a request message that did not parse (see `_tolerant`)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """`deserialize`, returning a `_Malformed` instead of raising: gRPC would answer a
    deserializer's exception with INTERNAL, but a malformed message is the client's fault
    (INVALID_ARGUMENT, raised by `_checked` inside the handler)."""
    if deserialize is None:
        return None

    def run(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as exc:
            return _Malformed(f"{type(exc).__name__}: {exc}")

    return run


def _malformed(item: _Malformed) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"malformed request message (not the method's protobuf type): {item.error}",
    )


class _Requests:
    """A request stream whose messages are checked (`_checked`); `ended` once the stream
    ran out, which is also how a cancelled client's stream looks at first."""

    def __init__(self, request: Any) -> None:
        self._request = iter(request)
        self.ended = False

    def __iter__(self) -> _Requests:
        return self

    def __next__(self) -> Any:
        try:
            item = next(self._request)
        except StopIteration:
            self.ended = True
            raise
        if isinstance(item, _Malformed):
            raise _malformed(item)
        return item


def _checked(request: Any, request_streaming: bool) -> Any:
    """The request, or ServiceError(INVALID_ARGUMENT) for a message that did not parse
    (for a request stream: when the iterator reaches it)."""
    if request_streaming:
        return _Requests(request)
    if isinstance(request, _Malformed):
        raise _malformed(request)
    return request


def _replace_behavior(
    handler: grpc.RpcMethodHandler, wrap: Callable[[Callable, bool], Callable]
) -> grpc.RpcMethodHandler:
    """Return `handler` with its behaviour wrapped (`wrap(fn, response_streaming)`) and a
    request deserializer that marks malformed messages instead of raising."""
    deserialize = _tolerant(handler.request_deserializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            wrap(handler.unary_unary, False), deserialize, handler.response_serializer
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            wrap(handler.unary_stream, True), deserialize, handler.response_serializer
        )
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            wrap(handler.stream_unary, False), deserialize, handler.response_serializer
        )
    return grpc.stream_stream_rpc_method_handler(
        wrap(handler.stream_stream, True), deserialize, handler.response_serializer
    )


class _CodecServer:
    """Stands in for the grpc.Server during a generated `add_*_to_server`: registers its
    method handlers with some (de)serializers replaced."""

    def __init__(
        self, server: grpc.Server, codecs: Mapping[str, Mapping[str, Callable[[Any], Any]]]
    ) -> None:
        self._server = server
        self._codecs = codecs

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # registered in add_registered_method_handlers, with the codecs applied

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        unknown = set(self._codecs) - set(handlers)
        if unknown:
            raise ValueError(f"codecs for unknown methods of {service}: {sorted(unknown)}")
        handlers = {m: h._replace(**self._codecs.get(m, {})) for m, h in handlers.items()}
        generic = grpc.method_handlers_generic_handler(service, handlers)
        self._server.add_generic_rpc_handlers((generic,))
        self._server.add_registered_method_handlers(service, handlers)


class ServiceInterceptor(grpc.ServerInterceptor):
    """Checks the bearer token of every RPC (UNAUTHENTICATED otherwise), maps `ServiceError`
    to its status code, a malformed request message to INVALID_ARGUMENT, a failed call to
    another service (grpc.RpcError) to that call's code (`from_upstream`), and records
    per-method request counts and latencies. Status messages are cut to MAX_DETAILS_CHARS
    (`cut_details`): a longer one could exceed the client's metadata limit.
    A call the client cancelled (or whose deadline passed) is counted as CANCELLED
    (DEADLINE_EXCEEDED), whatever the handler did after."""

    def __init__(self, token: str, metrics: Metrics, exempt_health: bool = True) -> None:
        self._token = f"{BEARER}{token}".encode()
        self._exempt_health = exempt_health
        self._requests = metrics.counter(
            "grpc_requests", "gRPC requests by method and status code", ("method", "code")
        )
        self._latency = metrics.histogram(
            "grpc_request_seconds",
            "gRPC request latency (streams: until the last message)",
            ("method",),
        )

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        if self._exempt_health and details.method.startswith(_EXEMPT_PREFIXES):
            return True
        for key, value in details.invocation_metadata or ():
            if key == AUTH_HEADER:
                got = value.encode() if isinstance(value, str) else value
                # Case-insensitive scheme, constant-time token comparison.
                return hmac.compare_digest(
                    got[: len(BEARER)].lower() + got[len(BEARER) :], self._token
                )
        return False

    def intercept_service(
        self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if not self._authorized(handler_call_details):
            self._requests.labels(method, "UNAUTHENTICATED").inc()

            def deny(_request: Any, context: grpc.ServicerContext) -> Any:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

            return _replace_behavior(handler, lambda _fn, _streaming: deny)
        request_streaming = bool(handler.request_streaming)
        return _replace_behavior(
            handler, lambda fn, streaming: self._wrap(method, fn, streaming, request_streaming)
        )

    def _finish(self, method: str, start: float, code: str) -> None:
        self._latency.labels(method).observe(time.perf_counter() - start)
        self._requests.labels(method, code).inc()

    def _wrap(
        self, method: str, fn: Callable, streaming: bool, request_streaming: bool = False
    ) -> Callable:
        def _abort(
            context: grpc.ServicerContext, start: float, err: ServiceError, request: Any
        ) -> None:
            ended = _ended_by_client(context, request)
            if ended is not None:  # whatever the handler raised, the client had gone
                err = ServiceError(ended, "the client ended the call")
            self._finish(method, start, err.code.name)
            context.abort(err.code, cut_details(err.message))

        def _failed(
            context: grpc.ServicerContext, start: float, exc: Exception, request: Any
        ) -> None:
            ended = _ended_by_client(context, request)
            self._finish(method, start, ended.name if ended else _code_of(context, exc))

        def _done(context: grpc.ServicerContext, start: float) -> None:
            # A handler that returns once the client has gone (Subscribe) did not succeed.
            ended = _ended_by_client(context)
            self._finish(method, start, ended.name if ended else "OK")

        if streaming:

            def stream_behavior(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                start = time.perf_counter()
                checked = None
                try:
                    checked = _checked(request, request_streaming)
                    yield from fn(checked, context)
                except GeneratorExit:  # gRPC dropped the stream: the client went away
                    self._finish(method, start, grpc.StatusCode.CANCELLED.name)
                    raise
                except ServiceError as err:
                    _abort(context, start, err, checked)
                except grpc.RpcError as err:  # a call this service made failed
                    _abort(context, start, from_upstream(err), checked)
                except Exception as exc:
                    _failed(context, start, exc, checked)
                    raise
                else:
                    _done(context, start)

            return stream_behavior

        def unary_behavior(request: Any, context: grpc.ServicerContext) -> Any:
            start = time.perf_counter()
            checked = None
            try:
                checked = _checked(request, request_streaming)
                response = fn(checked, context)
            except ServiceError as err:
                _abort(context, start, err, checked)
            except grpc.RpcError as err:  # a call this service made failed, or the
                _abort(context, start, from_upstream(err), checked)  # request stream's client
            except Exception as exc:
                _failed(context, start, exc, checked)
                raise
            _done(context, start)
            return response

        return unary_behavior


# How long a handler that failed after its request stream ended waits to learn whether the
# client cancelled: gRPC ends a cancelled client's request stream first (as if the client
# had finished sending) and marks the call cancelled just after.
CANCEL_SETTLE_S = 0.05


def _ended_by_client(context: grpc.ServicerContext, request: Any = None) -> grpc.StatusCode | None:
    """CANCELLED (or DEADLINE_EXCEEDED) when the call ended on the client's side before the
    handler finished; None while it is still active. `request`: the handler's request (a
    `_Requests` that ended waits up to CANCEL_SETTLE_S for a cancel to show)."""
    if isinstance(request, _Requests) and request.ended:
        deadline = time.monotonic() + CANCEL_SETTLE_S
        while context.is_active() and time.monotonic() < deadline:
            time.sleep(0.005)
    if context.is_active():
        return None
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


def _code_of(context: grpc.ServicerContext, exc: Exception) -> str:
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode):
        return code.name
    log.exception("unhandled error in RPC handler", exc_info=exc)
    return "UNKNOWN"


def server_credentials(settings: ServiceSettings) -> grpc.ServerCredentials | None:
    """TLS credentials from the cert paths (mTLS when a client CA is set), else None."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    pair = (settings.tls_key_file.read_bytes(), settings.tls_cert_file.read_bytes())
    ca = settings.tls_client_ca_file.read_bytes() if settings.tls_client_ca_file else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=ca, require_client_auth=ca is not None
    )


class GrpcServer:
    """A configured grpc.Server with health and reflection; `add` services, then `start`."""

    def __init__(self, settings: ServiceSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=settings.max_workers),
            interceptors=[
                ServiceInterceptor(settings.token(), metrics, settings.auth_exempt_health)
            ],
            options=server_options(settings.max_message_bytes),
            maximum_concurrent_rpcs=None,
        )
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names: list[str] = [health.SERVICE_NAME]
        self.port = 0

    def add(
        self,
        register: Callable[[Any, grpc.Server], None],
        servicer: Any,
        full_name: str,
        codecs: Mapping[str, Mapping[str, Callable[[Any], Any]]] | None = None,
    ) -> None:
        """Register a servicer, e.g. `add(add_QuantCacheServicer_to_server, s, "trace.quantcache.v1.QuantCache")`.

        `codecs` replaces some methods' `request_deserializer` / `response_serializer`, e.g.
        `{"PullVersion": {"response_serializer": f}}`, for messages coded by hand without
        protobuf's copies (trace_common.wire.chunk_wire); the bytes on the wire stay the same."""
        register(servicer, _CodecServer(self.server, codecs) if codecs else self.server)
        self._service_names.append(full_name)

    def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self._service_names]:
            self.health.set(name, status)

    def start(self) -> int:
        """Bind, start, return the bound port (useful when the configured port is 0)."""
        reflection.enable_server_reflection(
            [*self._service_names, reflection.SERVICE_NAME], self.server
        )
        address = f"{self.settings.grpc_host}:{self.settings.grpc_port}"
        creds = server_credentials(self.settings)
        if creds is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, creds)
        if self.port == 0:
            raise RuntimeError(f"could not bind gRPC address {address}")
        self.set_serving(False)
        self.server.start()
        return self.port

    def stop(self, grace: float | None = None) -> None:
        """Stop accepting RPCs, let in-flight ones finish for `grace` seconds."""
        self.set_serving(False)
        self.server.stop(self.settings.grace_seconds if grace is None else grace).wait()
