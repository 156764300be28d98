"""Triton kernels of the routed experts: top-k routing + block alignment, and the grouped GEMM.

Imports Triton at module import: load it through `trace_common.kernels.load_kernels`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from trace_common.kernels._tl_fp4 import FP16_DECODE_GAIN, load_fp4_tile


@triton.jit
def route_topk_kernel(
    logits_ptr,  # [T, E] router logits (any float dtype)
    ids_ptr,  # int32 out [T, TOPK], by decreasing probability
    w_ptr,  # fp32 out [T, TOPK]: softmax probabilities of the chosen experts (renormalized)
    E: tl.constexpr,
    TOPK: tl.constexpr,
    NORM_TOPK: tl.constexpr,
):
    """Program t: softmax over E experts and the top-k of token t (ties: lowest index)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, E)
    lg = tl.load(logits_ptr + t * E + cols).to(tl.float32)
    row_max = tl.max(lg, axis=0)
    denom = tl.sum(tl.exp(lg - row_max), axis=0)
    kk = tl.arange(0, TOPK)
    ids = tl.zeros([TOPK], tl.int32)
    w = tl.zeros([TOPK], tl.float32)
    cur = lg
    for k in tl.static_range(TOPK):
        mx = tl.max(cur, axis=0)
        idx = tl.argmax(cur, axis=0)
        ids = tl.where(kk == k, idx, ids)
        w = tl.where(kk == k, tl.exp(mx - row_max) / denom, w)
        cur = tl.where(cols == idx, float("-inf"), cur)
    if NORM_TOPK:
        w = w / tl.sum(w, axis=0)
    tl.store(ids_ptr + t * TOPK + kk, ids)
    tl.store(w_ptr + t * TOPK + kk, w)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def align_kernel(
    ids_ptr,  # int32 [P] expert of each pair (pair p = t * TOPK + j)
    cnt_ptr,  # int32 scratch [E], all zero on entry and on exit
    start_ptr,  # int32 scratch [E]
    sorted_pair_ptr,  # int32 out [MAXB * BM]: pair ids, n_pairs for padding
    block_expert_ptr,  # int32 out [MAXB]: expert of each BM-row block, -1 past the end
    n_pairs,
    E: tl.constexpr,
    BM: tl.constexpr,
    MAXB: tl.constexpr,
    BP: tl.constexpr,  # next power of two >= n_pairs
    BB: tl.constexpr,  # next power of two >= MAXB
):
    """Single program: each expert's pairs in BM-row blocks, experts in ascending order.

    A pair's slot within its expert comes from an atomic counter, so the order of the pairs
    inside an expert's blocks is arbitrary (each output row is computed independently, so the
    GEMM results do not depend on it)."""
    offs = tl.arange(0, BP)
    pm = offs < n_pairs
    ids = tl.load(ids_ptr + offs, mask=pm, other=0)
    rank = tl.atomic_add(cnt_ptr + ids, 1, mask=pm)  # old count = slot within the expert
    cols = tl.arange(0, E)
    b = tl.arange(0, BB)
    tl.store(block_expert_ptr + b, tl.full([BB], -1, tl.int32), mask=b < MAXB)
    for s0 in range(0, MAXB * BM, 1024):
        so = s0 + tl.arange(0, 1024)
        tl.store(sorted_pair_ptr + so, tl.zeros([1024], tl.int32) + n_pairs, mask=so < MAXB * BM)
    tl.debug_barrier()
    cnt = tl.load(cnt_ptr + cols, cache_modifier=".cg")  # [E] after all increments
    nblk = (cnt + BM - 1) // BM
    blk_end = tl.cumsum(nblk, axis=0)
    blk_start = blk_end - nblk
    total = tl.sum(nblk, axis=0)
    tl.store(start_ptr + cols, blk_start)
    tl.store(block_expert_ptr + blk_start, cols, mask=nblk > 0)  # first block of each expert
    tl.debug_barrier()
    first = tl.load(block_expert_ptr + b, mask=b < MAXB, other=-1, cache_modifier=".cg")
    eb = tl.associative_scan(first, 0, _max_combine)  # running max fills the later blocks
    tl.store(block_expert_ptr + b, tl.where(b < total, eb, -1), mask=b < MAXB)
    start = tl.load(start_ptr + ids, mask=pm, other=0, cache_modifier=".cg")
    tl.store(sorted_pair_ptr + start * BM + rank, offs, mask=pm)
    tl.store(cnt_ptr + cols, tl.zeros([E], tl.int32))  # ready for the next launch


