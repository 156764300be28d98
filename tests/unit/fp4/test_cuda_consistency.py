"""The reference gives the same bits on CUDA as on CPU (so GPU kernels may be tested against
either). Skipped, with the reason, where no CUDA device is present."""

from __future__ import annotations

import pytest
import torch

from trace_common.fp4 import mxfp4, nvfp4
from trace_common.fp4.guided import guided_quantize
from trace_common.fp4.record import capture

pytestmark = pytest.mark.gpu
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    mixed = torch.randn(64, 512, generator=g) * torch.exp(
        torch.empty(64, 512).uniform_(-12, 12, generator=g)
    )
    zeros = torch.randn(8, 64, generator=g)
    zeros[2] = 0
    zeros[5, 16:32] = 0
    ties = torch.tensor([[2688.0] + [0.0] * 15 + [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2])
    return [t.to(dtype) for t in (torch.randn(3, 7, 256, generator=g), mixed, zeros, ties)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gran", ["tensor", "row"])
def test_nvfp4_cpu_equals_cuda(dtype, gran) -> None:
    for x in _inputs(dtype):
        a = nvfp4.quantize(x, scale_granularity=gran)
        b = nvfp4.quantize(x.cuda(), scale_granularity=gran)
        assert torch.equal(a.qdata, b.qdata.cpu())
        assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8).cpu())
        assert torch.equal(
            a.per_tensor_scale.view(torch.int32), b.per_tensor_scale.view(torch.int32).cpu()
        )
        iv = _INT_VIEW[dtype]
        assert torch.equal(
            nvfp4.dequantize(a, dtype).view(iv), nvfp4.dequantize(b, dtype).view(iv).cpu()
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_cpu_equals_cuda(dtype) -> None:
    for x in _inputs(dtype):
        if x.shape[-1] % 32:
            continue
        a, b = mxfp4.quantize(x), mxfp4.quantize(x.cuda())
        assert torch.equal(a.qdata, b.qdata.cpu()) and torch.equal(a.scale, b.scale.cpu())
        iv = _INT_VIEW[dtype]
        assert torch.equal(
            mxfp4.dequantize(a, dtype).view(iv), mxfp4.dequantize(b, dtype).view(iv).cpu()
        )


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("mode", ["full", "compact"])
def test_guided_cpu_equals_cuda(fmt, mode) -> None:
    x = torch.randn(32, 256).bfloat16()
    x_train = (x.float() * (1 + 0.05 * torch.randn(32, 256))).bfloat16()
    y_cpu_q, rec_cpu = capture(x, fmt, mode)
    y_gpu_q, rec_gpu = capture(x.cuda(), fmt, mode)
    assert rec_cpu.to_bytes() == rec_gpu.to_bytes()
    assert torch.equal(y_cpu_q.view(torch.int16), y_gpu_q.view(torch.int16).cpu())
    a = guided_quantize(x_train, rec_cpu)
    b = guided_quantize(x_train.cuda(), rec_cpu)  # a CPU record guides a CUDA tensor
    assert torch.equal(a.view(torch.int16), b.view(torch.int16).cpu())
