"""The broadcast transport over NCCL on two GPUs (trace_common/clients/broadcast.py): the
trainer's Source on cuda:0 and a Member on cuda:1 (a thread each, one GPU each, as NCCL
allows in one process). A version arrives bit for bit in the member's GPU memory and the
group is reused for the next one; a member that never joins fails the broadcast within its
timeout and a new group works after it. The gloo tests
(tests/unit/weight_sync/test_broadcast_gloo.py) cover the same paths on the CPU."""

from __future__ import annotations

import threading

import pytest
import torch

from trace_common.clients import broadcast as bc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL: one rank per GPU)"
)
TIMEOUT_S = 20.0


def version(seed: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return {
        "codes": torch.randint(0, 256, (4096, 257), dtype=torch.uint8, device=device, generator=g),
        "scales": torch.randn(4096, 16, device=device, generator=g).to(torch.float8_e4m3fn),
        "embed": torch.randn(1000, 64, device=device, generator=g).to(torch.bfloat16),
    }


def send_and_receive(source, member, members: list[str], gid: str, tensors) -> tuple:
    flat, offsets = bc.flat_view(tensors)
    group = source.endpoint(offsets, flat.numel(), checksummed=False)
    group.group_id, group.members[:] = gid, members
    specs = bc.manifest(tensors, checksummed=False)
    got, errors = {}, {}

    def receive() -> None:
        torch.cuda.set_device(member.device)
        try:
            got["r1"] = member.receive(group, specs)
        except bc.BroadcastError as exc:
            errors["r1"] = exc

    t = threading.Thread(target=receive)
    t.start()
    try:
        source.send(group, flat)
    except bc.BroadcastError as exc:
        errors["source"] = exc
    t.join(3 * TIMEOUT_S)
    return got, errors


def test_a_one_rank_nccl_group_forms_broadcasts_and_times_out_a_missing_member() -> None:
    """What one GPU can check of the NCCL side: the process group built with its timeout,
    a broadcast on it, and a member that never checks in failing the send within the
    group's timeout (in the store, before NCCL), after which a new group works."""
    torch.cuda.set_device(0)
    source = bc.Source("127.0.0.1", 0, "nccl", 5.0)
    try:
        tensors = version(0, "cuda:0")
        flat, offsets = bc.flat_view(tensors)
        before = flat.clone()
        group = source.endpoint(offsets, flat.numel(), checksummed=False)
        group.group_id = "solo"
        source.send(group, flat)
        assert torch.equal(flat, before) and not source.renew_group
        group.group_id, group.members[:] = "with-gone", ["gone"]
        with pytest.raises(bc.BroadcastError, match="with-gone"):
            source.send(group, flat)
        assert source.renew_group
        group.group_id, group.members[:] = "solo-2", []
        source.send(group, flat)
        assert not source.renew_group
    finally:
        source.close()


@two_gpus
def test_versions_arrive_bit_for_bit_on_the_other_gpu_and_a_dead_member_fails_cleanly() -> None:
    torch.cuda.set_device(0)
    source = bc.Source("127.0.0.1", 0, "nccl", TIMEOUT_S)
    member = bc.Member("r1", torch.device("cuda", 1))
    try:
        for v in range(2):
            tensors = version(v, "cuda:0")
            got, errors = send_and_receive(source, member, ["r1"], "g1", tensors)
            assert not errors, errors
            for name, t in tensors.items():
                assert got["r1"][name].device == torch.device("cuda", 1)
                assert torch.equal(
                    got["r1"][name].cpu().view(torch.uint8), t.cpu().view(torch.uint8)
                )
        got, errors = send_and_receive(source, member, ["r1", "gone"], "g2", version(2, "cuda:0"))
        assert not got and set(errors) == {"source", "r1"} and source.renew_group
        tensors = version(3, "cuda:0")
        got, errors = send_and_receive(source, member, ["r1"], "g3", tensors)
        assert not errors and torch.equal(got["r1"]["embed"].cpu(), tensors["embed"].cpu())
    finally:
        member.close()
        source.close()
