"""Triton kernels of the decode step around the experts: fused residual + RMSNorm, q/k norm +
RoPE, KV append (BF16), and split-KV decode attention over a BF16 or an FP4 (NVFP4) cache.

Cache layout (contiguous, not paged), per layer, kv = 0 for K and 1 for V:
  BF16: values [2, B, Hkv, S, D]
  FP4:  codes  uint8 [2, B, Hkv, S, D/2], block scales uint8 e4m3 [2, B, Hkv, S, D/16],
        row scales fp32 [2, B, S] (one per token over all Hkv*D values, as the model's kv site)

Imports Triton at module import: load it through `trace_common.kernels.load_kernels`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from trace_common.kernels._tl_fp4 import FP16_DECODE_GAIN, load_fp4_tile

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def add_rmsnorm_kernel(
    delta_ptr,  # bf16 [T * NSUM, H]: rows summed into the residual (NSUM = 0: none)
    resid_ptr,  # bf16 [T, H] residual stream, updated in place
    w_ptr,  # bf16 [H] norm weight
    out_ptr,  # bf16 [T, H] normalized output
    eps,
    H: tl.constexpr,
    NSUM: tl.constexpr,
):
    """resid += sum of NSUM delta rows (attention output, or the top-k weighted expert
    outputs); out = rmsnorm(resid) * w, the model's RMSNorm (fp32 math, cast, then weight)."""
    add_rmsnorm_row(delta_ptr, resid_ptr, w_ptr, out_ptr, eps, tl.program_id(0).to(tl.int64), H,
                    NSUM)  # fmt: skip


