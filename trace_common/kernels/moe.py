"""Routed experts on the GPU: top-k routing with block alignment, and the grouped expert GEMM
with BF16 weights or packed NVFP4 weights and activations (W4A4) dequantized in registers.

Data flow of one MoE layer (T tokens, top-k, E experts, hidden H, expert width I):
  logits [T, E] --route_align--> RoutePlan (ids, weights, pairs sorted by expert in BM blocks)
  x [T, H] --(FP4: quantize rows)--> gate_up GEMM + silu*mul --> act [T*k, I]
  act --(FP4: quantize rows)--> down GEMM * routing weight --> y [T*k, H]  (summed per token
  by the next fused residual + RMSNorm kernel).
A pair p = t * k + j is token t's j-th expert. The plain-PyTorch references here
(`align_reference`, `moe_reference`) define the layout and the math the kernels are tested on.
"""

from __future__ import annotations

import torch

from trace_common.kernels import fp4_decode_words, fp4_gemm_impl, load_kernels
from trace_common.kernels.moe_layout import ExpertWeights, FP4Rows, RoutePlan, max_blocks

DECODE_BLOCK_M = 16  # rows per tile when experts see few tokens (decode): tensor-core minimum
PREFILL_BLOCK_M = 64  # rows per tile for prefill-sized token counts
MAX_FUSED_ROUTE_TOKENS = 256  # the single-program route kernel holds a [T, E] tile
_ROUTE_SENTINEL_CHUNK = 1024


def align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[
    torch.Tensor, torch.Tensor
]:  # fmt: skip
    """(sorted_pair, block_expert) for topk_ids [T, k], plain PyTorch.

    Each expert's pairs are ordered by (j, t) (the route kernel's order), padded to a multiple
    of block_m, experts in ascending order."""
    t, k = topk_ids.shape
    n_pairs = t * k
    maxb = max_blocks(n_pairs, num_experts, block_m)
    ids_kt = topk_ids.t().reshape(-1).long()  # order (j, t)
    pair_kt = (torch.arange(t, device=topk_ids.device)[None, :] * k
               + torch.arange(k, device=topk_ids.device)[:, None]).reshape(-1)  # fmt: skip
    order = torch.sort(ids_kt, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.long, device=topk_ids.device)
    counts.scatter_add_(0, ids_kt, torch.ones_like(ids_kt))
    nblk = (counts + block_m - 1) // block_m
    blk_start = torch.cumsum(nblk, 0) - nblk
    first = torch.cumsum(counts, 0) - counts  # first sorted index of each expert
    sorted_ids = ids_kt[order]
    rank = torch.arange(n_pairs, device=topk_ids.device) - first[sorted_ids]
    sorted_pair = torch.full((maxb * block_m,), n_pairs, dtype=torch.int32, device=topk_ids.device)
    sorted_pair[blk_start[sorted_ids] * block_m + rank] = pair_kt[order].int()
    block_expert = torch.full((maxb,), -1, dtype=torch.int32, device=topk_ids.device)
    total = int(nblk.sum())
    block_expert[:total] = torch.repeat_interleave(
        torch.arange(num_experts, device=topk_ids.device), nblk
    ).int()
    return sorted_pair, block_expert


