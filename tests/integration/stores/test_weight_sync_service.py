"""weight-sync in a subprocess, over real gRPC sockets, with replicas as separate clients."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
import torch

from trace_common.clients import WeightSyncClient
from trace_common.clients.tensors import tensor_to_wire
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2_grpc as pb_grpc
from trace_common.service.grpc_server import AUTH_HEADER
from trace_common.service.testing import ServiceProcess

TOKEN = "integration-test-token"
WS = "services.weight_sync"
HEARTBEAT_TIMEOUT_S = 0.6


def _policy(seed: int) -> dict[str, torch.Tensor]:
    """A small policy in the ModelOpt NVFP4 layout plus BF16 tensors."""
    g = torch.Generator().manual_seed(seed)
    out, inp = 256, 512
    return {
        "layers.0.mlp.experts.0.up_proj.weight": torch.randint(
            0, 256, (out, inp // 2), dtype=torch.uint8, generator=g
        ),
        "layers.0.mlp.experts.0.up_proj.weight_scale": torch.rand(out, inp // 16, generator=g)
        .mul(448)
        .to(torch.float8_e4m3fn),
        "layers.0.mlp.experts.0.up_proj.weight_scale_2": torch.tensor(
            0.0123 * (seed + 1), dtype=torch.float32
        ),
        "layers.0.self_attn.q_proj.weight": torch.randn(inp, inp, generator=g).to(torch.bfloat16),
        "embed_tokens.weight": torch.randn(1000, 64, generator=g).to(torch.bfloat16),
        "lm_head.bias": torch.randn(1000, generator=g),
    }


def _assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert bytes(tensor_to_wire(name, g)[1]) == bytes(tensor_to_wire(name, t)[1]), (
            f"{name}: bytes differ"
        )


@pytest.fixture()
def service() -> Iterator[ServiceProcess]:
    env = {
        "TRACE_AUTH_TOKEN": TOKEN,
        "TRACE_KEEP_VERSIONS": "2",
        "TRACE_CHUNK_BYTES": str(64 << 10),  # small chunks: many per tensor
        "TRACE_HEARTBEAT_TIMEOUT_SECONDS": str(HEARTBEAT_TIMEOUT_S),
    }
    with ServiceProcess(WS, env) as svc:
        yield svc


class Replica(threading.Thread):
    """A rollout replica's weight loop: register, subscribe, pull each notified version."""

    def __init__(self, address: str, replica_id: str, want: int, data_path: str = "auto") -> None:
        super().__init__(daemon=True)
        self.client = WeightSyncClient(address, TOKEN, data_path=data_path)
        self.replica_id = replica_id
        self.want = want
        self.pulled: dict[int, dict[str, torch.Tensor]] = {}
        self.registered = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.client.register(self.replica_id, f"{self.replica_id}:50053")
            stream = self.client.subscribe(self.replica_id)
            self.registered.set()
            for notice in stream:
                version, tensors, _ = self.client.pull_version(
                    notice.version, replica_id=self.replica_id
                )
                self.pulled[version] = tensors
                self.client.heartbeat(self.replica_id, version)
                if version >= self.want:
                    stream.cancel()
                    break
        except BaseException as exc:  # reported by the test
            self.error = exc
            self.registered.set()


