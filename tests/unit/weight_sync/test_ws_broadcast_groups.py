"""Broadcast offers in WeightSyncServicer: who is put in a version's group (live replicas of
the backend, less those that load over CUDA IPC), when the group keeps its id, what is
refused, and that only the notice sent while the push runs names the group."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from test_ws_offers import buffer
from test_ws_servicer import TENSORS, Ctx, code_of, header, make, messages, spec

from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb


def endpoint(h: pb.VersionHeader, **kw: object) -> pb.BroadcastGroup:
    offsets, off = [], 0
    for t in h.tensors:
        offsets.append(off)
        off += -(-max(t.nbytes, 1) // 256) * 256
    fields = dict(store_host="10.0.0.5", store_port=29510, backend="gloo", timeout_seconds=30.0,
                  buffer_bytes=off, tensor_offsets=offsets, source_node_id="boot-trainer",
                  source_device_uuid="GPU-0")  # fmt: skip
    fields.update(kw)
    return pb.BroadcastGroup(**fields)


def offer(version: int, *, ipc: bool = False, new_group: bool = False, **kw: object):
    h = header(version, TENSORS)
    request = pb.OfferVersionRequest(header=h, broadcast=endpoint(h, **kw), new_group=new_group)
    if ipc:
        request.buffer.CopyFrom(buffer(h, node_id="boot-trainer"))
    return request


def register(s, rid: str, backend: str = "gloo", node: str = "", gpu: str = "") -> None:
    request = pb.RegisterRequest(
        replica_id=rid, address="h:1", broadcast_backend=backend, node_id=node, device_uuid=gpu
    )
    s.Register(request, Ctx())


def test_the_group_is_the_live_replicas_of_the_backend_in_rank_order() -> None:
    s = make(timeout_s=0.5)
    for rid, backend in [("r2", "gloo"), ("r1", "gloo"), ("n1", "nccl"), ("p1", "")]:
        register(s, rid, backend)
    group = s.OfferVersion(offer(0), Ctx()).broadcast
    assert list(group.members) == ["r1", "r2"] and group.group_id
    assert group.store_host == "10.0.0.5" and group.store_port == 29510
    got = s.GetOffer(pb.GetOfferRequest(version=0, replica_id="r1"), Ctx())
    assert got.broadcast == group and not got.HasField("buffer")
    time.sleep(0.6)  # r1 and r2 stop beating: not alive, not in the next group
    register(s, "r3")
    assert list(s.OfferVersion(offer(1), Ctx()).broadcast.members) == ["r3"]


def test_a_group_keeps_its_id_until_members_store_or_trainer_change_it() -> None:
    s = make()
    register(s, "r1")
    first = s.OfferVersion(offer(0), Ctx()).broadcast.group_id
    assert s.OfferVersion(offer(1), Ctx()).broadcast.group_id == first  # communicators reused
    renewed = s.OfferVersion(offer(2, new_group=True), Ctx()).broadcast.group_id
    assert renewed != first  # the last broadcast failed
    register(s, "r2")
    joined = s.OfferVersion(offer(3), Ctx()).broadcast
    assert joined.group_id not in (first, renewed) and list(joined.members) == ["r1", "r2"]
    moved = s.OfferVersion(offer(4, store_port=29511), Ctx()).broadcast.group_id
    assert moved != joined.group_id


def test_nccl_leaves_out_the_replicas_on_the_trainers_gpu() -> None:
    """NCCL cannot join two ranks on one GPU: a replica on the trainer's GPU loads over CUDA
    IPC instead. Replicas on the trainer's node but other GPUs, or of unknown GPU, join."""
    s = make()
    register(s, "same-gpu", "nccl", node="boot-trainer", gpu="GPU-0")
    register(s, "same-node", "nccl", node="boot-trainer", gpu="GPU-1")
    register(s, "other-node", "nccl", node="boot-other", gpu="GPU-0")
    group = s.OfferVersion(offer(0, backend="nccl", ipc=True), Ctx()).broadcast
    assert list(group.members) == ["other-node", "same-node"]
    assert s.versions.offer_for(0).buffer is not None  # the IPC offer is held beside it
    register(s, "gloo-same-gpu", "gloo", node="boot-trainer", gpu="GPU-0")
    assert list(s.OfferVersion(offer(1), Ctx()).broadcast.members) == ["gloo-same-gpu"]


