"""`trace_common.device.to_cpu`: a policy's tensors brought to the host in one transfer."""

from __future__ import annotations

import pytest
import torch

from trace_common.device import to_cpu


def mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "codes": torch.randint(0, 256, (7, 5), dtype=torch.uint8, generator=g),
        "scales": torch.rand(7, 3, generator=g).to(torch.float8_e4m3fn),
        "scale_2": torch.tensor(0.25),
        "w": torch.randn(3, 9, generator=g),
        "bf": torch.randn(11, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(6, 4, generator=g).t(),
    }


def test_cpu_tensors_come_back_as_they_are() -> None:
    src = mixed()
    out = to_cpu(src)
    assert all(out[k] is src[k] for k in src)


@pytest.mark.gpu
def test_device_tensors_arrive_bit_for_bit() -> None:
    src = mixed()
    out = to_cpu({k: v.cuda() for k, v in src.items()})
    for k, v in src.items():
        assert out[k].device.type == "cpu" and out[k].dtype == v.dtype and out[k].shape == v.shape
        assert torch.equal(out[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
