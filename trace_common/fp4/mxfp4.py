"""MXFP4 (OCP Microscaling v1.0): E2M1 elements with one E8M0 scale per 32 elements.

    shared_exp = floor(log2(block_amax)) - 2      # 2 = floor(log2(6)), E2M1's emax
                 clamped to [-127, 127]; an all-zero block gets -127
    codes      = RNE_sat(x.float() / 2**shared_exp)
    dequant    = (e2m1(codes) * 2**shared_exp).to(dtype)

floor(log2(amax)) is read exactly from the fp32 exponent field (no log2 rounding); for a
subnormal or zero amax that field gives an exponent clamped to -127. Elements of a block
whose amax has a large mantissa exceed 6 after scaling and saturate to +-6 (as in the spec).

`MXFP4Tensor.scale` is the E8M0 scale as its **uint8 biased exponent** (bits = shared_exp +
127, value 2**(bits - 127)); `.scale_e8m0()` views it as torch.float8_e8m0fnu.
NaN/Inf inputs are refused with a ValueError naming the element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trace_common.fp4._checks import check_finite, check_last_dim, check_tensor
from trace_common.fp4.constants import (
    E8M0_EXPONENT_BIAS,
    E8M0_MAX_EXPONENT,
    E8M0_MIN_EXPONENT,
    E8M0_NAN,
    F4_E2M1_EMAX,
    F32_EXPONENT_BIAS,
    F32_EXPONENT_MASK,
    F32_MANTISSA_BITS,
    MXFP4_BLOCK_SIZE,
)
from trace_common.fp4.e2m1 import (
    f32_to_e2m1,
    pack_uint4,
    packed_values,
    unpack_uint4,
)

# fp32 bit pattern of 2**-127 (a subnormal: only mantissa bit 22 set); every other E8M0 value
# 2**(b - 127), b in 1..254, is the normal fp32 with exponent field b.
_F32_BITS_2_POW_MINUS_127 = 1 << (F32_MANTISSA_BITS - 1)


@dataclass(slots=True)
class MXFP4Tensor:
    """A quantized MXFP4 tensor.

    qdata: uint8 [..., K/2], two E2M1 codes per byte, even element in the low nibble
    scale: uint8 [..., K/32], E8M0 biased exponents (value 2**(scale - 127))
    shape: the original shape [..., K]
    dtype: the original dtype (dequantize's default output dtype)
    """

    qdata: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    @property
    def block_size(self) -> int:
        return MXFP4_BLOCK_SIZE

    def codes(self) -> torch.Tensor:
        """The unpacked uint8 E2M1 codes [..., K]."""
        return unpack_uint4(self.qdata)

    def scale_e8m0(self) -> torch.Tensor:
        """The block scales as torch.float8_e8m0fnu (a view of the same bytes)."""
        return self.scale.view(torch.float8_e8m0fnu)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self, dtype=self.dtype if dtype is None else dtype)


def e8m0_to_f32(scale_u8: torch.Tensor) -> torch.Tensor:
    """Exact fp32 value 2**(bits - 127) of uint8 E8M0 biased exponents (0xFF, NaN, refused)."""
    if scale_u8.dtype != torch.uint8:
        raise TypeError(f"e8m0_to_f32 expects uint8 biased exponents, got dtype {scale_u8.dtype}")
    if scale_u8.numel() and bool((scale_u8 == E8M0_NAN).any()):
        raise ValueError(f"E8M0 scale 0x{E8M0_NAN:02X} is NaN; not a valid MXFP4 block scale")
    bits_i32 = scale_u8.to(torch.int32) << F32_MANTISSA_BITS
    bits_i32 = torch.where(scale_u8 == 0, _F32_BITS_2_POW_MINUS_127, bits_i32)
    return bits_i32.view(torch.float32)


def shared_exponent(block_amax_fp32: torch.Tensor) -> torch.Tensor:
    """OCP MX shared exponent floor(log2(amax)) - 2 as int32, clamped to E8M0's range."""
    exp_field = (block_amax_fp32.view(torch.int32) >> F32_MANTISSA_BITS) & F32_EXPONENT_MASK
    unbiased = exp_field - F32_EXPONENT_BIAS  # floor(log2(amax)) for normal amax
    return (unbiased - F4_E2M1_EMAX).clamp(min=E8M0_MIN_EXPONENT, max=E8M0_MAX_EXPONENT)


def quantize(x: torch.Tensor) -> MXFP4Tensor:
    """Quantize x [..., K] (K % 32 == 0; fp32/bf16/fp16) to MXFP4."""
    check_tensor(x)
    k = check_last_dim(x, MXFP4_BLOCK_SIZE, "mxfp4")
    check_finite(x)
    with torch.no_grad():
        blocks_fp32 = x.float().reshape(*x.shape[:-1], k // MXFP4_BLOCK_SIZE, MXFP4_BLOCK_SIZE)
        block_amax = blocks_fp32.abs().amax(dim=-1)  # [..., K/32]
        scale_u8 = (shared_exponent(block_amax) + E8M0_EXPONENT_BIAS).to(torch.uint8)
        # Dividing by a power of two is exact (up to fp32 subnormal rounding of tiny results).
        scaled_fp32 = blocks_fp32 / e8m0_to_f32(scale_u8).unsqueeze(-1)  # [..., K/32, 32]
        codes_u8 = f32_to_e2m1(scaled_fp32).reshape(x.shape)
        return MXFP4Tensor(qdata=pack_uint4(codes_u8), scale=scale_u8, shape=x.shape, dtype=x.dtype)


def dequantize(q: MXFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize to `dtype`: fp32 code value * 2**shared_exp, then one cast."""
    if not isinstance(q, MXFP4Tensor):
        raise TypeError(f"mxfp4.dequantize expects an MXFP4Tensor, got {type(q).__name__}")
    k = q.shape[-1]
    values_fp32 = packed_values(q.qdata)
    blocks_fp32 = values_fp32.reshape(*q.shape[:-1], k // MXFP4_BLOCK_SIZE, MXFP4_BLOCK_SIZE)
    return (blocks_fp32 * e8m0_to_f32(q.scale).unsqueeze(-1)).reshape(q.shape).to(dtype)
