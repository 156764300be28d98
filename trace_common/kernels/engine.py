"""A standalone CUDA-graph decode engine for the Qwen3-MoE shape, BF16 or FP4, same code.

One decode step for B sequences (every kernel on static buffers, so the whole step is one
CUDA graph): embed -> per layer [add+RMSNorm, qkv GEMM, q/k norm + RoPE, KV append, split-KV
attention, o GEMM, add+RMSNorm, router GEMM, route+align, (FP4: quantize x) gate_up GEMM with
silu*mul, (FP4: quantize act) down GEMM * routing weight] -> add+RMSNorm -> LM head -> greedy.

The BF16 and FP4 engines share everything except: expert weights (BF16 [E, N, K] vs packed
NVFP4), expert activations (BF16 vs NVFP4 rows quantized per token), and the KV cache (BF16
vs NVFP4 codes + scales). Attention projections, router, norms, embeddings and the LM head stay
BF16 in both (the paper's sites). Guidance capture (FP4 only) writes the compact records of
the `moe_in`, `k` and `v` sites of `guided_layers` from inside the quantize kernels.

The rollout service's CUDA engine (`trace_common.rollout.cuda`) runs it on a pushed policy's
weights with continuous batching; bench/rollout_gpu.py runs it alone on random weights of the
model's shapes (shape, weights and memory sizing live in `engine_model`, re-exported here).
"""

from __future__ import annotations

import functools

import torch

from trace_common.kernels import attention as attn
from trace_common.kernels import (
    cuda_attn,
    cuda_small,
    cupy_available,
    fp4_attn_impl,
    fp4_gemm_impl,
    fused,
    moe,
    moe_layout,
)
from trace_common.kernels.cuda_launch import pdl_enabled
from trace_common.kernels.engine_model import (
    EngineShape,
    EngineWeights,
    LayerWeights,
    kv_bytes_per_sequence,
    largest_batch,
)
from trace_common.kernels.quant import CompactRecordBuffers, quantize_rows
from trace_common.kernels.settings import KernelSettings

# The standard step's BF16 projections that run on `cuda_small.gemv` (tensor-core GEMV) instead
# of cuBLAS, up to AUTO_STEP_GEMV_MAX_BATCH tokens: on the H200 the GEMV wins for o and router
# up to 16 tokens and loses from 32, and qkv on it loses at every batch (docs/kernels.md).
STEP_GEMV_SITES = ("qkv", "o", "router")
AUTO_STEP_GEMV = frozenset({"o", "router"})
AUTO_STEP_GEMV_MAX_BATCH = 16


def step_gemv_sites(shape: EngineShape, batch: int, device: str) -> frozenset[str]:
    """The projections of the standard step that run on `cuda_small.gemv`: AUTO_STEP_GEMV up
    to AUTO_STEP_GEMV_MAX_BATCH tokens; none where the GEMV cannot run (not CUDA, no CuPy) or
    a projection's shape does not fit it."""
    sites = AUTO_STEP_GEMV if batch <= AUTO_STEP_GEMV_MAX_BATCH else frozenset()
    if not (0 < batch <= cuda_small.GEMV_MAX_TOKENS and torch.device(device).type == "cuda"
            and cupy_available()):  # fmt: skip
        return frozenset()
    s = shape
    dims = {"qkv": ((s.q_heads + 2 * s.kv_heads) * s.head_dim, s.hidden),
            "o": (s.hidden, s.q_heads * s.head_dim), "router": (s.num_experts, s.hidden)}  # fmt: skip
    return frozenset(site for site in sites if cuda_small.gemv_supported(*dims[site]))


def small_batch_supported(shape: EngineShape, batch: int) -> bool:
    """Whether the small-batch kernels (`cuda_small.supports`) handle this shape and batch."""
    s = shape
    return cuda_small.supports(batch, hidden=s.hidden, head_dim=s.head_dim,
                               moe_inter=s.moe_inter, num_experts=s.num_experts, top_k=s.top_k,
                               vocab=s.vocab)  # fmt: skip