def test_with_nobody_to_join_nothing_is_held() -> None:
    s = make()
    register(s, "r1", backend="nccl")
    assert not s.OfferVersion(offer(0), Ctx()).HasField("broadcast")
    assert s.versions.offer_for(0) is None


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"backend": "mpi"}, "broadcast.backend"),
        ({"store_host": ""}, "broadcast.store_host"),
        ({"store_host": "h" * 300}, "broadcast.store_host"),
        ({"store_port": 0}, "broadcast.store_port"),
        ({"timeout_seconds": 0.0}, "broadcast.timeout_seconds"),
        ({"timeout_seconds": 1e9}, "broadcast.timeout_seconds"),
        ({"group_id": "mine"}, "broadcast.group_id"),
        ({"members": ["r1"]}, "broadcast.members"),
        ({"tensor_offsets": [0]}, "broadcast.tensor_offsets"),
        ({"buffer_bytes": 8}, "broadcast.buffer_bytes=8"),
        ({"buffer_bytes": 1 << 40}, f"broadcast.buffer_bytes={1 << 40} is over"),
        ({"source_node_id": "bad id!"}, "broadcast.source_node_id"),
        ({"source_device_uuid": "x" * 200}, "broadcast.source_device_uuid"),
    ],
)
def test_a_bad_broadcast_is_refused_naming_the_field(kw: dict, field: str) -> None:
    s = make()
    register(s, "r1")
    code, msg = code_of(lambda: s.OfferVersion(offer(0, **kw), Ctx()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in msg, msg
    assert s.versions.offer_for(0) is None


def test_an_offset_that_a_dtype_cannot_start_at_is_refused() -> None:
    s = make()
    register(s, "r1")
    request = offer(0)
    request.header.tensors[0].dtype = "float32"
    request.header.tensors[0].CopyFrom(spec("a", b"\0" * 8, dtype="float32", shape=[2]))
    request.header.total_bytes = sum(t.nbytes for t in request.header.tensors)
    request.broadcast.tensor_offsets[:] = [2, 256, 512]
    code, msg = code_of(lambda: s.OfferVersion(request, Ctx()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'a' at broadcast offset 2" in msg
    request.broadcast.tensor_offsets[:] = [0, 256, 512]
    assert list(s.OfferVersion(request, Ctx()).broadcast.members) == ["r1"]


def test_an_offer_needs_a_buffer_or_a_broadcast_and_register_a_known_backend() -> None:
    s = make()
    bare = pb.OfferVersionRequest(header=header(0, TENSORS))
    code, msg = code_of(lambda: s.OfferVersion(bare, Ctx()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "buffer" in msg and "broadcast" in msg
    code, msg = code_of(lambda: register(s, "r1", backend="x" * 1000))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "broadcast_backend" in msg
    assert len(msg) < 200  # the bad value is quoted, bounded
    code, msg = code_of(lambda: register(s, "r1", node="a b"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "node_id" in msg
    code, msg = code_of(lambda: register(s, "r1", gpu="GPU/0"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "device_uuid" in msg


def test_only_the_notice_sent_while_the_push_runs_names_the_group() -> None:
    s = make()
    register(s, "r1")
    ctx, heard, done = Ctx(), [], threading.Event()

    def listen() -> None:
        for n in s.Subscribe(pb.SubscribeRequest(replica_id="r1"), ctx):
            heard.append((n.version, n.offer_only, n.broadcast_group_id))
            if len(heard) == 2:
                ctx.active = False
                done.set()

    threading.Thread(target=listen, daemon=True).start()
    group = s.OfferVersion(offer(0), Ctx()).broadcast
    deadline = time.monotonic() + 10
    while not heard and time.monotonic() < deadline:
        time.sleep(0.01)
    s.PushVersion(iter(messages(0, TENSORS)), Ctx())
    assert done.wait(10)
    assert heard == [(0, True, group.group_id), (0, False, "")]
