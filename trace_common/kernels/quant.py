"""NVFP4 quantization on the GPU, bit-identical to `trace_common.fp4.nvfp4.quantize`, with the
compact guidance record (`trace_common.fp4.record.make_record(q, "compact")`) written by the
same pass, and the FP4 KV-cache append (quantize the new token's K/V rows and write them into
the cache at each sequence's position).

Same interface as the reference: `quantize(x, scale_granularity=..., per_tensor_scale=...)`
returns an `NVFP4Tensor`; `capture(x, mode)` returns (dequantized x, GuidanceRecord) like
`record.capture`. Runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1).

Importing this module registers `FAST_PATH` with the reference (`fp4.fast_path`), so that
`fp4.fake.fake_quantize` and `fp4.guided.guided_quantize` run these kernels on CUDA tensors
where Triton is installed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trace_common.fp4._checks import check_finite, check_last_dim, check_tensor
from trace_common.fp4.constants import NVFP4_BLOCK_SIZE
from trace_common.fp4.fast_path import FastPath, register_fast_path
from trace_common.fp4.guided import check_guided_input
from trace_common.fp4.nvfp4 import (
    SCALE_GRANULARITIES,
    NVFP4Tensor,
    ScaleGranularity,
    _check_scale_2,
    scale_2_from_amax,
)
from trace_common.fp4.record import GuidanceRecord, make_record
from trace_common.kernels import load_kernels, triton_available

_BITS_PER_BYTE = 8
_SMALL_ROW = 512  # rows up to this many elements use fewer warps


def check_buffer(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Raise ValueError naming `name` unless `t` is a contiguous `dtype` tensor of `shape` (a
    buffer a kernel reads or writes through its pointer)."""
    if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
        raise ValueError(f"{name}: expected contiguous {dtype} {shape}, got {t.dtype} "
                         f"{tuple(t.shape)} (contiguous={t.is_contiguous()})")  # fmt: skip


