"""The format registry and fake quantization (forward = dequant(quant(x)), backward = STE)."""

from __future__ import annotations

import pytest
import torch

from trace_common.fp4 import available_formats, get_format, mxfp4, nvfp4
from trace_common.fp4.fake import fake_quantize


def test_registry_lists_both_formats() -> None:
    assert available_formats() == ["mxfp4", "nvfp4"]
    assert get_format("nvfp4").block_size == 16
    assert get_format("mxfp4").block_size == 32


def test_unknown_format_named() -> None:
    with pytest.raises(ValueError, match="unknown FP4 format 'fp8'"):
        get_format("fp8")
    with pytest.raises(ValueError, match="'int4'"):
        fake_quantize(torch.randn(2, 32), "int4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_format_objects_match_modules(dtype) -> None:
    x = torch.randn(4, 64).to(dtype)
    nv = get_format("nvfp4")
    q = nv.quantize(x, scale_granularity="row")
    assert torch.equal(q.qdata, nvfp4.quantize(x, scale_granularity="row").qdata)
    assert torch.equal(nv.dequantize(q, dtype), nvfp4.dequantize(q, dtype))
    mx = get_format("mxfp4")
    assert torch.equal(mx.dequantize(mx.quantize(x)), mxfp4.dequantize(mxfp4.quantize(x)))
    with pytest.raises(TypeError, match="per_tensor_scale"):
        mx.quantize(x, per_tensor_scale=1.0)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quantize_forward_and_ste(fmt, dtype) -> None:
    x = torch.randn(3, 64).to(dtype).requires_grad_(True)
    y = fake_quantize(x, fmt)
    spec = get_format(fmt)
    kw = {"scale_granularity": "row"} if fmt == "nvfp4" else {}
    assert y.dtype == dtype
    assert torch.equal(y.detach(), spec.dequantize(spec.quantize(x.detach(), **kw), dtype))
    assert not torch.equal(y.detach(), x.detach())
    w = torch.randn(3, 64).to(dtype)
    (y * w).sum().backward()
    assert torch.equal(x.grad, w)


def test_fake_quantize_tensor_granularity() -> None:
    x = torch.randn(3, 32)
    y = fake_quantize(x, "nvfp4", scale_granularity="tensor")
    assert torch.equal(y, nvfp4.dequantize(nvfp4.quantize(x)))