@pytest.mark.parametrize("data_path", ["direct", "grpc"])
def test_push_reaches_two_subscribed_replicas_and_late_joiner(
    service: ServiceProcess, data_path: str
) -> None:
    trainer = WeightSyncClient(service.grpc_address, TOKEN, chunk_bytes=100_000)
    replicas = [
        Replica(service.grpc_address, f"rollout-{i}", want=2, data_path=data_path) for i in range(2)
    ]
    for r in replicas:
        r.start()
        assert r.registered.wait(10) and r.error is None
    time.sleep(0.2)  # both Subscribe streams are open
    policies = {v: _policy(v) for v in (1, 2)}
    info = trainer.push_version(1, policies[1], {"format": "nvfp4", "step": 10})
    assert info.version == 1 and info.num_tensors == len(policies[1])
    trainer.push_version(2, policies[2], {"format": "nvfp4", "step": 20})
    for r in replicas:
        r.join(20)
        assert r.error is None, r.error
        assert 2 in r.pulled, f"{r.replica_id} pulled {sorted(r.pulled)}"
        assert r.client.path == data_path
        for version, tensors in r.pulled.items():
            _assert_exact(tensors, policies[version])

    # A replica registering after the pushes gets the latest complete version at once.
    late = Replica(service.grpc_address, "rollout-late", want=2, data_path=data_path)
    late.start()
    late.join(20)
    assert late.error is None and sorted(late.pulled) == [2], sorted(late.pulled)
    _assert_exact(late.pulled[2], policies[2])
    version, tensors, meta = trainer.pull_version(replica_id="trainer")
    assert version == 2 and meta == {"format": "nvfp4", "step": 20}

    listed = {r.replica_id: r for r in trainer.replicas()}
    assert set(listed) == {"rollout-0", "rollout-1", "rollout-late"}
    assert all(r.version_held == 2 and r.version_lag == 0 and r.alive for r in listed.values())

    # Keep the last K=2: a third version drops version 1.
    response = trainer.push_version(3, _policy(3), {})
    assert [v.version for v in trainer.versions()] == [2, 3] and response.version == 3
    with pytest.raises(grpc.RpcError) as err:
        trainer.pull_version(1, replica_id="trainer")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "version 1" in err.value.details()
    metrics = httpx.get(f"{service.http_url}/metrics").text
    assert "trace_weight_sync_versions_published_total 3.0" in metrics
    assert 'trace_weight_sync_replica_version_lag{replica_id="rollout-0"} 1.0' in metrics


def test_half_pushed_version_is_never_visible(service: ServiceProcess) -> None:
    trainer = WeightSyncClient(service.grpc_address, TOKEN)
    trainer.push_version(1, _policy(1), {})
    policy = _policy(2)
    wire = [tensor_to_wire(n, t) for n, t in policy.items()]
    header = pb.VersionHeader(
        version=2,
        metadata_json="{}",
        tensors=[s for s, _ in wire],
        total_bytes=sum(s.nbytes for s, _ in wire),
    )
    halfway, resume = threading.Event(), threading.Event()

    def messages(abandon: bool) -> Iterator[pb.PushChunk]:
        yield pb.PushChunk(header=header)
        for index, (_, view) in enumerate(wire):
            if index == len(wire) // 2:
                halfway.set()
                resume.wait(10)
                if abandon:
                    raise RuntimeError("trainer crashed mid-push")
            yield pb.PushChunk(chunk=pb.TensorChunk(tensor_index=index, offset=0, data=bytes(view)))

    stub = pb_grpc.WeightSyncStub(grpc.insecure_channel(service.grpc_address))
    md = ((AUTH_HEADER, f"Bearer {TOKEN}"),)

    def check_invisible() -> None:
        assert [v.version for v in trainer.versions()] == [1]
        assert trainer.pull_version(replica_id="trainer")[0] == 1
        with pytest.raises(grpc.RpcError) as err:
            trainer.pull_version(2, replica_id="trainer")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

    # 1) A push in flight is invisible until its last byte is verified.
    future = stub.PushVersion.future(messages(abandon=False), metadata=md, timeout=30)
    assert halfway.wait(10)
    check_invisible()
    resume.set()
    assert future.result().published.version == 2
    assert trainer.pull_version(replica_id="trainer")[0] == 2

    # 2) An abandoned push (client dies mid-stream) never becomes visible.
    halfway.clear()
    resume.clear()
    header.version = 3
    future = stub.PushVersion.future(messages(abandon=True), metadata=md, timeout=30)
    assert halfway.wait(10)
    resume.set()
    with pytest.raises(grpc.RpcError):
        future.result()
    assert [v.version for v in trainer.versions()] == [1, 2]

    # 3) A push whose bytes fail their checksum is rejected (DATA_LOSS), not published.
    bad = pb.VersionHeader()
    bad.CopyFrom(header)
    bad.version = 4
    bad.tensors[0].crc32 ^= 1

    def corrupt() -> Iterator[pb.PushChunk]:
        yield pb.PushChunk(header=bad)
        for index, (_, view) in enumerate(wire):
            yield pb.PushChunk(chunk=pb.TensorChunk(tensor_index=index, offset=0, data=bytes(view)))

    with pytest.raises(grpc.RpcError) as err:
        stub.PushVersion(corrupt(), metadata=md, timeout=30)
    assert (
        err.value.code() == grpc.StatusCode.DATA_LOSS and bad.tensors[0].name in err.value.details()
    )
    assert [v.version for v in trainer.versions()] == [1, 2]
    # The failed pushes left no reservation behind: version 3 can be pushed now.
    assert trainer.push_version(3, policy, {}).version == 3


