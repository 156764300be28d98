"""CUDA C++ grouped expert GEMM for W4A4 NVFP4 at decode-sized token counts (mma.sync, Hopper).

The kernel (`cuda/moe_fp4.cu`) reads the weights in an MMA-fragment layout made once at load
by `pack_fp4_weights` (plain PyTorch, runs on any device), and the activations as fp16
(code * block scale * 2**-14, exact) written in B-fragment order by the quantize kernel
(`quantize_rows(..., dq16=...)`). It is compiled by NVRTC through CuPy on first use and
launched on PyTorch's current stream (`cuda_launch`), so a CUDA graph captured by PyTorch records it.

Importing this module needs neither CuPy nor a GPU; `moe_gemm_cuda` imports CuPy when first
called and raises ImportError naming the install command when it is missing.
"""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trace_common.kernels.cuda_launch import compiled_function, launch_on_torch_stream

if TYPE_CHECKING:
    from trace_common.kernels.moe import ExpertWeights, FP4Rows, RoutePlan

SOURCE = pathlib.Path(__file__).with_name("cuda") / "moe_fp4.cu"

MMA_M = 16  # output features per A tile
MMA_N = 8  # token slots per B tile
MMA_K = 16  # k per tile == NVFP4 block: one e4m3 scale per row and k-tile
K_GROUP = 64  # k per packed 16-byte load (4 k-tiles)
LANES = 32
BLOCK_MS = (8, 16)  # token slots per expert block the kernel is built for (NT = 1, 2)
SMEM_LIMIT = 48 * 1024  # static shared memory of the split-K reduction

# Where each A-fragment register r (a0..a3) takes its bits in the packed word, for its low
# half (h = 0; add 16 for h = 1): the 3 magnitude bits (m, e0, e1) from MAG[r]..MAG[r]+2, the
# sign from SIGN[r]. They partition the 32 bits, and the kernel's `decode_word` turns them into
# fp16 bits with 1 (r = 0, 2: shift + mask) or 2-3 integer ops more (r = 1, 3).
PACK_MAG_BIT = (0, 3, 7, 10)
PACK_SIGN_BIT = (6, 15, 13, 14)


@dataclass(slots=True)
class PackedFP4:
    """Expert weights [E, N, K] in the kernel's layout: words int32 [E, N/16, K/64, 32, 4]
    (word q of lane l: the A fragment of k-tile q of the group) and scales int32
    [E, N/16, K/64, 8, 2] (for row group g: e4m3 bytes (row g, row g+8) of k-tiles 0..3)."""

    words: torch.Tensor
    scales: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.scales))


def _slot_lut(device: torch.device | str) -> torch.Tensor:
    """int64 [8, 16]: the packed-word bits of code c (0..15) in slot s = 2 r + h."""
    lut = torch.zeros(8, 16, dtype=torch.int64)
    for r in range(4):
        for h in range(2):
            for c in range(16):
                v = 0
                for b in range(3):  # m, e0, e1
                    v |= ((c >> b) & 1) << (PACK_MAG_BIT[r] + b + 16 * h)
                v |= ((c >> 3) & 1) << (PACK_SIGN_BIT[r] + 16 * h)
                lut[2 * r + h, c] = v
    return lut.to(device)


def _check_shape(n: int, k: int) -> None:
    if n % MMA_M or k % K_GROUP:
        raise ValueError(f"weights N={n}, K={k}: need N % {MMA_M} == 0 and K % {K_GROUP} == 0")


