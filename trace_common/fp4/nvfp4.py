"""NVFP4: E2M1 elements, one FP8 E4M3 scale per 16 elements, and an FP32 second-level scale.

The numerics are NVIDIA ModelOpt's `NVFP4QTensor` (eager/CPU path) reproduced op for op, so
results are bit-identical to it (tests/unit/fp4/test_nvfp4_modelopt.py):

    scale_2   = amax(|x|).float() / (6 * 448)                    # fp32; per tensor or per row
    block     = block_amax.float() / (6 * scale_2)               # fp32 divide
    block     = 1.0 where block == 0; clamp(2**-9, 448); -> float8_e4m3fn (RNE)
    codes     = RNE_sat(x.float() / (block.float() * scale_2))   # fp32 product, then divide
    dequant   = (e2m1(codes) * (block.float() * scale_2)).to(dtype)

The "row" granularity takes the amax per row (per token) instead of per tensor; everything
else is identical. Deliberate difference from ModelOpt: an all-zero tensor/row (amax 0, or an
amax so tiny that amax/2688 underflows to 0) gets scale_2 = 1.0, where ModelOpt divides 0 by 0
and emits NaN scales. NaN/Inf inputs are refused with a ValueError naming the element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from trace_common.fp4._checks import check_finite, check_last_dim, check_tensor
from trace_common.fp4.constants import (
    F4_E2M1_MAX,
    F8E4M3_MAX,
    NVFP4_BLOCK_SCALE_MAX,
    NVFP4_BLOCK_SCALE_MIN,
    NVFP4_BLOCK_SIZE,
    NVFP4_ZERO_AMAX_SCALE_2,
    NVFP4_ZERO_BLOCK_SCALE,
)
from trace_common.fp4.e2m1 import (
    f32_to_e2m1,
    pack_uint4,
    packed_values,
    unpack_uint4,
)

ScaleGranularity = Literal["tensor", "row"]
SCALE_GRANULARITIES: tuple[str, ...] = ("tensor", "row")


@dataclass(slots=True)
class NVFP4Tensor:
    """A quantized NVFP4 tensor (ModelOpt checkpoint layout).

    qdata:            uint8 [..., K/2], two E2M1 codes per byte, even element in the low nibble
    scale:            float8_e4m3fn [..., K/16], one block scale per 16 elements
    per_tensor_scale: float32, 0-d for "tensor" granularity, [..., 1] for "row" (per token)
    shape:            the original shape [..., K]
    dtype:            the original dtype (dequantize's default output dtype)
    """

    qdata: torch.Tensor
    scale: torch.Tensor
    per_tensor_scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    scale_granularity: ScaleGranularity = "tensor"

    @property
    def block_size(self) -> int:
        return NVFP4_BLOCK_SIZE

    def codes(self) -> torch.Tensor:
        """The unpacked uint8 E2M1 codes [..., K]."""
        return unpack_uint4(self.qdata)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self, dtype=self.dtype if dtype is None else dtype)


def scale_2_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Second-level fp32 scale amax / (6 * 448); 1.0 where that is 0 (all-zero tensor/row)."""
    amax_fp32 = amax.float()
    # Divide by a tensor on amax's device, not a Python float: CUDA turns division by a CPU
    # scalar into a multiply by its reciprocal (1/2688 is inexact), CPU divides; a true
    # divide on both keeps the reference device-independent and equal to ModelOpt's CPU path.
    scale_2_fp32 = amax_fp32 / torch.full_like(amax_fp32, F4_E2M1_MAX * F8E4M3_MAX)
    return torch.where(scale_2_fp32 == 0, NVFP4_ZERO_AMAX_SCALE_2, scale_2_fp32)


def block_scales_e4m3(block_amax: torch.Tensor, scale_2_fp32: torch.Tensor) -> torch.Tensor:
    """e4m3 block scales from fp32 block amaxes [..., K/16] and the second-level scale.

    `scale_2_fp32` broadcasts against `block_amax` (0-d or [..., 1]).
    """
    # fp32 product first, then one fp32 divide: the order ModelOpt uses (bit-exactness).
    block_fp32 = block_amax.float() / (F4_E2M1_MAX * scale_2_fp32)
    block_fp32 = torch.where(block_fp32 == 0, NVFP4_ZERO_BLOCK_SCALE, block_fp32)
    return block_fp32.clamp(min=NVFP4_BLOCK_SCALE_MIN, max=NVFP4_BLOCK_SCALE_MAX).to(
        torch.float8_e4m3fn
    )


def effective_block_scale(scale_e4m3: torch.Tensor, scale_2_fp32: torch.Tensor) -> torch.Tensor:
    """fp32 product block * scale_2 [..., K/16]: the divisor of quantize, the factor of dequantize."""
    return scale_e4m3.to(torch.float32) * scale_2_fp32


def quantize(
    x: torch.Tensor,
    *,
    scale_granularity: ScaleGranularity = "tensor",
    per_tensor_scale: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """Quantize x [..., K] (K % 16 == 0; fp32/bf16/fp16) to NVFP4.

    scale_granularity: "tensor" (one fp32 scale_2, weights; ModelOpt's convention) or "row"
        (one per row of the last dim, i.e. per token, for activations and KV).
    per_tensor_scale: a precomputed positive fp32 second-level scale (0-d for "tensor",
        [..., 1] for "row"), e.g. a calibrated static scale; computed from x when None.
    """
    check_tensor(x)
    if scale_granularity not in SCALE_GRANULARITIES:
        raise ValueError(
            f"scale_granularity={scale_granularity!r}; expected one of {SCALE_GRANULARITIES}"
        )
    check_last_dim(x, NVFP4_BLOCK_SIZE, "nvfp4")
    check_finite(x)
    with torch.no_grad():
        x_fp32 = x.float()  # exact for bf16/fp16; ModelOpt's divide promotes to fp32 the same way
        if per_tensor_scale is None:
            if scale_granularity == "tensor":
                amax = x_fp32.abs().amax() if x.numel() else x_fp32.new_zeros(())
            else:
                amax = x_fp32.abs().amax(dim=-1, keepdim=True)  # [..., 1]
            scale_2_fp32 = scale_2_from_amax(amax)
        else:
            scale_2_fp32 = _check_scale_2(per_tensor_scale, x, scale_granularity)
        qdata, scale_e4m3 = _encode(x_fp32, scale_2_fp32)
        return NVFP4Tensor(
            qdata=qdata,
            scale=scale_e4m3,
            per_tensor_scale=scale_2_fp32,
            shape=x.shape,
            dtype=x.dtype,
            scale_granularity=scale_granularity,
        )


def _encode(x_fp32: torch.Tensor, scale_2_fp32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes [..., K/2], e4m3 block scales [..., K/16]) of fp32 `x_fp32` [..., K] for
    a second-level scale that broadcasts against its block scales [..., K/16]."""
    k = x_fp32.shape[-1]
    blocks_fp32 = x_fp32.reshape(*x_fp32.shape[:-1], k // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    block_amax = blocks_fp32.abs().amax(dim=-1)  # [..., K/16]
    scale_e4m3 = block_scales_e4m3(block_amax, scale_2_fp32)
    divisor_fp32 = effective_block_scale(scale_e4m3, scale_2_fp32)  # [..., K/16]
    scaled_fp32 = blocks_fp32 / divisor_fp32.unsqueeze(-1)  # [..., K/16, 16]
    codes_u8 = f32_to_e2m1(scaled_fp32).reshape(x_fp32.shape)  # [..., K]
    return pack_uint4(codes_u8), scale_e4m3


def quantize_stack(x: torch.Tensor, per_tensor_scale: torch.Tensor) -> list[NVFP4Tensor]:
    """Quantize the N tensors of x [N, ..., K] at once, tensor i with its own fp32 scale_2
    `per_tensor_scale[i]` ([N], positive): element for element what `quantize(x[i],
    per_tensor_scale=per_tensor_scale[i])` gives for each i, in a few kernels and one
    finiteness check instead of N. The results are views into shared stacked storage."""
    check_tensor(x)
    check_last_dim(x, NVFP4_BLOCK_SIZE, "nvfp4")
    if x.dim() < 2:
        raise ValueError(f"quantize_stack needs x of shape [N, ..., K], got {tuple(x.shape)}")
    n = x.shape[0]
    if tuple(per_tensor_scale.shape) != (n,):
        raise ValueError(
            f"per_tensor_scale has shape {tuple(per_tensor_scale.shape)}; x of shape "
            f"{tuple(x.shape)} needs ({n},)"
        )
    check_finite(x)
    with torch.no_grad():
        scale_2_fp32 = _check_scale_2_values(
            per_tensor_scale.to(device=x.device, dtype=torch.float32)
        )  # [N]
        per_block = scale_2_fp32.view(n, *([1] * (x.dim() - 1)))  # vs block scales [N, ..., K/16]
        qdata, scale_e4m3 = _encode(x.float(), per_block)
    shape = x.shape[1:]
    return [
        NVFP4Tensor(qdata[i], scale_e4m3[i], scale_2_fp32[i], shape=shape, dtype=x.dtype)
        for i in range(n)
    ]


def stack(qs: list[NVFP4Tensor]) -> NVFP4Tensor:
    """One NVFP4Tensor [N, ...] of N "tensor"-granularity tensors of one shape: codes and block
    scales stacked, each one's scale_2 broadcast over its tensor (for one batched dequantize,
    equal element for element to dequantizing each)."""
    if not qs or any(q.scale_granularity != "tensor" or q.shape != qs[0].shape for q in qs):
        raise ValueError("stack needs one or more 'tensor'-granularity NVFP4Tensors of one shape")
    first = qs[0]
    scale_2_fp32 = torch.stack([q.per_tensor_scale for q in qs])  # [N]
    return NVFP4Tensor(
        qdata=torch.stack([q.qdata for q in qs]),  # [N, ..., K/2]
        scale=torch.stack([q.scale for q in qs]),  # [N, ..., K/16]
        per_tensor_scale=scale_2_fp32.view(len(qs), *([1] * first.scale.dim())),
        shape=torch.Size((len(qs), *first.shape)),
        dtype=first.dtype,
    )


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize to `dtype`: fp32 math (code value * (block * scale_2)), then one cast."""
    if not isinstance(q, NVFP4Tensor):
        raise TypeError(f"nvfp4.dequantize expects an NVFP4Tensor, got {type(q).__name__}")
    k = q.shape[-1]
    values_fp32 = packed_values(q.qdata)  # [..., K]
    blocks_fp32 = values_fp32.reshape(*q.shape[:-1], k // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    factor_fp32 = effective_block_scale(q.scale, q.per_tensor_scale)  # [..., K/16]
    return (blocks_fp32 * factor_fp32.unsqueeze(-1)).reshape(q.shape).to(dtype)


def _check_scale_2(
    per_tensor_scale: torch.Tensor, x: torch.Tensor, scale_granularity: str
) -> torch.Tensor:
    if not isinstance(per_tensor_scale, torch.Tensor):
        per_tensor_scale = torch.tensor(float(per_tensor_scale))
    scale_2_fp32 = per_tensor_scale.to(device=x.device, dtype=torch.float32)
    expected = () if scale_granularity == "tensor" else (*x.shape[:-1], 1)
    if tuple(scale_2_fp32.shape) != expected:
        raise ValueError(
            f"per_tensor_scale has shape {tuple(scale_2_fp32.shape)}; {scale_granularity!r} "
            f"granularity for x of shape {tuple(x.shape)} needs {expected}"
        )
    return _check_scale_2_values(scale_2_fp32)


def _check_scale_2_values(scale_2_fp32: torch.Tensor) -> torch.Tensor:
    """ValueError naming the first second-level scale that is not finite and > 0."""
    ok = torch.isfinite(scale_2_fp32) & (scale_2_fp32 > 0)
    if not bool(ok.all()):
        bad = scale_2_fp32[~ok].flatten()[0]
        raise ValueError(f"per_tensor_scale must be finite and > 0, got {bad.item()}")
    return scale_2_fp32