@triton.jit
def moe_gemm_kernel(
    a_ptr,  # bf16 [rows, K], or (FP4) packed codes uint8 [rows, K/2]
    a_scale_ptr,  # FP4: uint8 e4m3 [rows, K/16]
    a_g_ptr,  # FP4: fp32 [rows] per-row second-level scale
    w_ptr,  # bf16 [E, N_W, K], or (FP4) packed codes uint8 [E, N_W, K/2]
    w_scale_ptr,  # FP4: uint8 e4m3 [E, N_W, K/16]
    w_g_ptr,  # FP4: fp32 [E] per-expert (per-tensor) second-level scale
    out_ptr,  # bf16 [n_pairs, N_OUT]
    route_w_ptr,  # fp32 [n_pairs] routing weights (MUL_ROUTE_W)
    sorted_pair_ptr,  # int32 [MAXB * BM]
    block_expert_ptr,  # int32 [MAXB]
    n_pairs,
    N_OUT: tl.constexpr,  # output columns (GATED: the weight has 2 * N_OUT rows, gate then up)
    K: tl.constexpr,
    A_DIV: tl.constexpr,  # A row of pair p is p // A_DIV (top_k for the hidden state, 1 after)
    GATED: tl.constexpr,  # out = silu(x @ gate^T) * (x @ up^T)
    MUL_ROUTE_W: tl.constexpr,  # out *= routing weight of the pair
    FP4: tl.constexpr,  # W4A4: A and W are packed NVFP4, dequantized in registers
    WORDS: tl.constexpr,  # FP4 codes passed as int32 words, decoded by inline PTX
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """out[pair, n] = sum_k A[pair // A_DIV, k] * W[expert(pair), n, k], grouped by expert.

    FP4: A and W tiles are decoded to fp16 (code * block scale * 2**-14, exact) in registers;
    the fp32 accumulator then gets 2**28 and both fp32 second-level scales."""
    pid_m = tl.program_id(1)  # expert blocks on the slow axis (see moe.moe_gemm's grid)
    pid_n = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    pair = tl.load(sorted_pair_ptr + pid_m * BM + tl.arange(0, BM))  # [BM]
    valid = pair < n_pairs
    a_row = tl.where(valid, pair // A_DIV, 0).to(tl.int64)
    N_W: tl.constexpr = 2 * N_OUT if GATED else N_OUT
    rn = pid_n * BN + tl.arange(0, BN)  # [BN] weight rows (gate half when GATED)
    w_row = (e * N_W + rn).to(tl.int64)
    acc = tl.zeros([BM, BN], tl.float32)
    acc_up = tl.zeros([BM, BN], tl.float32)
    if FP4:
        for k0 in range(0, K, BK):
            a = load_fp4_tile(a_ptr, a_scale_ptr, a_row, valid, k0, BM, BK, K, WORDS, False)
            w = load_fp4_tile(w_ptr, w_scale_ptr, w_row, valid, k0, BN, BK, K, WORDS, False)
            acc = tl.dot(a, tl.trans(w), acc)
            if GATED:
                u = load_fp4_tile(w_ptr, w_scale_ptr, w_row + N_OUT, valid, k0, BN, BK, K, WORDS,
                                  False)  # fmt: skip
                acc_up = tl.dot(a, tl.trans(u), acc_up)
        gain = tl.load(a_g_ptr + a_row) * (FP16_DECODE_GAIN * FP16_DECODE_GAIN)  # [BM]
        gain2 = gain[:, None] * tl.load(w_g_ptr + e)
        acc = acc * gain2
        acc_up = acc_up * gain2
    else:
        kk = tl.arange(0, BK)
        for k0 in range(0, K, BK):
            a = tl.load(a_ptr + a_row[:, None] * K + k0 + kk[None, :])
            w = tl.load(w_ptr + w_row[:, None] * K + k0 + kk[None, :])
            acc = tl.dot(a, tl.trans(w), acc)
            if GATED:
                u = tl.load(w_ptr + (w_row + N_OUT)[:, None] * K + k0 + kk[None, :])
                acc_up = tl.dot(a, tl.trans(u), acc_up)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up
    if MUL_ROUTE_W:
        acc = acc * tl.load(route_w_ptr + pair, mask=valid, other=0.0)[:, None]
    tl.store(
        out_ptr + pair.to(tl.int64)[:, None] * N_OUT + rn[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=valid[:, None],
    )