def test_dead_replica_reported_after_heartbeat_timeout(service: ServiceProcess) -> None:
    ws = WeightSyncClient(service.grpc_address, TOKEN)
    assert ws.register("alive-1", "a:1").heartbeat_timeout_seconds == pytest.approx(
        HEARTBEAT_TIMEOUT_S
    )
    ws.register("silent-1", "b:1")
    stop = ws.start_heartbeats("alive-1", lambda: -1, interval_s=HEARTBEAT_TIMEOUT_S / 4)
    try:
        assert all(r.alive for r in ws.replicas())
        time.sleep(HEARTBEAT_TIMEOUT_S * 2)
        state = {r.replica_id: r.alive for r in ws.replicas()}
        assert state == {"alive-1": True, "silent-1": False}
        assert (
            "trace_weight_sync_replicas_alive 1.0" in httpx.get(f"{service.http_url}/metrics").text
        )
        ws.heartbeat("silent-1", -1)  # it comes back
        assert all(r.alive for r in ws.replicas())
    finally:
        stop.set()


def _all_rpcs(stub: pb_grpc.WeightSyncStub, md: tuple[tuple[str, str], ...]) -> list:
    """One call of every WeightSync RPC, as thunks."""
    return [
        lambda: stub.Register(
            pb.RegisterRequest(replica_id="r", address="a:1"), metadata=md, timeout=5
        ),
        lambda: stub.Heartbeat(pb.HeartbeatRequest(replica_id="r"), metadata=md, timeout=5),
        lambda: stub.ListReplicas(pb.ListReplicasRequest(), metadata=md, timeout=5),
        lambda: stub.ListVersions(pb.ListVersionsRequest(), metadata=md, timeout=5),
        lambda: list(
            stub.PullVersion(pb.PullVersionRequest(replica_id="r"), metadata=md, timeout=5)
        ),
        lambda: stub.GetPullTicket(pb.PullTicketRequest(replica_id="r"), metadata=md, timeout=5),
        lambda: list(stub.Subscribe(pb.SubscribeRequest(replica_id="r"), metadata=md, timeout=5)),
        lambda: stub.PushVersion(iter([pb.PushChunk()]), metadata=md, timeout=5),
    ]


def test_auth_required_on_every_rpc(service: ServiceProcess) -> None:
    channel = grpc.insecure_channel(service.grpc_address)
    stub = pb_grpc.WeightSyncStub(channel)
    for md in [(), ((AUTH_HEADER, "Bearer wrong-token"),), ((AUTH_HEADER, TOKEN),)]:
        for call in _all_rpcs(stub, md):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, md
    assert WeightSyncClient(service.grpc_address, TOKEN).replicas() == [], "nothing registered"
    channel.close()


