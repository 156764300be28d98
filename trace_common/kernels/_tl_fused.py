"""Triton kernels that fold small launches of the standard decode step (`engine.DecodeEngine`)
into one: add+RMSNorm with the NVFP4 quantization of its output, and q/k norm + RoPE with the
KV append.

Each computes exactly what the launches it replaces compute, bit for bit: the RMSNorm and RoPE
are `_tl_attn`'s own helpers (`add_rmsnorm_row`, `norm_rope_head`) at the same launch width (a
reduction's order depends on both; the reduced tensors get the same layouts, checked in the
TTGIR), and the NVFP4 math is `_tl_fp4.quantize_store_row` itself. Tests: tests/unit/gpu/test_fused_gpu.py.

Imports Triton at module import: load it through `trace_common.kernels.load_kernels`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from trace_common.kernels._tl_attn import add_rmsnorm_row, norm_rope_head
from trace_common.kernels._tl_fp4 import quantize_store_row, row_scale_2


@triton.jit
def add_rmsnorm_quant_kernel(
    delta_ptr,  # bf16 [T * NSUM, H]: rows summed into the residual (NSUM = 0: none)
    resid_ptr,  # bf16 [T, H] residual stream, updated in place
    w_ptr,  # bf16 [H] norm weight
    out_ptr,  # bf16 [T, H] normalized output (the router's input)
    eps,
    codes_ptr,  # uint8 out [T, H/2]: NVFP4 codes of out
    scale_ptr,  # uint8 out [T, H/16]: e4m3 block scales
    g_out_ptr,  # fp32 out [T]: per-token scale_2
    mbits_ptr,  # uint8 out (CAPTURE) [T, H/8]: compact record
    rec_scale_ptr,  # uint8 out (CAPTURE) [T, H/16]
    rec_g_ptr,  # fp32 out (CAPTURE) [T]
    dq_ptr,  # fp16 out (DQ16) [T, H]: the CUDA expert GEMM's operand
    H: tl.constexpr,
    NSUM: tl.constexpr,
    CAPTURE: tl.constexpr,
    DQ16: tl.constexpr,
):
    """Program t: `_tl_attn.add_rmsnorm_kernel` (its helper), then `nvfp4_quant_kernel` with a
    per-row scale_2 on its bf16 output: the row is whole in this program, so the per-token
    amax needs no second pass."""
    t = tl.program_id(0).to(tl.int64)
    y = add_rmsnorm_row(delta_ptr, resid_ptr, w_ptr, out_ptr, eps, t, H, NSUM)
    xq = y.to(tl.float32)
    quantize_store_row(xq, row_scale_2(xq), t, t, 1, codes_ptr, scale_ptr, g_out_ptr, mbits_ptr,
                       rec_scale_ptr, rec_g_ptr, dq_ptr, H, H, H, False, CAPTURE,
                       DQ16)  # fmt: skip


@triton.jit
def _norm_rope_at(src, nw, pos_ptr, b, inv_freq_ptr, eps, D: tl.constexpr):
    """`_tl_attn.norm_rope_head` of the head whose D values start at `src`."""
    half = tl.arange(0, D // 2)
    x1 = tl.load(src + half).to(tl.float32)
    x2 = tl.load(src + D // 2 + half).to(tl.float32)
    return norm_rope_head(x1, x2, nw, pos_ptr, b, inv_freq_ptr, eps, D)


@triton.jit
def qk_norm_rope_append_kernel(
    qkv_ptr,  # bf16 [B, (HQ + 2 * HKV) * D] output of the fused q/k/v projection
    norm_w_ptr,  # bf16 [2, D]: q norm weight, then k norm weight
    pos_ptr,  # int32 [B] position of the new token
    inv_freq_ptr,  # fp32 [D/2]
    q_out_ptr,  # bf16 [B, HQ, D]
    cache_ptr,  # BF16: values [2, B, HKV, S, D]; FP4: codes uint8 [2, B, HKV, S, D/2]
    scale_ptr,  # FP4: block scales uint8 [2, B, HKV, S, D/16]
    g_out_ptr,  # FP4: row scales fp32 [2, B, S]
    mbits_ptr,  # FP4 + CAPTURE: compact record rows [2 * B, HKV * D] (k rows, then v rows)
    rec_scale_ptr,
    rec_g_ptr,
    B,
    S,
    eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    FP4: tl.constexpr,
    CAPTURE: tl.constexpr,
):
    """Grid (B, HQ + 2). Program (b, h < HQ): q head h as `qk_norm_rope_kernel`. Program
    (b, HQ): the HKV k heads, program (b, HQ + 1): the v heads, each written as one token row
    of HKV * D values into the cache at pos[b]: plain (BF16), or NVFP4 quantized with one
    scale_2 over the row (FP4, as `kv_append_fp4`, which quantizes the same bf16 values)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    src = qkv_ptr + b * (HQ + 2 * HKV) * D
    if h < HQ:
        o1, o2 = _norm_rope_at(src + h * D, norm_w_ptr, pos_ptr, b, inv_freq_ptr, eps, D)
        half = tl.arange(0, D // 2)
        dst = q_out_ptr + (b * HQ + h) * D
        tl.store(dst + half, o1)
        tl.store(dst + D // 2 + half, o2)
    else:
        kv = h - HQ  # 0: k, 1: v
        if kv == 0:
            hh = tl.arange(0, HKV)[:, None]
            k1 = tl.zeros([HKV, D // 2], tl.float32)
            k2 = tl.zeros([HKV, D // 2], tl.float32)
            for j in tl.static_range(HKV):
                o1, o2 = _norm_rope_at(src + (HQ + j) * D, norm_w_ptr + D, pos_ptr, b,
                                         inv_freq_ptr, eps, D)  # fmt: skip
                k1 = tl.where(hh == j, o1.to(tl.float32)[None, :], k1)
                k2 = tl.where(hh == j, o2.to(tl.float32)[None, :], k2)
            # [HKV, D/2, 2] -> [HKV, 2, D/2] -> the row: head-major, each head's halves in order
            row = tl.reshape(tl.permute(tl.join(k1, k2), (0, 2, 1)), [HKV * D])
        else:
            row = tl.load(src + (HQ + HKV) * D + tl.arange(0, HKV * D)).to(tl.float32)
        r = kv * B + b  # the cache's (kv, b) row, as kv_append's program r
        pos = tl.load(pos_ptr + b).to(tl.int64)
        if FP4:
            quantize_store_row(row, row_scale_2(row), r, pos, S, cache_ptr, scale_ptr, g_out_ptr,
                               mbits_ptr, rec_scale_ptr, rec_g_ptr, cache_ptr, HKV * D, HKV * D,
                               D, True, CAPTURE, False)  # fmt: skip
        else:
            c = tl.arange(0, HKV * D)
            tl.store(cache_ptr + ((r * HKV + c // D) * S + pos) * D + c % D, row.to(tl.bfloat16))
