"""CUDA C++ grouped expert GEMM for W4A4 NVFP4 at decode-sized token counts (mma.sync, Hopper).

The kernel (`cuda/moe_fp4.cu`) reads the weights in an MMA-fragment layout made once at load
by `moe_layout.pack_fp4_weights` (plain PyTorch, runs on any device), and the activations as
fp16 (code * block scale * 2**-14, exact) written in B-fragment order by the quantize kernel
(`quantize_rows(..., dq16=...)`). It is compiled by NVRTC through CuPy on first use and
launched on PyTorch's current stream (`cuda_launch`), so a CUDA graph captured by PyTorch records it.

Importing this module needs neither CuPy nor a GPU; `moe_gemm_cuda` imports CuPy when first
called and raises ImportError naming the install command when it is missing.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib

import torch

from trace_common.kernels.cuda_launch import (
    compiled_function,
    launch_on_torch_stream,
    pointers,
    sm_resources,
)
from trace_common.kernels.moe_layout import (
    K_GROUP,
    LANES,
    MMA_K,
    MMA_M,
    ExpertWeights,
    FP4Rows,
    RoutePlan,
)

SOURCE = pathlib.Path(__file__).with_name("cuda") / "moe_fp4.cu"
WG_SOURCE = SOURCE.with_name("moe_fp4_wg.cu")  # the wgmma kernel (sm_90a only)

MMA_N = 8  # token slots per B tile
BLOCK_MS = (8, 16)  # token slots per expert block the kernel is built for (NT = 1, 2)
SMEM_LIMIT = 48 * 1024  # static shared memory of the split-K reduction


def decode_packed_reference(words: torch.Tensor) -> torch.Tensor:
    """The kernel's `decode_word` in PyTorch: int32 words [...] -> fp16 bits int32 [..., 4, 2]
    (register r, half h), for tests."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    m32 = 0xFFFFFFFF
    r0 = (w << 9) & 0x8E008E00
    r1 = ((w << 6) & 0x0E000E00) | (w & 0x80008000)
    r2 = (w << 2) & 0x8E008E00
    r3 = ((w >> 1) & 0x0E000E00) | ((w << 1) & 0x80008000 & m32)
    regs = torch.stack((r0, r1, r2, r3), dim=-1)
    return torch.stack((regs & 0xFFFF, regs >> 16), dim=-1)


