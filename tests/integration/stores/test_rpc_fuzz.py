"""Every RPC of quant-cache and weight-sync (real subprocesses, real Redis, gRPC over
loopback) driven with malformed and random messages: a message that does not parse gets
INVALID_ARGUMENT, nothing gets INTERNAL or UNKNOWN, and the services stay up."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2
from trace_common.service.grpc_server import AUTH_HEADER
from trace_common.service.testing import ServiceProcess
from trace_common.stores.redis_local import LocalRedis

TOKEN = "fuzz-token"
META = ((AUTH_HEADER, f"Bearer {TOKEN}"),)
SERVICES = {
    "quant_cache": quantcache_pb2.DESCRIPTOR.services_by_name["QuantCache"],
    "weight_sync": weightsync_pb2.DESCRIPTOR.services_by_name["WeightSync"],
}
METHODS = [(svc, m) for svc, d in SERVICES.items() for m in d.methods]
NEVER = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
# Bytes that are no protobuf message: a truncated varint, a bad wire type, a length past the end.
MALFORMED = [b"\x08", b"\x0f\x01", b"\x0a\x7f\x01", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"]


@pytest.fixture(scope="module")
def channels() -> Iterator[dict[str, tuple[grpc.Channel, ServiceProcess]]]:
    with LocalRedis() as redis_server:
        qc = ServiceProcess(
            "services.quant_cache", {"TRACE_AUTH_TOKEN": TOKEN, "TRACE_REDIS_URL": redis_server.url}
        ).start()
        ws = ServiceProcess("services.weight_sync", {"TRACE_AUTH_TOKEN": TOKEN}).start()
        try:
            yield {
                "quant_cache": (grpc.insecure_channel(qc.grpc_address), qc),
                "weight_sync": (grpc.insecure_channel(ws.grpc_address), ws),
            }
        finally:
            qc.stop()
            ws.stop()


def _call(channel: grpc.Channel, service: str, method, messages: list[bytes]) -> grpc.StatusCode:
    """Send raw message bytes to `method`; the status code it ends with."""
    path = f"/{SERVICES[service].full_name}/{method.name}"
    kind = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }[(method.client_streaming, method.server_streaming)]
    call = kind(path)
    request = iter(messages) if method.client_streaming else messages[0]
    try:
        reply = call(request, metadata=META, timeout=10)
        if method.server_streaming:
            for _ in reply:
                pass
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def _alive(proc: ServiceProcess) -> bool:
    with grpc.insecure_channel(proc.grpc_address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return proc.alive() and reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(("service", "method"), METHODS, ids=lambda x: getattr(x, "name", x))
@pytest.mark.parametrize("raw", MALFORMED)
def test_a_message_that_does_not_parse_is_invalid_argument(channels, service, method, raw) -> None:
    channel, _ = channels[service]
    code = _call(channel, service, method, [raw])
    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{method.name} {raw!r}: {code}"


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    target=st.sampled_from(METHODS),
    messages=st.lists(st.binary(max_size=64), min_size=1, max_size=3),
)
def test_random_messages_never_get_internal_or_unknown(channels, target, messages) -> None:
    service, method = target
    channel, _ = channels[service]
    code = _call(channel, service, method, messages)
    assert code not in NEVER, f"{method.name} {messages!r}: {code}"


def test_services_survive_the_fuzzing(channels) -> None:
    for _, proc in channels.values():
        assert _alive(proc)
