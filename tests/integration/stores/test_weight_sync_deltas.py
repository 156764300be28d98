"""Policy-version deltas through a real weight-sync process: a trainer pushes only what
changed, a replica holding the previous version pulls only that, on both data paths; the
result is bit-identical to a full transfer, and every fault falls back to a full version."""

from __future__ import annotations

import re
from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import pytest
import torch

from tests.integration.stores.test_weight_sync_service import TOKEN, WS, _assert_exact, _policy
from trace_common.clients import WeightSyncClient
from trace_common.clients.tensors import tensor_to_wire
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2_grpc as pb_grpc
from trace_common.service.grpc_server import AUTH_HEADER
from trace_common.service.testing import ServiceProcess


def _step(
    policy: dict[str, torch.Tensor], seed: int, fraction: float = 0.01
) -> dict[str, torch.Tensor]:
    """The next version: `fraction` of each tensor's elements moved (as an RL step moves a
    few FP4 codes and BF16 values across a rounding boundary); scale_2 changes."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in policy.items():
        new = t.clone()
        flat = new.view(-1).view(torch.uint8).view(new.numel(), -1) if new.dim() else None
        if flat is None:
            new = t * 1.001
        else:
            idx = torch.randperm(flat.shape[0], generator=g)[
                : max(1, int(flat.shape[0] * fraction))
            ]
            flat[idx, 0] ^= 1
        out[name] = new
    return out


def _wire_bytes(policy: dict[str, torch.Tensor]) -> int:
    return sum(tensor_to_wire(n, t)[0].nbytes for n, t in policy.items())


def _metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^trace_weight_sync_{name}{{?{re.escape(labels)}}}? (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.fixture()
def service() -> Iterator[ServiceProcess]:
    env = {
        "TRACE_AUTH_TOKEN": TOKEN,
        "TRACE_KEEP_VERSIONS": "3",
        "TRACE_CHUNK_BYTES": str(64 << 10),
    }
    with ServiceProcess(WS, env) as svc:
        yield svc


@pytest.mark.parametrize("data_path", ["direct", "grpc"])
def test_consecutive_versions_travel_as_deltas_and_rebuild_exactly(
    service: ServiceProcess, data_path: str
) -> None:
    trainer = WeightSyncClient(service.grpc_address, TOKEN, chunk_bytes=100_000, deltas=True)
    replica = WeightSyncClient(service.grpc_address, TOKEN, data_path=data_path, deltas=True)
    full = WeightSyncClient(service.grpc_address, TOKEN, data_path=data_path)  # keeps no base
    versions = {0: _policy(0)}
    for v in (1, 2):
        versions[v] = _step(versions[v - 1], seed=v)
    nbytes = _wire_bytes(versions[0])

    trainer.push_version(0, versions[0], {"step": 0})
    got, tensors, _ = replica.pull_version(0, replica_id="r0")
    assert got == 0 and replica.base is not None and replica.base.version == 0
    _assert_exact(tensors, versions[0])
    text = httpx.get(f"{service.http_url}/metrics").text
    assert _metric(text, "push_bytes_total") == nbytes  # the first push is whole

    for v in (1, 2):
        trainer.push_version(v, versions[v], {"step": v})
        got, tensors, meta = replica.pull_version(v, replica_id="r0")
        assert (got, meta) == (v, {"step": v})
        _assert_exact(tensors, versions[v])
        _assert_exact(full.pull_version(v, replica_id="full")[1], versions[v])
    text = httpx.get(f"{service.http_url}/metrics").text
    # Two delta pushes and two delta pulls, each far under a full version; the pulls of the
    # client without a base were whole.
    assert _metric(text, "pushes_total", 'kind="delta"') == 2
    assert _metric(text, "pulls_total", 'kind="delta"') == 2
    assert _metric(text, "pulls_total", 'kind="full"') == 3
    pushed = _metric(text, "push_bytes_total") - nbytes
    pulled = _metric(text, "pull_bytes_total", 'replica_id="r0"') - nbytes
    assert 0 < pushed < 2 * nbytes / 5 and 0 < pulled < 2 * nbytes / 5, (pushed, pulled, nbytes)

    # A replica two versions behind gets a delta against what it holds (computed by
    # weight-sync from the two stored versions), bit-identical again.
    behind = WeightSyncClient(service.grpc_address, TOKEN, data_path=data_path, deltas=True)
    behind.pull_version(0, replica_id="behind")
    _assert_exact(behind.pull_version(2, replica_id="behind")[1], versions[2])
    text = httpx.get(f"{service.http_url}/metrics").text
    assert _metric(text, "pulls_total", 'kind="delta"') == 3


def test_a_base_weight_sync_lacks_means_full_versions(service: ServiceProcess) -> None:
    trainer = WeightSyncClient(service.grpc_address, TOKEN, deltas=True)
    v0, v1 = _policy(0), None
    trainer.push_version(0, v0, {})
    v1 = _step(v0, seed=1)
    port = service.grpc_port
    service.kill()  # the restarted weight-sync holds no version: the delta push is refused
    env = {**{k: v for k, v in service.env.items()
              if k.startswith("TRACE_") and k != "TRACE_PORTS_FILE"},
           "TRACE_GRPC_PORT": str(port)}  # fmt: skip
    with ServiceProcess(WS, env) as fresh:
        trainer.push_version(1, v1, {})  # refused as a delta, pushed whole at once
        text = httpx.get(f"{fresh.http_url}/metrics").text
        assert _metric(text, "pushes_total", 'kind="full"') == 1
        assert _metric(text, "pushes_total", 'kind="delta"') == 0
        # A replica asking for a delta against a version weight-sync does not keep gets it whole.
        replica = WeightSyncClient(fresh.grpc_address, TOKEN, deltas=True)
        replica.base = type(trainer.base)(0, trainer.base.specs, trainer.base.raw)  # holds v0
        _assert_exact(replica.pull_version(1, replica_id="r")[1], v1)
        text = httpx.get(f"{fresh.http_url}/metrics").text
        assert _metric(text, "pulls_total", 'kind="full"') == 1


def test_a_corrupted_delta_never_becomes_a_version(service: ServiceProcess) -> None:
    """A delta push whose payload is altered is refused by the rebuilt tensor's CRC-32
    (DATA_LOSS, nothing published); a replica whose base was altered refuses the delta it is
    sent and pulls the version whole."""
    trainer = WeightSyncClient(service.grpc_address, TOKEN, deltas=True)
    v0 = _policy(0)
    trainer.push_version(0, v0, {})
    v1 = _step(v0, seed=1)
    from trace_common.clients.weight_deltas import encode_version
    from trace_common.wire.chunk_wire import encode_chunk

    header, payloads, _ = encode_version(1, v1, "{}", trainer.base, keep=False)
    assert header.delta_bytes < header.total_bytes / 5
    index = next(i for i, d in enumerate(header.deltas) if d.payload_bytes)
    bad = np.array(payloads[index], dtype=np.uint8)
    bad[-1] ^= 0x08

    def stream() -> Iterator[pb.PushChunk | bytes]:
        yield pb.PushChunk(header=header)
        for i, p in enumerate(payloads):
            data = bad if i == index else np.frombuffer(memoryview(p).cast("B"), np.uint8)
            if data.nbytes:
                yield pb.PushChunk.FromString(encode_chunk(i, 0, memoryview(data)))

    stub = pb_grpc.WeightSyncStub(grpc.insecure_channel(service.grpc_address))
    md = ((AUTH_HEADER, f"Bearer {TOKEN}"),)
    with pytest.raises(grpc.RpcError) as err:
        stub.PushVersion(stream(), metadata=md, timeout=10)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert "rebuilt bytes have crc32" in err.value.details()
    assert [v.version for v in trainer.versions()] == [0]

    trainer.push_version(1, v1, {})  # the genuine delta
    replica = WeightSyncClient(service.grpc_address, TOKEN, deltas=True)
    replica.pull_version(0, replica_id="r")
    name = next(iter(replica.base.raw))
    replica.base.raw[name][0] ^= 0x01  # the replica's copy of version 0 is not weight-sync's
    _assert_exact(replica.pull_version(1, replica_id="r")[1], v1)  # refused, then pulled whole
    text = httpx.get(f"{service.http_url}/metrics").text
    assert _metric(text, "pulls_total", 'kind="delta"') == 1
    assert _metric(text, "pulls_total", 'kind="full"') == 2


def test_bad_delta_requests_name_the_field(service: ServiceProcess) -> None:
    stub = pb_grpc.WeightSyncStub(grpc.insecure_channel(service.grpc_address))
    md = ((AUTH_HEADER, f"Bearer {TOKEN}"),)
    WeightSyncClient(service.grpc_address, TOKEN).push_version(0, _policy(0), {})
    with pytest.raises(grpc.RpcError) as err:
        stub.GetPullTicket(pb.PullTicketRequest(replica_id="r", base_version=-3), metadata=md)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "base_version=-3" in err.value.details()
    spec, _ = tensor_to_wire("w", torch.zeros(4, dtype=torch.uint8))
    for base_version, deltas, code, text in [
        (5, [pb.TensorDelta(kind=3, payload_bytes=4)], grpc.StatusCode.INVALID_ARGUMENT, "base_version=5"),
        (0, [pb.TensorDelta(kind=9, payload_bytes=4)], grpc.StatusCode.INVALID_ARGUMENT, "unknown delta kind 9"),
        (0, [pb.TensorDelta(kind=1, payload_bytes=7, changed=1)], grpc.StatusCode.INVALID_ARGUMENT, "is 5 bytes, payload_bytes=7"),
        (0, [pb.TensorDelta(kind=1, payload_bytes=5, changed=1)], grpc.StatusCode.INVALID_ARGUMENT, "base version 0 has no uint8[4]"),
    ]:  # fmt: skip
        header = pb.VersionHeader(version=1, tensors=[spec], total_bytes=4, base_version=base_version,
                                  deltas=deltas, delta_bytes=sum(d.payload_bytes for d in deltas))  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            stub.PushVersion(iter([pb.PushChunk(header=header)]), metadata=md, timeout=10)
        assert err.value.code() == code, (text, err.value.details())
        assert text in err.value.details()