@triton.jit
def add_rmsnorm_row(delta_ptr, resid_ptr, w_ptr, out_ptr, eps, t, H: tl.constexpr,
                    NSUM: tl.constexpr):  # fmt: skip
    """Row t of `add_rmsnorm_kernel` (also the first half of `_tl_fused.add_rmsnorm_quant_kernel`:
    one body, so both reduce in the same order); returns the bf16 [H] row it stored to out."""
    cols = tl.arange(0, H)
    x = tl.load(resid_ptr + t * H + cols).to(tl.float32)
    if NSUM > 0:
        d = tl.zeros([H], tl.float32)
        for j in tl.static_range(NSUM):
            d += tl.load(delta_ptr + (t * NSUM + j) * H + cols).to(tl.float32)
        x = (x + d.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
        tl.store(resid_ptr + t * H + cols, x.to(tl.bfloat16))
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    y = ((x * r).to(tl.bfloat16).to(tl.float32) * tl.load(w_ptr + cols).to(tl.float32)).to(
        tl.bfloat16
    )
    tl.store(out_ptr + t * H + cols, y)
    return y


@triton.jit
def qk_norm_rope_kernel(
    qkv_ptr,  # bf16 [B, (HQ + 2 * HKV) * D] output of the fused q/k/v projection
    norm_w_ptr,  # bf16 [2, D]: q norm weight, then k norm weight
    pos_ptr,  # int32 [B] position of the new token
    inv_freq_ptr,  # fp32 [D/2]
    q_out_ptr,  # bf16 [B, HQ, D]
    kv_out_ptr,  # bf16 [2, B, HKV * D] new K (post-RoPE) and V rows
    B,
    eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
):
    """Program (b, h): per-head RMSNorm then rotate-half RoPE for q heads and k heads; v heads
    are copied. Grid (B, HQ + 2 * HKV)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    half = tl.arange(0, D // 2)
    base = qkv_ptr + b * (HQ + 2 * HKV) * D + h * D
    x1 = tl.load(base + half).to(tl.float32)
    x2 = tl.load(base + D // 2 + half).to(tl.float32)
    if h >= HQ + HKV:  # v: copy
        hv = h - HQ - HKV
        dst = kv_out_ptr + (B + b) * HKV * D + hv * D
        tl.store(dst + half, x1.to(tl.bfloat16))
        tl.store(dst + D // 2 + half, x2.to(tl.bfloat16))
    else:
        is_q = h < HQ
        nw = norm_w_ptr + (h >= HQ).to(tl.int32) * D
        o1, o2 = norm_rope_head(x1, x2, nw, pos_ptr, b, inv_freq_ptr, eps, D)
        if is_q:  # noqa: SIM108 - a runtime branch over pointers
            dst = q_out_ptr + (b * HQ + h) * D
        else:
            dst = kv_out_ptr + b * HKV * D + (h - HQ) * D
        tl.store(dst + half, o1)
        tl.store(dst + D // 2 + half, o2)


@triton.jit
def norm_rope_head(x1, x2, nw, pos_ptr, b, inv_freq_ptr, eps, D: tl.constexpr):
    """One q or k head of `qk_norm_rope_kernel` (also of `_tl_fused.qk_norm_rope_append_kernel`):
    its halves x1, x2 (fp32 [D/2]) RMS-normalized with weight `nw`, then rotate-half RoPE at
    position pos[b]; returns the two halves, bf16 [D/2]."""
    half = tl.arange(0, D // 2)
    r = tl.math.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
    y1 = (x1 * r).to(tl.bfloat16).to(tl.float32) * tl.load(nw + half).to(tl.float32)
    y2 = (x2 * r).to(tl.bfloat16).to(tl.float32) * tl.load(nw + D // 2 + half).to(tl.float32)
    y1 = y1.to(tl.bfloat16).to(tl.float32)
    y2 = y2.to(tl.bfloat16).to(tl.float32)
    ang = tl.load(pos_ptr + b).to(tl.float32) * tl.load(inv_freq_ptr + half)
    c = tl.cos(ang).to(tl.bfloat16).to(tl.float32)
    s = tl.sin(ang).to(tl.bfloat16).to(tl.float32)
    o1 = (y1 * c - y2 * s).to(tl.bfloat16)
    o2 = (y2 * c + y1 * s).to(tl.bfloat16)
    return o1, o2


@triton.jit
def kv_append_bf16_kernel(
    kv_new_ptr,  # bf16 [2, B, HKV * D]
    cache_ptr,  # bf16 [2, B, HKV, S, D]
    pos_ptr,  # int32 [B]
    B,
    S,
    HKV: tl.constexpr,
    D: tl.constexpr,
):
    """Program r = kv * B + b writes the new token's HKV heads at position pos[b]."""
    r = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + r % B).to(tl.int64)
    c = tl.arange(0, HKV * D)
    x = tl.load(kv_new_ptr + r * HKV * D + c)
    tl.store(cache_ptr + ((r * HKV + c // D) * S + pos) * D + c % D, x)


@triton.jit
def decode_attn_split_kernel(
    q_ptr,  # bf16 [B, HQ, D]
    kc_ptr,  # BF16: values [2, B, HKV, S, D]; FP4: codes uint8 [2, B, HKV, S, D/2]
    ks_ptr,  # FP4: block scales uint8 [2, B, HKV, S, D/16]
    kg_ptr,  # FP4: row scales fp32 [2, B, S]
    lens_ptr,  # int32 [B]: valid tokens of each sequence (new token included)
    part_o_ptr,  # fp32 [B, HQ, NSPLIT, D] unnormalized partial outputs
    part_ml_ptr,  # fp32 [B, HQ, NSPLIT, 2] running max (log2 domain) and sum
    B,
    S,
    qk_scale,  # head_dim ** -0.5 * log2(e)
    NSPLIT,
    CHUNK: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BH: tl.constexpr,  # >= HQ // HKV, >= 16 (tensor-core tile)
    BN: tl.constexpr,
    FP4: tl.constexpr,
    WORDS: tl.constexpr,  # FP4 codes passed as int32 words, decoded by inline PTX
):
    """Program (b, kv head, split): flash-decoding over positions [split*CHUNK, +CHUNK) for
    the HQ/HKV query heads sharing this kv head, so K/V are read once per group.

    FP4: K/V tiles are decoded to fp16 (code * block scale * 2**-14) in registers; the row
    scale (and 2**14) multiply the scores for K and the probabilities for V."""
    b = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    L = tl.load(lens_ptr + b)
    start = sp * CHUNK
    if start >= L:
        return
    end = tl.minimum(start + CHUNK, L)
    G: tl.constexpr = HQ // HKV
    hrow = tl.arange(0, BH)
    hmask = hrow < G
    dcol = tl.arange(0, D)
    q = tl.load(
        q_ptr + (b * HQ + hk * G + hrow)[:, None] * D + dcol[None, :],
        mask=hmask[:, None],
        other=0.0,
    )
    if FP4:
        q = q.to(tl.float16)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    k_head = (b * HKV + hk) * S  # row of (kv=0, b, hk, pos=0)
    v_head = ((B + b) * HKV + hk) * S
    for i in range(0, CHUNK, BN):  # fixed trip count; the tail past `end` is masked
        offs = start + i + tl.arange(0, BN)
        nmask = offs < end
        if FP4:
            kt = load_fp4_tile(kc_ptr, ks_ptr, k_head + offs, nmask, 0, BN, D, D, WORDS, True)
            kg = tl.load(kg_ptr + b * S + offs, mask=nmask, other=0.0) * FP16_DECODE_GAIN
            sc = tl.dot(q, tl.trans(kt)) * (kg * qk_scale)[None, :]
        else:
            kt = tl.load(
                kc_ptr + (k_head + offs)[:, None] * D + dcol[None, :],
                mask=nmask[:, None],
                other=0.0,
            )
            sc = tl.dot(q, tl.trans(kt)) * qk_scale
        sc = tl.where(nmask[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP4:
            vt = load_fp4_tile(kc_ptr, ks_ptr, v_head + offs, nmask, 0, BN, D, D, WORDS, True)
            vg = tl.load(kg_ptr + (B + b) * S + offs, mask=nmask, other=0.0) * FP16_DECODE_GAIN
            pv = (p * vg[None, :]).to(tl.float16)
        else:
            vt = tl.load(
                kc_ptr + (v_head + offs)[:, None] * D + dcol[None, :],
                mask=nmask[:, None],
                other=0.0,
            )
            pv = p.to(tl.bfloat16)
        acc = acc * alpha[:, None] + tl.dot(pv, vt)
        m_i = m_new
    o_row = (b * HQ + hk * G + hrow) * NSPLIT + sp
    tl.store(part_o_ptr + o_row[:, None] * D + dcol[None, :], acc, mask=hmask[:, None])
    tl.store(part_ml_ptr + o_row * 2, m_i, mask=hmask)
    tl.store(part_ml_ptr + o_row * 2 + 1, l_i, mask=hmask)


@triton.jit
def decode_attn_reduce_kernel(
    part_o_ptr,  # fp32 [B, HQ, NSPLIT, D]
    part_ml_ptr,  # fp32 [B, HQ, NSPLIT, 2]
    lens_ptr,  # int32 [B]
    out_ptr,  # bf16 [B, HQ * D]
    NSPLIT,
    CHUNK: tl.constexpr,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,  # next power of two >= NSPLIT
):
    """Program (b, h): combine the valid splits (those starting before lens[b])."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    L = tl.load(lens_ptr + b)
    sp = tl.arange(0, BS)
    smask = (sp < NSPLIT) & (sp * CHUNK < L)
    row = (b * HQ + h) * NSPLIT + sp
    m = tl.load(part_ml_ptr + row * 2, mask=smask, other=float("-inf"))
    lsum = tl.load(part_ml_ptr + row * 2 + 1, mask=smask, other=0.0)
    m_all = tl.max(m, axis=0)
    wgt = tl.where(smask, tl.exp2(m - m_all), 0.0)
    dcol = tl.arange(0, D)
    o = tl.load(part_o_ptr + row[:, None] * D + dcol[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(o * wgt[:, None], axis=0) / tl.sum(lsum * wgt, axis=0)
    tl.store(out_ptr + (b * HQ + h) * D + dcol, out.to(tl.bfloat16))
