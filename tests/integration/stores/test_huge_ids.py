"""An id far over its length limit (1 MiB, under the 64 MiB message limit) sent to every RPC
that takes one gets INVALID_ARGUMENT naming the field and its limit, and the error quotes
only a short prefix of the id: a quoted 1 MiB id made the status message too large for the
client's metadata limit, which the client reported as RESOURCE_EXHAUSTED. Real quant-cache and
weight-sync subprocesses, the rollout servicer in-process; gRPC over loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest

from services.rollout.servicer import RolloutServicer
from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2 as qc_pb
from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2_grpc as qc_grpc
from trace_common.protos_gen.trace.rollout.v1 import rollout_pb2 as ro_pb
from trace_common.protos_gen.trace.rollout.v1 import rollout_pb2_grpc as ro_grpc
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as ws_pb
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2_grpc as ws_grpc
from trace_common.rollout import EngineHolder
from trace_common.service import Metrics, ServiceSettings
from trace_common.service.grpc_server import AUTH_HEADER, GrpcServer
from trace_common.service.testing import ServiceProcess
from trace_common.stores.redis_local import LocalRedis

TOKEN = "huge-id-token"
META = ((AUTH_HEADER, f"Bearer {TOKEN}"),)
HUGE = "a" * (1 << 20)  # 1 MiB: over every id limit, far under the message limit
MAX_DETAILS_CHARS = 400  # the error names field and rule and quotes a short prefix only


@pytest.fixture(scope="module")
def stubs() -> Iterator[dict[str, object]]:
    settings = ServiceSettings(auth_token=TOKEN, grpc_host="127.0.0.1", grpc_port=0)
    rollout = GrpcServer(settings, Metrics("rollout"))
    servicer = RolloutServicer("rep-a", EngineHolder(), None, metrics=Metrics("rollout"))
    rollout.add(ro_grpc.add_RolloutServicer_to_server, servicer, "trace.rollout.v1.Rollout")
    port = rollout.start()
    with LocalRedis() as redis_server:
        qc = ServiceProcess(
            "services.quant_cache", {"TRACE_AUTH_TOKEN": TOKEN, "TRACE_REDIS_URL": redis_server.url}
        ).start()
        ws = ServiceProcess("services.weight_sync", {"TRACE_AUTH_TOKEN": TOKEN}).start()
        channels = [grpc.insecure_channel(a) for a in (qc.grpc_address, ws.grpc_address)]
        channels.append(grpc.insecure_channel(f"127.0.0.1:{port}"))
        try:
            yield {
                "qc": qc_grpc.QuantCacheStub(channels[0]),
                "ws": ws_grpc.WeightSyncStub(channels[1]),
                "rollout": ro_grpc.RolloutStub(channels[2]),
            }
        finally:
            for ch in channels:
                ch.close()
            qc.stop()
            ws.stop()
            rollout.stop(0)


def _put(stub, run_id: str = "run", sample_id: str = "s0"):
    key = qc_pb.RecordKey(run_id=run_id, policy_version=0, sample_id=sample_id)
    chunk = qc_pb.PutRecordsChunk(key=key, total_bytes=1, crc32=0xE8B7BE43, data=b"a")
    return stub.PutRecords(iter([chunk]), metadata=META, timeout=10)


def _generate(stub, **ids: str):
    request = ro_pb.GenerateRequest(
        prompts=[ro_pb.Prompt(token_ids=[1, 2])],
        group_size=1,
        run_id=ids.get("run_id", "run"),
        sample_id_prefix=ids.get("sample_id_prefix", "s0"),
    )
    return list(stub.Generate(request, metadata=META, timeout=10))


# (name, call, field, limit): one call per id field of every RPC that takes one.
CASES: list[tuple[str, Callable[[dict], object], str, int]] = [
    ("PutRecords.run_id", lambda s: _put(s["qc"], run_id=HUGE), "run_id", 128),
    ("PutRecords.sample_id", lambda s: _put(s["qc"], sample_id=HUGE), "sample_id", 256),
    (
        "GetRecords.run_id",
        lambda s: list(
            s["qc"].GetRecords(
                qc_pb.GetRecordsRequest(run_id=HUGE, sample_ids=["s0"]), metadata=META, timeout=10
            )
        ),
        "run_id",
        128,
    ),
    (
        "GetRecords.sample_ids",
        lambda s: list(
            s["qc"].GetRecords(
                qc_pb.GetRecordsRequest(run_id="run", sample_ids=[HUGE]), metadata=META, timeout=10
            )
        ),
        "sample_id",
        256,
    ),
    (
        "Delete.run_id",
        lambda s: s["qc"].Delete(qc_pb.DeleteRequest(run_id=HUGE), metadata=META, timeout=10),
        "run_id",
        128,
    ),
    (
        "Register.replica_id",
        lambda s: s["ws"].Register(
            ws_pb.RegisterRequest(replica_id=HUGE, address="x:1"), metadata=META, timeout=10
        ),
        "replica_id",
        128,
    ),
    (
        "Heartbeat.replica_id",
        lambda s: s["ws"].Heartbeat(
            ws_pb.HeartbeatRequest(replica_id=HUGE, version_held=-1), metadata=META, timeout=10
        ),
        "replica_id",
        128,
    ),
    (
        "Subscribe.replica_id",
        lambda s: list(
            s["ws"].Subscribe(ws_pb.SubscribeRequest(replica_id=HUGE), metadata=META, timeout=10)
        ),
        "replica_id",
        128,
    ),
    (
        "PullVersion.replica_id",
        lambda s: list(
            s["ws"].PullVersion(
                ws_pb.PullVersionRequest(replica_id=HUGE), metadata=META, timeout=10
            )
        ),
        "replica_id",
        128,
    ),
    (
        "GetPullTicket.replica_id",
        lambda s: s["ws"].GetPullTicket(
            ws_pb.PullTicketRequest(replica_id=HUGE), metadata=META, timeout=10
        ),
        "replica_id",
        128,
    ),
    ("Generate.run_id", lambda s: _generate(s["rollout"], run_id=HUGE), "run_id", 128),
    (
        "Generate.sample_id_prefix",
        lambda s: _generate(s["rollout"], sample_id_prefix=HUGE),
        "sample_id_prefix",
        256,
    ),
]


@pytest.mark.parametrize(("name", "call", "field", "limit"), CASES, ids=[c[0] for c in CASES])
def test_a_huge_id_is_invalid_argument_naming_the_field_and_limit(
    stubs: dict, name: str, call: Callable[[dict], object], field: str, limit: int
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call(stubs)
    err = info.value
    details = err.details() or ""
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {err.code()} {details[:200]}"
    assert details.startswith(f"{field}=") and f"{{1,{limit}}}" in details, details
    assert len(details) < MAX_DETAILS_CHARS, f"{name}: {len(details)} characters of details"


def test_only_a_message_over_the_message_limit_gets_resource_exhausted() -> None:
    """An id under the server's message limit is the service's to judge (INVALID_ARGUMENT);
    a message over the limit is refused by gRPC before any handler runs (RESOURCE_EXHAUSTED)."""
    limit = 2 << 20
    env = {"TRACE_AUTH_TOKEN": TOKEN, "TRACE_MAX_MESSAGE_BYTES": str(limit)}
    with (
        ServiceProcess("services.weight_sync", env) as ws,
        grpc.insecure_channel(ws.grpc_address) as channel,
    ):
        stub = ws_grpc.WeightSyncStub(channel)
        for size, code in [
            (limit - 1024, grpc.StatusCode.INVALID_ARGUMENT),
            (limit + 1024, grpc.StatusCode.RESOURCE_EXHAUSTED),
        ]:
            request = ws_pb.RegisterRequest(replica_id="a" * size, address="x:1")
            with pytest.raises(grpc.RpcError) as info:
                stub.Register(request, metadata=META, timeout=10)
            assert info.value.code() == code, (size, info.value.details())
            assert len(info.value.details() or "") < MAX_DETAILS_CHARS
