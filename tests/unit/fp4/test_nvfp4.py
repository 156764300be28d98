"""NVFP4 behaviour beyond the ModelOpt comparison: layout, zero tensors, bad input."""

from __future__ import annotations

import pytest
import torch

from trace_common.fp4 import nvfp4
from trace_common.fp4.constants import NVFP4_ZERO_AMAX_SCALE_2


def test_layout_and_dtypes_row_granularity() -> None:
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    q = nvfp4.quantize(x, scale_granularity="row")
    assert q.qdata.shape == (2, 3, 32) and q.qdata.dtype == torch.uint8
    assert q.scale.shape == (2, 3, 4) and q.scale.dtype == torch.float8_e4m3fn
    assert q.per_tensor_scale.shape == (2, 3, 1) and q.per_tensor_scale.dtype == torch.float32
    assert q.shape == x.shape and q.dtype == torch.bfloat16
    assert q.dequantize().dtype == torch.bfloat16
    assert nvfp4.dequantize(q).dtype == torch.float32


def test_all_zero_tensor_is_exact_zero_not_nan() -> None:
    # ModelOpt divides 0 by 0 here (NaN scales); TRACE defines scale_2 = 1.0.
    q = nvfp4.quantize(torch.zeros(2, 32))
    assert q.per_tensor_scale.item() == NVFP4_ZERO_AMAX_SCALE_2
    assert q.scale.float().tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert (q.qdata == 0).all()
    assert torch.equal(nvfp4.dequantize(q), torch.zeros(2, 32))


def test_zero_row_in_row_granularity() -> None:
    x = torch.randn(3, 32)
    x[1] = 0
    q = nvfp4.quantize(x, scale_granularity="row")
    assert q.per_tensor_scale[1].item() == NVFP4_ZERO_AMAX_SCALE_2
    assert (nvfp4.dequantize(q)[1] == 0).all()
    assert torch.isfinite(nvfp4.dequantize(q)).all()


def test_quantization_error_is_bounded() -> None:
    # SQNR of NVFP4 on Gaussian data is ~20 dB; a broken scale or rounding drops far below.
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    for gran in ("tensor", "row"):
        err = nvfp4.dequantize(nvfp4.quantize(x, scale_granularity=gran)) - x
        sqnr_db = 10 * torch.log10(x.pow(2).sum() / err.pow(2).sum()).item()
        assert sqnr_db > 18.0, f"{gran}: SQNR {sqnr_db:.1f} dB, expected > 18 dB"


def test_empty_rows_are_allowed() -> None:
    q = nvfp4.quantize(torch.zeros(0, 32), scale_granularity="row")
    assert q.qdata.shape == (0, 16)
    assert nvfp4.dequantize(q).shape == (0, 32)


@pytest.mark.parametrize("k", [8, 24, 33])
def test_last_dim_not_multiple_of_block(k: int) -> None:
    with pytest.raises(ValueError, match=rf"last dim {k} .* block size 16"):
        nvfp4.quantize(torch.randn(2, k))


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.float64, torch.float8_e4m3fn])
def test_unsupported_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match=str(dtype)):
        nvfp4.quantize(torch.zeros(2, 16).to(dtype))


def test_not_a_tensor() -> None:
    with pytest.raises(TypeError, match="list"):
        nvfp4.quantize([1.0] * 16)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_refused_naming_value_and_index(bad: float) -> None:
    x = torch.ones(2, 32, dtype=torch.bfloat16)
    x[1, 5] = bad
    with pytest.raises(ValueError, match=rf"contains {bad} at index \(1, 5\)"):
        nvfp4.quantize(x)


def test_bad_granularity_and_scale() -> None:
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="'block'"):
        nvfp4.quantize(x, scale_granularity="block")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"shape \(2,\).*needs \(2, 1\)"):
        nvfp4.quantize(x, scale_granularity="row", per_tensor_scale=torch.ones(2))
    with pytest.raises(ValueError, match=r"finite and > 0, got -1\.0"):
        nvfp4.quantize(x, per_tensor_scale=torch.tensor(-1.0))


def test_zero_d_input() -> None:
    with pytest.raises(ValueError, match="0-d"):
        nvfp4.quantize(torch.tensor(1.0))


def test_quantize_stack_equals_quantizing_each_tensor() -> None:
    """The batched quantizer gives, for each tensor, the codes, block scales and scale_2 that
    quantizing it alone with the same scale_2 gives, bit for bit (an all-zero tensor, tiny and
    huge magnitudes included), and one batched dequantize equals dequantizing each."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 8, 64, generator=g)
    x[1] = 0.0
    x[2] *= 1e-30
    x[3] *= 1e4
    scale_2 = nvfp4.scale_2_from_amax(x.abs().amax(dim=(1, 2)))
    got = nvfp4.quantize_stack(x, scale_2)
    for i, q in enumerate(got):
        ref = nvfp4.quantize(x[i], per_tensor_scale=scale_2[i])
        assert torch.equal(q.qdata, ref.qdata) and q.shape == ref.shape
        assert torch.equal(q.scale.view(torch.uint8), ref.scale.view(torch.uint8))
        assert torch.equal(q.per_tensor_scale, ref.per_tensor_scale)
        assert q.per_tensor_scale.dim() == 0
    deq = nvfp4.stack(got).dequantize(torch.float32)
    assert torch.equal(deq, torch.stack([nvfp4.dequantize(q) for q in got]))


def test_quantize_stack_refuses_bad_input_naming_it() -> None:
    x = torch.randn(3, 4, 32)
    with pytest.raises(ValueError, match=r"needs \(3,\)"):
        nvfp4.quantize_stack(x, torch.ones(2))
    with pytest.raises(ValueError, match=r"finite and > 0, got 0\.0"):
        nvfp4.quantize_stack(x, torch.tensor([1.0, 0.0, 1.0]))
    x[2, 1, 5] = float("nan")
    with pytest.raises(ValueError, match="nan"):
        nvfp4.quantize_stack(x, torch.ones(3))
