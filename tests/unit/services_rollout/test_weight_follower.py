"""The rollout's weight follower with a fake weight-sync client: register, subscribe, pull,
build, swap, heartbeat; old or repeated notices are ignored; a dropped stream reconnects."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from services.rollout.weights import WeightFollower
from trace_common.clients.broadcast import BroadcastError
from trace_common.clients.cuda_ipc import IpcError, node_id
from trace_common.protos_gen.trace.common.v1 import common_pb2
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb
from trace_common.rollout.engine import EngineHolder
from trace_common.service import Metrics


def Notice(version: int, *, node: str = "", offer_only: bool = False, group: str = ""):
    return common_pb2.PolicyVersionInfo(
        version=version, cuda_ipc_node=node, offer_only=offer_only, broadcast_group_id=group
    )


class Dropped(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


class Stream:
    """A server stream: the notices, then dropped (or idle until cancelled, like a live one)."""

    def __init__(self, versions: list[int], *, idle: bool) -> None:
        self.versions = list(versions)
        self.idle = idle
        self.cancelled = threading.Event()

    def __iter__(self):
        return self

    def __next__(self) -> common_pb2.PolicyVersionInfo:
        if self.versions:
            v = self.versions.pop(0)
            return v if isinstance(v, common_pb2.PolicyVersionInfo) else Notice(v)
        if self.idle:
            self.cancelled.wait(10)
            raise StopIteration
        raise Dropped()

    def cancel(self) -> None:
        self.cancelled.set()


class FakeWeightSync:
    def __init__(self, streams: list[list[int]]) -> None:
        self.streams = streams  # each subscribe() yields one list, then the stream drops
        self.events: list[str] = []
        self.done = threading.Event()
        self.last_pull = {"kind": "full", "bytes": 1, "full_bytes": 1}

    def register(self, replica_id, address, *, broadcast_backend="", node_id="", device_uuid=""):
        backend = f" {broadcast_backend}" if broadcast_backend else ""
        self.events.append(f"register {replica_id} {address}{backend}")

    def start_heartbeats(self, replica_id, version_held, interval_s):
        self.events.append("heartbeats")
        return threading.Event()

    def subscribe(self, replica_id: str):
        if not self.streams:
            self.done.set()
            return Stream([], idle=True)
        return Stream(self.streams.pop(0), idle=False)

    def pull_version(self, version, *, replica_id):
        self.events.append(f"pull {version}")
        return version, {"w": torch.full((2,), float(version))}, {"m": "x", "n": 3}

    def heartbeat(self, replica_id: str, version: int) -> int:
        self.events.append(f"heartbeat {version}")
        return version


def test_follows_versions_and_reconnects() -> None:
    ws = FakeWeightSync([[0, 1, 1], [0, 2]])  # duplicates and an old notice after reconnecting
    holder = EngineHolder()
    built = []

    def factory(tensors, meta, version):
        built.append((float(tensors["w"][0]), meta))
        return object()

    f = WeightFollower(
        ws, holder, factory, replica_id="r0", address=lambda: "127.0.0.1:9",
        heartbeat_interval_s=1.0, metrics=Metrics("rollout"),
    )  # fmt: skip
    f.start()
    assert ws.done.wait(10)
    f.stop()
    assert holder.version == 2 and f.pulls == 3
    assert [v for v, _ in built] == [0.0, 1.0, 2.0]
    assert built[0][1] == {"m": "x"}  # only string metadata reaches the engine factory
    assert ws.events[:2] == ["register r0 127.0.0.1:9", "heartbeats"]
    assert [e for e in ws.events if e.startswith(("pull", "heartbeat "))] == [
        "pull 0", "heartbeat 0", "pull 1", "heartbeat 1", "pull 2", "heartbeat 2",
    ]  # fmt: skip


class FakeOffers(FakeWeightSync):
    """Offers of the versions in `opens` open; the others fail as a stale handle does."""

    def __init__(self, streams, opens: set[int]) -> None:
        super().__init__(streams)
        self.opens = opens

    def open_offer(self, version, *, replica_id):
        self.events.append(f"offer {version}")
        if version not in self.opens:
            raise IpcError("cannot open the CUDA IPC buffer: invalid resource handle")
        self.last_pull = {"kind": "cuda_ipc", "bytes": 0, "full_bytes": 8}
        return version, {"w": torch.full((2,), float(version))}, {"m": "x"}


def follow(
    ws, *, cuda_ipc: bool = False, member=None
) -> tuple[WeightFollower, EngineHolder, list[float]]:
    holder, built = EngineHolder(), []

    def factory(tensors, meta, version):
        built.append(float(tensors["w"][0]))
        return object()

    f = WeightFollower(
        ws, holder, factory, replica_id="r0", address=lambda: "127.0.0.1:9",
        heartbeat_interval_s=1.0, metrics=Metrics("rollout"), cuda_ipc=cuda_ipc, member=member,
    )  # fmt: skip
    f.start()
    assert ws.done.wait(10)
    f.stop()
    return f, holder, built


@pytest.mark.skipif(not node_id(), reason="this kernel has no boot id (no CUDA IPC offers)")
def test_offers_on_this_node_load_before_the_push_and_a_failed_one_falls_back() -> None:
    """Version 1's offer opens: served from it, its complete notice pulls nothing. Version
    2's fails: counted, and the version is pulled once its push completes. An offer from
    another node is never opened."""
    here = node_id()
    ws = FakeOffers(
        [[
            Notice(0),
            Notice(1, node=here, offer_only=True), Notice(1, node=here),
            Notice(2, node=here, offer_only=True), Notice(2, node=here),
            Notice(3, node="another-host", offer_only=True), Notice(3, node="another-host"),
        ]],
        opens={1},
    )  # fmt: skip
    f, holder, built = follow(ws, cuda_ipc=True)
    assert holder.version == 3 and built == [0.0, 1.0, 2.0, 3.0]
    loads = [e for e in ws.events if e.startswith(("pull", "offer"))]
    assert loads == ["pull 0", "offer 1", "offer 2", "pull 2", "pull 3"]
    assert f.ipc_failures == 1


def test_a_replica_without_cuda_ipc_waits_for_the_push() -> None:
    here = node_id() or "h"
    ws = FakeOffers([[Notice(0), Notice(1, node=here, offer_only=True), Notice(1, node=here)]],
                    opens={1})  # fmt: skip
    _, holder, built = follow(ws, cuda_ipc=False)
    assert holder.version == 1 and built == [0.0, 1.0]
    assert [e for e in ws.events if e.startswith(("pull", "offer"))] == ["pull 0", "pull 1"]


class FakeMember:
    backend = "gloo"
    device_uuid = ""
    closed = False

    def close(self) -> None:
        self.closed = True


class FakeBroadcasts(FakeWeightSync):
    """Version v's group has the members `groups[v]`; receiving works for versions in
    `delivers` and fails as a timed-out broadcast does for the others."""

    def __init__(self, streams, groups: dict[int, list[str]], delivers: set[int]) -> None:
        super().__init__(streams)
        self.groups, self.delivers = groups, delivers

    def get_offer(self, version, *, replica_id):
        return pb.GetOfferResponse(
            broadcast=pb.BroadcastGroup(group_id=f"g{version}", members=self.groups[version])
        )

    def receive_broadcast(self, version, member, *, replica_id):
        self.events.append(f"broadcast {version}")
        if version not in self.delivers:
            raise BroadcastError(f"group g{version}: the broadcast timed out")
        self.last_pull = {"kind": "broadcast", "bytes": 8, "full_bytes": 8}
        return version, {"w": torch.full((2,), float(version))}, {"m": "x"}


def test_broadcasts_are_received_when_a_member_and_failures_fall_back_to_the_pull() -> None:
    """v1 arrives in its broadcast (its complete notice pulls nothing); v2's group does not
    include this replica (joined later): pulled. v3..v5 fail: each is pulled once its push
    completes, and after the third failure in a row the replica leaves broadcasts (registers
    again without a backend) and v6's broadcast notice is ignored."""
    versions = range(1, 7)
    notices = [Notice(0)]
    for v in versions:
        notices += [Notice(v, offer_only=True, group=f"g{v}"), Notice(v)]
    ws = FakeBroadcasts(
        [notices], groups={v: ["r0"] if v != 2 else ["r1"] for v in versions}, delivers={1, 6}
    )
    member = FakeMember()
    f, holder, built = follow(ws, member=member)
    assert holder.version == 6 and built == [float(v) for v in range(7)]
    loads = [e for e in ws.events if e.startswith(("pull", "broadcast", "register"))]
    assert loads == [
        "register r0 127.0.0.1:9 gloo", "pull 0", "broadcast 1", "pull 2",
        "broadcast 3", "pull 3", "broadcast 4", "pull 4", "broadcast 5",
        "register r0 127.0.0.1:9", "pull 5", "pull 6",
    ]  # fmt: skip
    assert f.broadcast_failures == 3 and f.member is None and member.closed
