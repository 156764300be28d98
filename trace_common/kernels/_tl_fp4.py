"""Triton building blocks of the NVFP4 numerics, and the quantize(+capture, +KV append) kernel.

Bit-exact with `trace_common.fp4.nvfp4` (ModelOpt's convention):
- every fp32 divide is `div_rn` (IEEE round-to-nearest; Triton's `/` is an approximate
  `div.full.f32`, which would flip ties);
- the e4m3 cast of a block scale is done by integer RNE on the fp32 bits (normals) and by an
  exact RNE of s * 2**9 (subnormals), not by a hardware/emulated float8 conversion, so the
  result does not depend on the Triton version's fp8 lowering;
- E2M1 encoding counts the RNE boundaries exactly as `e2m1.f32_to_e2m1` does.

Imports Triton at module import: load it through `trace_common.kernels.load_kernels`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from trace_common.fp4.constants import (
    F4_E2M1_MAX,
    F8E4M3_MAX,
    NVFP4_BLOCK_SCALE_MIN,
    NVFP4_BLOCK_SIZE,
)

# Named constants as Triton compile-time values (same numbers as trace_common.fp4.constants).
E2M1_MAX = tl.constexpr(F4_E2M1_MAX)  # 6.0
SCALE2_DIVISOR = tl.constexpr(F4_E2M1_MAX * F8E4M3_MAX)  # 2688.0 = 6 * 448
BLOCK_SCALE_MIN = tl.constexpr(NVFP4_BLOCK_SCALE_MIN)  # 2**-9
BLOCK_SCALE_MAX = tl.constexpr(F8E4M3_MAX)  # 448.0
BLOCK = tl.constexpr(NVFP4_BLOCK_SIZE)  # 16
E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)  # 0b0_0001_000
E4M3_SUBNORMAL_STEP = tl.constexpr(2.0**-9)  # 0b0_0000_001
E4M3_SUBNORMAL_INV_STEP = tl.constexpr(512.0)  # 2**9
# fp32 -> e4m3 keeps 3 of 23 mantissa bits: RNE on the low 20 bits.
F32_TO_E4M3_DROP_BITS = tl.constexpr(20)
F32_TO_E4M3_HALF_MINUS_1 = tl.constexpr((1 << 19) - 1)  # 0x7FFFF
F32_TO_E4M3_KEEP_MASK = tl.constexpr(-(1 << 20))  # ~0xFFFFF as int32
E4M3_EXP_BIAS_DELTA = tl.constexpr(127 - 7)  # fp32 bias 127, e4m3 bias 7


@triton.jit
def e4m3_round(s):
    """RNE of positive fp32 `s` in [2**-9, 448] onto the e4m3fn grid.

    Returns (value fp32, exactly the e4m3 value; bits int32, the e4m3fn byte)."""
    bits = s.to(tl.int32, bitcast=True)
    lsb = (bits >> F32_TO_E4M3_DROP_BITS) & 1
    rn = (bits + F32_TO_E4M3_HALF_MINUS_1 + lsb) & F32_TO_E4M3_KEEP_MASK
    val_n = rn.to(tl.float32, bitcast=True)
    byte_n = ((((rn >> 23) & 0xFF) - E4M3_EXP_BIAS_DELTA) << 3) | ((rn >> 20) & 7)
    q = s * E4M3_SUBNORMAL_INV_STEP  # exact (power of two); q in [1, 8) for subnormals
    fl = q.to(tl.int32)  # floor, q >= 0
    frac = q - fl.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((fl & 1) == 1))
    k = fl + up.to(tl.int32)  # 1..8; 8 is 2**-6 = byte 0x08, the smallest normal
    val_s = k.to(tl.float32) * E4M3_SUBNORMAL_STEP
    is_sub = s < E4M3_MIN_NORMAL
    return tl.where(is_sub, val_s, val_n), tl.where(is_sub, k, byte_n)


@triton.jit
def e4m3_to_f32(b):
    """e4m3fn byte (int32 0..255, non-negative scales only) -> fp32 value."""
    e = (b >> 3) & 15
    m = b & 7
    normal = ((e + E4M3_EXP_BIAS_DELTA) << 23) | (m << 20)
    return tl.where(
        e == 0, m.to(tl.float32) * E4M3_SUBNORMAL_STEP, normal.to(tl.float32, bitcast=True)
    )


@triton.jit
def f32_to_e2m1(y):
    """E2M1 codes (int32 0..15) of scaled fp32 values: RNE, saturating, sign in bit 3."""
    a = tl.abs(y)
    c = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    return c | tl.where(y < 0, 8, 0)


@triton.jit
def e2m1_to_f32(c):
    """E2M1 codes (int32 0..15) -> fp32 values (code 0b1000 gives +0.0, as the reference)."""
    e = (c >> 1) & 3
    m = c & 1
    mag = tl.where(e > 0, ((e + 126) << 23) | (m << 22), tl.where(m == 1, 126 << 23, 0))
    sign = tl.where((c & 7) != 0, (c >> 3) << 31, 0)
    return (mag | sign).to(tl.float32, bitcast=True)


# fp16 bit trick for E2M1 -> fp16: the 3 magnitude bits e1 e0 m go to fp16 bits 11..9 (the two
# low exponent bits and the top mantissa bit), the sign to bit 15. The result is the code's value
# times 2**-14 (code 0b001 becomes the fp16 subnormal 2**-15 = 0.5 * 2**-14), so decoding costs
# a few integer ops per element; the 2**-14 is folded into the fp32 epilogue (FP16_DECODE_GAIN).
E2M1_FP16_MAG_SHIFT = tl.constexpr(9)
E2M1_FP16_SIGN_SHIFT = tl.constexpr(12)
FP16_DECODE_GAIN = tl.constexpr(16384.0)  # 2**14
FP16_DECODE_INV = tl.constexpr(1.0 / 16384.0)  # 2**-14


@triton.jit
def dequant_tile_f16(packed, scale_bytes, R: tl.constexpr, K: tl.constexpr):
    """Packed codes uint8 [R, K/2] and e4m3 block-scale bytes [R, K/16] -> fp16 [R, K] holding
    code * block_scale * 2**-14, exactly: code * e4m3 scale has <= 6 significant bits and is a
    multiple of 2**-24 (fp16's smallest subnormal), at most 6 * 448 * 2**-14 < 0.17. The caller
    multiplies the fp32 accumulator by FP16_DECODE_GAIN and the fp32 second-level scale."""
    p = packed.to(tl.int16)
    lo = ((p & 7) << E2M1_FP16_MAG_SHIFT) | ((p & 8) << E2M1_FP16_SIGN_SHIFT)
    hi = ((p & 0x70) << (E2M1_FP16_MAG_SHIFT - 4)) | ((p & 0x80) << (E2M1_FP16_SIGN_SHIFT - 4))
    v = tl.interleave(lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True))
    s = e4m3_to_f32(scale_bytes.to(tl.int32)).to(tl.float16)  # exact: e4m3 is a subset of fp16
    v3 = tl.reshape(v, [R, K // 16, 16]) * s[:, :, None]
    return tl.reshape(v3, [R, K])


@triton.jit
def row_scale_2(x):
    """Per-row second-level scale of fp32 `x` (a whole row, zeros past its end): amax / 2688,
    1.0 for an all-zero row (NVFP4_ZERO_AMAX_SCALE_2)."""
    g = tl.math.div_rn(tl.max(tl.abs(x), axis=0), SCALE2_DIVISOR)
    return tl.where(g == 0.0, 1.0, g)


@triton.jit
def quantize_store_row(
    x,  # fp32 [BLOCK_C]: the row, zeros past C
    g,  # fp32 scalar: its scale_2
    r,  # int64 row index (records, dq16, row layout; KV_APPEND: r = kv * B + b)
    pos,  # int64 cache position (KV_APPEND; else unused)
    seq_cap,  # S (KV_APPEND)
    codes_ptr, scale_ptr, g_out_ptr, mbits_ptr, rec_scale_ptr, rec_g_ptr, dq_ptr,
    C: tl.constexpr, BLOCK_C: tl.constexpr, SEG: tl.constexpr, KV_APPEND: tl.constexpr,
    CAPTURE: tl.constexpr, DQ16: tl.constexpr,
):  # fmt: skip
    """NVFP4-quantize one row held in registers and store codes, e4m3 block scales and
    scale_2 (row layout, or the FP4 KV cache at `pos`), the dq16 operand and the compact
    record: the body of `nvfp4_quant_kernel` (see its pointer comments), shared with the fused
    kernels of `_tl_fused`. Every step is elementwise or a max, so the result does not depend
    on how the row is laid out over threads."""
    NB: tl.constexpr = BLOCK_C // BLOCK
    xb = tl.reshape(x, [NB, BLOCK])  # [NB, 16]
    block_amax = tl.max(tl.abs(xb), axis=1)  # [NB]
    six_g = tl.zeros([NB], tl.float32) + E2M1_MAX * g  # fp32 product first, as the reference
    s = tl.math.div_rn(block_amax, six_g)
    s = tl.where(s == 0.0, 1.0, s)  # all-zero block: NVFP4_ZERO_BLOCK_SCALE
    s = tl.minimum(tl.maximum(s, BLOCK_SCALE_MIN), BLOCK_SCALE_MAX)
    s_val, s_byte = e4m3_round(s)
    divisor = tl.broadcast_to((s_val * g)[:, None], [NB, BLOCK])  # fp32 block * scale_2
    codes = f32_to_e2m1(tl.math.div_rn(xb, divisor))  # [NB, 16] int32
    if DQ16:  # the CUDA expert GEMM's B operand: exact in fp16 (see cuda/moe_fp4.cu)
        kk = tl.arange(0, BLOCK)
        perm = ((kk % 8) // 2) * 4 + (kk // 8) * 2 + kk % 2  # lane quad t: 2t, 2t+1, 2t+8, 2t+9
        jd = tl.arange(0, NB)
        dq = e2m1_to_f32(codes) * s_val[:, None] * FP16_DECODE_INV
        tl.store(dq_ptr + r * C + jd[:, None] * BLOCK + perm[None, :], dq.to(tl.float16),
                 mask=(jd < C // BLOCK)[:, None])  # fmt: skip
    codes = tl.reshape(codes, [BLOCK_C // 2, 2])
    lo, hi = tl.split(codes)
    packed = (lo | (hi << 4)).to(tl.uint8)  # [BLOCK_C/2]
    jc = tl.arange(0, BLOCK_C // 2)
    jb = tl.arange(0, NB)
    if KV_APPEND:
        NSEG: tl.constexpr = C // SEG
        seg_c = jc // (SEG // 2)
        code_off = ((r * NSEG + seg_c) * seq_cap + pos) * (SEG // 2) + jc % (SEG // 2)
        seg_b = jb // (SEG // BLOCK)
        scale_off = ((r * NSEG + seg_b) * seq_cap + pos) * (SEG // BLOCK) + jb % (SEG // BLOCK)
        g_off = r * seq_cap + pos
    else:
        code_off = r * (C // 2) + jc
        scale_off = r * (C // BLOCK) + jb
        g_off = r
    tl.store(codes_ptr + code_off, packed, mask=jc < C // 2)
    tl.store(scale_ptr + scale_off, s_byte.to(tl.uint8), mask=jb < C // BLOCK)
    tl.store(g_out_ptr + g_off, g)
    if CAPTURE:
        # byte j holds elements 8j..8j+7: lo[4j+i] is element 8j+2i (bit 2i), hi[4j+i] is
        # element 8j+2i+1 (bit 2i+1); the bits are disjoint, so their sum is their OR.
        shift = 2 * tl.arange(0, 4)
        m_lo = tl.reshape(lo & 1, [BLOCK_C // 8, 4])
        m_hi = tl.reshape(hi & 1, [BLOCK_C // 8, 4])
        byte = tl.sum((m_lo << shift[None, :]) + (m_hi << (shift[None, :] + 1)), axis=1)
        jm = tl.arange(0, BLOCK_C // 8)
        tl.store(mbits_ptr + r * (C // 8) + jm, byte.to(tl.uint8), mask=jm < C // 8)
        tl.store(rec_scale_ptr + r * (C // BLOCK) + jb, s_byte.to(tl.uint8), mask=jb < C // BLOCK)
        tl.store(rec_g_ptr + r, g)


@triton.jit
def nvfp4_quant_kernel(
    x_ptr,  # [R, C] fp32/bf16/fp16, row stride x_row_stride
    x_row_stride,
    g_in_ptr,  # fp32: given scale_2, [1] (per tensor) or [R] (GIVEN_ROWS)
    codes_ptr,  # uint8 out: [R, C/2] or the FP4 KV cache codes [2, B, NSEG, S, SEG/2]
    scale_ptr,  # uint8 out (e4m3 bits): [R, C/16] or the cache scales [2, B, NSEG, S, SEG/16]
    g_out_ptr,  # fp32 out: the scale_2 used, [R] or the cache row scales [2, B, S]
    mbits_ptr,  # uint8 out (CAPTURE): [R, C/8] mantissa bits, element i -> bit i % 8
    rec_scale_ptr,  # uint8 out (CAPTURE): [R, C/16]
    rec_g_ptr,  # fp32 out (CAPTURE): [R]
    dq_ptr,  # fp16 out (DQ16): [R, C] code * block scale * 2**-14, B-fragment order per block
    pos_ptr,  # int32 [B] (KV_APPEND): cache position each sequence writes at
    n_seq,  # B (KV_APPEND): rows are (kv, b) = (r // B, r % B)
    seq_cap,  # S (KV_APPEND): cache capacity in tokens
    C: tl.constexpr,
    BLOCK_C: tl.constexpr,  # next power of two >= C
    SEG: tl.constexpr,  # KV_APPEND: elements per head (row = NSEG heads of SEG)
    PER_ROW: tl.constexpr,  # scale_2 = amax of the row / 2688 (else given)
    GIVEN_ROWS: tl.constexpr,  # given scale_2 per row (else one for all rows)
    KV_APPEND: tl.constexpr,
    CAPTURE: tl.constexpr,
    DQ16: tl.constexpr,
):
    """One program quantizes one row of C elements (NVFP4, blocks of 16 along the row)."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    x = tl.load(x_ptr + r * x_row_stride + cols, mask=cols < C, other=0.0).to(tl.float32)
    if PER_ROW:
        g = row_scale_2(x)
    elif GIVEN_ROWS:
        g = tl.load(g_in_ptr + r)
    else:
        g = tl.load(g_in_ptr)
    if KV_APPEND:  # noqa: SIM108 - constexpr branch, one side compiled
        pos = tl.load(pos_ptr + r % n_seq).to(tl.int64)
    else:
        pos = r  # unused
    quantize_store_row(x, g, r, pos, seq_cap, codes_ptr, scale_ptr, g_out_ptr, mbits_ptr,
                       rec_scale_ptr, rec_g_ptr, dq_ptr, C, BLOCK_C, SEG, KV_APPEND, CAPTURE,
                       DQ16)  # fmt: skip


# One 32-bit word holds 8 E2M1 codes (element i in nibble i). For j = 0..3 the word shifted
# right by 4j has element j in bits 0..3 and element j+4 in bits 16..19, so one shift, one
# mask, two shifts and one LOP3 build the fp16x2 pair (element j, element j+4) with the bit
# trick above, and one mul.f16x2 applies the block scale: ~3 instructions per element.
def _decode_word_asm() -> str:
    """The PTX the comment above describes: per pair j, t = word >> 4j, the bit trick, the scale."""
    steps = []
    for j in range(4):
        load = "mov.b32 t, $8;" if j == 0 else f"shr.u32 t, $8, {4 * j};"
        steps.append(
            f"{load}\nshl.b32 u, t, 9;\nand.b32 v, t, 0x00080008;\nshl.b32 v, v, 12;\n"
            f"lop3.b32 u, u, v, 0x0E000E00, 0xEC;\nmul.rn.f16x2 u, u, s2;\n"
            f"mov.b32 {{${j}, ${j + 4}}}, u;\n"
        )
    return "\n{\n.reg .b32 t, u, v, s2;\nmov.b32 s2, $9;\n" + "".join(steps) + "}\n"


_DECODE_WORD_ASM = tl.constexpr(_decode_word_asm())


@triton.jit
def dequant_words_f16(words, scale_bytes, R: tl.constexpr, K: tl.constexpr):
    """Same result as `dequant_tile_f16`, from the codes viewed as int32 words [R, K/8] (8
    codes per word), decoded with inline PTX (Hopper/any sm_80+; not the interpreter)."""
    s = e4m3_to_f32(scale_bytes.to(tl.int32)).to(tl.float16)  # [R, K/16]
    s_bits = s.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    s2 = s_bits | (s_bits << 16)  # the scale as fp16x2
    s_w = tl.reshape(tl.broadcast_to(s2[:, :, None], [R, K // 16, 2]), [R, K // 8])
    o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
        _DECODE_WORD_ASM,
        "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
        [words, s_w],
        dtype=(tl.float16,) * 8,
        is_pure=True,
        pack=1,
    )
    # join appends a minor dim: [.., p, q, r] flattens to element 4p + 2q + r of the word
    even = tl.join(tl.join(o0, o4), tl.join(o2, o6))
    odd = tl.join(tl.join(o1, o5), tl.join(o3, o7))
    return tl.reshape(tl.join(even, odd), [R, K])


@triton.jit
def load_fp4_tile(
    codes_ptr,  # uint8 codes (WORDS False) or the same memory viewed as int32 words
    scale_ptr,  # uint8 e4m3 block scales
    rows,  # int64 [R] row indices (row length K_ROW elements)
    mask,  # bool [R] (used when HAS_MASK)
    k0,  # first element of the tile along the row
    R: tl.constexpr,
    BK: tl.constexpr,
    K_ROW: tl.constexpr,
    WORDS: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """Load and decode an FP4 tile [R, BK] -> fp16 (code * block scale * 2**-14)."""
    ks = tl.arange(0, BK // 16)
    s_off = rows[:, None] * (K_ROW // 16) + k0 // 16 + ks[None, :]
    if WORDS:
        kw = tl.arange(0, BK // 8)
        c_off = rows[:, None] * (K_ROW // 8) + k0 // 8 + kw[None, :]
    else:
        kh = tl.arange(0, BK // 2)
        c_off = rows[:, None] * (K_ROW // 2) + k0 // 2 + kh[None, :]
    if HAS_MASK:
        c = tl.load(codes_ptr + c_off, mask=mask[:, None], other=0)
        s = tl.load(scale_ptr + s_off, mask=mask[:, None], other=0)
    else:
        c = tl.load(codes_ptr + c_off)
        s = tl.load(scale_ptr + s_off)
    if WORDS:  # noqa: SIM108 - constexpr branch, one side compiled
        v = dequant_words_f16(c, s, R, BK)
    else:
        v = dequant_tile_f16(c, s, R, BK)
    return v


@triton.jit
def guided_compact_kernel(
    x_ptr,  # [R, C] fp32/bf16/fp16, unit stride along C: the trainer's values
    x_row_stride,
    mbits_ptr,  # uint8 [R, C/8]: the rollout's mantissa bits, element i -> bit i % 8
    scale_ptr,  # uint8 [R, C/16]: the rollout's e4m3 block scales
    g_ptr,  # fp32 [R]: the rollout's second-level scales
    y_ptr,  # out [R, C], x's dtype: s_rollout * q*
    C: tl.constexpr,
    BLOCK_C: tl.constexpr,  # next power of two >= C
    OUT_BF16: tl.constexpr,  # y is bf16
):
    """Rollout-guided rounding of one row (`fp4.guided.guided_quantize`, compact NVFP4
    records): z = clamp(x / s, -6, 6) with the rollout's scale s; of the two E2M1 magnitudes
    that bracket |z| (one where z is on the grid), the one whose mantissa bit is the
    rollout's; the value times s, in x's dtype."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    inside = cols < C
    x = tl.load(x_ptr + r * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    s_byte = tl.load(scale_ptr + r * (C // BLOCK) + cols // BLOCK, mask=inside, other=0x38)
    factor = e4m3_to_f32(s_byte.to(tl.int32)) * tl.load(g_ptr + r)
    z = tl.minimum(tl.maximum(tl.math.div_rn(x, factor), -E2M1_MAX), E2M1_MAX)
    mag = tl.abs(z)
    nearest = f32_to_e2m1(mag)  # magnitude index 0..7 (mag >= 0: no sign bit)
    g_near = e2m1_to_f32(nearest)
    other = nearest + (mag > g_near).to(tl.int32) - (mag < g_near).to(tl.int32)
    byte = tl.load(mbits_ptr + r * (C // 8) + cols // 8, mask=inside, other=0).to(tl.int32)
    m_rollout = (byte >> (cols % 8)) & 1
    idx = tl.where((nearest & 1) == m_rollout, nearest, other)
    q = e2m1_to_f32(idx)
    q = tl.where(z < 0, -q, q) + 0.0  # + 0.0: a guided zero is +0.0, as the reference's
    y = q * factor
    if OUT_BF16:  # RNE on the fp32 bits (finite values): the same on every Triton backend
        bits = y.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        out = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + r * C + cols, out, mask=inside)
