"""WeightSyncPublisher with a broadcast source: it offers each version with the buffer's
layout and checksummed manifest, sends the flat buffer to the group weight-sync formed, then
pushes; a failed broadcast is counted and the next offer asks for a new group; a weight-sync
without offers turns the broadcast off; a NCCL source never sends a CPU export."""

from __future__ import annotations

import grpc
import torch

from services.trainer.remote import WeightSyncPublisher
from trace_common.clients import broadcast as bc
from trace_common.clients.tensors import tensor_to_wire
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb

TENSORS = {
    "w.codes": torch.arange(40, dtype=torch.uint8).reshape(4, 10),
    "w.scale_2": torch.tensor(0.25),
    "embed.weight": torch.linspace(-1, 1, 12).to(torch.bfloat16).reshape(3, 4),
}


class Unimplemented(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNIMPLEMENTED

    def details(self) -> str:
        return "no offers here"


class FakeClient:
    def __init__(self, *, offers: bool = True) -> None:
        self.offers, self.calls, self.last_push = offers, [], {"weight_push_bytes": 1}

    def offer_version(self, version, shared, specs, metadata, *, broadcast, new_group):
        self.calls.append(("offer", version, list(specs), broadcast, new_group))
        if not self.offers:
            raise Unimplemented()
        group = pb.BroadcastGroup()
        group.CopyFrom(broadcast)
        group.group_id, group.members[:] = f"g{version}", ["r1"]
        return group

    def push_version(self, version, tensors, metadata):
        self.calls.append(("push", version))


class FakeSource:
    def __init__(self, backend: str = "gloo", fails: set[int] = frozenset()) -> None:
        self.backend, self.fails, self.renew_group, self.sent = backend, fails, False, []

    endpoint = bc.Source.endpoint
    host, port, timeout_seconds = "127.0.0.1", 29510, 5.0

    def send(self, group: pb.BroadcastGroup, flat: torch.Tensor) -> None:
        self.sent.append((group.group_id, flat.clone()))
        self.renew_group = group.group_id in {f"g{v}" for v in self.fails}
        if self.renew_group:
            raise bc.BroadcastError(f"broadcast to group {group.group_id} failed: timeout")


def test_a_version_is_offered_broadcast_then_pushed() -> None:
    client, source = FakeClient(), FakeSource()
    pub = WeightSyncPublisher(client, source=source)
    pub.publish(3, TENSORS, {})
    (kind, version, specs, endpoint, new_group), push = client.calls
    assert (kind, version, push, new_group) == ("offer", 3, ("push", 3), False)
    assert endpoint.checksummed and endpoint.backend == "gloo"
    assert [s.crc32 for s in specs] == [tensor_to_wire(n, t)[0].crc32 for n, t in TENSORS.items()]
    ((gid, flat),) = source.sent
    got = bc.unpack(flat, specs, endpoint.tensor_offsets)
    assert gid == "g3" and all(torch.equal(got[n], t) for n, t in TENSORS.items())
    assert pub.last_push["weight_broadcast_members"] == 1
    assert pub.last_push["weight_broadcast_failures"] == 0


def test_a_failed_broadcast_is_counted_and_the_next_offer_asks_for_a_new_group() -> None:
    client, source = FakeClient(), FakeSource(fails={1})
    pub = WeightSyncPublisher(client, source=source)
    pub.publish(1, TENSORS, {})
    pub.publish(2, TENSORS, {})
    offers = [c for c in client.calls if c[0] == "offer"]
    assert [c[4] for c in offers] == [False, True]  # new_group after the failure
    assert [c for c in client.calls if c[0] == "push"] == [("push", 1), ("push", 2)]
    assert pub.broadcast_failures == 1 and pub.last_push["weight_broadcast_failures"] == 1


def test_a_weight_sync_without_offers_turns_the_broadcast_off() -> None:
    client = FakeClient(offers=False)
    pub = WeightSyncPublisher(client, source=FakeSource())
    pub.publish(1, TENSORS, {})
    pub.publish(2, TENSORS, {})
    assert [c[0] for c in client.calls] == ["offer", "push", "push"] and pub.source is None


def test_a_nccl_source_sends_no_cpu_export() -> None:
    client, source = FakeClient(), FakeSource(backend="nccl")
    WeightSyncPublisher(client, source=source).publish(1, TENSORS, {})
    assert client.calls == [("push", 1)] and not source.sent
