"""Decode-step kernels around the experts: KV caches (BF16 and FP4, contiguous, not paged),
split-KV decode attention over either, fused residual + RMSNorm, and q/k norm + RoPE.

FP4 KV: each new token's K (post-RoPE) and V rows (all kv heads, Hkv * D values) are NVFP4
quantized with a per-token fp32 scale when appended (the model's `kv` site), written as packed
codes + e4m3 block scales; attention decodes them in registers (see `_tl_attn`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trace_common.fp4.constants import NVFP4_BLOCK_SIZE
from trace_common.kernels import fp4_attn_impl, fp4_decode_words, load_kernels

LOG2E = 1.4426950408889634
ATTN_BLOCK_N = 64  # keys per inner tile
ATTN_MIN_CHUNK = 256  # keys per split, at least
TARGET_PROGRAMS = 528  # ~4 programs per SM on a 132-SM H200
# The ring CUDA kernel streams each split through a cp.async ring, so a split costs its tokens
# plus a fixed start (first tiles' latency, the warp merge, the partials): modelled as this many
# tokens. Its plan picks the split size that minimises waves x (split + this), see ring_chunk.
RING_SPLIT_OVERHEAD = 128


@dataclass(slots=True)
class KVCacheGPU:
    """One layer's cache for B sequences of capacity S (see module docstring for layouts)."""

    fp4: bool
    values: torch.Tensor | None = None  # bf16 [2, B, Hkv, S, D]
    codes: torch.Tensor | None = None  # uint8 [2, B, Hkv, S, D/2]
    scales: torch.Tensor | None = None  # uint8 [2, B, Hkv, S, D/16]
    row_scales: torch.Tensor | None = None  # fp32 [2, B, S]

    @classmethod
    def allocate(
        cls, *, fp4: bool, batch: int, kv_heads: int, capacity: int, head_dim: int, device: str
    ) -> KVCacheGPU:
        shape = (2, batch, kv_heads, capacity)
        if not fp4:
            return cls(False, values=torch.empty(*shape, head_dim, dtype=torch.bfloat16,
                                                 device=device))  # fmt: skip
        return cls(
            True,
            codes=torch.empty(*shape, head_dim // 2, dtype=torch.uint8, device=device),
            scales=torch.empty(
                *shape, head_dim // NVFP4_BLOCK_SIZE, dtype=torch.uint8, device=device
            ),
            row_scales=torch.empty(2, batch, capacity, dtype=torch.float32, device=device),
        )

    @staticmethod
    def bytes_per_token(*, fp4: bool, kv_heads: int, head_dim: int) -> int:
        """Bytes one token occupies in one layer (K and V)."""
        width = kv_heads * head_dim
        if not fp4:
            return 2 * width * 2
        return 2 * (width // 2 + width // NVFP4_BLOCK_SIZE + 4)

    def copy_prefix_(self, src: int, dsts: torch.Tensor, n: int) -> None:
        """Copy positions 0..n-1 of sequence `src` into the sequences `dsts` (int64 [k])."""
        for t in (self.values, self.codes, self.scales):
            if t is not None:  # [2, B, Hkv, S, ...]
                t[:, dsts, :, :n] = t[:, src : src + 1, :, :n]
        if self.row_scales is not None:  # [2, B, S]
            self.row_scales[:, dsts, :n] = self.row_scales[:, src : src + 1, :n]

    def fill_random_(self, generator: torch.Generator | None = None) -> None:
        """Fill with random valid contents (bench: a long context without a prefill)."""
        if not self.fp4:
            assert self.values is not None
            self.values.normal_(generator=generator)
            return
        assert self.codes is not None and self.scales is not None and self.row_scales is not None
        self.codes.random_(0, 256, generator=generator)
        self.scales.random_(0x30, 0x50, generator=generator)  # e4m3 around 1.0, no NaN
        self.row_scales.fill_(1.0 / 448.0)


def kv_append(
    cache: KVCacheGPU, kv_new: torch.Tensor, pos: torch.Tensor, capture: object | None = None
) -> None:
    """Write the new token's K/V rows kv_new [2, B, Hkv * D] at position pos[b]."""
    if cache.fp4:
        from trace_common.kernels.quant import kv_append_fp4

        assert cache.codes is not None
        kv_append_fp4(kv_new, cache.codes, cache.scales, cache.row_scales, pos, capture)  # type: ignore[arg-type]
        return
    k_mod = load_kernels("_tl_attn")
    assert cache.values is not None
    _, b, hkv, s, d = cache.values.shape
    k_mod.kv_append_bf16_kernel[(2 * b,)](kv_new, cache.values, pos, b, s, HKV=hkv, D=d)


@dataclass(slots=True)
class DecodeAttnPlan:
    """Split-KV launch geometry and scratch for one (batch, capacity) shape."""

    chunk: int
    nsplit: int
    part_o: torch.Tensor  # fp32 [B, HQ, NSPLIT, D]
    part_ml: torch.Tensor  # fp32 [B, HQ, NSPLIT, 2]
    # fused attention (one launch, the last CTA of each (sequence, kv head) combines): its
    # arrival counters, int32 [B * HKV], zero between launches; None: split + reduce kernels
    counters: torch.Tensor | None = None

    @classmethod
    def make(
        cls, *, batch: int, q_heads: int, kv_heads: int, capacity: int, head_dim: int,
        context_hint: int, device: str, cuda_fp4: bool = False, fused: bool = False,
    ) -> DecodeAttnPlan:  # fmt: skip
        """Pick keys-per-split so that batch * kv_heads * splits of the expected context fill
        the GPU; splits past a sequence's length return at once. `cuda_fp4`: for the CUDA FP4
        kernel: its wave rule (`ring_chunk`) at `capacity` tokens. `fused`: the one-launch
        kernels where `fused_chunk` takes the context (short ones); then `counters` is set
        (the engine asks for them per `cuda_attn.fused_enabled`)."""
        from trace_common.kernels import cuda_attn

        chunk = 0
        if fused:
            chunk = fused_chunk(batch * kv_heads, context_hint, fp4=cuda_fp4,
                                sms=_sm_count(device))  # fmt: skip
        fused = chunk > 0  # else the split kernels' rules below
        if not fused and cuda_fp4:
            # for the longest sequence the plan serves: planned for the starting length, a step
            # past a split boundary (1K + a few tokens) needs a second wave of CTAs
            ring_slots = cuda_attn.ring_ctas_per_sm() * _sm_count(device)
            chunk = ring_chunk(batch * kv_heads, max(context_hint, capacity), ring_slots)
        elif not fused:
            want = max(1, math.ceil(TARGET_PROGRAMS / (batch * kv_heads)))
            chunk = max(ATTN_MIN_CHUNK,
                        math.ceil(context_hint / want / ATTN_BLOCK_N) * ATTN_BLOCK_N)  # fmt: skip
        nsplit = math.ceil(capacity / chunk)
        return cls(
            chunk,
            nsplit,
            torch.empty(batch, q_heads, nsplit, head_dim, dtype=torch.float32, device=device),
            torch.empty(batch, q_heads, nsplit, 2, dtype=torch.float32, device=device),
            torch.zeros(batch * kv_heads, dtype=torch.int32, device=device) if fused else None,
        )


def _sm_count(device: str) -> int:
    from trace_common.kernels.cuda_launch import sm_resources

    return sm_resources(device)[0]


def ring_chunk(heads: int, context: int, slots: int) -> int:
    """Keys per split (a multiple of ATTN_BLOCK_N) for `heads` (batch * kv heads) sequences of
    `context` tokens on `slots` resident CTAs: the one that minimises waves x (split +
    RING_SPLIT_OVERHEAD) tokens, the smallest on ties."""
    best = (math.inf, ATTN_BLOCK_N)
    for chunk in range(ATTN_BLOCK_N, max(context, 1) + ATTN_BLOCK_N, ATTN_BLOCK_N):
        waves = math.ceil(heads * math.ceil(context / chunk) / slots)
        best = min(best, (waves * (chunk + RING_SPLIT_OVERHEAD), chunk))
    return best[1]


def fused_chunk(heads: int, context: int, *, fp4: bool, sms: int) -> int:
    """Keys per split of the fused kernels (`cuda_attn`) for `heads` (batch x kv heads)
    sequences of `context` tokens: the wave rule for their resident CTAs (`ring_chunk`, at
    least cuda_attn.FUSED_MIN_CHUNK); 0 (use split + reduce) where that is more than
    cuda_attn.FUSED_MAX_SPLITS splits."""
    from trace_common.kernels import cuda_attn

    per_sm = cuda_attn.ring_ctas_per_sm() if fp4 else cuda_attn.FUSED_BF16_CTAS_PER_SM
    chunk = max(ring_chunk(heads, context, per_sm * sms), cuda_attn.FUSED_MIN_CHUNK)
    return chunk if -(-max(context, 1) // chunk) <= cuda_attn.FUSED_MAX_SPLITS else 0


def decode_attention(
    q: torch.Tensor,  # bf16 [B, HQ, D]
    cache: KVCacheGPU,
    lens: torch.Tensor,  # int32 [B] valid tokens (new one included)
    plan: DecodeAttnPlan,
    out: torch.Tensor | None = None,  # bf16 [B, HQ * D]
    decode: str | None = None,  # FP4 cache, Triton: "ptx" | "bits" (default: fp4_decode_words)
    impl: str | None = None,  # FP4 cache: "cuda" | "triton" (default: fp4_attn_impl)
    pdl: bool = False,  # fused plan: launch as a programmatic dependent launch
    kv_new: torch.Tensor | None = None,  # bf16 [2, B, Hkv * D]: append it first (see below)
    kv_capture: object | None = None,  # with kv_new: its guidance record (kv_append's)
) -> torch.Tensor:
    """Softmax attention of one new query per sequence over its cached keys/values. With an
    FP4 cache the split kernel is the CUDA one (`cuda_attn`) where chosen and the shape fits,
    else Triton; the splits are combined by the Triton reduce kernel either way. With a fused
    plan (`plan.counters`) and a shape the CUDA kernels handle: one launch that also combines
    (BF16 cache, or FP4 with the CUDA kernel). `kv_new`: the new token's K/V rows, appended at
    position lens[b] - 1 first, as kv_append(cache, kv_new, lens - 1, kv_capture): inside the
    CUDA FP4 attention kernel where it can (`cuda_attn.append_supported`), else by kv_append."""
    b, hq, d = q.shape
    qk_scale = d**-0.5 * LOG2E
    if out is None:
        out = torch.empty(b, hq * d, dtype=torch.bfloat16, device=q.device)
    if kv_new is not None and not _append_in_kernel(q, cache, plan, impl):
        kv_append(cache, kv_new, lens - 1, kv_capture)
        kv_new = None
    how = _attention_cuda(q, cache, lens, plan, out, qk_scale, impl, pdl, kv_new, kv_capture)
    if how == "fused":
        return out
    k_mod = load_kernels("_tl_attn")
    if how != "split":  # else the CUDA FP4 split kernel wrote the partials
        if cache.fp4:
            assert cache.codes is not None
            hkv, s = cache.codes.shape[2], cache.codes.shape[3]
            words = fp4_decode_words(q.device, decode)
            kc = cache.codes.view(torch.int32) if words else cache.codes
            ks, kg = cache.scales, cache.row_scales
        else:
            assert cache.values is not None
            hkv, s = cache.values.shape[2], cache.values.shape[3]
            kc = ks = kg = cache.values
            words = False
        k_mod.decode_attn_split_kernel[(b, hkv, plan.nsplit)](
            q, kc, ks, kg, lens, plan.part_o, plan.part_ml, b, s, qk_scale, plan.nsplit,
            CHUNK=plan.chunk, HQ=hq, HKV=hkv, D=d, BH=max(16, hq // hkv), BN=ATTN_BLOCK_N,
            FP4=cache.fp4, WORDS=words, num_warps=4, num_stages=3,
        )  # fmt: skip
    k_mod.decode_attn_reduce_kernel[(b, hq)](
        plan.part_o, plan.part_ml, lens, out, plan.nsplit, CHUNK=plan.chunk, HQ=hq, D=d,
        BS=max(2, 1 << (plan.nsplit - 1).bit_length()), num_warps=4,
    )  # fmt: skip
    return out


def _fp4_cuda_runs(q: torch.Tensor, cache: KVCacheGPU, plan: DecodeAttnPlan,
                   impl: str | None) -> bool:  # fmt: skip
    """Whether the CUDA FP4 kernel takes this call: an FP4 cache, the CUDA implementation
    chosen, a shape and split size it handles."""
    if not (cache.fp4 and fp4_attn_impl(impl) == "cuda"):
        return False
    from trace_common.kernels import cuda_attn

    assert cache.codes is not None
    return cuda_attn.supports(q.shape[1], cache.codes.shape[2], q.shape[2], plan.chunk)


def _append_in_kernel(q: torch.Tensor, cache: KVCacheGPU, plan: DecodeAttnPlan,
                      impl: str | None) -> bool:  # fmt: skip
    """Whether `decode_attention` runs the CUDA FP4 kernel that can append the new token."""
    if not _fp4_cuda_runs(q, cache, plan, impl):
        return False
    from trace_common.kernels import cuda_attn

    assert cache.codes is not None
    return cuda_attn.append_supported(cache.codes.shape[2])


def _attention_cuda(
    q: torch.Tensor, cache: KVCacheGPU, lens: torch.Tensor, plan: DecodeAttnPlan,
    out: torch.Tensor, qk_scale: float, impl: str | None, pdl: bool,
    kv_new: torch.Tensor | None = None, kv_capture: object | None = None,
) -> str:  # fmt: skip
    """The CUDA kernels' part of `decode_attention`, where they handle the case: "fused" (one
    launch wrote `out`), "split" (the FP4 split kernel wrote the partials), else "". `kv_new`
    (only where _append_in_kernel): the FP4 kernel appends it first."""
    from trace_common.kernels import cuda_attn

    if not cache.fp4:  # the BF16 cache: CUDA only with a fused plan (counters set)
        kv = cache.values
        assert kv is not None
        if plan.counters is None or not cuda_attn.supports(q.shape[1], kv.shape[2], q.shape[2],
                                                            plan.chunk):  # fmt: skip
            return ""
        cuda_attn.decode_attn_fused_bf16(q, kv, lens, plan.part_o, plan.part_ml, plan.counters,
                                         out, chunk=plan.chunk, qk_scale=qk_scale, pdl=pdl)  # fmt: skip
        return "fused"
    if not _fp4_cuda_runs(q, cache, plan, impl):
        return ""
    kv = cache.codes
    fused = plan.counters is not None
    cuda_attn.decode_attn_split_cuda(
        q, kv, cache.scales, cache.row_scales, lens, plan.part_o, plan.part_ml,  # type: ignore[arg-type]
        chunk=plan.chunk, qk_scale=qk_scale, counters=plan.counters if fused else None,
        out=out if fused else None, pdl=pdl and fused, kv_new=kv_new,
        kv_capture=kv_capture,  # type: ignore[arg-type]
    )  # fmt: skip
    return "fused" if fused else "split"


def dequantize_cache(cache: KVCacheGPU) -> torch.Tensor:
    """fp32 [2, B, Hkv, S, D] values of the cache (reference path for tests)."""
    if not cache.fp4:
        assert cache.values is not None
        return cache.values.float()
    from trace_common.fp4.nvfp4 import NVFP4Tensor, dequantize

    assert cache.codes is not None and cache.scales is not None and cache.row_scales is not None
    two, b, hkv, s, half = cache.codes.shape
    d = half * 2
    # rows are tokens over all heads: [2, B, S, Hkv * D/2] etc.
    codes = cache.codes.permute(0, 1, 3, 2, 4).reshape(two, b, s, hkv * half)
    scales = cache.scales.permute(0, 1, 3, 2, 4).reshape(two, b, s, -1)
    q = NVFP4Tensor(codes, scales.view(torch.float8_e4m3fn), cache.row_scales[..., None],
                    torch.Size((two, b, s, hkv * d)), torch.float32, "row")  # fmt: skip
    return dequantize(q).reshape(two, b, s, hkv, d).permute(0, 1, 3, 2, 4)


def attention_reference(q: torch.Tensor, kv: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """fp32 reference: q [B, HQ, D], kv [2, B, Hkv, S, D] values -> [B, HQ * D]."""
    b, hq, d = q.shape
    hkv = kv.shape[2]
    outs = []
    for i in range(b):
        n = int(lens[i])
        k = kv[0, i, :, :n].repeat_interleave(hq // hkv, dim=0)  # [HQ, n, D]
        v = kv[1, i, :, :n].repeat_interleave(hq // hkv, dim=0)
        s = torch.einsum("hd,hnd->hn", q[i].float(), k) * d**-0.5
        outs.append(torch.einsum("hn,hnd->hd", torch.softmax(s, -1), v).reshape(-1))
    return torch.stack(outs)


def add_rmsnorm(
    delta: torch.Tensor | None, resid: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
    *, nsum: int, eps: float,
) -> torch.Tensor:  # fmt: skip
    """resid [T, H] += sum of `nsum` rows of delta per token; out = RMSNorm(resid) * weight."""
    k_mod = load_kernels("_tl_attn")
    t, h = resid.shape
    k_mod.add_rmsnorm_kernel[(t,)](
        resid if delta is None else delta, resid, weight, out, eps, H=h, NSUM=nsum, num_warps=4
    )
    return out


def qk_norm_rope(
    qkv: torch.Tensor, norm_w: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor,
    q_out: torch.Tensor, kv_out: torch.Tensor, *, q_heads: int, kv_heads: int, eps: float,
) -> None:  # fmt: skip
    """Per-head RMSNorm + RoPE of the new q/k (norm_w [2, D]: q then k), v copied."""
    k_mod = load_kernels("_tl_attn")
    b = qkv.shape[0]
    d = norm_w.shape[1]
    k_mod.qk_norm_rope_kernel[(b, q_heads + 2 * kv_heads)](
        qkv, norm_w, pos, inv_freq, q_out, kv_out, b, eps, HQ=q_heads, HKV=kv_heads, D=d,
        num_warps=1,
    )  # fmt: skip


__all__ = [
    "DecodeAttnPlan",
    "KVCacheGPU",
    "add_rmsnorm",
    "attention_reference",
    "decode_attention",
    "dequantize_cache",
    "fused_chunk",
    "kv_append",
    "qk_norm_rope",
    "ring_chunk",
]