def pack_fp4_weights(codes: torch.Tensor, scales: torch.Tensor, chunk: int = 8) -> PackedFP4:
    """Repack NVFP4 codes uint8 [E, N, K/2] (element 2j in the low nibble of byte j) and e4m3
    block scales uint8 [E, N, K/16] into the kernel's layout (`chunk` experts at a time)."""
    e, n, half_k = codes.shape
    k = 2 * half_k
    _check_shape(n, k)
    if scales.shape != (e, n, k // MMA_K):
        raise ValueError(f"scales {tuple(scales.shape)} do not match codes {tuple(codes.shape)}")
    lut = _slot_lut(codes.device)
    slot = torch.arange(8, device=codes.device)
    words = torch.empty(e, n // MMA_M, k // K_GROUP, LANES, 4, dtype=torch.int32,
                        device=codes.device)  # fmt: skip
    for e0 in range(0, e, chunk):
        c = codes[e0 : e0 + chunk]
        nib = torch.stack((c & 15, c >> 4), dim=-1).reshape(c.shape[0], n, k)  # [e, N, K]
        # N = (tile, rhalf, g), K = (kg, q, khalf, t, h) -> [e, tile, kg, g, t, q, khalf, rhalf, h]
        nib = nib.reshape(-1, n // MMA_M, 2, 8, k // K_GROUP, 4, 2, 4, 2)
        nib = nib.permute(0, 1, 4, 3, 7, 5, 6, 2, 8).reshape(-1, n // MMA_M, k // K_GROUP,
                                                           LANES, 4, 8)  # fmt: skip
        # slot 2 r + h with r = 2 khalf + rhalf: a0 (g, 2t..), a1 (g+8, 2t..), a2 (g, 2t+8..), a3
        bits = lut[slot, nib.long()].sum(dim=-1)  # disjoint bits: sum == or
        words[e0 : e0 + chunk] = (bits - ((bits >> 31) << 32)).to(torch.int32)
    # scales: N = (tile, rhalf, g), K/16 = (kg, q) -> [e, tile, kg, g, q, rhalf] bytes
    s = scales.reshape(e, n // MMA_M, 2, 8, k // K_GROUP, 4).permute(0, 1, 4, 3, 5, 2)
    s = s.contiguous().reshape(e, n // MMA_M, k // K_GROUP, 8, 8).view(torch.int32)
    return PackedFP4(words, s)


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
# WK * KGW * 64 == K. Picked by `bench/rollout_gpu_kernels.py --cuda-sweep` on an H200
# (fastest summed over 1, 8, 32, 128 tokens of each block size; docs/benchmarks.md).
# TRACE_FP4_CUDA_CONFIGS=<json file> overrides them ({"K,block_m,gated": [RW, WK, KGW, MINB]}).
CONFIGS: dict[tuple[int, int, bool], tuple[int, int, int, int]] = {
    (2048, 8, True): (2, 16, 2, 2),
    (2048, 16, True): (2, 8, 4, 2),
    (768, 8, False): (4, 4, 3, 0),
    (768, 16, False): (4, 4, 3, 4),
}


def _configs() -> dict[tuple[int, int, bool], tuple[int, int, int, int]]:
    path = os.environ.get("TRACE_FP4_CUDA_CONFIGS")
    if not path:
        return CONFIGS
    raw = json.loads(pathlib.Path(path).read_text())
    out = dict(CONFIGS)
    for key, val in raw.items():
        k, bm, gated = key.split(",")
        out[(int(k), int(bm), gated == "True")] = tuple(int(v) for v in val)  # type: ignore[assignment]
    return out


def default_config(k: int, block_m: int, gated: bool) -> tuple[int, int, int, int]:
    """(RW, WK, KGW, MINB) of CONFIGS, or for another shape: split K into up to 8 warps."""
    configs = _configs()
    if (k, block_m, gated) in configs:
        return configs[(k, block_m, gated)]
    kg = k // K_GROUP
    for wk in (8, 4, 6, 2, 3, 1):
        if kg % wk == 0 and kg // wk <= 4:
            return (1 if gated else 2, wk, kg // wk, 0)
    return (1 if gated else 2, kg, 1, 0) if kg <= 16 else (1, 16, kg // 16, 0)


def _kernel(block_m: int, rw: int, wk: int, kgw: int, gated: bool, minb: int):
    """The compiled expert-GEMM instance for one launch configuration."""
    name = (f"moe_fp4_mma<{block_m // MMA_N}, {rw}, {wk}, {kgw}, {str(gated).lower()}, "
            f"{minb}>")  # fmt: skip
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
    config: tuple[int, int, int, int] | None = None,  # (RW, WK, KGW, MINB); default CONFIGS
) -> torch.Tensor:
    """`moe.moe_gemm` for packed weights and fp16-decoded activations (see module docstring)."""
    import numpy as np

    if w.packed is None:
        raise ValueError("weights are not packed for the CUDA kernel: pack_fp4_weights first")
    if a.dq16 is None:
        raise ValueError("activations lack dq16: quantize_rows(..., dq16=...) first")
    if plan.block_m not in BLOCK_MS:
        raise ValueError(f"plan.block_m={plan.block_m}; the CUDA kernel handles {BLOCK_MS}")
    n_out = w.n // 2 if gated else w.n
    rw, wk, kgw, minb = config or default_config(w.k, plan.block_m, gated)
    if (
        wk * kgw * K_GROUP != w.k
        or n_out % (MMA_M * rw)
        or smem_bytes(plan.block_m, rw, wk, gated) > SMEM_LIMIT
    ):
        raise ValueError(f"config RW={rw}, WK={wk}, KGW={kgw} does not fit N_out={n_out}, "
                         f"K={w.k}, block_m={plan.block_m}")  # fmt: skip
    n_pairs = plan.n_pairs
    if out is None:
        out = torch.empty(n_pairs, n_out, dtype=torch.bfloat16, device=plan.topk_w.device)
    fn = _kernel(plan.block_m, rw, wk, kgw, gated, minb)
    grid = (plan.block_expert.numel(), n_out // (MMA_M * rw))
    ptr = np.uint64
    args = (
        ptr(w.packed.words.data_ptr()), ptr(w.packed.scales.data_ptr()),
        ptr(w.scale_2.data_ptr()), ptr(a.dq16.data_ptr()), ptr(a.scale_2.data_ptr()),
        ptr(plan.sorted_pair.data_ptr()), ptr(plan.block_expert.data_ptr()),
        ptr(plan.topk_w.data_ptr()), ptr(out.data_ptr()),
        np.int32(n_pairs), np.int32(n_out), np.int32(a_div), np.int32(int(mul_route_w)),
    )  # fmt: skip
    launch_on_torch_stream(fn, grid, (wk * LANES,), args, out.device)
    return out


def block_m_for(n_pairs: int, num_experts: int) -> int:
    """Token slots per expert block for the CUDA kernel: 8 while a typical expert sees a few
    tokens (mean pairs per expert <= 3), else 16 (an expert with more takes several blocks)."""
    return 8 if n_pairs <= 3 * num_experts else 16


def smem_bytes(block_m: int, rw: int, wk: int, gated: bool) -> int:
    """Static shared memory of the kernel's split-K reduction (fp32 per fragment value)."""
    tiles = 2 * rw if gated else rw
    return wk * tiles * (block_m // MMA_N) * 4 * LANES * 4


__all__ = [
    "BLOCK_MS",
    "CONFIGS",
    "PackedFP4",
    "block_m_for",
    "decode_packed_reference",
    "dq16_permutation",
    "moe_gemm_cuda",
    "pack_fp4_weights",
    "smem_bytes",
]