@dataclass(slots=True)
class CompactRecordBuffers:
    """Preallocated outputs of in-kernel guidance capture for R rows of K elements.

    mbits [R, K/8] uint8, block_scales [R, K/16] uint8 (e4m3 bits), row_scales [R] fp32;
    reused across decode steps (and CUDA-graph replays)."""

    mbits: torch.Tensor
    block_scales: torch.Tensor
    row_scales: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, k: int, device: torch.device | str) -> CompactRecordBuffers:
        return cls(
            torch.empty(rows, k // _BITS_PER_BYTE, dtype=torch.uint8, device=device),
            torch.empty(rows, k // NVFP4_BLOCK_SIZE, dtype=torch.uint8, device=device),
            torch.empty(rows, dtype=torch.float32, device=device),
        )

    def check(self, rows: int, k: int, name: str = "capture") -> None:
        """Raise ValueError unless these are the buffers of `rows` rows of `k` elements."""
        check_buffer(f"{name}.mbits", self.mbits, torch.uint8, (rows, k // _BITS_PER_BYTE))
        check_buffer(f"{name}.block_scales", self.block_scales, torch.uint8,
                     (rows, k // NVFP4_BLOCK_SIZE))  # fmt: skip
        check_buffer(f"{name}.row_scales", self.row_scales, torch.float32, (rows,))

    def record(self, shape: tuple[int, ...]) -> GuidanceRecord:
        """The buffers as a compact nvfp4 GuidanceRecord of a tensor of `shape`."""
        return GuidanceRecord(
            "nvfp4", "compact", shape, self.mbits, self.block_scales, self.row_scales
        )


def _launch_meta(k: int) -> tuple[int, int]:
    block_c = triton_next_pow2(k)
    return block_c, (1 if block_c <= _SMALL_ROW else 4)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def quantize_rows(
    x2d: torch.Tensor,  # [R, K], unit stride along K
    *,
    scale_2: torch.Tensor | None,  # None: per-row amax; fp32 [1] (one for all) or [R] (given)
    capture: CompactRecordBuffers | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    dq16: torch.Tensor | None = None,  # fp16 [R, K] out: the CUDA expert GEMM's operand
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel launch: (codes uint8 [R, K/2], scale uint8 [R, K/16], scale_2 fp32 [R]), written
    into `out` when given (preallocated buffers for CUDA-graph capture). With `dq16`, also
    writes code * block scale * 2**-14 (exact in fp16) in the B-fragment order of
    `cuda_moe.dq16_permutation` within each block of 16."""
    k_mod = load_kernels("_tl_fp4")
    r, k = x2d.shape
    if x2d.stride(1) != 1:
        raise ValueError(f"x must have unit stride along its last dim, got strides {x2d.stride()}")
    if out is None:
        out = (
            torch.empty(r, k // 2, dtype=torch.uint8, device=x2d.device),
            torch.empty(r, k // NVFP4_BLOCK_SIZE, dtype=torch.uint8, device=x2d.device),
            torch.empty(r, dtype=torch.float32, device=x2d.device),
        )
    codes, scale, g_out = out
    g_in = g_out if scale_2 is None else scale_2.float().contiguous()
    cap = capture or CompactRecordBuffers(codes, scale, g_out)  # unused when not capturing
    if dq16 is not None and (dq16.shape != (r, k) or dq16.dtype != torch.float16):
        raise ValueError(f"dq16 must be float16 {(r, k)}, got {dq16.dtype} {tuple(dq16.shape)}")
    block_c, warps = _launch_meta(k)
    if r:
        k_mod.nvfp4_quant_kernel[(r,)](
            x2d, x2d.stride(0), g_in, codes, scale, g_out,
            cap.mbits, cap.block_scales, cap.row_scales, codes if dq16 is None else dq16,
            g_out, 1, 1,  # no KV addressing
            C=k, BLOCK_C=block_c, SEG=k, PER_ROW=scale_2 is None,
            GIVEN_ROWS=scale_2 is not None and scale_2.numel() > 1, KV_APPEND=False,
            CAPTURE=capture is not None, DQ16=dq16 is not None, num_warps=warps,
        )  # fmt: skip
    return codes, scale, g_out


def quantize(
    x: torch.Tensor,
    *,
    scale_granularity: ScaleGranularity = "tensor",
    per_tensor_scale: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """GPU `nvfp4.quantize`: same arguments, bit-identical NVFP4Tensor."""
    q, _ = _quantize(x, scale_granularity, per_tensor_scale, capture=False)
    return q


def quantize_and_record(
    x: torch.Tensor,
    *,
    scale_granularity: ScaleGranularity = "row",
    per_tensor_scale: torch.Tensor | None = None,
) -> tuple[NVFP4Tensor, GuidanceRecord]:
    """Quantize and write the compact guidance record in the same pass over x."""
    q, rec = _quantize(x, scale_granularity, per_tensor_scale, capture=True)
    assert rec is not None
    return q, rec


def fake_quantize(x: torch.Tensor, *, scale_granularity: ScaleGranularity = "row") -> torch.Tensor:
    """GPU `nvfp4.dequantize(nvfp4.quantize(x), x.dtype)`, bit-identical: the quantize kernel,
    then the reference's dequantize. Non-finite inputs are refused as the reference refuses
    them."""
    check_tensor(x)
    check_finite(x)
    q, _ = _quantize(x, scale_granularity, None, capture=False)
    return q.dequantize(x.dtype)


def guided_quantize(x: torch.Tensor, record: GuidanceRecord) -> torch.Tensor:
    """GPU forward of `fp4.guided.guided_quantize` for compact NVFP4 records (the caller adds
    the straight-through gradient): the same values bit for bit, in x's dtype. x must have
    the record's shape and be finite, as the reference requires."""
    rec = check_guided_input(x, record)
    if (rec.fmt, rec.mode) != ("nvfp4", "compact"):
        raise ValueError(f"the guided kernel reads compact NVFP4 records, got {rec.fmt}/{rec.mode}")
    k = rec.k
    x2d = x.reshape(-1, k)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    r = x2d.shape[0]
    y = torch.empty(r, k, dtype=x.dtype, device=x.device)
    if r:
        block_c, warps = _launch_meta(k)
        load_kernels("_tl_fp4").guided_compact_kernel[(r,)](
            x2d, x2d.stride(0), rec.payload.contiguous(), rec.block_scales.contiguous(),
            rec.row_scales.contiguous(), y, C=k, BLOCK_C=block_c,  # type: ignore[union-attr]
            OUT_BF16=x.dtype == torch.bfloat16, num_warps=warps,
        )  # fmt: skip
    return y.reshape(x.shape)


def capture(x: torch.Tensor, mode: str = "compact") -> tuple[torch.Tensor, GuidanceRecord]:
    """GPU `record.capture(x, "nvfp4", mode)`: (dequantized x in x.dtype, record)."""
    if mode == "compact":
        q, rec = quantize_and_record(x, scale_granularity="row")
    else:
        q = quantize(x, scale_granularity="row")
        rec = make_record(q, mode)
    return q.dequantize(x.dtype), rec


def _quantize(
    x: torch.Tensor,
    scale_granularity: str,
    per_tensor_scale: torch.Tensor | None,
    *,
    capture: bool,
) -> tuple[NVFP4Tensor, GuidanceRecord | None]:
    check_tensor(x)
    if scale_granularity not in SCALE_GRANULARITIES:
        raise ValueError(
            f"scale_granularity={scale_granularity!r}; expected one of {SCALE_GRANULARITIES}"
        )
    k = check_last_dim(x, NVFP4_BLOCK_SIZE, "nvfp4")
    x2d = x.reshape(-1, k)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    r = x2d.shape[0]
    scale_2 = None
    if per_tensor_scale is not None:
        scale_2 = _check_scale_2(per_tensor_scale, x, scale_granularity).reshape(-1)
    elif scale_granularity == "tensor":
        amax = x2d.abs().amax() if x2d.numel() else x2d.new_zeros((), dtype=torch.float32)
        scale_2 = scale_2_from_amax(amax).reshape(1)
    bufs = CompactRecordBuffers.allocate(r, k, x.device) if capture else None
    codes, scale, g_out = quantize_rows(x2d, scale_2=scale_2, capture=bufs)
    lead = tuple(x.shape[:-1])
    per_row = scale_granularity == "row"
    pts = g_out.reshape(*lead, 1) if per_row else scale_2.reshape(())  # type: ignore[union-attr]
    q = NVFP4Tensor(
        qdata=codes.reshape(*lead, k // 2),
        scale=scale.view(torch.float8_e4m3fn).reshape(*lead, k // NVFP4_BLOCK_SIZE),
        per_tensor_scale=pts,
        shape=x.shape,
        dtype=x.dtype,
        scale_granularity=scale_granularity,  # type: ignore[arg-type]
    )
    rec = None if bufs is None else bufs.record(tuple(x.shape))
    return q, rec


def kv_append_fp4(
    kv_new: torch.Tensor,  # bf16 [2, B, Hkv * D]: the new token's K (post-RoPE) and V rows
    codes: torch.Tensor,  # uint8 [2, B, Hkv, S, D/2]
    scales: torch.Tensor,  # uint8 [2, B, Hkv, S, D/16]
    row_scales: torch.Tensor,  # fp32 [2, B, S]
    pos: torch.Tensor,  # int32 [B]
    capture: CompactRecordBuffers | None = None,  # rows [2 * B, Hkv * D]
) -> None:
    """Quantize each new K/V row (per-token scale over all kv heads, as the model's kv site)
    and write codes and scales into the FP4 cache at position pos[b], in one launch; with
    `capture`, also write the rows' compact guidance record."""
    k_mod = load_kernels("_tl_fp4")
    two, b, width = kv_new.shape
    _, _, hkv, s, half_d = codes.shape
    d = half_d * 2
    if two != 2 or width != hkv * d or kv_new.stride(-1) != 1:
        raise ValueError(
            f"kv_new has shape {tuple(kv_new.shape)}; expected (2, {b}, {hkv * d}) contiguous"
        )
    cap = capture or CompactRecordBuffers(codes, scales, row_scales)
    block_c, warps = _launch_meta(width)
    k_mod.nvfp4_quant_kernel[(2 * b,)](
        kv_new, width, row_scales, codes, scales, row_scales,
        cap.mbits, cap.block_scales, cap.row_scales, codes,
        pos, b, s,
        C=width, BLOCK_C=block_c, SEG=d, PER_ROW=True, GIVEN_ROWS=False, KV_APPEND=True,
        CAPTURE=capture is not None, DQ16=False, num_warps=warps,
    )  # fmt: skip


def on_gpu(x: torch.Tensor) -> bool:
    """Whether these kernels may run on x: a CUDA tensor, with Triton installed."""
    return x.is_cuda and triton_available()


FAST_PATH = FastPath("triton", on_gpu, fake_quantize, guided_quantize)
register_fast_path(FAST_PATH)

__all__ = [
    "FAST_PATH",
    "CompactRecordBuffers",
    "capture",
    "kv_append_fp4",
    "on_gpu",
    "quantize",
    "quantize_and_record",
    "quantize_rows",
]