def route_reference(logits: torch.Tensor, top_k: int, norm_topk: bool = True) -> tuple[
    torch.Tensor, torch.Tensor
]:  # fmt: skip
    """The model's routing: softmax in fp32, top-k, renormalized weights."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids.int(), w


def route_align(
    logits: torch.Tensor, top_k: int, block_m: int, *, norm_topk: bool = True
) -> RoutePlan:
    """Route T tokens and lay the pairs out for the grouped GEMM: two launches (top-k per
    token, then the single-program alignment), or the PyTorch reference for T > 256."""
    t, e = logits.shape
    if t > MAX_FUSED_ROUTE_TOKENS or e & (e - 1):
        ids, w = route_reference(logits, top_k, norm_topk)
        sp, be = align_reference(ids, e, block_m)
        return RoutePlan(ids, w, sp, be, block_m)
    plan = RoutePlan.allocate(t, e, top_k, block_m, logits.device)
    route_align_into(logits, plan, norm_topk=norm_topk)
    return plan


def route_align_into(logits: torch.Tensor, plan: RoutePlan, *, norm_topk: bool = True) -> None:
    """route_align writing into the plan's preallocated buffers (CUDA-graph friendly)."""
    k_mod = load_kernels("_tl_moe")
    t, e = logits.shape
    top_k = plan.topk_ids.shape[1]
    maxb = plan.block_expert.numel()
    k_mod.route_topk_kernel[(t,)](
        logits, plan.topk_ids, plan.topk_w, E=e, TOPK=top_k, NORM_TOPK=norm_topk, num_warps=1
    )
    assert plan.scratch is not None
    k_mod.align_kernel[(1,)](
        plan.topk_ids, plan.scratch[0], plan.scratch[1], plan.sorted_pair, plan.block_expert,
        t * top_k, E=e, BM=plan.block_m, MAXB=maxb, BP=max(16, _next_pow2(t * top_k)),
        BB=max(16, _next_pow2(maxb)), num_warps=4 if t * top_k <= 512 else 8,
    )  # fmt: skip


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def moe_gemm(
    a: torch.Tensor | FP4Rows,  # bf16 [rows, K] or FP4Rows
    w: ExpertWeights,
    plan: RoutePlan,
    *,
    gated: bool,
    a_div: int,
    mul_route_w: bool,
    out: torch.Tensor | None = None,  # bf16 [T*k, N_out]
    block_n: int | None = None,
    block_k: int = 128,
    decode: str | None = None,  # "ptx" | "bits" (default: fp4_decode_words)
    impl: str | None = None,  # FP4: "cuda" | "triton" (default: fp4_gemm_impl, see below)
) -> torch.Tensor:
    """Grouped expert GEMM (see module docstring); returns out [T*k, N_out].

    FP4 weights held only in the CUDA layout run the CUDA kernel (`cuda_moe`), held only in
    the row layout the Triton kernel; holding both, `impl` (default: fp4_gemm_impl) chooses."""
    fp4 = isinstance(a, FP4Rows)
    if fp4 != w.is_fp4:
        raise ValueError(f"activation fp4={fp4} but weights fp4={w.is_fp4}: W4A4 or BF16 only")
    if fp4 and (w.codes is None or (w.packed is not None and fp4_gemm_impl(impl) == "cuda")):
        from trace_common.kernels.cuda_moe import moe_gemm_cuda

        return moe_gemm_cuda(a, w, plan, gated=gated, a_div=a_div, mul_route_w=mul_route_w,
                             out=out)  # type: ignore[arg-type]  # fmt: skip
    k_mod = load_kernels("_tl_moe")
    n_out = w.n // 2 if gated else w.n
    if block_n is None:
        block_n = 32 if gated else 64
    if n_out % block_n or w.k % block_k:
        raise ValueError(f"N_out={n_out}, K={w.k} must be multiples of {block_n}, {block_k}")
    n_pairs = plan.n_pairs
    if out is None:
        out = torch.empty(n_pairs, n_out, dtype=torch.bfloat16, device=plan.topk_w.device)
    words = fp4 and fp4_decode_words(out.device, decode)
    if fp4:
        a_codes = a.codes.view(torch.int32) if words else a.codes
        w_codes = w.codes.view(torch.int32) if words else w.codes  # type: ignore[union-attr]
        a_args = (a_codes, a.scales, a.scale_2)
        w_args = (w_codes, w.scales, w.scale_2)
    else:
        a_args = (a, a, a)
        w_args = (w.bf16, w.bf16, w.bf16)
    # (output tiles, expert blocks): every tile of block 0, then of block 1, ..., so the programs
    # of the empty blocks past the routing's (up to a third of the plan's bound at decode sizes)
    # come last instead of in every wave (the CUDA kernels' grids alike, cuda_moe)
    grid = (n_out // block_n, plan.block_expert.numel())
    k_mod.moe_gemm_kernel[grid](
        *a_args, *w_args, out, plan.topk_w, plan.sorted_pair, plan.block_expert, n_pairs,
        N_OUT=n_out, K=w.k, A_DIV=a_div, GATED=gated, MUL_ROUTE_W=mul_route_w, FP4=fp4, WORDS=words,
        BM=plan.block_m, BN=block_n, BK=block_k, num_warps=4, num_stages=4,
    )  # fmt: skip
    return out


def quantize_weights(w_bf16: torch.Tensor, *, shared_halves: bool) -> ExpertWeights:
    """NVFP4-quantize expert weights [E, N, K] with the GPU quantizer: a per-expert scale_2
    (gate and up share one when `shared_halves`, as the model's quantize_policy)."""
    from trace_common.fp4.nvfp4 import scale_2_from_amax
    from trace_common.kernels.quant import quantize_rows

    e, n, k = w_bf16.shape
    codes = torch.empty(e, n, k // 2, dtype=torch.uint8, device=w_bf16.device)
    scales = torch.empty(e, n, k // 16, dtype=torch.uint8, device=w_bf16.device)
    amax = w_bf16.abs().amax(dim=(1, 2)).float()  # [E]; shared gate/up amax == whole amax
    g = scale_2_from_amax(amax)
    for i in range(e):
        c, s, _ = quantize_rows(w_bf16[i], scale_2=g[i : i + 1])
        codes[i], scales[i] = c, s
    del shared_halves  # the whole [gate; up] amax is max(gate amax, up amax) already
    return ExpertWeights(n=n, k=k, codes=codes, scales=scales, scale_2=g)


def moe_reference(
    x: torch.Tensor,  # [T, H]
    ids: torch.Tensor,  # [T, k]
    weights: torch.Tensor,  # [T, k] fp32
    w_gate_up: torch.Tensor,  # [E, 2I, H] (dequantized value for FP4) fp32
    w_down: torch.Tensor,  # [E, H, I]
    act_quant: bool,
) -> torch.Tensor:
    """Per-pair outputs y [T*k, H] in fp32 (weighted, not yet summed): the math of the model's
    Experts.forward with fp32 matmuls; act_quant applies per-row NVFP4 fake quant to the
    expert inputs (x and the down_proj input) as the rollout's W4A4 path."""
    from trace_common.fp4.fake import fake_quantize

    k = ids.shape[1]
    inter = w_down.shape[2]
    xq = fake_quantize(x.float(), "nvfp4", scale_granularity="row") if act_quant else x.float()
    rows = xq.repeat_interleave(k, dim=0)  # [T*k, H]
    e_of = ids.reshape(-1).long()
    gu = torch.einsum("ph,pnh->pn", rows, w_gate_up[e_of].float())  # [T*k, 2I]
    h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    h = h.to(torch.bfloat16).float()
    if act_quant:
        h = fake_quantize(h, "nvfp4", scale_granularity="row")
    y = torch.einsum("pi,phi->ph", h, w_down[e_of].float())
    return y * weights.reshape(-1, 1).float()


__all__ = [
    "DECODE_BLOCK_M",
    "PREFILL_BLOCK_M",
    "align_reference",
    "moe_gemm",
    "moe_reference",
    "quantize_weights",
    "route_align",
    "route_align_into",
    "route_reference",
]
