"""The broadcast transport over gloo (trace_common/clients/broadcast.py): a trainer's Source
and members in threads of this process, each with its own TCPStore client, as separate
processes would have. Versions arrive bit for bit and a group is reused while its id stays;
a member that never joins, a bad checksum or a bad layout fail with BroadcastError, and a
new group works after a failed one."""

from __future__ import annotations

import threading

import pytest
import torch

from trace_common.clients import broadcast as bc
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb

TIMEOUT_S = 5.0


def version(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.w.codes": torch.randint(0, 256, (64, 33), dtype=torch.uint8, generator=g),
        "layers.0.w.scales": torch.randn(64, 2, generator=g).to(torch.float8_e4m3fn),
        "layers.0.w.scale_2": torch.rand((), generator=g),
        "embed.weight": torch.randn(17, 8, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, dtype=torch.int32),
    }


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(
        x.dtype == y.dtype
        and x.shape == y.shape
        and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for x, y in zip(a.values(), b.values(), strict=True)
    )


def group_for(source: bc.Source, members: list[str], gid: str, tensors) -> tuple:
    flat, offsets = bc.flat_view(tensors)
    group = source.endpoint(offsets, flat.numel(), checksummed=True, node="")
    group.group_id = gid
    group.members[:] = members
    return group, flat, bc.manifest(tensors, checksummed=True)


def run(source, group, flat, specs, members: dict[str, bc.Member]) -> tuple[dict, dict]:
    """Send from `source` and receive on every member at once; (received, errors) by name."""
    got, errors = {}, {}

    def receive(name: str, member: bc.Member) -> None:
        try:
            got[name] = member.receive(group, specs)
        except bc.BroadcastError as exc:
            errors[name] = exc

    threads = [threading.Thread(target=receive, args=kv) for kv in members.items()]
    for t in threads:
        t.start()
    try:
        source.send(group, flat)
    except bc.BroadcastError as exc:
        errors["source"] = exc
    for t in threads:
        t.join(3 * TIMEOUT_S)
    return got, errors


@pytest.fixture
def source():
    s = bc.Source("127.0.0.1", 0, "gloo", TIMEOUT_S)
    yield s
    s.close()


def test_members_get_each_version_bit_for_bit_and_keep_their_group(source) -> None:
    assert source.renew_group  # a new trainer's first offer asks for a new group
    members = {r: bc.Member(r, torch.device("cpu")) for r in ("r1", "r2")}
    for v in range(2):
        tensors = version(v)
        group, flat, specs = group_for(source, list(members), "g1", tensors)
        got, errors = run(source, group, flat, specs, members)
        assert not errors and set(got) == {"r1", "r2"}
        assert all(same_bits(t, tensors) for t in got.values())
        if v == 0:
            kept = {r: m._groups.pg for r, m in members.items()}
    assert all(m._groups.pg is kept[r] for r, m in members.items())  # one communicator


def test_a_member_that_never_joins_fails_the_broadcast_and_a_new_group_works(source) -> None:
    tensors = version(0)
    members = {"r1": bc.Member("r1", torch.device("cpu"))}
    group, flat, specs = group_for(source, ["r1", "gone"], "g1", tensors)
    got, errors = run(source, group, flat, specs, members)
    assert not got and set(errors) == {"source", "r1"}
    assert "g1" in str(errors["source"]) and source.renew_group
    assert members["r1"]._groups.pg is None  # the broken group is dropped
    group, flat, specs = group_for(source, ["r1"], "g2", tensors)
    got, errors = run(source, group, flat, specs, members)
    assert not errors and same_bits(got["r1"], tensors) and not source.renew_group


def test_a_checksum_that_does_not_match_is_refused(source) -> None:
    tensors = version(1)
    members = {"r1": bc.Member("r1", torch.device("cpu"))}
    group, flat, specs = group_for(source, ["r1"], "g1", tensors)
    specs[0].crc32 ^= 1
    got, errors = run(source, group, flat, specs, members)
    assert not got and "CRC-32" in str(errors["r1"]) and "layers.0.w.codes" in str(errors["r1"])


def test_a_replica_outside_the_group_or_of_another_backend_is_refused() -> None:
    group = pb.BroadcastGroup(group_id="g", backend="gloo", members=["r1"], timeout_seconds=1)
    group.buffer_bytes = 1 << 50  # nothing is allocated for a buffer the manifest cannot fill
    with pytest.raises(bc.BroadcastError, match="at most 256 bytes"):
        bc.Member("r1", torch.device("cpu")).receive(group, [])
    group.buffer_bytes = 0
    with pytest.raises(bc.BroadcastError, match="'r9' is not a member of group g"):
        bc.Member("r9", torch.device("cpu")).receive(group, [])
    group.backend = "nccl"
    with pytest.raises(bc.BroadcastError, match="uses 'nccl'; this replica joins 'gloo'"):
        bc.Member("r1", torch.device("cpu")).receive(group, [])


def test_layout_views_and_bounds() -> None:
    tensors = version(2)
    flat, offsets = bc.pack(tensors)
    assert all(o % bc.ALIGN == 0 for o in offsets)
    specs = bc.manifest(tensors, checksummed=False)
    assert same_bits(bc.unpack(flat, specs, offsets), tensors)
    views = bc.unpack(flat, specs, offsets)
    again, view_offsets = bc.flat_view(views)
    assert again.data_ptr() == flat.data_ptr()  # views of one buffer: no copy
    assert same_bits(bc.unpack(again, specs, view_offsets), tensors)
    with pytest.raises(bc.BroadcastError, match="outside the"):
        bc.unpack(flat[:100], specs, offsets)
    with pytest.raises(ValueError, match="backend 'mpi'"):
        bc.Source("127.0.0.1", 0, "mpi", 1.0)
