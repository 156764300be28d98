"""`trace_common.device._packed_to_host`, the large-version path of `to_host`, on CPU
tensors (the copy itself is device-agnostic; tests/unit/gpu/test_trainer_gpu.py runs
`to_host` on CUDA): views of one buffer come back as views of one copy at the same
offsets; tensors that are not such views, or views of a much larger buffer, are left to
the tensor-by-tensor path (None)."""

from __future__ import annotations

import torch

from trace_common.device import _packed_to_host


def packed() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    buf = torch.arange(1024, dtype=torch.int32).view(torch.uint8)  # 4096 bytes
    return buf, {
        "a": buf[0:64].view(torch.int32).view(4, 4),
        "b": buf[256:256 + 18].view(torch.bfloat16).view(3, 3),
        "s": buf[512:516].view(torch.float32).view(()),
    }  # fmt: skip


def test_views_of_one_buffer_come_back_in_one_copy() -> None:
    buf, t = packed()
    out = _packed_to_host(list(t.items()), 4096, pinned=False)
    assert out is not None and out.keys() == t.keys()
    for k, v in t.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape
        assert torch.equal(out[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
    assert len({v.untyped_storage().data_ptr() for v in out.values()}) == 1
    assert out["a"].untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    buf.zero_()
    assert out["a"].any()


def test_other_tensors_are_left_to_the_per_tensor_path() -> None:
    _, t = packed()
    separate = {**t, "own": torch.ones(3)}
    assert _packed_to_host(list(separate.items()), 4096, pinned=False) is None
    strided = {**t, "a": t["a"].t()}
    assert _packed_to_host(list(strided.items()), 4096, pinned=False) is None
    big = torch.zeros(200 << 20, dtype=torch.uint8)  # a 200 MiB allocation for 64 bytes
    assert _packed_to_host([("x", big[:64])], 64, pinned=False) is None
