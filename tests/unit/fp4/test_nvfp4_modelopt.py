"""NVFP4 is bit-identical to NVIDIA ModelOpt's NVFP4QTensor (eager/CPU path).

Compared bit for bit: packed codes, e4m3 block-scale bytes, fp32 second-level scale bits, and
the dequantized tensor's bits in the output dtype.
"""

from __future__ import annotations

import warnings
import zlib

import pytest
import torch

from trace_common.fp4 import nvfp4
from trace_common.fp4.constants import F4_E2M1_MAX, F8E4M3_MAX, NVFP4_BLOCK_SIZE

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # modelopt warns about the installed transformers version
    qtensor = pytest.importorskip(
        "modelopt.torch.quantization.qtensor",
        reason="nvidia-modelopt (the [modelopt] extra) is the bit-exact reference",
    )
NVFP4QTensor = qtensor.NVFP4QTensor

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
GLOBAL_AMAX_FOR_UNIT_SCALE = F4_E2M1_MAX * F8E4M3_MAX  # 2688: makes scale_2 exactly 1.0


def modelopt_quantize(x: torch.Tensor):
    qt, scale, scale_2 = NVFP4QTensor.quantize(x, NVFP4_BLOCK_SIZE)
    deq = qt.dequantize(
        x.dtype, scale=scale, double_scale=scale_2, block_sizes={-1: NVFP4_BLOCK_SIZE}
    )
    return qt._quantized_data, scale, scale_2, deq