def dq16_permutation(device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [16]: where element kk of a 16-block goes in the B-fragment order of `dq16`:
    lane quad t reads halves (2t, 2t+1, 2t+8, 2t+9) as 8 contiguous bytes."""
    kk = torch.arange(MMA_K, device=device)
    return ((kk % 8) // 2) * 4 + (kk // 8) * 2 + kk % 2


# Launch configuration per (K, token slots, gated): (RW output tiles per CTA, WK warps along K,
# KGW 64-wide k groups per warp, MINB CTAs per SM for the register allocator, 0 = none);
# WK * KGW * 64 == K. Picked by `bench/experiments/rollout_gpu_kernels.py --cuda-sweep` on an
# H200 (fastest summed over 1, 8, 32, 128 tokens of each block size; docs/benchmarks.md).
# `KernelSettings.expert_gemm_configs` (a JSON file, `load_overrides`) overrides them.
CONFIGS: dict[tuple[int, int, bool], tuple[int, int, int, int]] = {
    (2048, 8, True): (2, 16, 2, 2),
    (2048, 16, True): (2, 8, 4, 2),
    (768, 8, False): (2, 4, 3, 8),
    (768, 16, False): (4, 4, 3, 4),
}


# `moe_fp4_stream` (the streaming kernel, see cuda/moe_fp4.cu) per (K, token slots, gated):
# (RW output tiles per item, WK warps along K, KGW 64-wide k groups per warp, S ring stages,
# MINB CTAs per SM for the register allocator, 0 = none); WK * KGW * 64 == K.
# Picked by `bench/experiments/rollout_gpu_kernels.py --cuda-sweep` on an H200 (fastest summed
# over 1, 8, 32 tokens for 8 slots, at 128 tokens for 16).
STREAM_CONFIGS: dict[tuple[int, int, bool], tuple[int, int, int, int, int]] = {
    (2048, 8, True): (1, 4, 8, 3, 3),
    (2048, 16, True): (1, 4, 8, 3, 3),
    (768, 8, False): (2, 4, 3, 4, 3),
    (768, 16, False): (2, 4, 3, 4, 3),
}
CUDA_KERNELS = ("stream", "mma", "wg")  # moe_fp4_stream, moe_fp4_mma, moe_fp4_wg
# `moe_fp4_wg` (warpgroup MMAs, 8- or 16-slot blocks; cuda/moe_fp4_wg.cu) per (K, token slots,
# gated): (KGW 64-wide k groups per ring stage, S ring stages per warp, NWG warpgroups per CTA);
# 16 slots: the fastest of `bench/experiments/rollout_gpu_kernels.py --cuda-sweep wg` at 96 / 128
# tokens on an H200, confirmed in the engine.
WG_CONFIGS: dict[tuple[int, int, bool], tuple[int, ...]] = {
    (2048, 16, True): (4, 2, 4),
    (768, 16, False): (6, 2, 4),
}
DEFAULT_CUDA_KERNEL = "mma"  # for shapes KERNEL_FOR does not name
# The kernel per (K, token slots, gated): the faster one on an H200 (same sums,
# `bench/experiments/rollout_gpu_kernels.py --cuda-sweep`). 16 slots on sm_90: the
# warpgroup-MMA kernel (`wg`); `stream` where wgmma is missing (not sm_90).
# ... and `wg` only up to this many pairs (batch 156 at top-8), `stream` past them, where its
# item-walking grid keeps more CTAs busy (both on `wave_grid`; the crossover is in
# docs/benchmarks.md, "Expert GEMM defaults").
WG_MAX_PAIRS = 1248
KERNEL_FOR: dict[tuple[int, int, bool], str] = {
    (2048, 8, True): "mma",
    (2048, 16, True): "wg",
    (768, 8, False): "mma",
    (768, 16, False): "wg",
}


# Launch configurations that replace the built-in ones for their shapes (`set_overrides`):
# (K, token slots, gated) -> a config of 4 numbers runs `moe_fp4_mma` with it, of 5 numbers
# `moe_fp4_stream`, of 3 numbers (KGW, S, NWG) `moe_fp4_wg`.
_OVERRIDES: dict[tuple[int, int, bool], tuple[int, ...]] = {}


def load_overrides(path: str | pathlib.Path) -> dict[tuple[int, int, bool], tuple[int, ...]]:
    """The launch configurations of a JSON file {"K,block_m,gated": [numbers]} (3, 4 or 5
    numbers each, see _OVERRIDES); anything else raises ValueError naming the file."""
    out = {}
    for key, val in json.loads(pathlib.Path(path).read_text()).items():
        parts = key.split(",")
        if len(parts) != 3 or len(val) not in (3, 4, 5):
            raise ValueError(f"{path}: {key!r}: {val} is not 'K,block_m,gated': 3, 4 or 5 "
                             "numbers")  # fmt: skip
        k, bm, gated = parts
        out[(int(k), int(bm), gated == "True")] = tuple(int(v) for v in val)
    return out


def set_overrides(configs: dict[tuple[int, int, bool], tuple[int, ...]]) -> None:
    """Use `configs` (as `load_overrides` returns) instead of the built-in configurations of
    their shapes from now on; {} restores the built-in ones."""
    _OVERRIDES.clear()
    _OVERRIDES.update(configs)


def _override() -> dict[tuple[int, int, bool], tuple[int, ...]]:
    return _OVERRIDES


_OVERRIDE_KERNEL = {3: "wg", 4: "mma", 5: "stream"}  # an override config's kernel, by its length


def cuda_kernel(kernel: str | None = None, key: tuple[int, int, bool] | None = None,
                n_pairs: int | None = None, device: torch.device | None = None) -> str:  # fmt: skip
    """The CUDA expert-GEMM kernel to run for shape `key` = (K, token slots, gated): `kernel`,
    else the one an override (`set_overrides`) names for the shape, else
    KERNEL_FOR (its `wg` only up to WG_MAX_PAIRS pairs, `stream` past them), else
    DEFAULT_CUDA_KERNEL. With `device`: a `wg` chosen by default becomes `stream` where
    wgmma is missing (`wg_supported`); one asked for by name is refused there."""
    named = kernel
    if not kernel and key is not None:
        cfg = _override().get(key)
        kernel = KERNEL_FOR.get(key) if cfg is None else _OVERRIDE_KERNEL[len(cfg)]
        if cfg is None and kernel == "wg" and n_pairs is not None and n_pairs > WG_MAX_PAIRS:
            kernel = "stream"
    kernel = kernel or DEFAULT_CUDA_KERNEL
    if kernel not in CUDA_KERNELS:
        raise ValueError(f"kernel={kernel!r}; expected one of {CUDA_KERNELS}")
    if kernel == "wg" and device is not None and not wg_supported(device):
        if named:
            raise ValueError(f"the wg kernel needs wgmma (sm_90), not on {device}")
        kernel = "stream"  # the per-shape default elsewhere
    return kernel


def _configs(kernel: str) -> dict[tuple[int, int, bool], tuple[int, ...]]:
    """The built-in configs of `kernel` ("mma", "stream" or "wg"), with the overrides of that
    kernel on top (_OVERRIDE_KERNEL: by their length)."""
    base: dict[tuple[int, int, bool], tuple[int, ...]] = dict(
        {"mma": CONFIGS, "stream": STREAM_CONFIGS, "wg": WG_CONFIGS}[kernel]
    )
    base.update({k: v for k, v in _override().items() if _OVERRIDE_KERNEL[len(v)] == kernel})
    return base


def default_config(k: int, block_m: int, gated: bool) -> tuple[int, int, int, int]:
    """(RW, WK, KGW, MINB) of CONFIGS, or for another shape: split K into up to 8 warps."""
    configs = _configs("mma")
    if (k, block_m, gated) in configs:
        return configs[(k, block_m, gated)]  # type: ignore[return-value]
    kg = k // K_GROUP
    for wk in (8, 4, 6, 2, 3, 1):
        if kg % wk == 0 and kg // wk <= 4:
            return (1 if gated else 2, wk, kg // wk, 0)
    return (1 if gated else 2, kg, 1, 0) if kg <= 16 else (1, 16, kg // 16, 0)


def default_stream_config(k: int, block_m: int, gated: bool, n_out: int
                          ) -> tuple[int, int, int, int, int]:  # fmt: skip
    """(RW, WK, KGW, S, MINB) of STREAM_CONFIGS, or for another shape: K over up to 8 warps of
    <= 8 k groups each, the widest item of <= 2 (gated) or 4 tiles that divides N_out."""
    configs = _configs("stream")
    if (k, block_m, gated) in configs:
        return configs[(k, block_m, gated)]  # type: ignore[return-value]
    kg = k // K_GROUP
    wk = next((w for w in (8, 4, 6, 2, 3, 1) if kg % w == 0 and kg // w <= 8), kg)
    tiles = n_out // MMA_M
    rw = next(r for r in ((2, 1) if gated else (4, 2, 1)) if tiles % r == 0)
    return (rw, wk, kg // wk, 4, 0)


def stream_smem_bytes(block_m: int, rw: int, wk: int, kgw: int, stages: int, gated: bool) -> int:
    """Dynamic shared memory of `moe_fp4_stream`: the per-warp rings (one stage = one tile's
    words + scales over the warp's K slice) and two items' partial sums."""
    tiles = 2 * rw if gated else rw
    stage = kgw * (LANES * 16 + 64)
    return wk * stages * stage + 2 * wk * tiles * (block_m // MMA_N) * 4 * LANES * 4


STREAM_SMEM_MAX = 227 * 1024  # opt-in dynamic shared memory per CTA on sm_90


def expected_experts(n_tokens: int, top_k: int, num_experts: int) -> float:
    """Distinct experts a uniform top-k router chooses for `n_tokens` tokens, on average."""
    return num_experts * (1 - (1 - top_k / num_experts) ** n_tokens)


def expected_blocks(n_tokens: int, top_k: int, num_experts: int, block_m: int, maxb: int) -> float:
    """Expert blocks a uniform router fills for `n_tokens` tokens: distinct experts chosen,
    at least the pairs over block_m, at most the plan's bound."""
    distinct = expected_experts(n_tokens, top_k, num_experts)
    return min(float(maxb), max(distinct, n_tokens * top_k / block_m, 1.0))


def stream_grid(n_items: int, est_blocks: float, ctas_per_sm: int, n_sms: int,
                waves: int = 1) -> tuple[int, int]:  # fmt: skip
    """(CTAs per expert block, items per CTA): as many CTAs per block as keep the expected
    blocks' CTAs within `waves` waves of resident CTAs, the block's items split evenly."""
    per_block = max(1, int(waves * n_sms * ctas_per_sm // max(est_blocks, 1.0)))
    ipc = -(-n_items // min(per_block, n_items))
    return -(-n_items // ipc), ipc


@functools.lru_cache(maxsize=64)
def block_count_moments(n_tokens: int, top_k: int, num_experts: int, block_m: int
                        ) -> tuple[float, float]:  # fmt: skip
    """Mean and variance of the expert blocks a uniform top-k router fills for `n_tokens`
    tokens: each expert sees Binomial(n_tokens, top_k / num_experts) pairs and takes
    ceil(pairs / block_m) blocks; experts taken as independent (the variance is then an
    upper bound: their counts are negatively correlated)."""
    p = min(top_k / num_experts, 1.0)
    if p == 1.0:
        return float(num_experts * -(-n_tokens // block_m)), 0.0
    mean = second = 0.0
    pmf = (1 - p) ** n_tokens  # P(0 pairs), then P(c) from P(c - 1)
    for c in range(1, n_tokens + 1):
        pmf *= (n_tokens - c + 1) / c * p / (1 - p)
        blocks = -(-c // block_m)
        mean += pmf * blocks
        second += pmf * blocks * blocks
    return num_experts * mean, num_experts * (second - mean * mean)


GRID_CTA_OVERHEAD_ITEMS = 1.0  # a CTA's fixed cost (its block's B, the ring's fill) in items


def _block_grid(n_items: int, plan: RoutePlan, n_exp: int, ctas_per_sm: int,
                device: torch.device, waves: int = 1) -> tuple[int, int]:  # fmt: skip
    """(CTAs per expert block, items per CTA) of an item-walking kernel: `wave_grid`; the
    bench's `waves` > 1 sizes an even grid (`stream_grid`) for that many waves."""
    t, k = plan.topk_ids.shape
    maxb, sms = plan.block_expert.numel(), sm_resources(device)[0]
    if waves == 1:
        mean, var = block_count_moments(t, k, n_exp, plan.block_m)
        return wave_grid(n_items, mean, var, sms * ctas_per_sm, maxb)
    est = expected_blocks(t, k, n_exp, plan.block_m, maxb)
    return stream_grid(n_items, est, ctas_per_sm, sms, waves)


def wave_grid(n_items: int, mean_blocks: float, var_blocks: float, slots: int,
              max_blocks: int) -> tuple[int, int]:  # fmt: skip
    """(CTAs per expert block, items per CTA) for a grid of whole waves: the split whose
    expected time, waves of `slots` resident CTAs x (items per CTA + GRID_CTA_OVERHEAD_ITEMS),
    is least over the block count's distribution (normal, from block_count_moments; at
    most `max_blocks`). One CTA per block while the blocks fit one wave; when they may not
    (e.g. 8-slot blocks at 80 tokens: ~136 blocks on 132 SMs, a second wave of 4 CTAs that
    each stream a whole block), the block's items split so the last wave stays short. The
    model overrates a short last wave where only a few steps spill into it, so near that edge
    an even grid (`stream_grid`) can be as fast."""
    sd = max(var_blocks, 0.0) ** 0.5
    lo = max(1, math.floor(mean_blocks - 4 * sd))
    hi = min(max_blocks, max(lo, math.ceil(mean_blocks + 4 * sd)))
    weights = [math.exp(-0.5 * ((b - mean_blocks) / sd) ** 2) if sd > 0 else float(b == lo)
               for b in range(lo, hi + 1)]  # fmt: skip
    total = sum(weights) or 1.0
    best = None
    for ipc in range(n_items, 0, -1):  # fewest CTAs first: they win ties
        gy = -(-n_items // ipc)
        if gy * ipc - n_items >= ipc:  # the same split as a larger ipc
            continue
        waves = sum(wt * -(-b * gy // slots)
                    for b, wt in zip(range(lo, hi + 1), weights, strict=True))  # fmt: skip
        cost = waves / total * (ipc + GRID_CTA_OVERHEAD_ITEMS)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, gy, ipc)
    assert best is not None
    return best[1], best[2]


_RESIDENT_FNS: dict[tuple, tuple[object, int]] = {}


def _resident_kernel(name: str, warps: int, smem: int, device: torch.device,
                     source: pathlib.Path | None = None, arch: str | None = None
                     ) -> tuple[object, int]:  # fmt: skip
    """The compiled instance `name` of a kernel sized to the GPU (`moe_fp4_stream`,
    `moe_fp4_wg` with its `source` and `arch`) allowed `smem` bytes of dynamic
    shared memory, and the CTAs of it one SM holds."""
    source = source or SOURCE  # read per call: benches swap SOURCE for A/Bs
    key = (source, name, smem, device.index)
    hit = _RESIDENT_FNS.get(key)
    if hit is not None:
        return hit
    fn = compiled_function(source, name, smem, arch)
    _, smem_sm, regs_sm, threads_sm = sm_resources(device)
    regs = int(getattr(fn, "num_regs", 0)) or 128
    per_cta = [threads_sm // (warps * LANES),
               smem_sm // (smem + 1024 + int(getattr(fn, "shared_size_bytes", 0))),
               regs_sm // (warps * (-(-regs * LANES // 256) * 256)), 32]  # fmt: skip
    _RESIDENT_FNS[key] = (fn, max(1, min(per_cta)))
    return _RESIDENT_FNS[key]


def _kernel(block_m: int, rw: int, wk: int, kgw: int, gated: bool, minb: int,
            qout: bool = False, pdl: bool = False, pairs: bool = False):  # fmt: skip
    """The compiled expert-GEMM instance for one launch configuration (`qout`: it also
    quantizes its output, see `moe_gemm_cuda`; `pdl`: launched as a programmatic dependent
    launch, it waits for the previous grid first; `pairs`: one block per pair)."""
    flags = ", ".join(str(f).lower() for f in (qout, pdl, pairs))
    name = (f"moe_fp4_mma<{block_m // MMA_N}, {rw}, {wk}, {kgw}, {str(gated).lower()}, "
            f"{minb}, {flags}>")  # fmt: skip
    return compiled_function(SOURCE, name)


def moe_gemm_cuda(
    a: FP4Rows,
    w: ExpertWeights,
    plan: RoutePlan,
    *,
    gated: bool,
    a_div: int,
    mul_route_w: bool,
    out: torch.Tensor | None = None,
    config: tuple[int, ...] | None = None,  # mma: (RW, WK, KGW, MINB); stream: + S before MINB
    kernel: str | None = None,  # "stream" | "mma" | "wg" (default: `cuda_kernel`)
    pdl: bool = False,
    quant_out: FP4Rows | None = None,
    counter: torch.Tensor | None = None,  # int32 [>= MAXB], zero: quant_out's per-block counters
    stream_waves: int = 1,  # stream kernel: waves of resident CTAs its grid is sized for
    stream_probe: bool = False,  # stream kernel: the bench's timing probe (wrong outputs)
    by_pairs: bool = False,
) -> torch.Tensor:
    """`moe.moe_gemm` for packed weights and fp16-decoded activations (see module docstring).

    `by_pairs` (the `mma` kernel, block_m 8): one block per pair, its expert from
    plan.topk_ids; the plan's block layout is not read (the router may skip it) and
    `counter` needs one entry per pair.

    `pdl`: the `mma` kernel as a programmatic dependent launch (it waits before
    reading anything; the `stream` kernel is launched normally). `quant_out`: also NVFP4-quantize
    `out` into it (per-row scale_2, and its dq16 if given), equal to quant.quantize_rows(out,
    scale_2=None, dq16=quant_out.dq16): by the last CTA of each expert block in the `mma`
    kernel (`counter`: one per block), by a quantize launch after the other kernels.
    `stream_probe` (no decode, no block scale) times what those cost; its outputs are wrong."""
    if w.packed is None:
        raise ValueError("weights are not packed for the CUDA kernel: pack_fp4_weights first")
    if a.dq16 is None:
        raise ValueError("activations lack dq16: quantize_rows(..., dq16=...) first")
    if plan.block_m not in BLOCK_MS:
        raise ValueError(f"plan.block_m={plan.block_m}; the CUDA kernel handles {BLOCK_MS}")
    n_out = w.n // 2 if gated else w.n
    if out is None:
        out = torch.empty(plan.n_pairs, n_out, dtype=torch.bfloat16, device=plan.topk_w.device)
    blocks = plan.n_pairs if by_pairs else plan.block_expert.numel()
    if quant_out is not None:
        _check_quant_out(quant_out, counter, plan.n_pairs, n_out, blocks)
    kern = cuda_kernel(kernel, (w.k, plan.block_m, gated), plan.n_pairs, out.device)
    if by_pairs and (kern != "mma" or plan.block_m != MMA_N):
        raise ValueError(f"by_pairs needs the mma kernel and block_m {MMA_N} (got {kern!r}, "
                         f"block_m {plan.block_m})")  # fmt: skip
    if kern != "mma":
        if kern == "stream":
            _launch_stream(a, w, plan, gated, a_div, mul_route_w, out, config, stream_waves,
                           stream_probe)  # fmt: skip
        else:
            _launch_wg(a, w, plan, gated, a_div, mul_route_w, out, config)
        if quant_out is not None:
            from trace_common.kernels.quant import quantize_rows

            quantize_rows(out, scale_2=None, dq16=quant_out.dq16,
                          out=(quant_out.codes, quant_out.scales, quant_out.scale_2))  # fmt: skip
    else:
        _launch_mma(a, w, plan, gated, a_div, mul_route_w, out, config, pdl, quant_out, counter,
                    by_pairs)  # fmt: skip
    return out


def _check_quant_out(q: FP4Rows, counter: torch.Tensor | None, rows: int, k: int,
                     blocks: int) -> None:  # fmt: skip
    q.check(rows, k, "quant_out")
    if k % 16:
        raise ValueError(f"quant_out: N_out={k} is not a multiple of 16")
    if counter is None or counter.dtype != torch.int32 or counter.numel() < blocks:
        raise ValueError(f"quant_out needs counter: a zeroed int32 tensor of >= {blocks} "
                         "elements (one per expert block)")  # fmt: skip


def row_multiplier(a_div: int, n_pairs: int) -> int:
    """The kernels' a_mul for activation row = pair // a_div: ceil(2**32 / a_div), whose
    product's high word is that quotient for every pair < n_pairs while n_pairs * a_div <=
    2**32 (the error of the rounded-up reciprocal stays below one step); 2**32 for a_div = 1."""
    if a_div < 1:
        raise ValueError(f"a_div={a_div}: must be >= 1")
    if n_pairs * a_div > 1 << 32:
        raise ValueError(f"a_div={a_div} with {n_pairs} pairs: n_pairs * a_div exceeds 2**32")
    return -(-(1 << 32) // a_div)


def _args(a: FP4Rows, w: ExpertWeights, plan: RoutePlan, out: torch.Tensor,
          n_out: int, a_div: int, mul_route_w: bool, by_pairs: bool = False) -> tuple:  # fmt: skip
    """The kernel arguments every CUDA kernel starts with (`by_pairs`: the top-k ids in the
    block -> expert slot)."""
    import numpy as np

    assert w.packed is not None and a.dq16 is not None
    ptr = np.uint64
    x, x_g = a.dq16.data_ptr(), a.scale_2.data_ptr()
    return (
        ptr(w.packed.words.data_ptr()), ptr(w.packed.scales.data_ptr()),
        ptr(w.scale_2.data_ptr()), ptr(x), ptr(x_g),
        ptr(plan.sorted_pair.data_ptr()),
        ptr((plan.topk_ids if by_pairs else plan.block_expert).data_ptr()),
        ptr(plan.topk_w.data_ptr()), ptr(out.data_ptr()),
        np.int32(plan.n_pairs), np.int32(n_out), np.uint64(row_multiplier(a_div, plan.n_pairs)),
        np.int32(int(mul_route_w)),
    )  # fmt: skip


def _launch_stream(a: FP4Rows, w: ExpertWeights, plan: RoutePlan, gated: bool, a_div: int,
                   mul_route_w: bool, out: torch.Tensor, config: tuple[int, ...] | None,
                   waves: int = 1, probe: bool = False) -> None:  # fmt: skip
    import numpy as np

    n_out = w.n // 2 if gated else w.n
    cfg = config or default_stream_config(w.k, plan.block_m, gated, n_out)
    if len(cfg) != 5:
        raise ValueError(f"stream config {cfg}: expected (RW, WK, KGW, S, MINB)")
    rw, wk, kgw, stages, _ = cfg
    smem = stream_smem_bytes(plan.block_m, rw, wk, kgw, stages, gated)
    if (wk * kgw * K_GROUP != w.k or n_out % (MMA_M * rw) or kgw * 4 > LANES or stages < 2
            or smem > STREAM_SMEM_MAX):  # fmt: skip
        raise ValueError(f"stream config RW={rw}, WK={wk}, KGW={kgw}, S={stages} does not fit "
                         f"N_out={n_out}, K={w.k}, block_m={plan.block_m}")  # fmt: skip
    name = (f"moe_fp4_stream<{plan.block_m // MMA_N}, {rw}, {wk}, {kgw}, {str(gated).lower()}, "
            f"{stages}, {cfg[4]}{', true' if probe else ''}>")  # fmt: skip
    fn, ctas_per_sm = _resident_kernel(name, wk, smem, out.device)
    assert w.packed is not None
    gy, ipc = _block_grid(n_out // (MMA_M * rw), plan, w.packed.words.shape[0], ctas_per_sm,
                          out.device, waves)  # fmt: skip
    args = (*_args(a, w, plan, out, n_out, a_div, mul_route_w), np.int32(ipc))
    # (CTAs per block, expert blocks): the empty blocks' CTAs last, as in _launch_mma
    launch_on_torch_stream(fn, (gy, plan.block_expert.numel()), (wk * LANES,), args, out.device,
                           shared_mem=smem)  # fmt: skip


def wg_supported(device: torch.device) -> bool:
    """Whether `device` runs the wgmma kernel: compute capability 9.0 (H100 / H200)."""
    return device.type == "cuda" and _capability(device.index) == (9, 0)


@functools.lru_cache(maxsize=16)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def wg_smem_bytes(k: int, kgw: int, stages: int, gated: bool, nwg: int = 1,
                  block_m: int = 16) -> int:  # fmt: skip
    """Dynamic shared memory of `moe_fp4_wg`: the block's `block_m` activation rows in fp16,
    then the rings of 4 warps per warpgroup (a stage: KGW k groups of the warp's tile, and of
    its up tile when gated)."""
    return k * block_m * 2 + 4 * nwg * stages * (2 if gated else 1) * kgw * (LANES * 16 + 64)


def _launch_wg(a: FP4Rows, w: ExpertWeights, plan: RoutePlan, gated: bool, a_div: int,
               mul_route_w: bool, out: torch.Tensor, config: tuple[int, ...] | None) -> None:  # fmt: skip
    """`moe_fp4_wg` (config (KGW, S[, NWG])): items of 64 output features, CTAs of NWG
    warpgroups."""
    import numpy as np

    n_out = w.n // 2 if gated else w.n
    bm = plan.block_m
    kgw, stages, *rest = config or _configs("wg").get((w.k, bm, gated), (4, 2, 1))
    nwg = rest[0] if rest else 1
    smem = wg_smem_bytes(w.k, kgw, stages, gated, nwg, bm)
    if (bm not in BLOCK_MS or n_out % 64 or w.k % (K_GROUP * kgw) or not 2 <= kgw <= 8
            or stages < 2 or not 1 <= nwg <= 8 or smem > STREAM_SMEM_MAX):  # fmt: skip
        raise ValueError(f"wg config KGW={kgw}, S={stages}, NWG={nwg} does not fit "
                         f"N_out={n_out}, K={w.k}, block_m={bm} (8- or 16-slot blocks, "
                         "N_out % 64 == 0, 2 <= KGW <= 8)")  # fmt: skip
    name = f"moe_fp4_wg<{w.k}, {kgw}, {str(gated).lower()}, {stages}, {nwg}, {bm}>"
    fn, ctas_per_sm = _resident_kernel(name, 4 * nwg, smem, out.device, WG_SOURCE, "sm_90a")
    assert w.packed is not None
    gy, ipc = _block_grid(n_out // 64, plan, w.packed.words.shape[0], ctas_per_sm, out.device)
    args = (*_args(a, w, plan, out, n_out, a_div, mul_route_w), np.int32(ipc))
    launch_on_torch_stream(fn, (gy, plan.block_expert.numel()), (nwg * 4 * LANES,), args,
                           out.device, shared_mem=smem)  # fmt: skip


def _launch_mma(a: FP4Rows, w: ExpertWeights, plan: RoutePlan, gated: bool,
                a_div: int, mul_route_w: bool, out: torch.Tensor, config: tuple[int, ...] | None,
                pdl: bool = False, quant_out: FP4Rows | None = None,
                counter: torch.Tensor | None = None, by_pairs: bool = False) -> None:  # fmt: skip

    n_out = w.n // 2 if gated else w.n
    cfg = config or default_config(w.k, plan.block_m, gated)
    if len(cfg) != 4:
        raise ValueError(f"mma config {cfg}: expected (RW, WK, KGW, MINB)")
    rw, wk, kgw, minb = cfg
    if (
        wk * kgw * K_GROUP != w.k
        or n_out % (MMA_M * rw)
        or smem_bytes(plan.block_m, rw, wk, gated) > SMEM_LIMIT
    ):
        raise ValueError(f"config RW={rw}, WK={wk}, KGW={kgw} does not fit N_out={n_out}, "
                         f"K={w.k}, block_m={plan.block_m}")  # fmt: skip
    fn = _kernel(plan.block_m, rw, wk, kgw, gated, minb, quant_out is not None, pdl, by_pairs)
    # (output tiles, expert blocks): blocks as the slow dimension, so the CTAs of the empty ones
    # (past the routing's) come last instead of in every wave
    grid = (n_out // (MMA_M * rw), plan.n_pairs if by_pairs else plan.block_expert.numel())
    q = quant_out
    qargs = pointers(counter, *((None,) * 4 if q is None else (q.codes, q.scales, q.scale_2,
                                                                q.dq16)))  # fmt: skip
    launch_on_torch_stream(fn, grid, (wk * LANES,),
                           (*_args(a, w, plan, out, n_out, a_div, mul_route_w, by_pairs), *qargs),
                           out.device, pdl=pdl)  # fmt: skip


def block_m_for(n_pairs: int, num_experts: int) -> int:
    """Token slots per expert block for the CUDA kernel: 8 while a typical expert sees a few
    tokens (mean pairs per expert <= 5), else 16 (an expert with more takes several blocks).
    The threshold is where 8 slots stop beating 16 in the FP4 engine on an H200
    (docs/benchmarks.md)."""
    return 8 if n_pairs <= 5 * num_experts else 16


def smem_bytes(block_m: int, rw: int, wk: int, gated: bool) -> int:
    """Static shared memory of the kernel's split-K reduction (fp32 per fragment value)."""
    tiles = 2 * rw if gated else rw
    return wk * tiles * (block_m // MMA_N) * 4 * LANES * 4


__all__ = [
    "BLOCK_MS",
    "CONFIGS",
    "CUDA_KERNELS",
    "KERNEL_FOR",
    "STREAM_CONFIGS",
    "block_count_moments",
    "block_m_for",
    "cuda_kernel",
    "decode_packed_reference",
    "default_stream_config",
    "dq16_permutation",
    "expected_blocks",
    "load_overrides",
    "moe_gemm_cuda",
    "row_multiplier",
    "set_overrides",
    "smem_bytes",
    "stream_grid",
    "stream_smem_bytes",
    "wave_grid",
]
