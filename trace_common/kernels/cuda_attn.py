"""CUDA C++ split-KV decode attention over the FP4 KV cache (mma.sync, Hopper).

Two kernels in `cuda/attn_fp4.cu`, picked by the launch config (`kernel_name`): `attn_fp4_ring`
(the default: a per-warp cp.async shared-memory ring, swapped MMAs) and `attn_fp4_split` (the
first version, "regs"). Both read the cache in the layout the append kernel writes
(`attention.KVCacheGPU`: NVFP4 codes + e4m3 block scales + per-token fp32 scale, contiguous)
and write the same split partials as the Triton split kernel, so `attention.decode_attention`
combines them with the Triton reduce kernel either way. It handles head_dim 128 and 8 query
heads per kv head (the Qwen3-MoE shape); `supports` says whether a shape fits. Compiled by
NVRTC through CuPy on first use and launched on PyTorch's current stream (CUDA-graph safe).

Importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import pathlib

import torch

from trace_common.kernels.cuda_launch import compiled_function, launch_on_torch_stream

SOURCE = pathlib.Path(__file__).with_name("cuda") / "attn_fp4.cu"
HEAD_DIM = 128
GROUP = 8  # query heads per kv head
TILE = 16  # tokens per warp step
# Launch configurations: ("ring", warps per CTA, CTAs per SM asked of the register allocator,
# shared-memory stages per warp) runs `attn_fp4_ring` (cp.async ring, swapped MMAs); ("regs",
# warps, CTAs per SM) runs `attn_fp4_split`, the first version (register double buffer).
# ("regs", 4, 3) fits 168 registers, ("ring", 4, 4, 4) 115, neither spills (nvcc -Xptxas -v,
# sm_90a); bench/rollout_gpu_kernels.py --attention-only --attn-sweep times them. H200,
# 2026-12-02, graph-timed split + reduce: the ring kernel takes 0.54-0.70x the time of the
# regs kernel at every measured shape (32K batch 8: 66.5 vs 123 us; batch 128: 845 vs 1527 us).
DEFAULT_CONFIG: tuple = ("ring", 4, 4, 4)


def kernel_name(config: tuple) -> tuple[str, int]:
    """(template instance to compile, warps per CTA) of a launch configuration."""
    kind, *p = config
    if kind == "ring" and len(p) == 3 and p[2] >= 2:
        return f"attn_fp4_ring<{p[0]}, {p[1]}, {p[2]}>", p[0]
    if kind == "regs" and len(p) == 2:
        return f"attn_fp4_split<{p[0]}, {p[1]}>", p[0]
    raise ValueError(f"CUDA FP4 attention config {config!r}: expected ('ring', warps, "
                     f"CTAs per SM, stages >= 2) or ('regs', warps, CTAs per SM)")  # fmt: skip


def ring_ctas_per_sm(config: tuple | None = None) -> int:
    """CTAs per SM the ring kernel's config asks for (0 for the "regs" kernel)."""
    config = config or DEFAULT_CONFIG
    kernel_name(config)
    return config[2] if config[0] == "ring" else 0


def supports(q_heads: int, kv_heads: int, head_dim: int, chunk: int) -> bool:
    """Whether the CUDA kernel handles this attention shape and split size."""
    return head_dim == HEAD_DIM and q_heads == GROUP * kv_heads and chunk % TILE == 0


def decode_attn_split_cuda(
    q: torch.Tensor,  # bf16 [B, HQ, 128]
    codes: torch.Tensor,  # uint8 [2, B, HKV, S, 64]
    scales: torch.Tensor,  # uint8 [2, B, HKV, S, 8]
    row_scales: torch.Tensor,  # fp32 [2, B, S]
    lens: torch.Tensor,  # int32 [B]
    part_o: torch.Tensor,  # fp32 [B, HQ, NSPLIT, 128]
    part_ml: torch.Tensor,  # fp32 [B, HQ, NSPLIT, 2]
    *,
    chunk: int,
    qk_scale: float,  # head_dim ** -0.5 * log2(e)
    config: tuple | None = None,  # default DEFAULT_CONFIG
) -> None:
    """Split kernel of FP4 decode attention: writes part_o / part_ml for splits of `chunk`
    tokens (splits starting at or past lens[b] are left untouched, as the reduce skips them)."""
    import numpy as np

    b, hq, d = q.shape
    _, _, hkv, s, half = codes.shape
    nsplit = part_o.shape[2]
    if not supports(hq, hkv, d, chunk) or half * 2 != d:
        raise ValueError(f"CUDA FP4 attention needs head_dim {HEAD_DIM}, {GROUP} q heads per kv "
                         f"head, chunk % {TILE} == 0; got D={d}, HQ={hq}, HKV={hkv}, "
                         f"chunk={chunk}")  # fmt: skip
    if q.dtype != torch.bfloat16 or not q.is_contiguous() or lens.dtype != torch.int32:
        raise ValueError(f"q must be contiguous bf16 and lens int32; got {q.dtype}, {lens.dtype}")
    for name, t in (("codes", codes), ("scales", scales), ("row_scales", row_scales)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    name, warps = kernel_name(config or DEFAULT_CONFIG)
    fn = compiled_function(SOURCE, name)
    ptr = np.uint64
    args = (
        ptr(q.data_ptr()), ptr(codes.data_ptr()), ptr(scales.data_ptr()),
        ptr(row_scales.data_ptr()), ptr(lens.data_ptr()), ptr(part_o.data_ptr()),
        ptr(part_ml.data_ptr()), np.int32(b), np.int32(hkv), np.int32(s), np.int32(chunk),
        np.int32(nsplit), np.float32(qk_scale),
    )  # fmt: skip
    launch_on_torch_stream(fn, (nsplit, hkv, b), (warps * 32,), args, q.device)


__all__ = [
    "DEFAULT_CONFIG",
    "decode_attn_split_cuda",
    "kernel_name",
    "ring_ctas_per_sm",
    "supports",
]