def assert_bit_identical(x: torch.Tensor) -> None:
    ref_q, ref_scale, ref_scale_2, ref_deq = modelopt_quantize(x.clone())
    q = nvfp4.quantize(x, scale_granularity="tensor")
    assert q.qdata.dtype == torch.uint8 and q.qdata.shape == (*x.shape[:-1], x.shape[-1] // 2)
    assert q.scale.dtype == torch.float8_e4m3fn
    assert q.per_tensor_scale.dtype == torch.float32 and q.per_tensor_scale.shape == ()
    assert torch.equal(q.qdata, ref_q), "packed codes differ from ModelOpt"
    assert torch.equal(q.scale.view(torch.uint8), ref_scale.view(torch.uint8)), "block scales"
    assert q.per_tensor_scale.view(torch.int32).item() == ref_scale_2.view(torch.int32).item()
    deq = nvfp4.dequantize(q, dtype=x.dtype)
    iv = _INT_VIEW[x.dtype]
    assert torch.equal(deq.view(iv), ref_deq.view(iv)), "dequantized bits differ from ModelOpt"


SHAPES = [(16,), (3, 32), (2, 5, 64), (64, 256), (7, 1024)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
RANGES = [1e-6, 1e-2, 1.0, 37.0, 1e4]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("magnitude", RANGES)
def test_random_normal_bit_identical(shape, dtype, magnitude) -> None:
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, dtype, magnitude)).encode()))
    x = (torch.randn(shape, generator=g) * magnitude).to(dtype)
    assert_bit_identical(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heavy_tailed_mixed_magnitudes_bit_identical(dtype) -> None:
    g = torch.Generator().manual_seed(7)
    # log-uniform magnitudes over 12 decades, random signs: blocks of wildly different scales.
    mag = torch.exp(torch.empty(32, 512).uniform_(-14, 14, generator=g))
    sign = torch.where(torch.rand(32, 512, generator=g) < 0.5, -1.0, 1.0)
    x = (mag * sign).to(dtype)
    if dtype == torch.bfloat16:
        x = x.clamp(-3e38, 3e38)
    assert_bit_identical(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_zero_blocks_bit_identical(dtype) -> None:
    x = torch.randn(4, 64).to(dtype)
    x[0, :16] = 0
    x[2, 16:48] = 0
    x[3, :] = 0
    assert_bit_identical(x)
    q = nvfp4.quantize(x)
    assert q.scale[3].float().tolist() == [1.0] * 4  # all-zero block -> block scale 1.0
    assert q.codes()[3].tolist() == [0] * 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_ties_bit_identical(dtype) -> None:
    # scale_2 = 2688 / 2688 = 1 and a block of amax 6 gets block scale 1: values are exact ties.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    block_ties = [6.0, *ties, *(-t for t in ties), -0.0]
    x = torch.tensor(
        [[GLOBAL_AMAX_FOR_UNIT_SCALE] + [0.0] * 15 + block_ties],
        dtype=dtype,
    )
    assert_bit_identical(x)
    q = nvfp4.quantize(x)
    assert q.per_tensor_scale.item() == 1.0 and q.scale[0, 1].float().item() == 1.0
    assert q.codes()[0, 16:].tolist() == [
        0b0111,  # 6
        0b0000,
        0b0010,
        0b0010,
        0b0100,
        0b0100,
        0b0110,
        0b0110,  # ties -> even
        0b1000,
        0b1010,
        0b1010,
        0b1100,
        0b1100,
        0b1110,
        0b1110,
        0b0000,  # -0.0
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_at_and_past_saturation_bit_identical(dtype) -> None:
    # Block amax 6.375: 6.375 / 6 = 1.0625 rounds to e4m3 1.0, so the scaled amax is 6.375 > 6.
    x = torch.zeros(1, 48, dtype=dtype)
    x[0, 0] = GLOBAL_AMAX_FOR_UNIT_SCALE
    x[0, 16] = 6.375
    x[0, 17] = -6.375
    x[0, 18] = 6.0
    x[0, 19] = 5.9
    x[0, 32:48] = torch.linspace(-2688, 2688, 16).to(dtype)
    assert_bit_identical(x)
    q = nvfp4.quantize(x)
    assert q.scale[0, 1].float().item() == 1.0
    assert q.codes()[0, 16:20].tolist() == [0b0111, 0b1111, 0b0111, 0b0111]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_blocks_next_to_huge_bit_identical(dtype) -> None:
    x = torch.randn(8, 64).to(dtype)
    x[:, :16] *= 1e-7  # block scale clamps to 2**-9: these round to 0
    x[:, 16:32] *= 1e5
    x[:, 32:48] *= 1e-3
    assert_bit_identical(x)
    q = nvfp4.quantize(x)
    assert (q.scale[:, 0].float() == 2.0**-9).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_granularity_equals_modelopt_per_row(dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 128, generator=g) * torch.logspace(-3, 3, 6).unsqueeze(-1)).to(dtype)
    q = nvfp4.quantize(x, scale_granularity="row")
    assert q.per_tensor_scale.shape == (6, 1)
    deq = nvfp4.dequantize(q, dtype=dtype)
    iv = _INT_VIEW[dtype]
    for r in range(6):
        ref_q, ref_scale, ref_scale_2, ref_deq = modelopt_quantize(x[r : r + 1].clone())
        assert torch.equal(q.qdata[r : r + 1], ref_q)
        assert torch.equal(q.scale[r : r + 1].view(torch.uint8), ref_scale.view(torch.uint8))
        assert q.per_tensor_scale[r, 0].view(torch.int32) == ref_scale_2.view(torch.int32)
        assert torch.equal(deq[r : r + 1].view(iv), ref_deq.view(iv))


def test_given_per_tensor_scale_matches_modelopt() -> None:
    x = torch.randn(4, 64)
    scale_2 = torch.tensor(0.01)
    qt, scale, _ = NVFP4QTensor.quantize(x, NVFP4_BLOCK_SIZE, weights_scaling_factor_2=scale_2)
    q = nvfp4.quantize(x, per_tensor_scale=scale_2)
    assert torch.equal(q.qdata, qt._quantized_data)
    assert torch.equal(q.scale.view(torch.uint8), scale.view(torch.uint8))
