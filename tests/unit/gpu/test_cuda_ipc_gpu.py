"""CUDA IPC weight transfer on a real GPU (trace_common/clients/cuda_ipc.py).

- A buffer packed and shared by another process opens here bit for bit; once that process
  is gone its handle is refused with IpcError.
- Through the services: a CUDA replica on this node serves a version the trainer only
  offered (no push), bit-identical to the same weights pulled over the network; a version
  whose offer cannot be opened is counted and pulled once its push completes.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import subprocess
import sys
import textwrap
import time

import grpc
import httpx
import pytest
import torch

from services.trainer.remote import WeightSyncPublisher
from trace_common.clients import WeightSyncClient
from trace_common.clients import cuda_ipc as ipc
from trace_common.device import pack_on_device
from trace_common.model import GuidanceConfig, MoECausalLM, QuantConfig
from trace_common.model.config import ModelConfig
from trace_common.protos_gen.trace.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb
from trace_common.rl.policy import LearnerConfig, ModelLearner
from trace_common.service.grpc_server import AUTH_HEADER
from trace_common.service.process import LocalService, local_stores

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not ipc.node_id(), reason="this kernel has no boot id"),
]

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]
PRODUCER = textwrap.dedent("""
    import sys
    from test_cuda_ipc_gpu import expected
    from trace_common.clients import cuda_ipc as ipc
    from trace_common.device import pack_on_device
    from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb
    packed = pack_on_device(expected())
    shared = ipc.share(packed)
    print(shared.buffer.SerializeToString().hex(), flush=True)
    print(pb.VersionHeader(tensors=ipc.manifest(packed)).SerializeToString().hex(), flush=True)
    sys.stdin.readline()
