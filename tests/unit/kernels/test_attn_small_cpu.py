"""The fused BF16 decode attention kernel's fragment layouts, emulated lane by lane on the CPU
(trace_common/kernels/cuda/attn_small.cu, `attn_bf16_fused`): each lane's 16-byte loads of K,
Q and V, the m16n8k16 fragments of the swapped products S^T = K Q^T and O^T = V^T P^T (words
paired by PRMT), and the d positions its merge writes. One 16-token tile must give the exact
scores and outputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_attn_fp4_cpu import byte_perm, movmatrix_trans


def bf16_words(x: torch.Tensor) -> np.ndarray:
    """bf16 [..., 2n] -> uint32 [..., n] (element 2i in the low half), as the kernel loads."""
    return x.contiguous().view(torch.int32).numpy().view(np.uint32)


def halves(w: int) -> tuple[float, float]:
    """(low, high) bf16 halves of a 32-bit word as floats."""
    t = torch.tensor([w & 0xFFFF, w >> 16], dtype=torch.int32).to(torch.int16)
    return tuple(float(v) for v in t.view(torch.bfloat16).float())  # type: ignore[return-value]


@pytest.fixture(scope="module")
def tile():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(16, 128, generator=g).bfloat16()
    v = torch.randn(16, 128, generator=g).bfloat16()
    q = torch.randn(8, 128, generator=g).bfloat16()
    return k, v, q


def test_scores_tile_exact(tile):
    """S^T from the lanes' K A-fragments and Q B-fragments equals K Q^T (all 16 tokens x 8
    heads): lane (g, t) loads d = 32c + 8t .. + 8 of K rows g, g + 8 and of Q row g; words
    (x, y) feed one MMA, (z, w) the next."""
    k, _, q = tile
    kw, qw = bf16_words(k), bf16_words(q)  # [16, 64], [8, 64]
    s_t = np.zeros((16, 8))
    for c in range(4):
        for m in range(2):
            a = np.zeros((16, 16))
            b = np.zeros((16, 8))
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                base = (32 * c + 8 * t) // 2 + 2 * m  # word index of (x | z)
                a[g, 2 * t : 2 * t + 2] = halves(int(kw[g, base]))  # a0
                a[g + 8, 2 * t : 2 * t + 2] = halves(int(kw[g + 8, base]))  # a1
                a[g, 2 * t + 8 : 2 * t + 10] = halves(int(kw[g, base + 1]))  # a2
                a[g + 8, 2 * t + 8 : 2 * t + 10] = halves(int(kw[g + 8, base + 1]))  # a3
                b[2 * t : 2 * t + 2, g] = halves(int(qw[g, base]))  # b0
                b[2 * t + 8 : 2 * t + 10, g] = halves(int(qw[g, base + 1]))  # b1
            s_t += a @ b
    ref = k.double().numpy() @ q.double().numpy().T
    np.testing.assert_allclose(s_t, ref, rtol=1e-12, atol=1e-12)


def test_pv_tile_exact(tile):
    """O^T = V^T P^T from the lanes' V words paired by PRMT (0x5410: the low halves of tokens
    2t, 2t+1 -> rows d; 0x7632: the high halves -> rows d + 1) and the movmatrix-transposed
    P^T equals P^T V, at d = 8g + 2 (mt & 3) + 64 (mt >> 2) (+1 for rows g + 8)."""
    _, v, _ = tile
    p = torch.rand(16, 8, generator=torch.Generator().manual_seed(1)).bfloat16().double()
    p = p.numpy()  # [token, head]
    pb0 = movmatrix_trans([(p[ln >> 2, 2 * (ln & 3)], p[ln >> 2, 2 * (ln & 3) + 1])
                           for ln in range(32)])  # fmt: skip
    pb1 = movmatrix_trans([(p[8 + (ln >> 2), 2 * (ln & 3)], p[8 + (ln >> 2), 2 * (ln & 3) + 1])
                           for ln in range(32)])  # fmt: skip
    bmat = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        bmat[2 * t : 2 * t + 2, g] = pb0[lane]
        bmat[2 * t + 8 : 2 * t + 10, g] = pb1[lane]
    assert np.array_equal(bmat, p)
    vw = bf16_words(v)  # [16, 64]
    got = np.zeros((8, 128))  # [head, d]
    for mt in range(8):
        h, w = mt >> 2, mt & 3
        a = np.zeros((16, 16))
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            word = (8 * g + 64 * h) // 2 + w
            v0, v1, v2, v3 = (int(vw[tok, word]) for tok in (2 * t, 2 * t + 1, 2 * t + 8,
                                                             2 * t + 9))  # fmt: skip
            a[g, 2 * t : 2 * t + 2] = halves(byte_perm(v0, v1, 0x5410))  # a0
            a[g + 8, 2 * t : 2 * t + 2] = halves(byte_perm(v0, v1, 0x7632))  # a1
            a[g, 2 * t + 8 : 2 * t + 10] = halves(byte_perm(v2, v3, 0x5410))  # a2
            a[g + 8, 2 * t + 8 : 2 * t + 10] = halves(byte_perm(v2, v3, 0x7632))  # a3
        acc = a @ bmat  # [row, head]
        for r in range(16):
            d = 8 * (r % 8) + 2 * w + 64 * h + (r >= 8)
            got[:, d] = acc[r]
    ref = p.T @ v.double().numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_fused_kernel_names():
    from trace_common.kernels.cuda_attn import fused_bf16_warps, kernel_name

    assert kernel_name(("ring", 4, 4, 4), fused=True) == ("attn_fp4_ring<4, 4, 4, true>", 4)
    assert kernel_name(("ring", 4, 4, 4)) == ("attn_fp4_ring<4, 4, 4>", 4)
    assert [fused_bf16_warps(c) for c in (16, 32, 64, 128, 512)] == [1, 2, 4, 4, 4]


def test_fused_plan_chunks():
    """The fused plan splits by the wave rule for the fused kernels' resident CTAs, at least
    FUSED_MIN_CHUNK keys: at 1K context and batch 1, 128-token splits (the wave rule's 64
    raised; 9 x 4 kv heads = 36 CTAs); at 32K (more splits than FUSED_MAX_SPLITS) or not asked
    for: split + reduce (no counters)."""
    from trace_common.kernels import attention as attn

    kw = dict(batch=1, q_heads=32, kv_heads=4, capacity=1100, head_dim=128, context_hint=1024,
              device="cpu")  # fmt: skip
    for fp4 in (False, True):
        plan = attn.DecodeAttnPlan.make(**kw, cuda_fp4=fp4, fused=True)
        assert plan.chunk == 128 and plan.counters is not None
        assert plan.counters.shape == (4,) and plan.counters.dtype == torch.int32
    long = dict(kw, capacity=33000, context_hint=32768)  # > FUSED_MAX_SPLITS: split + reduce
    assert attn.DecodeAttnPlan.make(**long, fused=True).counters is None
    assert attn.DecodeAttnPlan.make(**kw).counters is None


def test_fused_enabled_rule(monkeypatch):
    """The small-batch step's attention is fused, and the standard step's for a BF16 cache from
    FUSED_BF16_MIN_CONTEXT tokens (CuPy present); nothing without CuPy."""
    from trace_common.kernels import cuda_attn

    monkeypatch.setattr(cuda_attn, "cupy_available", lambda: True)
    long, short = cuda_attn.FUSED_BF16_MIN_CONTEXT, cuda_attn.FUSED_BF16_MIN_CONTEXT - 1
    assert cuda_attn.fused_enabled() and cuda_attn.fused_enabled(fp4=True, context=short)
    assert cuda_attn.fused_enabled(small_batch=False, context=long)
    assert not cuda_attn.fused_enabled(small_batch=False, context=short)
    assert not cuda_attn.fused_enabled(small_batch=False, fp4=True, context=long)
    monkeypatch.setattr(cuda_attn, "cupy_available", lambda: False)
    assert not cuda_attn.fused_enabled()