def test_replica_registers_again_after_a_weight_sync_restart(service: ServiceProcess) -> None:
    """A fresh weight-sync knows no replica: the client's heartbeat and subscribe register
    again with the remembered address, and the replica is listed once more."""
    replica = WeightSyncClient(service.grpc_address, TOKEN)
    replica.register("rollout-7", "10.0.0.7:50053")
    assert replica.heartbeat("rollout-7", -1) == -1
    port = service.grpc_port
    service.kill()
    env = {**{k: v for k, v in service.env.items()
              if k.startswith("TRACE_") and k != "TRACE_PORTS_FILE"},
           "TRACE_GRPC_PORT": str(port)}  # fmt: skip
    with ServiceProcess(WS, env) as fresh:
        trainer = WeightSyncClient(fresh.grpc_address, TOKEN)
        assert trainer.replicas() == []
        # a client that never registered the replica is told so, as before
        stranger = WeightSyncClient(fresh.grpc_address, TOKEN)
        with pytest.raises(grpc.RpcError) as err:
            stranger.heartbeat("rollout-7", 3)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert replica.heartbeat("rollout-7", 3) == -1  # registered again, then the beat
        (listed,) = trainer.replicas()
        assert (listed.replica_id, listed.address, listed.version_held) == (
            "rollout-7", "10.0.0.7:50053", 3)  # fmt: skip
    # and a Subscribe stream: register again, resubscribe, get the first version pushed
    with ServiceProcess(WS, env) as fresh:
        stream = replica.subscribe("rollout-7")
        WeightSyncClient(fresh.grpc_address, TOKEN).push_version(0, _policy(0), {})
        notice = next(iter(stream))
        stream.cancel()
        assert notice.version == 0


def test_ticket_flood_and_fake_registrations_stay_bounded() -> None:
    """Any token holder can ask for tickets and register replicas: the flood uses up the
    data plane's tickets, yet an honest replica still pulls (over gRPC, that once); fake
    registrations beyond max_replicas are refused and /status stays small."""
    env = {"TRACE_AUTH_TOKEN": TOKEN, "TRACE_DATA_PLANE_MAX_TICKETS": "16",
           "TRACE_MAX_REPLICAS": "300"}  # fmt: skip
    with ServiceProcess(WS, env) as svc:
        trainer = WeightSyncClient(svc.grpc_address, TOKEN)
        trainer.push_version(1, _policy(1), {})
        stub = pb_grpc.WeightSyncStub(grpc.insecure_channel(svc.grpc_address))
        meta = ((AUTH_HEADER, f"Bearer {TOKEN}"),)
        exhausted = 0
        for i in range(40):
            try:
                stub.GetPullTicket(pb.PullTicketRequest(replica_id=f"flood-{i}"), metadata=meta)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                exhausted += 1
        assert exhausted == 40 - 16
        honest = WeightSyncClient(svc.grpc_address, TOKEN)  # data_path="auto"
        version, tensors, _ = honest.pull_version(replica_id="honest")
        assert version == 1
        _assert_exact(tensors, _policy(1))
        assert honest.path == "direct"  # only that pull fell back; the next asks again
        strict = WeightSyncClient(svc.grpc_address, TOKEN, data_path="direct")
        with pytest.raises(grpc.RpcError) as err:
            strict.pull_version(replica_id="strict")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        refused = 0
        for i in range(320):
            try:
                stub.Register(pb.RegisterRequest(replica_id=f"fake-{i:04d}", address="x:1"),
                              metadata=meta)  # fmt: skip
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                refused += 1
        assert refused == 20
        assert httpx.get(f"{svc.http_url}/status").json()["replicas"].startswith("hidden")
        reply = httpx.get(f"{svc.http_url}/status", headers={"Authorization": f"Bearer {TOKEN}"})
        status = reply.json()
        assert status["replicas_total"] == 300 and len(status["replicas"]) == 64
        assert len(reply.content) < 16_000, len(reply.content)