""")


def expected() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(5)
    return {"a": torch.randint(0, 255, (1000, 3), generator=g, device="cuda").to(torch.uint8),
            "b": torch.randn(77, generator=g, device="cuda").to(torch.bfloat16),
            "c": torch.randn(4, 5, generator=g, device="cuda")}  # fmt: skip


def test_another_process_buffer_opens_bit_exact_and_refuses_once_it_is_gone() -> None:
    path = [str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER], cwd=ROOT, text=True, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    try:
        buffer = pb.CudaIpcBuffer.FromString(bytes.fromhex(proc.stdout.readline()))
        specs = list(pb.VersionHeader.FromString(bytes.fromhex(proc.stdout.readline())).tensors)
        got = ipc.open_shared(buffer, specs)
        for name, want in expected().items():
            assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
        del got
        proc.stdin.write("done\n")
        proc.stdin.flush()
        assert proc.wait(60) == 0
        with pytest.raises(ipc.IpcError, match="cannot open"):
            ipc.open_shared(buffer, specs)
        other = pb.CudaIpcBuffer()
        other.CopyFrom(buffer)
        other.node_id = "another-host"
        with pytest.raises(ipc.IpcError, match="another-host"):
            ipc.open_shared(other, specs)
    finally:
        proc.kill()


def test_pack_on_device_copies_and_aligns() -> None:
    t = expected()
    t["e4m3"] = torch.randn(64, 16, device="cuda").to(torch.float8_e4m3fn)
    t["scalar"] = torch.tensor(0.25, device="cuda")
    t["strided"] = torch.randn(8, 6, device="cuda").t()  # not contiguous: copied on its own
    packed = pack_on_device(t)
    assert list(packed) == list(t)
    for name in ("e4m3", "scalar", "strided"):
        v = packed[name]
        assert v.dtype == t[name].dtype and v.shape == t[name].shape
        assert torch.equal(v.contiguous().view(torch.uint8), t[name].contiguous().view(torch.uint8))
    del t["e4m3"], packed["e4m3"]  # torch.equal has no float8 kernel
    base = packed["a"].untyped_storage().data_ptr()
    for name, v in packed.items():
        assert torch.equal(v, t[name]) and (v.data_ptr() - base) % 256 == 0
    t["a"].zero_()  # the packed copy is independent of the source
    assert packed["a"].any()


CFG = ModelConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=64, num_experts=8, top_k=2, moe_intermediate_size=128,
                  max_position_embeddings=512)  # fmt: skip


def export(seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    model = MoECausalLM(CFG).init_weights(seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    learner = ModelLearner(model, LearnerConfig(mode="trace"), quant=QuantConfig(),
                           guidance=GuidanceConfig(), eos_id=2, pad_id=0, device="cuda")  # fmt: skip
    learner.export_on_device = True
    return learner.export_weights()


def wait_version(replica: LocalService, version: int, limit: float = 120.0) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        st = httpx.get(f"{replica.http_url}/status", timeout=10).json()
        if st["policy_version"] >= version:
            return st
        time.sleep(0.05)
    raise AssertionError(f"the replica never served version {version}:\n{replica.log()[-3000:]}")


def greedy(replica: LocalService, token: str) -> list[tuple[list[int], list[float]]]:
    stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(replica.grpc_address))
    request = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=[5 + i, 9, 17, 3 * i + 1]) for i in range(4)],
        group_size=1, run_id="ipc", sample_id_prefix="s",
        sampling=rollout_pb2.SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=16),
    )  # fmt: skip
    out = stub.Generate(request, metadata=[(AUTH_HEADER, f"Bearer {token}")], timeout=120)
    return sorted((list(c.token_ids), list(c.logprobs)) for c in out)


def test_a_replica_serves_an_offered_version_and_falls_back_when_it_cannot(tmp_path) -> None:
    token = secrets.token_hex(16)
    v0, meta = export(0)
    v1, _ = export(1)
    with local_stores(token, tmp_path) as env:
        client = WeightSyncClient(env["TRACE_WEIGHT_SYNC_ADDRESS"], token)
        publisher = WeightSyncPublisher(client, cuda_ipc=True)
        publisher.publish(0, v0, meta)
        replica = LocalService("rollout", "services.rollout", {
            **env, "TRACE_ROLLOUT_ENGINE": "cuda", "TRACE_DEVICE": "cuda",
            "TRACE_REPLICA_ID": "r0", "TRACE_ROLLOUT_MAX_BATCH": "8",
            "TRACE_ROLLOUT_MAX_CONTEXT": "256"}, tmp_path).launch()  # fmt: skip
        try:
            replica.wait_ports(timeout=300).wait_serving(timeout=300)
            wait_version(replica, 0)
            # Version 1 offered only: served from the trainer's GPU buffer.
            shared = ipc.share(v1)
            client.offer_version(1, shared, ipc.manifest(v1), meta)
            st = wait_version(replica, 1)
            assert st["last_weight_pull"]["kind"] == "cuda_ipc"
            assert max(v.version for v in client.versions()) == 0  # an offer publishes nothing
            from_ipc = greedy(replica, token)
            # Version 2 (the same weights) with a handle nobody can open: counted, then pulled.
            bad = pb.CudaIpcBuffer()
            bad.CopyFrom(shared.buffer)
            bad.memory_handle = bytes(64)
            client._stub.OfferVersion(
                pb.OfferVersionRequest(
                    header=pb.VersionHeader(version=2, metadata_json=json.dumps(meta, sort_keys=True),
                                            tensors=ipc.manifest(v1),
                                            total_bytes=sum(s.nbytes for s in ipc.manifest(v1))),
                    buffer=bad,
                ),
                metadata=client.metadata,
            )  # fmt: skip
            time.sleep(1.0)
            assert wait_version(replica, 1)["policy_version"] == 1  # still whole on version 1
            client.push_version(2, {k: t.cpu() for k, t in v1.items()}, meta)
            st = wait_version(replica, 2)
            assert st["last_weight_pull"]["kind"] in ("full", "delta")
            assert st["weight_ipc_failures_total"] == 1
            assert greedy(replica, token) == from_ipc  # bit-identical to the network path
        finally:
            replica.stop()
