"""WeightSyncServicer in-process with hand-built messages: validation, atomic publish, registry."""

from __future__ import annotations

import threading
import time
import zlib

import grpc
import pytest

from services.weight_sync.registry import ReplicaRegistry
from services.weight_sync.servicer import PULL_SERIALIZE, PUSH_DESERIALIZE, WeightSyncServicer
from services.weight_sync.versions import MAX_POLICY_VERSION, VersionStore
from trace_common.protos_gen.trace.common.v1 import common_pb2
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb
from trace_common.service import Metrics, ServiceError
from trace_common.wire.chunk_wire import ChunkView

MAX_VERSION = 1 << 20


class Ctx:
    """The part of grpc.ServicerContext the servicer uses."""

    def __init__(self) -> None:
        self.active = True

    def is_active(self) -> bool:
        return self.active


def make(keep: int = 2, timeout_s: float = 30.0) -> WeightSyncServicer:
    return WeightSyncServicer(
        VersionStore(keep),
        ReplicaRegistry(timeout_s),
        Metrics("weight_sync"),
        max_version_bytes=MAX_VERSION,
        chunk_bytes=3,
    )


def spec(
    name: str, data: bytes, dtype: str = "uint8", shape: list[int] | None = None
) -> common_pb2.TensorSpec:
    return common_pb2.TensorSpec(
        name=name,
        dtype=dtype,
        shape=[len(data)] if shape is None else shape,
        nbytes=len(data),
        crc32=zlib.crc32(data),
    )


def header(version: int, tensors: dict[str, bytes], **kw: object) -> pb.VersionHeader:
    specs = [spec(n, d) for n, d in tensors.items()]
    return pb.VersionHeader(
        version=version,
        metadata_json=kw.get("meta", "{}"),
        tensors=specs,
        total_bytes=sum(s.nbytes for s in specs),
    )


def messages(version: int, tensors: dict[str, bytes]) -> list[pb.PushChunk]:
    out = [pb.PushChunk(header=header(version, tensors))]
    for i, data in enumerate(tensors.values()):
        for off in range(0, len(data), 2):
            out.append(
                pb.PushChunk(
                    chunk=pb.TensorChunk(tensor_index=i, offset=off, data=data[off : off + 2])
                )
            )
    return out


