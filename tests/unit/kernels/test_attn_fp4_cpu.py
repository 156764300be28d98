"""The ring FP4 attention kernel's data movement, emulated lane by lane on the CPU
(trace_common/kernels/cuda/attn_fp4.cu, `attn_fp4_ring`): the cp.async stage layout (swizzled
code rows), each lane's shared-memory reads, the fp16 decode, the m16n8k16 fragment layouts of
the swapped products S^T = K Q^T and O^T = V^T P^T, and movmatrix. One 16-token tile must give
the exact scores and outputs, at the output positions the kernel's merge writes, and every
shared-memory read must be free of bank conflicts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_cuda_pack_cpu import E2M1_FP16_BITS, _fp4_bytes

from trace_common.fp4.constants import E2M1_VALUES

# stage layout of attn_fp4.cu
ST_KC, ST_VC, ST_KS, ST_KR, STAGE = 0, 1024, 2048, 2304, 2432


def ring_code_off(row: int, chunk: int) -> int:
    return (row >> 1) * 128 + ((((row & 1) << 2) | chunk) ^ (((row >> 1) & 3) << 1)) * 16


def byte_perm(x: int, y: int, sel: int) -> int:
    b = (x & 0xFFFFFFFF) | (y & 0xFFFFFFFF) << 32
    return sum(((b >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def f16(bits: int) -> float:
    return float(np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0])


def h2(x: int, high_bytes: bool) -> tuple[float, float]:
    """h2_b01 / h2_b23: two bytes of x as the high bytes of an fp16 pair (low half first)."""
    sh = 16 if high_bytes else 0
    return f16(((x >> sh) & 0xFF) << 8), f16(((x >> (sh + 8)) & 0xFF) << 8)


def e4m3(byte: int) -> float:
    return float(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float())


def words(buf: np.ndarray, off: int, n: int) -> list[int]:
    return [int(w) for w in buf[off : off + 4 * n].view(np.uint32)]


def values(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[16, 64] code bytes + [16, 8] e4m3 block scales -> [16, 128] values * 2**-14."""
    lut = np.array(E2M1_VALUES, dtype=np.float64)
    c = np.stack([codes & 0xF, codes >> 4], -1).reshape(16, 128)
    s = np.array([[e4m3(int(b)) for b in row] for row in scales]).repeat(16, 1)
    return lut[c] * s * 2.0**-14


