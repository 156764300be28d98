"""Fused launches for the standard decode step (`engine.DecodeEngine.step`, batch > 1).

Each function replaces two launches of the step by one kernel (`_tl_fused`) that writes
exactly what the two write, bit for bit (tests/unit/gpu/test_fused_gpu.py):

- `add_rmsnorm_quant`: `attention.add_rmsnorm` + `quant.quantize_rows` of its output
  (per-token scale_2, optional compact record and dq16 operand): the ln2 norm of an FP4 layer
  and the experts' input quantization;
- `qk_norm_rope_append`: `attention.qk_norm_rope` + `attention.kv_append` (BF16 or FP4 cache,
  optional compact record of the k/v rows).

The engine uses both (FUSED_PARTS) wherever the shape allows (`norm_quant_supported`,
`qk_kv_supported`), the two launches elsewhere. Both save a launch without serializing work: fusions that would move a step onto fewer
threads (routing top-k and block layout in one launch, the experts' act quantize inside an
expert GEMM) cost more than the launch they save in the standard step, so they are not here.
"""

from __future__ import annotations

import torch

from trace_common.kernels import load_kernels
from trace_common.kernels.attention import KVCacheGPU
from trace_common.kernels.moe_layout import FP4Rows
from trace_common.kernels.quant import CompactRecordBuffers

FUSED_PARTS = frozenset({"norm_quant", "qk_kv"})
_NORM_WARPS = 4  # add_rmsnorm's launch width: the sum of squares must reduce in the same order
_HEAD_WARPS = 1  # qk_norm_rope's


def add_rmsnorm_quant(
    delta: torch.Tensor | None, resid: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
    q: FP4Rows, *, nsum: int, eps: float, capture: CompactRecordBuffers | None = None,
) -> torch.Tensor:  # fmt: skip
    """resid [T, H] += sum of `nsum` delta rows per token; out = RMSNorm(resid) * weight (as
    `attention.add_rmsnorm`); q = NVFP4 rows of out with a per-token scale_2 (codes, scales,
    scale_2 and, where q.dq16 is given, the CUDA GEMM operand, as `quant.quantize_rows`);
    with `capture`, its compact record."""
    k_mod = load_kernels("_tl_fused")
    t, h = resid.shape
    if not norm_quant_supported(h):
        raise ValueError(f"hidden={h}: the fused kernel needs a power of two >= 16")
    if q.dq16 is not None and (q.dq16.shape != (t, h) or q.dq16.dtype != torch.float16):
        raise ValueError(f"dq16 must be float16 {(t, h)}, got {q.dq16.dtype} {tuple(q.dq16.shape)}")
    cap = capture or CompactRecordBuffers(q.codes, q.scales, q.scale_2)  # unused when None
    k_mod.add_rmsnorm_quant_kernel[(t,)](
        resid if delta is None else delta, resid, weight, out, eps,
        q.codes, q.scales, q.scale_2, cap.mbits, cap.block_scales, cap.row_scales,
        q.codes if q.dq16 is None else q.dq16,
        H=h, NSUM=nsum, CAPTURE=capture is not None, DQ16=q.dq16 is not None,
        num_warps=_NORM_WARPS,
    )  # fmt: skip
    return out


def norm_quant_supported(hidden: int) -> bool:
    """Whether `add_rmsnorm_quant` takes rows of `hidden` values (a power of two >= 16)."""
    return hidden >= 16 and not hidden & (hidden - 1)


def qk_kv_supported(kv_heads: int, head_dim: int) -> bool:
    """Whether `qk_norm_rope_append` takes this shape (one token row of K or V is a power of
    two of >= 16 values)."""
    width = kv_heads * head_dim
    return width >= 16 and not width & (width - 1) and not head_dim & (head_dim - 1)


def qk_norm_rope_append(
    qkv: torch.Tensor, norm_w: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor,
    q_out: torch.Tensor, cache: KVCacheGPU, capture: CompactRecordBuffers | None = None, *,
    q_heads: int, kv_heads: int, eps: float,
) -> None:  # fmt: skip
    """`attention.qk_norm_rope` then `attention.kv_append` in one launch: q_out gets the normed
    and rotated q heads; the new k (normed, rotated) and v rows go into the cache at pos[b]
    (FP4: quantized, with `capture` rows [2 * B, Hkv * D] written as kv_append writes them)."""
    k_mod = load_kernels("_tl_fused")
    b = qkv.shape[0]
    d = norm_w.shape[1]
    if not qk_kv_supported(kv_heads, d):
        raise ValueError(f"kv_heads={kv_heads}, head_dim={d}: see qk_kv_supported")
    if cache.fp4:
        assert cache.codes is not None and cache.scales is not None
        dst, scales, g_out, s = cache.codes, cache.scales, cache.row_scales, cache.codes.shape[3]
        cap = capture or CompactRecordBuffers(cache.codes, cache.scales, cache.row_scales)
    else:
        assert cache.values is not None
        dst = scales = g_out = cache.values
        s = cache.values.shape[3]
        cap = CompactRecordBuffers(dst, dst, dst)
        capture = None  # BF16 sites have no record
    k_mod.qk_norm_rope_append_kernel[(b, q_heads + 2)](
        qkv, norm_w, pos, inv_freq, q_out, dst, scales, g_out,
        cap.mbits, cap.block_scales, cap.row_scales, b, s, eps,
        HQ=q_heads, HKV=kv_heads, D=d, FP4=cache.fp4, CAPTURE=capture is not None,
        num_warps=_HEAD_WARPS,
    )  # fmt: skip


__all__ = [
    "FUSED_PARTS",
    "add_rmsnorm_quant",
    "norm_quant_supported",
    "qk_kv_supported",
    "qk_norm_rope_append",
]