def code_of(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(ServiceError) as err:
        fn()
    return err.value.code, err.value.message


TENSORS = {"a": b"abcdefg", "empty": b"", "b": b"\x00\x01\x02"}


def pull(s: WeightSyncServicer, request: pb.PullVersionRequest) -> list[pb.PullChunk]:
    """PullVersion's messages, parsed: chunks come as PullChunk wire bytes (chunk_wire)."""
    return [
        pb.PullChunk.FromString(m) if isinstance(m, bytes) else m
        for m in s.PullVersion(request, Ctx())
    ]


def test_pushed_chunk_views_are_kept_as_pull_messages() -> None:
    """Chunks decoded by the service's PushVersion codec are stored as their wire bytes."""
    s = make()
    wire = [pb.PushChunk(header=header(2, {"a": b"abc", "b": b"de"}))]
    wire += [
        pb.PushChunk(chunk=pb.TensorChunk(tensor_index=i, offset=0, data=d))
        for i, d in enumerate((b"abc", b"de"))
    ]
    raw = [m.SerializeToString() for m in wire]
    decoded = [PUSH_DESERIALIZE(r) for r in raw]
    assert isinstance(decoded[1], ChunkView) and bytes(decoded[1].data) == b"abc"
    s.PushVersion(iter(decoded), Ctx())
    sent = list(s.PullVersion(pb.PullVersionRequest(replica_id="r0"), Ctx()))
    assert sent[1] is raw[1] and sent[2] is raw[2]  # the received bytes, no copy
    assert [PULL_SERIALIZE(m) for m in sent[1:]] == raw[1:]


def test_push_then_pull_in_chunks() -> None:
    s = make()
    response = s.PushVersion(iter(messages(5, TENSORS)), Ctx())
    assert response.published.version == 5 and response.published.num_tensors == 3
    pulled = pull(s, pb.PullVersionRequest(replica_id="r0"))
    assert pulled[0].header.version == 5
    data: dict[int, bytes] = {}
    for m in pulled[1:]:
        assert m.chunk.offset == len(data.get(m.chunk.tensor_index, b""))
        data[m.chunk.tensor_index] = data.get(m.chunk.tensor_index, b"") + m.chunk.data
    assert data == {0: b"abcdefg", 2: b"\x00\x01\x02"}
    assert max(len(m.chunk.data) for m in pulled[1:]) <= 3  # chunk_bytes
    # A push chunk larger than chunk_bytes is re-cut for pulls.
    big = [
        pb.PushChunk(header=header(6, {"a": b"abcdefg"})),
        pb.PushChunk(chunk=pb.TensorChunk(tensor_index=0, data=b"abcdefg")),
    ]
    s.PushVersion(iter(big), Ctx())
    pulled = pull(s, pb.PullVersionRequest(replica_id="r0", version=6))[1:]
    assert [(m.chunk.offset, m.chunk.data) for m in pulled] == [(0, b"abc"), (3, b"def"), (6, b"g")]


def bad_dtype() -> list[pb.PushChunk]:
    h = header(1, {"a": b"ab"})
    h.tensors[0].dtype = "float3"
    return [pb.PushChunk(header=h)]


def wrong_nbytes() -> list[pb.PushChunk]:
    h = header(1, {"a": b"abcd"})
    h.tensors[0].dtype, h.tensors[0].shape[:] = "bfloat16", [3]
    return [pb.PushChunk(header=h)]


def with_header(**changes: object) -> list[pb.PushChunk]:
    msgs = messages(1, {"a": b"ab"})
    for k, v in changes.items():
        setattr(msgs[0].header, k, v)
    return msgs


def dup_names() -> list[pb.PushChunk]:
    h = header(1, {"a": b"ab"})
    h.tensors.append(h.tensors[0])
    h.total_bytes = 4
    return [pb.PushChunk(header=h)]


def out_of_order() -> list[pb.PushChunk]:
    msgs = messages(1, {"a": b"abcd"})
    msgs[1], msgs[2] = msgs[2], msgs[1]
    return msgs


@pytest.mark.parametrize(
    ("msgs", "code", "needle"),
    [
        ([], grpc.StatusCode.INVALID_ARGUMENT, "must be a header"),
        (messages(1, {"a": b"ab"})[1:], grpc.StatusCode.INVALID_ARGUMENT, "must be a header"),
        (with_header(version=-2), grpc.StatusCode.INVALID_ARGUMENT, "version=-2"),
        (
            [pb.PushChunk(header=pb.VersionHeader(version=1))],
            grpc.StatusCode.INVALID_ARGUMENT,
            "no tensors",
        ),
        (with_header(metadata_json="{oops"), grpc.StatusCode.INVALID_ARGUMENT, "metadata_json"),
        (with_header(metadata_json="[1]"), grpc.StatusCode.INVALID_ARGUMENT, "JSON object"),
        (with_header(total_bytes=99), grpc.StatusCode.INVALID_ARGUMENT, "total_bytes=99"),
        (bad_dtype(), grpc.StatusCode.INVALID_ARGUMENT, "unsupported dtype 'float3'"),
        (wrong_nbytes(), grpc.StatusCode.INVALID_ARGUMENT, "nbytes=4"),
        (dup_names(), grpc.StatusCode.INVALID_ARGUMENT, "appears twice"),
        (
            [pb.PushChunk(header=header(1, {"big": bytes(MAX_VERSION + 1)}))],
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"max_version_bytes={MAX_VERSION}",
        ),
        (out_of_order(), grpc.StatusCode.INVALID_ARGUMENT, "out-of-order chunk"),
        (
            messages(1, {"a": b"abcd"})[:2],
            grpc.StatusCode.INVALID_ARGUMENT,
            "stream ended in tensor 0 of 1",
        ),
        (
            [*messages(1, {"a": b"ab"}), pb.PushChunk(header=header(1, {"a": b"ab"}))],
            grpc.StatusCode.INVALID_ARGUMENT,
            "second header",
        ),
        (
            [
                *messages(1, {"a": b"ab"}),
                pb.PushChunk(chunk=pb.TensorChunk(tensor_index=0, data=b"x")),
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "after all 1 tensors",
        ),
    ],
)
def test_push_rejects_bad_input(
    msgs: list[pb.PushChunk], code: grpc.StatusCode, needle: str
) -> None:
    s = make()
    got, message = code_of(lambda: s.PushVersion(iter(msgs), Ctx()))
    assert got == code and needle in message, message
    assert s.versions.latest() is None, "nothing published"
    # The version number is free again after a failed push.
    assert s.PushVersion(iter(messages(1, {"a": b"ab"})), Ctx()).published.version == 1


def test_checksum_mismatch_is_data_loss_and_unpublished() -> None:
    s = make()
    msgs = messages(1, {"a": b"abcd"})
    msgs[2].chunk.data = b"XX"
    code, message = code_of(lambda: s.PushVersion(iter(msgs), Ctx()))
    assert code == grpc.StatusCode.DATA_LOSS and "tensor 'a'" in message
    assert s.versions.latest() is None


def test_stale_and_concurrent_pushes_fail_precondition() -> None:
    s = make()
    s.PushVersion(iter(messages(3, TENSORS)), Ctx())
    code, message = code_of(lambda: s.PushVersion(iter(messages(3, TENSORS)), Ctx()))
    assert (
        code == grpc.StatusCode.FAILED_PRECONDITION
        and "not newer than the latest published version 3" in message
    )
    # A push of version 4 in flight blocks a second push of 4.
    gate = threading.Event()
    msgs = messages(4, TENSORS)

    def slow() -> object:
        yield msgs[0]
        gate.wait(5)
        yield from msgs[1:]

    t = threading.Thread(target=lambda: s.PushVersion(slow(), Ctx()))
    t.start()
    time.sleep(0.1)
    code, message = code_of(lambda: s.PushVersion(iter(messages(4, TENSORS)), Ctx()))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "already being pushed" in message
    assert s.versions.latest_version() == 3, "in-flight version is invisible"
    gate.set()
    t.join(5)
    assert s.versions.latest_version() == 4


def test_pull_validation_and_keep_last_k() -> None:
    s = make(keep=2)
    code, message = code_of(
        lambda: list(s.PullVersion(pb.PullVersionRequest(replica_id="r0"), Ctx()))
    )
    assert code == grpc.StatusCode.NOT_FOUND and "no version has been published" in message
    for v in (1, 2, 3):
        s.PushVersion(iter(messages(v, TENSORS)), Ctx())
    assert [v.version for v in s.ListVersions(pb.ListVersionsRequest(), Ctx()).versions] == [2, 3]
    code, message = code_of(
        lambda: list(s.PullVersion(pb.PullVersionRequest(replica_id="r0", version=1), Ctx()))
    )
    assert code == grpc.StatusCode.NOT_FOUND and "kept: [2, 3]" in message
    assert (
        code_of(
            lambda: list(s.PullVersion(pb.PullVersionRequest(replica_id="r0", version=-1), Ctx()))
        )[0]
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (
        code_of(lambda: list(s.PullVersion(pb.PullVersionRequest(replica_id="bad id"), Ctx())))[0]
        == grpc.StatusCode.INVALID_ARGUMENT
    )


def test_a_pull_names_its_replica() -> None:
    """Pulls are counted per replica (pull_bytes, data-plane tickets): a pull without a
    replica_id is INVALID_ARGUMENT on both paths."""
    s = make()
    s.PushVersion(iter(messages(1, TENSORS)), Ctx())
    for call in (
        lambda: list(s.PullVersion(pb.PullVersionRequest(), Ctx())),
        lambda: list(s.PullVersion(pb.PullVersionRequest(version=1), Ctx())),
        lambda: s.GetPullTicket(pb.PullTicketRequest(version=1), Ctx()),
    ):
        code, message = code_of(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and message.startswith("replica_id="), (
            message
        )
    assert pull(s, pb.PullVersionRequest(replica_id="trainer"))[0].header.version == 1


def test_registry_validation_and_liveness() -> None:
    s = make(timeout_s=0.2)
    assert (
        code_of(lambda: s.Register(pb.RegisterRequest(replica_id="", address="x:1"), Ctx()))[0]
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (
        code_of(lambda: s.Register(pb.RegisterRequest(replica_id="r", address="x" * 300), Ctx()))[0]
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    code, message = code_of(
        lambda: s.Heartbeat(pb.HeartbeatRequest(replica_id="ghost", version_held=1), Ctx())
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "'ghost' is not registered" in message
    code, _ = code_of(lambda: list(s.Subscribe(pb.SubscribeRequest(replica_id="ghost"), Ctx())))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert s.Register(pb.RegisterRequest(replica_id="r", address="x:1"), Ctx()).latest_version == -1
    assert (
        code_of(lambda: s.Heartbeat(pb.HeartbeatRequest(replica_id="r", version_held=-2), Ctx()))[0]
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    s.PushVersion(iter(messages(7, TENSORS)), Ctx())
    assert (
        s.Heartbeat(pb.HeartbeatRequest(replica_id="r", version_held=5), Ctx()).latest_version == 7
    )
    (info,) = s.ListReplicas(pb.ListReplicasRequest(), Ctx()).replicas
    assert info.alive and info.version_held == 5 and info.version_lag == 2
    time.sleep(0.3)
    (info,) = s.ListReplicas(pb.ListReplicasRequest(), Ctx()).replicas
    assert not info.alive and info.seconds_since_heartbeat >= 0.2


def test_version_held_is_a_version_that_could_have_been_published() -> None:
    """Versions live in memory: a restarted weight-sync knows none, so a replica's heartbeat
    of an older version than any this one published (or of one it never saw) is accepted;
    only numbers no push can publish are refused, naming the value and the bound."""
    s = make()
    s.Register(pb.RegisterRequest(replica_id="r", address="x:1"), Ctx())
    # A fresh weight-sync (latest -1) and a replica still serving version 5 from before.
    assert (
        s.Heartbeat(pb.HeartbeatRequest(replica_id="r", version_held=5), Ctx()).latest_version == -1
    )
    assert s.Heartbeat(pb.HeartbeatRequest(replica_id="r", version_held=-1), Ctx())
    for held in (MAX_POLICY_VERSION + 1, 2**63 - 1):
        code, message = code_of(
            lambda held=held: s.Heartbeat(
                pb.HeartbeatRequest(replica_id="r", version_held=held), Ctx()
            )
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT, held
        assert f"version_held={held}" in message and str(MAX_POLICY_VERSION) in message, message
    s.Heartbeat(pb.HeartbeatRequest(replica_id="r", version_held=MAX_POLICY_VERSION), Ctx())
    (info,) = s.ListReplicas(pb.ListReplicasRequest(), Ctx()).replicas
    assert info.version_held == MAX_POLICY_VERSION


def test_a_version_past_the_bound_is_not_published() -> None:
    """A push of 2**63 - 1 would make ListReplicas' lag of a replica at -1 overflow int64."""
    s = make()
    code, message = code_of(lambda: s.PushVersion(iter(messages(2**63 - 1, TENSORS)), Ctx()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and str(MAX_POLICY_VERSION) in message
    s.PushVersion(iter(messages(MAX_POLICY_VERSION, TENSORS)), Ctx())
    s.Register(pb.RegisterRequest(replica_id="r", address="x:1"), Ctx())
    (info,) = s.ListReplicas(pb.ListReplicasRequest(), Ctx()).replicas
    assert info.version_lag == MAX_POLICY_VERSION + 1


def test_subscribe_sends_latest_then_new_and_ends_on_shutdown() -> None:
    s = make()
    s.Register(pb.RegisterRequest(replica_id="r", address="x:1"), Ctx())
    s.PushVersion(iter(messages(1, TENSORS)), Ctx())
    stream = s.Subscribe(pb.SubscribeRequest(replica_id="r"), Ctx())
    assert next(stream).version == 1
    threading.Timer(0.1, lambda: s.PushVersion(iter(messages(2, TENSORS)), Ctx())).start()
    assert next(stream).version == 2
    threading.Timer(0.1, s.shutdown).start()
    assert list(stream) == []


def test_silent_replicas_are_forgotten_with_their_metric_series() -> None:
    metrics = Metrics("weight_sync")
    registry = ReplicaRegistry(0.05, expire_after_s=0.2, max_replicas=3)
    s = WeightSyncServicer(
        VersionStore(2), registry, metrics, max_version_bytes=MAX_VERSION, chunk_bytes=3
    )
    for rid in ("a", "b", "c"):
        s.Register(pb.RegisterRequest(replica_id=rid, address=f"{rid}:1"), Ctx())
    code, message = code_of(
        lambda: s.Register(pb.RegisterRequest(replica_id="d", address="d:1"), Ctx())
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_replicas=3" in message
    assert 'replica_id="a"' in metrics.exposition().decode()
    time.sleep(0.1)
    s.Heartbeat(pb.HeartbeatRequest(replica_id="a", version_held=-1), Ctx())
    listed = {
        r.replica_id: r.alive for r in s.ListReplicas(pb.ListReplicasRequest(), Ctx()).replicas
    }
    assert listed == {"a": True, "b": False, "c": False}  # dead, not yet forgotten
    time.sleep(0.15)
    s.Heartbeat(pb.HeartbeatRequest(replica_id="a", version_held=-1), Ctx())
    assert [r.replica_id for r in s.ListReplicas(pb.ListReplicasRequest(), Ctx()).replicas] == ["a"]
    text = metrics.exposition().decode()
    assert (
        'replica_id="a"' in text and 'replica_id="b"' not in text and 'replica_id="c"' not in text
    )
    # room again; and a forgotten replica's heartbeat says "not registered" (it re-registers)
    s.Register(pb.RegisterRequest(replica_id="d", address="d:1"), Ctx())
    code, message = code_of(
        lambda: s.Heartbeat(pb.HeartbeatRequest(replica_id="b", version_held=1), Ctx())
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "'b' is not registered" in message


def test_registry_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError, match="expire_after_s=1 must be >= heartbeat_timeout_s=2"):
        ReplicaRegistry(2, expire_after_s=1)
    with pytest.raises(ValueError, match="max_replicas must be >= 1, got 0"):
        ReplicaRegistry(2, max_replicas=0)
