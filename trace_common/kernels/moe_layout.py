"""The routed experts' data on the GPU, shared by the Triton (`moe`) and CUDA (`cuda_moe`)
expert GEMMs: the routing plan and its block layout, expert weights (BF16, NVFP4 rows, or the
CUDA kernel's MMA-fragment layout made by `pack_fp4_weights`), and quantized activation rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trace_common.kernels.quant import check_buffer

MMA_M = 16  # output features per A tile
MMA_K = 16  # k per tile == NVFP4 block: one e4m3 scale per row and k-tile
K_GROUP = 64  # k per packed 16-byte load (4 k-tiles)
LANES = 32

# Where each A-fragment register r (a0..a3) takes its bits in the packed word, for its low
# half (h = 0; add 16 for h = 1): the 3 magnitude bits (m, e0, e1) from MAG[r]..MAG[r]+2, the
# sign from SIGN[r]. They partition the 32 bits, and the kernel's `decode_word` turns them into
# fp16 bits with 1 (r = 0, 2: shift + mask) or 2-3 integer ops more (r = 1, 3).
PACK_MAG_BIT = (0, 3, 7, 10)
PACK_SIGN_BIT = (6, 15, 13, 14)


def max_blocks(n_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on BM-row blocks: sum_e ceil(c_e / BM) <= P // BM + min(E, P)."""
    return n_pairs // block_m + min(num_experts, n_pairs)


@dataclass(slots=True)
class RoutePlan:
    """Routing of T tokens and its block layout for the grouped GEMM.

    topk_ids [T, k] int32, topk_w [T, k] fp32,
    sorted_pair [MAXB * BM] int32 (pair id, or T*k for padding), block_expert [MAXB] int32
    (-1 past the last block). Within an expert's blocks the pair order is arbitrary on the
    Triton path (atomic slots); `align_reference` orders them by (j, t)."""

    topk_ids: torch.Tensor
    topk_w: torch.Tensor
    sorted_pair: torch.Tensor
    block_expert: torch.Tensor
    block_m: int
    scratch: torch.Tensor | None = None  # int32 [2, E]: per-expert counters (zero) and starts

    @property
    def n_pairs(self) -> int:
        return self.topk_ids.numel()

    @classmethod
    def allocate(
        cls, t: int, num_experts: int, top_k: int, block_m: int, device: torch.device | str
    ) -> RoutePlan:
        """Buffers for T tokens (the Triton route path)."""
        maxb = max_blocks(t * top_k, num_experts, block_m)
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            torch.zeros(t, top_k, **i32),
            torch.zeros(t, top_k, dtype=torch.float32, device=device),
            torch.empty(maxb * block_m, **i32),
            torch.empty(maxb, **i32),
            block_m,
            torch.zeros(2, num_experts, **i32),
        )


@dataclass(slots=True)
class ExpertWeights:
    """One projection of all experts: BF16 [E, N, K], or NVFP4 codes uint8 [E, N, K/2] with
    e4m3 block scales uint8 [E, N, K/16] and a per-expert fp32 second-level scale [E]; the
    NVFP4 codes and scales may be held (also, or only) in the CUDA kernel's layout (`packed`)."""

    n: int
    k: int
    bf16: torch.Tensor | None = None
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    scale_2: torch.Tensor | None = None
    packed: PackedFP4 | None = None

    @property
    def is_fp4(self) -> bool:
        return self.codes is not None or self.packed is not None

    def nbytes(self) -> int:
        ts = (self.bf16,) if not self.is_fp4 else (self.codes, self.scales, self.scale_2)
        n = sum(t.numel() * t.element_size() for t in ts if t is not None)
        return n + (0 if self.packed is None else self.packed.nbytes())

    def pack_for_cuda_(self, *, keep_rows: bool = False) -> None:
        """Repack the NVFP4 codes/scales for the CUDA kernel (once, at load); drop the row
        layout unless `keep_rows` (then both GEMM implementations can run)."""
        if self.codes is None or self.scales is None:
            raise ValueError("pack_for_cuda_ needs NVFP4 weights in the row layout")
        self.packed = pack_fp4_weights(self.codes, self.scales)
        if not keep_rows:
            self.codes = self.scales = None


@dataclass(slots=True)
class FP4Rows:
    """Packed NVFP4 rows (per-row scale_2): codes [R, K/2], scales uint8 [R, K/16], g [R];
    dq16 fp16 [R, K] (optional): the same values decoded for the CUDA kernel (see
    `quant.quantize_rows`)."""

    codes: torch.Tensor
    scales: torch.Tensor
    scale_2: torch.Tensor
    dq16: torch.Tensor | None = None

    def check(self, rows: int, k: int, name: str) -> None:
        """Raise ValueError (naming `name`.field) unless these hold `rows` rows of `k` values."""
        check_buffer(f"{name}.codes", self.codes, torch.uint8, (rows, k // 2))
        check_buffer(f"{name}.scales", self.scales, torch.uint8, (rows, k // 16))
        check_buffer(f"{name}.scale_2", self.scale_2, torch.float32, (rows,))
        if self.dq16 is not None:
            check_buffer(f"{name}.dq16", self.dq16, torch.float16, (rows, k))


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


__all__ = [
    "K_GROUP",
    "LANES",
    "MMA_K",
    "MMA_M",
    "ExpertWeights",
    "FP4Rows",
    "PackedFP4",
    "RoutePlan",
    "max_blocks",
    "pack_fp4_weights",
]
