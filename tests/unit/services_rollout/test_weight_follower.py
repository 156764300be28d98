"""The rollout's weight follower with a fake weight-sync client: register, subscribe, pull,
build, swap, heartbeat; old or repeated notices are ignored; a dropped stream reconnects."""

from __future__ import annotations

import threading

import grpc
import torch

from services.rollout.weights import WeightFollower
from trace_common.rollout.engine import EngineHolder
from trace_common.service import Metrics


class Notice:
    def __init__(self, version: int) -> None:
        self.version = version


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

    def __next__(self) -> Notice:
        if self.versions:
            return Notice(self.versions.pop(0))
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

    def register(self, replica_id: str, address: str) -> None:
        self.events.append(f"register {replica_id} {address}")

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
