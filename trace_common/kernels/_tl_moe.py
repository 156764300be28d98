"""Triton kernels of the routed experts: top-k routing + block alignment, and the grouped GEMM.

Imports Triton at module import: load it through `trace_common.kernels.load_kernels`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from trace_common.kernels._tl_fp4 import FP16_DECODE_GAIN, load_fp4_tile


@triton.jit
def route_align_kernel(
    logits_ptr,  # [T, E] router logits (any float dtype)
    ids_ptr,  # int32 out [T, TOPK]
    w_ptr,  # fp32 out [T, TOPK]: softmax probabilities of the chosen experts (renormalized)
    rank_ptr,  # int32 scratch [T, TOPK]: rank of each pair among its expert's pairs
    sorted_pair_ptr,  # int32 out [MAXB * BM]: pair id t*TOPK+k, or n_pairs for padding
    block_expert_ptr,  # int32 out [MAXB]: expert of each BM-row block, -1 past the end
    T,
    E: tl.constexpr,
    TOPK: tl.constexpr,
    BM: tl.constexpr,
    MAXB: tl.constexpr,
    BT: tl.constexpr,  # next power of two >= T
    BB: tl.constexpr,  # next power of two >= MAXB
    NORM_TOPK: tl.constexpr,
):
    """Single program: softmax top-k of every token, then each expert's pairs laid out in
    BM-row blocks (pairs ordered by (k, t) within an expert, as `moe.align_reference`)."""
    rows = tl.arange(0, BT)
    cols = tl.arange(0, E)
    rmask = rows < T
    lg = tl.load(
        logits_ptr + rows[:, None] * E + cols[None, :], mask=rmask[:, None], other=float("-inf")
    ).to(tl.float32)  # [BT, E]
    row_max = tl.max(lg, axis=1)
    denom = tl.sum(tl.exp(lg - row_max[:, None]), axis=1)
    cnt = tl.zeros([E], tl.int32)
    wsum = tl.zeros([BT], tl.float32)
    cur = lg
    for k in tl.static_range(TOPK):
        mx = tl.max(cur, axis=1)  # [BT]
        idx = tl.argmax(cur, axis=1)  # [BT] first index of the max
        onehot = (cols[None, :] == idx[:, None]) & rmask[:, None]  # [BT, E]
        oh = onehot.to(tl.int32)
        excl = tl.cumsum(oh, axis=0) - oh  # earlier tokens picking the same expert at this k
        rank = tl.sum((excl + cnt[None, :]) * oh, axis=1)  # [BT]
        cnt += tl.sum(oh, axis=0)
        p = tl.exp(mx - row_max) / denom
        wsum += p
        tl.store(ids_ptr + rows * TOPK + k, idx.to(tl.int32), mask=rmask)
        tl.store(rank_ptr + rows * TOPK + k, rank, mask=rmask)
        tl.store(w_ptr + rows * TOPK + k, p, mask=rmask)
        cur = tl.where(onehot, float("-inf"), cur)
    nblk = (cnt + BM - 1) // BM  # [E]
    blk_end = tl.cumsum(nblk, axis=0)
    blk_start = blk_end - nblk
    total = tl.sum(nblk, axis=0)
    b = tl.arange(0, BB)
    eb = tl.sum((b[:, None] >= blk_end[None, :]).to(tl.int32), axis=1)
    eb = tl.where(b < total, eb, -1)
    tl.store(block_expert_ptr + b, eb, mask=b < MAXB)
    n_pairs = T * TOPK
    for s0 in range(0, MAXB * BM, 1024):
        offs = s0 + tl.arange(0, 1024)
        tl.store(
            sorted_pair_ptr + offs, tl.zeros([1024], tl.int32) + n_pairs, mask=offs < MAXB * BM
        )
    tl.debug_barrier()  # the scatter below overwrites the padding; ids/ranks are re-read
    for k in tl.static_range(TOPK):
        idx = tl.load(ids_ptr + rows * TOPK + k, mask=rmask, other=0)
        rank = tl.load(rank_ptr + rows * TOPK + k, mask=rmask, other=0)
        start = tl.sum(tl.where(cols[None, :] == idx[:, None], blk_start[None, :], 0), axis=1)
        tl.store(sorted_pair_ptr + start * BM + rank, rows * TOPK + k, mask=rmask)
        if NORM_TOPK:
            p = tl.load(w_ptr + rows * TOPK + k, mask=rmask, other=0.0)
            tl.store(w_ptr + rows * TOPK + k, p / wsum, mask=rmask)


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
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
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
