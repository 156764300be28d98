"""CUDA IPC offers in WeightSyncServicer: validation, GetOffer, and Subscribe's notices (an
offer before its push, then the complete version); the service never opens a buffer."""

from __future__ import annotations

import threading

import grpc
import pytest
from test_ws_servicer import TENSORS, Ctx, code_of, header, make, messages

from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb


def buffer(h: pb.VersionHeader, **kw: object) -> pb.CudaIpcBuffer:
    offsets, off = [], 0
    for t in h.tensors:
        offsets.append(off)
        off += t.nbytes
    fields = dict(node_id="boot-1", device_uuid="GPU-abc", memory_handle=b"h" * 64,
                  buffer_bytes=off, ref_counter_handle=b"/torch_123", tensor_offsets=offsets)  # fmt: skip
    fields.update(kw)
    return pb.CudaIpcBuffer(**fields)


def offer(version: int, **kw: object) -> pb.OfferVersionRequest:
    h = header(version, TENSORS)
    return pb.OfferVersionRequest(header=h, buffer=buffer(h, **kw))


def test_an_offer_is_held_but_not_published() -> None:
    s = make()
    s.OfferVersion(offer(3), Ctx())
    got = s.GetOffer(pb.GetOfferRequest(version=3, replica_id="r0"), Ctx())
    assert got.header.version == 3 and got.buffer.memory_handle == b"h" * 64
    assert s.versions.latest_version() == -1  # a pull still finds nothing
    code, msg = code_of(lambda: s.GetOffer(pb.GetOfferRequest(version=4, replica_id="r0"), Ctx()))
    assert code == grpc.StatusCode.NOT_FOUND and "version 4" in msg


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"node_id": ""}, "buffer.node_id"),
        ({"device_uuid": "x" * 200}, "buffer.device_uuid"),
        ({"memory_handle": b""}, "buffer.memory_handle"),
        ({"ref_counter_handle": b"r" * 300}, "buffer.ref_counter_handle"),
        ({"tensor_offsets": [0]}, "buffer.tensor_offsets"),
        ({"buffer_bytes": 4}, "buffer.buffer_bytes=4"),
    ],
)
def test_a_bad_buffer_is_refused_naming_the_field(kw: dict, field: str) -> None:
    s = make()
    code, msg = code_of(lambda: s.OfferVersion(offer(1, **kw), Ctx()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in msg
    assert s.versions.offer_for(1) is None


def test_offers_of_deltas_old_versions_and_bad_manifests_are_refused() -> None:
    s = make()
    s.PushVersion(iter(messages(5, TENSORS)), Ctx())
    code, msg = code_of(lambda: s.OfferVersion(offer(4), Ctx()))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "older than" in msg
    s.OfferVersion(offer(5), Ctx())  # a republish may offer the latest again
    delta = offer(6)
    delta.header.base_version = 5
    code, msg = code_of(lambda: s.OfferVersion(delta, Ctx()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "base_version" in msg
    bad = offer(7)
    bad.header.total_bytes += 1
    code, msg = code_of(lambda: s.OfferVersion(bad, Ctx()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "total_bytes" in msg
    code, _ = code_of(lambda: s.GetOffer(pb.GetOfferRequest(version=5, replica_id=""), Ctx()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_subscribers_hear_the_offer_first_then_the_complete_version() -> None:
    s = make()
    s.Register(pb.RegisterRequest(replica_id="r0", address="h:1"), Ctx())
    ctx = Ctx()
    heard = []
    events = [threading.Event() for _ in range(3)]

    def listen() -> None:
        for n in s.Subscribe(pb.SubscribeRequest(replica_id="r0"), ctx):
            heard.append((n.version, n.offer_only, n.cuda_ipc_node))
            events[len(heard) - 1].set()
            if len(heard) == 3:
                ctx.active = False

    t = threading.Thread(target=listen, daemon=True)
    s.PushVersion(iter(messages(0, TENSORS)), Ctx())
    t.start()
    assert events[0].wait(10)
    s.OfferVersion(offer(1), Ctx())
    assert events[1].wait(10)
    s.PushVersion(iter(messages(1, TENSORS)), Ctx())
    assert events[2].wait(10)
    t.join(5)
    assert heard == [(0, False, ""), (1, True, "boot-1"), (1, False, "boot-1")]


def test_offers_are_dropped_with_their_versions() -> None:
    s = make(keep=1)
    for v in range(4):
        s.OfferVersion(offer(v), Ctx())
        s.PushVersion(iter(messages(v, TENSORS)), Ctx())
    assert [v for v in range(4) if s.versions.offer_for(v) is not None] == [3]
