"""MXFP4 (OCP MX v1.0) against spec tables and an independent scalar reference."""

from __future__ import annotations

import math

import pytest
import torch

from trace_common.fp4 import mxfp4
from trace_common.fp4.constants import E2M1_MAGNITUDES

GRID = E2M1_MAGNITUDES


def ref_scale_exponent(amax: float) -> int:
    """floor(log2(amax)) - 2 clamped to [-127, 127]; zero -> -127 (scalar, via frexp)."""
    if amax == 0:
        return -127
    _, e = math.frexp(amax)  # amax = m * 2**e, m in [0.5, 1)
    return max(-127, min(127, e - 1 - 2))


def ref_rne_magnitude_index(a: float) -> int:
    """Nearest grid magnitude index, ties to the even index, saturating at 6."""
    if a >= GRID[-1]:
        return len(GRID) - 1
    best = min(range(len(GRID)), key=lambda i: (abs(GRID[i] - a), i % 2))
    return best


def ref_quantize_block(block: list[float]) -> tuple[int, list[int]]:
    e = ref_scale_exponent(max(abs(v) for v in block))
    codes = []
    for v in block:
        idx = ref_rne_magnitude_index(abs(v) / 2.0**e)
        codes.append(idx | (8 if v < 0 else 0))
    return e + 127, codes


@pytest.mark.parametrize(
    ("amax", "scale_bits", "amax_code"),
    [
        (1.0, 125, 0b0110),  # 2**(0-2): 1 / 0.25 = 4
        (6.0, 127, 0b0111),  # floor(log2 6) = 2 -> scale 1, 6 -> 6
        (7.99, 127, 0b0111),  # saturates: 7.99 / 1 > 6
        (8.0, 128, 0b0110),  # scale 2: 8 / 2 = 4
        (0.75, 124, 0b0111),  # scale 2**-3: 0.75 / 0.125 = 6
        (3.0e38, 252, 0b0111),  # floor(log2 3e38) = 127 -> 125; 3e38 / 2**125 = 7.05 -> 6
    ],
)
def test_scale_spec_table(amax: float, scale_bits: int, amax_code: int) -> None:
    x = torch.zeros(1, 32)
    x[0, 3] = amax
    q = mxfp4.quantize(x)
    assert q.scale.tolist() == [[scale_bits]]
    assert q.scale.dtype == torch.uint8
    assert q.codes()[0, 3].item() == amax_code
    assert q.codes()[0, 3].item() == ref_quantize_block(x[0].tolist())[1][3]
    assert q.scale_e8m0().float().item() == 2.0 ** (scale_bits - 127)


def test_zero_block_and_subnormal_amax_get_minimum_scale() -> None:
    x = torch.zeros(2, 32)
    x[1, 0] = 1e-45  # fp32 subnormal: floor(log2) is below the E8M0 range
    q = mxfp4.quantize(x)
    assert q.scale.tolist() == [[0], [0]]
    assert (q.qdata == 0).all()
    assert torch.equal(mxfp4.dequantize(q), torch.zeros(2, 32))


def test_ties_to_even_within_block() -> None:
    # amax 4 -> scale 2**0: values are their own scaled values.
    vals = [4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -2.5, -5.0, -0.1] + [0.0] * 20
    q = mxfp4.quantize(torch.tensor([vals]))
    assert q.scale.item() == 127
    assert q.codes()[0, :12].tolist() == [
        0b0110,
        0b0000,
        0b0010,
        0b0010,
        0b0100,
        0b0100,
        0b0110,
        0b0110,
        0b1010,
        0b1100,
        0b1110,
        0b1000,
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("log_mag", [-20, -3, 0, 5, 30])
def test_matches_scalar_reference(dtype: torch.dtype, log_mag: int) -> None:
    g = torch.Generator().manual_seed(log_mag + 100)
    x = torch.randn(4, 64, generator=g) * 2.0**log_mag
    x = x * torch.exp(torch.empty(4, 64).uniform_(-3, 3, generator=g))
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    x = x.to(dtype)
    q = mxfp4.quantize(x)
    deq = mxfp4.dequantize(q)
    codes = q.codes()
    for r in range(4):
        for b in range(2):
            block = x[r, 32 * b : 32 * (b + 1)].float().tolist()
            bits, ref_codes = ref_quantize_block(block)
            assert q.scale[r, b].item() == bits
            assert codes[r, 32 * b : 32 * (b + 1)].tolist() == ref_codes
            ref_vals = [(-1 if c & 8 else 1) * GRID[c & 7] * 2.0 ** (bits - 127) for c in ref_codes]
            assert deq[r, 32 * b : 32 * (b + 1)].tolist() == [v + 0.0 for v in ref_vals]
    assert mxfp4.dequantize(q, dtype=dtype).dtype == dtype


def test_layout() -> None:
    q = mxfp4.quantize(torch.randn(2, 3, 64))
    assert q.qdata.shape == (2, 3, 32) and q.scale.shape == (2, 3, 2)


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"last dim 48 .* block size 32"):
        mxfp4.quantize(torch.randn(2, 48))
    with pytest.raises(TypeError, match="int64"):
        mxfp4.quantize(torch.zeros(2, 32, dtype=torch.int64))
    x = torch.ones(2, 32)
    x[0, 7] = float("nan")
    with pytest.raises(ValueError, match=r"nan at index \(0, 7\)"):
        mxfp4.quantize(x)
    with pytest.raises(ValueError, match="0xFF is NaN"):
        mxfp4.e8m0_to_f32(torch.tensor([255], dtype=torch.uint8))