def movmatrix_trans(regs: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """movmatrix.sync.aligned.m8n8.trans.b16: lane l holds row l >> 2, columns 2 (l & 3) and
    2 (l & 3) + 1 of an 8x8 matrix, before and after (of the transpose)."""
    m = np.zeros((8, 8))
    for lane, pair in enumerate(regs):
        m[lane >> 2, 2 * (lane & 3) : 2 * (lane & 3) + 2] = pair
    return [tuple(m.T[lane >> 2, 2 * (lane & 3) : 2 * (lane & 3) + 2]) for lane in range(32)]


@pytest.fixture(scope="module")
def tile():
    rng = np.random.default_rng(7)
    kc, vc = (rng.integers(0, 256, (16, 64), dtype=np.uint8) for _ in range(2))
    ks, vs = (rng.integers(0x30, 0x50, (16, 8), dtype=np.uint8) for _ in range(2))
    stage = np.zeros(STAGE, np.uint8)
    for lane in range(32):  # ring_fill
        for h in range(2):
            c = lane + 32 * h
            row, chunk = c >> 2, c & 3
            o = ring_code_off(row, chunk)
            stage[ST_KC + o : ST_KC + o + 16] = kc[row, 16 * chunk : 16 * chunk + 16]
            stage[ST_VC + o : ST_VC + o + 16] = vc[row, 16 * chunk : 16 * chunk + 16]
        src = ks if lane < 16 else vs
        stage[ST_KS + 8 * lane : ST_KS + 8 * lane + 8] = src[lane & 15]
    return dict(kc=kc, vc=vc, ks=ks, vs=vs, stage=stage)


def test_swizzle_is_a_permutation_of_chunks():
    offs = sorted(ring_code_off(r, c) for r in range(16) for c in range(4))
    assert offs == list(range(0, 1024, 16))


def _banks_free(addrs: list[int], width: int) -> bool:
    """One warp-wide shared load of `width` bytes per lane: each phase (128 bytes of lanes)
    touches every 4-byte bank at most once."""
    per = 128 // width
    for p in range(0, 32, per):
        banks = [(a // 4 + i) % 32 for a in addrs[p : p + per] for i in range(width // 4)]
        if len(set(banks)) != len(banks):
            return False
    return True


def test_shared_reads_are_bank_conflict_free():
    lanes = [(lane >> 2, lane & 3) for lane in range(32)]
    for extra in (0, 512):  # K rows g and g + 8 (16 bytes each)
        assert _banks_free([ring_code_off(g, t) + extra for g, t in lanes], 16)
    for row_of in (lambda t: 2 * t, lambda t: 2 * t + 1, lambda t: 2 * t + 8, lambda t: 2 * t + 9):
        addrs = [ring_code_off(row_of(t), g >> 1) + 8 * (g & 1) for g, t in lanes]
        assert _banks_free(addrs, 8), "V reads (8 bytes, rows 2t..)"
    # the unswizzled layout would conflict 4-way on V: the test can fail
    assert not _banks_free([128 * t + 16 * (g >> 1) + 8 * (g & 1) for g, t in lanes], 8)


def test_scores_tile_exact(tile):
    """S^T = K Q^T from the lanes' A (K) and B (Q) fragments equals the plain dot products."""
    st, g_ = tile["stage"], np.random.default_rng(1)
    q = g_.standard_normal((8, 128)).astype(np.float16).astype(np.float64)
    a = np.zeros((8, 16, 16))  # k-tile, row (token), col (k)
    b = np.zeros((8, 16, 8))  # k-tile, k, col (head)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        k0 = words(st, ST_KC + ring_code_off(g, t), 4)
        k1 = words(st, ST_KC + ring_code_off(g, t) + 512, 4)
        s0 = [e4m3(int(x)) for x in st[ST_KS + 8 * g + 2 * t : ST_KS + 8 * g + 2 * t + 2]]
        s1 = [e4m3(int(x)) for x in st[ST_KS + 8 * (g + 8) + 2 * t :][:2]]
        f = q[g, 32 * t : 32 * t + 32]
        for w in range(4):
            lo0, hi0 = _fp4_bytes(k0[w])
            lo1, hi1 = _fp4_bytes(k1[w])
            sc0, sc1 = s0[w >= 2], s1[w >= 2]
            for kt, (x0, x1) in ((2 * w, (lo0, lo1)), (2 * w + 1, (hi0, hi1))):
                for row, x, sc in ((g, x0, sc0), (g + 8, x1, sc1)):
                    a[kt, row, 2 * t : 2 * t + 2] = np.array(h2(x, False)) * sc  # a0 / a1
                    a[kt, row, 2 * t + 8 : 2 * t + 10] = np.array(h2(x, True)) * sc  # a2 / a3
            # load_q_frags: k-tile 2w: (f0, f2 | f4, f6); 2w+1: (f1, f3 | f5, f7) of 8-group w
            for kt, o in ((2 * w, 0), (2 * w + 1, 1)):
                b[kt, 2 * t : 2 * t + 2, g] = f[8 * w + o : 8 * w + o + 4 : 2]
                b[kt, 2 * t + 8 : 2 * t + 10, g] = f[8 * w + o + 4 : 8 * w + o + 8 : 2]
    s_t = np.einsum("krc,kcn->rn", a, b)
    ref = values(tile["kc"], tile["ks"]) @ q.T  # [token, head]
    np.testing.assert_allclose(s_t, ref, rtol=1e-12, atol=1e-18)


def test_pv_tile_exact(tile):
    """O^T = V^T P^T from the lanes' V A-fragments and the movmatrix-transposed P^T equals the
    plain product, at d = 16g + 2mt (+1 for rows g + 8), the positions the merge writes."""
    st, g_ = tile["stage"], np.random.default_rng(2)
    p = g_.random((16, 8)).astype(np.float16).astype(np.float64)  # [token, head]
    # P packed in the S^T accumulator layout (lane (g, t): tokens g | g + 8, heads 2t, 2t + 1),
    # then movmatrix.trans of each half gives the B fragments b0 / b1 of P^T
    pb0 = movmatrix_trans(
        [(p[ln >> 2, 2 * (ln & 3)], p[ln >> 2, 2 * (ln & 3) + 1]) for ln in range(32)]
    )
    pb1 = movmatrix_trans([(p[8 + (ln >> 2), 2 * (ln & 3)], p[8 + (ln >> 2), 2 * (ln & 3) + 1])
                           for ln in range(32)])  # fmt: skip
    bmat = np.zeros((16, 8))  # B[k = token, n = head] as the mma reads the fragments
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        bmat[2 * t : 2 * t + 2, g] = pb0[lane]
        bmat[2 * t + 8 : 2 * t + 10, g] = pb1[lane]
    assert np.array_equal(bmat, p)
    acc = np.zeros((8, 16, 8))  # m-tile, row (d), col (head)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        off0 = ring_code_off(2 * t, g >> 1) + 8 * (g & 1)
        off1 = ring_code_off(2 * t + 1, g >> 1) + 8 * (g & 1)
        w = [words(st, ST_VC + o, 2) for o in (off0, off1, off0 + 512, off1 + 512)]
        vsc = ST_KS + 128 + 16 * t + g
        sv0 = np.array([e4m3(int(st[vsc])), e4m3(int(st[vsc + 8]))])
        sv1 = np.array([e4m3(int(st[vsc + 64])), e4m3(int(st[vsc + 72]))])
        a = np.zeros((8, 16, 16))
        for k in range(2):
            for h in range(2):
                sel = 0x7362 if h else 0x5140
                lo0, hi0 = _fp4_bytes(byte_perm(w[0][k], w[1][k], sel))
                lo1, hi1 = _fp4_bytes(byte_perm(w[2][k], w[3][k], sel))
                mt = 2 * (2 * k + h)
                for e in range(2):  # e = 0: h2_b01, e = 1: h2_b23
                    a[mt + e, g, 2 * t : 2 * t + 2] = np.array(h2(lo0, e == 1)) * sv0
                    a[mt + e, g + 8, 2 * t : 2 * t + 2] = np.array(h2(hi0, e == 1)) * sv0
                    a[mt + e, g, 2 * t + 8 : 2 * t + 10] = np.array(h2(lo1, e == 1)) * sv1
                    a[mt + e, g + 8, 2 * t + 8 : 2 * t + 10] = np.array(h2(hi1, e == 1)) * sv1
        # each lane fills only its own fragment entries of A: sum the lanes' parts
        acc += np.einsum("mrk,kn->mrn", a, bmat)
    o_ref = p.T @ values(tile["vc"], tile["vs"])  # [head, d]
    got = np.zeros((8, 128))
    for mt in range(8):
        for r in range(16):
            got[:, 16 * (r % 8) + 2 * mt + (r >= 8)] = acc[mt, r]
    np.testing.assert_allclose(got, o_ref, rtol=1e-12, atol=1e-18)


def test_fp16_decode_table_matches_values():
    """The emulation's decode path agrees with E2M1_FP16_BITS (shared with the GEMM tests)."""
    for c in range(16):
        w = c * 0x11111111
        lo, _ = _fp4_bytes(w)
        assert (lo & 0xFF) << 8 == E2M1_FP16_BITS[c]


def test_kernel_name_configs():
    from trace_common.kernels.cuda_attn import kernel_name

    assert kernel_name(("ring", 4, 4, 4)) == ("attn_fp4_ring<4, 4, 4>", 4)
    for bad in (("ring", 4, 4, 1), ("ring", 4, 4), ("flash", 4, 3), ("regs", 4, 3)):
        with pytest.raises(ValueError, match="CUDA FP4 attention config"):
            kernel_name(bad)


def test_attn_config_from_settings():
    """KernelSettings.attn_config replaces the launch configuration used where none is given
    (checked as kernel_name checks it); None: DEFAULT_CONFIG. parse_config reads the comma
    form."""
    from trace_common.kernels import cuda_attn
    from trace_common.kernels.settings import KernelSettings

    assert cuda_attn.default_config() == cuda_attn.DEFAULT_CONFIG
    try:
        KernelSettings(attn_config=cuda_attn.parse_config("ring, 4, 2, 5")).apply()
        assert cuda_attn.default_config() == ("ring", 4, 2, 5)
        assert cuda_attn.ring_ctas_per_sm() == 2
    finally:
        KernelSettings().apply()
    assert cuda_attn.default_config() == cuda_attn.DEFAULT_CONFIG
    for bad in ("ring,4,4,x", "ring,4,4,1", "ring,4,4", "warp,1", ","):
        with pytest.raises(ValueError, match="attention launch config"):
            cuda_attn.parse_config(bad)
    with pytest.raises(ValueError, match="CUDA FP4 attention config"):
        KernelSettings(attn_config=("ring", 4, 4, 1))