class DecodeEngine:
    """Static-shape decode for `batch` sequences with caches of `capacity` tokens.

    `small_batch` (default: cuda_small.small_batch_enabled(batch), where the shape allows) runs
    the step on the fused small-batch kernels of `cuda_small` (7 launches per layer instead of
    13; projections and BF16 experts on its GEMVs, the LM head on cuBLAS); the FP4 experts, the
    FP4 KV append and the attention are the same kernels either way. `pdl` (default:
    `cuda_launch.pdl_enabled`, sm_90) launches the small-batch kernels as programmatic
    dependent launches (each overlaps its start and weight prefetch with its predecessor's
    tail); without `small_batch` it has no effect. The standard step runs the projections
    `step_gemv_sites` names on the small-batch GEMV, the rest on cuBLAS. `settings`: the
    kernels' launch shapes (default: the built-in ones), applied process-wide here."""

    def __init__(
        self, shape: EngineShape, weights: EngineWeights, *, batch: int, capacity: int,
        context: int, guided_layers: tuple[int, ...] = (), device: str = "cuda",
        small_batch: bool | None = None,
        pdl: bool | None = None,
        settings: KernelSettings | None = None,
    ) -> None:  # fmt: skip
        (settings or KernelSettings()).apply()
        s = self.shape = shape
        self.w = weights
        gu0 = weights.layers[0].gate_up
        self.fp4 = gu0.is_fp4
        # the CUDA expert GEMM when the weights are packed for it (and only so, or it is chosen)
        self.cuda_gemm = (
            self.fp4 and gu0.packed is not None and (gu0.codes is None or fp4_gemm_impl() == "cuda")
        )
        if not 0 < batch <= moe.MAX_FUSED_ROUTE_TOKENS:
            raise ValueError(
                f"batch={batch}: the graph-captured router handles 1..{moe.MAX_FUSED_ROUTE_TOKENS}"
            )
        if guided_layers and not self.fp4:
            raise ValueError("guidance capture needs the FP4 engine (BF16 has no FP4 sites)")
        if small_batch is None:
            small_batch = cuda_small.small_batch_enabled(batch) and small_batch_supported(s, batch)
        elif small_batch and not small_batch_supported(s, batch):
            raise ValueError(f"small_batch: batch={batch} or shape {s} not handled by cuda_small")
        self.small = small_batch
        # programmatic dependent launches of the small-batch kernels (cuda_launch.pdl_enabled)
        self.pdl = small_batch and (pdl_enabled() if pdl is None else pdl)
        # fused launches writing the same results: on the small path with the CUDA expert GEMM
        # (cuda_small.FP4_FUSE), on the standard path (fused.FUSED_PARTS)
        self.small_fuse = cuda_small.FP4_FUSE if small_batch and self.cuda_gemm else frozenset()
        parts = frozenset() if small_batch else fused.FUSED_PARTS
        self.qk_kv = "qk_kv" in parts and fused.qk_kv_supported(s.kv_heads, s.head_dim)
        self.norm_quant = (
            self.fp4 and "norm_quant" in parts and fused.norm_quant_supported(s.hidden)
        )
        self.gemv_sites = frozenset() if small_batch else step_gemv_sites(s, batch, device)
        self.batch, self.capacity, self.guided = batch, capacity, frozenset(guided_layers)
        b, h, d = batch, s.hidden, s.head_dim
        bf = dict(dtype=torch.bfloat16, device=device)
        self.tokens = torch.zeros(b, dtype=torch.long, device=device)
        self.pos = torch.full((b,), context, dtype=torch.int32, device=device)
        self.lens = self.pos + 1
        self.resid = torch.empty(b, h, **bf)
        self.xn = torch.empty(b, h, **bf)
        self.qkv = torch.empty(b, (s.q_heads + 2 * s.kv_heads) * d, **bf)
        self.q = torch.empty(b, s.q_heads, d, **bf)
        self.kv_new = torch.empty(2, b, s.kv_heads * d, **bf)
        self.attn_out = torch.empty(b, s.q_heads * d, **bf)
        self.o = torch.empty(b, h, **bf)
        self.rlogits = torch.empty(b, s.num_experts, **bf)
        self.act = torch.empty(b * s.top_k, s.moe_inter, **bf)
        self.y = torch.empty(b * s.top_k, h, **bf)
        self.logits = torch.empty(b, s.vocab, **bf)
        self.inv_freq = 1.0 / (
            s.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
        )
        if self.cuda_gemm:
            from trace_common.kernels.cuda_moe import block_m_for

            self.block_m = block_m_for(b * s.top_k, s.num_experts)
        elif self.small and not self.fp4:
            self.block_m = 8  # cuda_small.moe_gate_up: one 8-token MMA column block per expert
        else:
            self.block_m = moe.DECODE_BLOCK_M
        # small step: the expert GEMMs by pairs, the router laying out no blocks (BF16
        # cuda_small.moe_gate_up; FP4 the CUDA mma kernel with 8-slot blocks, cuda_moe)
        self.experts_by_pairs = small_batch and cuda_small.experts_by_pairs(batch)
        if self.experts_by_pairs and self.fp4:
            from trace_common.kernels.cuda_moe import MMA_N, cuda_kernel

            self.experts_by_pairs = self.cuda_gemm and self.block_m == MMA_N and all(
                cuda_kernel(None, (k, self.block_m, gated)) == "mma"
                for k, gated in ((s.hidden, True), (s.moe_inter, False)))  # fmt: skip
        # where the small FP4 step appends the new token to the KV cache: "attention" (part
        # "kv_attn": inside the attention kernel, which falls back to a launch where it
        # cannot), else "launch" (quant.kv_append_fp4)
        self.kv_append_site = "attention" if "kv_attn" in self.small_fuse else "launch"
        if self.small:
            self.resid_b = torch.empty(b, h, **bf)  # residual ping-pong (fused prologues)
            self.y_sum = torch.empty(b, h, **bf)  # BF16 experts: top-k sum per token
            # the router's last-CTA counter (more experts than one cluster takes)
            self.router_counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.plans = [
            moe_layout.RoutePlan.allocate(b, s.num_experts, s.top_k, self.block_m, device)
            for _ in range(s.num_layers)
        ]
        if "act" in self.small_fuse:  # gate_up's last-CTA counters, one per expert block (or
            # pair), zero between launches
            self.fp4_counters = torch.zeros(
                max(self.plans[0].block_expert.numel(), b * s.top_k), dtype=torch.int32,
                device=device)  # fmt: skip
        self.caches = [
            attn.KVCacheGPU.allocate(
                fp4=self.fp4,
                batch=b,
                kv_heads=s.kv_heads,
                capacity=capacity,
                head_dim=d,
                device=device,
            )
            for _ in range(s.num_layers)
        ]
        self.attn_plan = attn.DecodeAttnPlan.make(
            batch=b, q_heads=s.q_heads, kv_heads=s.kv_heads, capacity=capacity, head_dim=d,
            context_hint=context, device=device,
            cuda_fp4=self.fp4 and fp4_attn_impl() == "cuda",
            fused=cuda_attn.fused_enabled(small_batch=self.small, fp4=self.fp4, context=context),
        )  # fmt: skip
        if self.fp4:
            u8 = dict(dtype=torch.uint8, device=device)
            f32 = dict(dtype=torch.float32, device=device)
            n = b * s.top_k
            i = s.moe_inter

            def dq16(rows: int, k: int) -> torch.Tensor | None:
                if not self.cuda_gemm:
                    return None
                return torch.empty(rows, k, dtype=torch.float16, device=device)

            self.xq = moe_layout.FP4Rows(torch.empty(b, h // 2, **u8), torch.empty(b, h // 16, **u8),
                                  torch.empty(b, **f32), dq16(b, h))  # fmt: skip
            self.actq = moe_layout.FP4Rows(torch.empty(n, i // 2, **u8), torch.empty(n, i // 16, **u8),
                                    torch.empty(n, **f32), dq16(n, i))  # fmt: skip
            self.records = {
                layer: (
                    CompactRecordBuffers.allocate(b, h, device),  # moe_in
                    CompactRecordBuffers.allocate(2 * b, s.kv_heads * d, device),  # k; v
                )
                for layer in self.guided
            }
        self.graph: torch.cuda.CUDAGraph | None = None

    def fill_context_(self, seed: int = 0) -> None:
        """Random cache contents standing for `context` tokens already decoded."""
        g = torch.Generator(device=self.tokens.device).manual_seed(seed)
        for c in self.caches:
            c.fill_random_(g)

    def step(self) -> None:
        """One decode step: reads self.tokens, writes the next greedy tokens into it."""
        if self.small:
            self._step_small()
            return
        s, w = self.shape, self.w
        torch.index_select(w.embed, 0, self.tokens, out=self.resid)
        for li, lw in enumerate(w.layers):
            prev = None if li == 0 else self.y
            attn.add_rmsnorm(prev, self.resid, lw.ln1, self.xn, nsum=0 if li == 0 else s.top_k,
                             eps=s.eps)  # fmt: skip
            self._project("qkv", self.xn, lw.w_qkv, self.qkv)
            rec = self.records.get(li) if self.fp4 else None
            if self.qk_kv:
                fused.qk_norm_rope_append(self.qkv, lw.norm_qk, self.pos, self.inv_freq, self.q,
                                          self.caches[li], None if rec is None else rec[1],
                                          q_heads=s.q_heads, kv_heads=s.kv_heads,
                                          eps=s.eps)  # fmt: skip
            else:
                attn.qk_norm_rope(self.qkv, lw.norm_qk, self.pos, self.inv_freq, self.q,
                                  self.kv_new, q_heads=s.q_heads, kv_heads=s.kv_heads,
                                  eps=s.eps)  # fmt: skip
                attn.kv_append(self.caches[li], self.kv_new, self.pos,
                               None if rec is None else rec[1])  # fmt: skip
            attn.decode_attention(self.q, self.caches[li], self.lens, self.attn_plan,
                                  out=self.attn_out)  # fmt: skip
            self._project("o", self.attn_out, lw.w_o, self.o)
            if self.norm_quant:  # ln2 and the experts' input quantization in one launch
                fused.add_rmsnorm_quant(self.o, self.resid, lw.ln2, self.xn, self.xq, nsum=1,
                                        eps=s.eps, capture=None if rec is None else rec[0])  # fmt: skip
            else:
                attn.add_rmsnorm(self.o, self.resid, lw.ln2, self.xn, nsum=1, eps=s.eps)
            self._project("router", self.xn, lw.router, self.rlogits)
            plan = self.plans[li]
            moe.route_align_into(self.rlogits, plan)
            if self.fp4:
                self._experts_fp4(lw, plan, rec, x_quantized=self.norm_quant)
            else:
                moe.moe_gemm(self.xn, lw.gate_up, plan, gated=True, a_div=s.top_k,
                             mul_route_w=False, out=self.act)  # fmt: skip
                moe.moe_gemm(self.act, lw.down, plan, gated=False, a_div=1, mul_route_w=True,
                             out=self.y)  # fmt: skip
        self._finish(self.y, self.resid, s.top_k)

    def _project(self, site: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """out = x @ w^T of the standard step's projection `site`: cuBLAS, or the small-batch
        GEMV where `gemv_sites` names it."""
        if site in self.gemv_sites:
            cuda_small.gemv(x, w, out, warps=cuda_small.WARPS[site])
        else:
            torch.mm(x, w.t(), out=out)

    def _finish(self, delta: torch.Tensor | None, resid: torch.Tensor, nsum: int) -> None:
        """The step's tail on both paths: the last layer's output `delta` (`nsum` rows per
        token) added to `resid`, final RMSNorm, LM head (cuBLAS, faster than the small-batch
        GEMV at the LM head's size: docs/kernels.md), greedy token, positions advanced."""
        s, w = self.shape, self.w
        attn.add_rmsnorm(delta, resid, w.final_norm, self.xn, nsum=nsum, eps=s.eps)
        torch.mm(self.xn, w.lm_head.t(), out=self.logits)
        torch.argmax(self.logits, dim=-1, out=self.tokens)
        self.pos.add_(1)
        self.lens.add_(1)

    def _experts_fp4(self, lw: LayerWeights, plan: moe_layout.RoutePlan, rec: tuple | None, *,
                     x_quantized: bool = False, fuse_act: bool = False,
                     pdl: bool = False) -> None:  # fmt: skip
        """FP4 routed experts of self.xn into self.y (per pair): quantize, gate_up, quantize,
        down (the guidance record of `moe_in` written by the first quantize). `x_quantized`:
        self.xq already holds xn's NVFP4 rows and record (written by cuda_small.router_topk
        or fused.add_rmsnorm_quant). CUDA expert GEMM only: `fuse_act` (gate_up's last CTA of
        each expert block quantizes act), `pdl` (both GEMMs as programmatic dependent
        launches)."""
        s = self.shape
        if (fuse_act or pdl) and not self.cuda_gemm:
            raise ValueError("fuse_act / pdl need the CUDA expert GEMM")
        if not x_quantized:
            quantize_rows(self.xn, scale_2=None, capture=None if rec is None else rec[0],
                          out=(self.xq.codes, self.xq.scales, self.xq.scale_2),
                          dq16=self.xq.dq16)  # fmt: skip
        if self.cuda_gemm:
            from trace_common.kernels.cuda_moe import moe_gemm_cuda

            gemm = functools.partial(moe_gemm_cuda, pdl=pdl, by_pairs=self.experts_by_pairs)
        else:
            gemm = functools.partial(moe.moe_gemm, impl="triton")
        act_quant = dict(quant_out=self.actq, counter=self.fp4_counters) if fuse_act else {}
        gemm(self.xq, lw.gate_up, plan, gated=True, a_div=s.top_k, mul_route_w=False,
             out=self.act, **act_quant)  # fmt: skip
        if not fuse_act:
            quantize_rows(self.act, scale_2=None,
                          out=(self.actq.codes, self.actq.scales, self.actq.scale_2),
                          dq16=self.actq.dq16)  # fmt: skip
        gemm(self.actq, lw.down, plan, gated=False, a_div=1, mul_route_w=True,
             out=self.y)  # fmt: skip

    def _step_small(self) -> None:
        """`step` on the small-batch kernels. The residual alternates between self.resid and
        self.resid_b: a fused add + RMSNorm prologue reads one and writes the other."""
        s, w, b = self.shape, self.w, self.batch
        fuse = self.small_fuse
        cur, other = self.resid, self.resid_b
        torch.index_select(w.embed, 0, self.tokens, out=cur)
        delta: torch.Tensor | None = None
        nsum = 0
        for li, lw in enumerate(w.layers):
            rec = self.records.get(li) if self.fp4 else None
            cache = self.caches[li]
            qkv_args = dict(
                w_qkv=lw.w_qkv, qkv=self.qkv, norm_w=lw.norm_qk,
                pos=self.pos, inv_freq=self.inv_freq, q_out=self.q, kv_new=self.kv_new,
                cache=None if self.fp4 else cache.values, q_heads=s.q_heads,
                kv_heads=s.kv_heads, eps=s.eps,
            )  # fmt: skip
            if b * (nsum + 1) <= cuda_small.PROLOGUE_MAX_ROWS:
                cuda_small.qkv_rope(**qkv_args, resid_in=cur, delta=delta, nsum=nsum,
                                    ln_w=lw.ln1, resid_out=other, pdl=self.pdl)  # fmt: skip
                cur, other = other, cur
            else:
                attn.add_rmsnorm(delta, cur, lw.ln1, self.xn, nsum=nsum, eps=s.eps)
                cuda_small.qkv_rope(**qkv_args, xn=self.xn, pdl=self.pdl)
            kv_rec = None if rec is None else rec[1]
            if self.fp4 and self.kv_append_site == "launch":
                attn.kv_append(cache, self.kv_new, self.pos, kv_rec)
            in_attn = self.fp4 and self.kv_append_site == "attention"
            attn.decode_attention(self.q, cache, self.lens, self.attn_plan, out=self.attn_out,
                                  pdl=self.pdl, kv_new=self.kv_new if in_attn else None,
                                  kv_capture=kv_rec if in_attn else None)  # fmt: skip
            cuda_small.gemv(self.attn_out, lw.w_o, self.o, warps=cuda_small.WARPS["o"],
                            pdl=self.pdl)  # fmt: skip
            plan = self.plans[li]
            cuda_small.router_topk(
                resid_in=cur, delta=self.o, nsum=1, ln_w=lw.ln2, eps=s.eps, resid_out=other,
                xn_out=self.xn, w_router=lw.router, logits=self.rlogits,
                counter=self.router_counter, topk_ids=plan.topk_ids, topk_w=plan.topk_w,
                sorted_pair=None if self.experts_by_pairs else plan.sorted_pair,
                block_expert=None if self.experts_by_pairs else plan.block_expert,
                block_m=plan.block_m, pdl=self.pdl,
                xq=self.xq if "xq" in fuse else None,
                capture=None if rec is None or "xq" not in fuse else rec[0],
            )  # fmt: skip
            cur, other = other, cur
            if self.fp4:
                self._experts_fp4(lw, plan, rec, x_quantized="xq" in fuse, fuse_act="act" in fuse,
                                  pdl=self.pdl and "pdl" in fuse)  # fmt: skip
                delta, nsum = self.y, s.top_k
            else:
                assert lw.gate_up.bf16 is not None and lw.down.bf16 is not None
                pairs = self.experts_by_pairs
                layout = (None, None) if pairs else (plan.sorted_pair, plan.block_expert)
                cuda_small.moe_gate_up(self.xn, lw.gate_up.bf16, *layout, self.act,
                                       top_k=s.top_k, topk_ids=plan.topk_ids if pairs else None,
                                       pdl=self.pdl)  # fmt: skip
                cuda_small.moe_down(self.act, lw.down.bf16, plan.topk_ids, plan.topk_w,
                                    self.y_sum, pdl=self.pdl)  # fmt: skip
                delta, nsum = self.y_sum, 1
        self._finish(delta, cur, nsum)

    def capture(self, warmup: int = 2) -> None:
        """Compile (eager warm-up steps on a side stream), then capture one step as a graph."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self.step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()

    def replay(self) -> None:
        assert self.graph is not None, "call capture() first"
        self.graph.replay()

    def bytes_last_step(self, context: int) -> int:
        """HBM bytes the last step had to read at least: every weight it used once (attention,
        router, the experts its tokens chose, LM head, B embedding rows) plus the KV cache of
        `context` tokens per sequence, counted from the routing it recorded."""
        s, w = self.shape, self.w
        total = w.lm_head.numel() * 2 + self.batch * s.hidden * 2
        kv_tok = attn.KVCacheGPU.bytes_per_token(fp4=self.fp4, kv_heads=s.kv_heads,
                                                 head_dim=s.head_dim)  # fmt: skip
        for li, lw in enumerate(w.layers):
            total += sum(t.numel() * t.element_size() for t in (lw.w_qkv, lw.w_o, lw.router))
            used = int(torch.unique(self.plans[li].topk_ids).numel())
            per_expert = (lw.gate_up.nbytes() + lw.down.nbytes()) / s.num_experts
            total += int(used * per_expert)
            total += self.batch * context * kv_tok
        return total


__all__ = [
    "AUTO_STEP_GEMV",
    "AUTO_STEP_GEMV_MAX_BATCH",
    "STEP_GEMV_SITES",
    "DecodeEngine",
    "EngineShape",
    "EngineWeights",
    "kv_bytes_per_sequence",
    "largest_batch",
    "small_batch_supported",
    "step_gemv_sites",
]
