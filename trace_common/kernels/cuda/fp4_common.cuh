// Helpers shared by the CUDA kernels (moe_fp4.cu, attn_fp4.cu, small_batch.cu). No system headers:
// compiled by NVRTC (CuPy RawModule, with -I on this folder) or nvcc alike.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// two e4m3 bytes (low byte -> low half) -> fp16x2, exact
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 v16) {
  u32 r;
  u16 h = (u16)v16;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(h));
  return r;
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// ---- cp.async (global -> shared, bypassing registers) ----------------------------------------

// 32-bit shared-memory address of a generic pointer into shared memory
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// 16 bytes, L2 only (.cg)
__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// 16 / 8 / 4 bytes of which the first n come from src and the rest are zero-filled
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 n) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n));
}

__device__ __forceinline__ void cp_async8(u32 dst, const void* src, u32 n) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(n));
}

__device__ __forceinline__ void cp_async4(u32 dst, const void* src, u32 n) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(n));
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// wait until at most N of this thread's committed groups are still in flight
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// ---- programmatic dependent launch (cuda_launch.launch_pdl; sm_90) ---------------------------
// Both are no-ops in a grid launched without the attribute (or with no programmatic dependent).

// wait until the previous grid on the stream has completed and its writes are visible: every
// thread that reads (or writes) what an earlier kernel writes (or reads) must pass it first
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// let the next grid (if launched with the attribute) start once every CTA of this one is here
__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// ---- NVFP4 row quantization (bit-exact with _tl_fp4.quantize_store_row / quant.quantize_rows)
// Used by the kernels that fold a quantize launch into their tail (small_batch.cu router,
// moe_fp4.cu gate_up). Same arithmetic order as the reference: per-row amax -> scale_2 =
// amax / 2688 (1 if 0) -> per block amax / (6 scale_2) (1 if 0), clamped to [2**-9, 448] ->
// e4m3 RNE (integer RNE of the fp32 bits; exact s * 2**9 RNE below 2**-6) -> codes =
// E2M1 RNE of x / (e4m3 scale * scale_2). Every divide is IEEE round-to-nearest (div.rn).
#define NVFP4_E2M1_MAX 6.0f            // F4_E2M1_MAX
#define NVFP4_SCALE2_DIVISOR 2688.0f   // F4_E2M1_MAX * F8E4M3_MAX
#define NVFP4_SCALE_MIN 0.001953125f   // NVFP4_BLOCK_SCALE_MIN = 2**-9
#define NVFP4_SCALE_MAX 448.0f         // F8E4M3_MAX
#define E4M3_MIN_NORMAL 0.015625f      // 2**-6 = 0b0_0001_000
#define FP16_DECODE_INV 6.103515625e-05f  // 2**-14 (the dq16 operand's decode gain)

__device__ __forceinline__ float div_rn_f32(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ u16 f32_to_f16_rn(float v) {
  u16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}

// RNE of a positive fp32 s in [2**-9, 448] onto the e4m3fn grid: the value, and its byte.
__device__ __forceinline__ float f32_to_e4m3_rn(float s, u32& byte) {
  const int bits = __float_as_int(s);
  const int rn = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF;  // keep 3 mantissa bits
  if (s >= E4M3_MIN_NORMAL) {
    byte = (u32)(((((rn >> 23) & 0xFF) - (127 - 7)) << 3) | ((rn >> 20) & 7));
    return __int_as_float(rn);
  }
  const float q = s * 512.0f;  // exact; subnormal steps of 2**-9
  const int fl = (int)q;
  const float frac = q - (float)fl;
  const int k = fl + ((frac > 0.5f || (frac == 0.5f && (fl & 1))) ? 1 : 0);
  byte = (u32)k;
  return (float)k * NVFP4_SCALE_MIN;
}

// E2M1 code (sign in bit 3) of a scaled fp32 value: RNE, saturating (e2m1.f32_to_e2m1)
__device__ __forceinline__ u32 f32_to_e2m1(float y) {
  const float a = fabsf(y);
  const u32 c = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                (a >= 3.5f) + (a > 5.0f);
  return c | (y < 0.f ? 8u : 0u);
}

// E2M1 code -> fp32 (code 0b1000 gives +0.0, as the reference)
__device__ __forceinline__ float e2m1_to_f32(u32 c) {
  const u32 e = (c >> 1) & 3, m = c & 1;
  const u32 mag = e > 0 ? ((e + 126) << 23) | (m << 22) : (m ? 126u << 23 : 0u);
  return __uint_as_float(mag | ((c & 7) ? (c >> 3) << 31 : 0u));
}

// Where one quantized row goes (each pointer already at the row; null = skipped, except
// codes, scales, scale_2): codes [K/2] (element 2j low nibble), e4m3 scales [K/16], scale_2
// [1], dq16 [K] fp16 code * scale * 2**-14 in cuda_moe.dq16_permutation order per block of
// 16, and the compact guidance record: mbits [K/8] (element i -> bit i % 8 of byte i / 8), its
// block scales [K/16] and scale_2 [1]. Codes and scales are in segments of seg_blocks blocks,
// segment i at i * seg_codes / i * seg_scales bytes (the FP4 KV cache: a head at one
// position); `nvfp4_row_out` makes the plain row layout (one segment).
struct NVFP4RowOut {
  u8* codes;
  u8* scales;
  float* scale_2;
  u16* dq16;
  u8* mbits;
  u8* rec_scales;
  float* rec_g;
  int seg_blocks;
  long seg_codes, seg_scales;
};

__device__ __forceinline__ NVFP4RowOut nvfp4_row_out(u8* codes, u8* scales, float* scale_2) {
  NVFP4RowOut o;
  o.codes = codes;
  o.scales = scales;
  o.scale_2 = scale_2;
  o.dq16 = nullptr;
  o.mbits = nullptr;
  o.rec_scales = nullptr;
  o.rec_g = nullptr;
  o.seg_blocks = 1 << 30;
  o.seg_codes = o.seg_scales = 0;
  return o;
}

// 16 bf16 values at p (32-byte aligned) -> fp32, read from L2 (.cg: written by other CTAs of
// this grid before a fence + counter)
__device__ __forceinline__ void load_bf16x16_cg(const u16* p, float (&x)[16]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    u32 v[4];
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                 : "l"(p + 8 * hh) : "memory");
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[8 * hh + 2 * i] = __uint_as_float(v[i] << 16);
      x[8 * hh + 2 * i + 1] = __uint_as_float(v[i] & 0xFFFF0000u);
    }
  }
}

// scale_2 of a row from its amax (NVFP4_ZERO_AMAX_SCALE_2 = 1 for an all-zero row)
__device__ __forceinline__ float nvfp4_scale_2(float amax) {
  const float g = div_rn_f32(amax, NVFP4_SCALE2_DIVISOR);
  return g == 0.f ? 1.0f : g;
}

// Quantize block blk (its 16 values x) of a row whose scale_2 is g into o (all but scale_2).
__device__ __forceinline__ void nvfp4_quantize_block(const float (&x)[16], float g, int blk,
                                                     const NVFP4RowOut& o) {
  float bamax = 0.f;
#pragma unroll
  for (int j = 0; j < 16; ++j) bamax = fmaxf(bamax, fabsf(x[j]));
  float s = div_rn_f32(bamax, NVFP4_E2M1_MAX * g);  // fp32 product first, as the reference
  if (s == 0.f) s = 1.0f;  // NVFP4_ZERO_BLOCK_SCALE
  s = fminf(fmaxf(s, NVFP4_SCALE_MIN), NVFP4_SCALE_MAX);
  u32 sbyte;
  const float sv = f32_to_e4m3_rn(s, sbyte);
  const float divisor = sv * g;
  // codes (element 2j low nibble of byte j), mantissa bits, and the dq16 words: B-fragment
  // order, slot 4 ((kk % 8) / 2) + 2 (kk / 8) + kk % 2 holds element kk (2 slots per word)
  u32 cw2[2] = {0u, 0u}, mb = 0, h[8];
#pragma unroll
  for (int kk = 0; kk < 16; ++kk) {
    const u32 c = f32_to_e2m1(div_rn_f32(x[kk], divisor));
    cw2[kk >> 3] |= c << (4 * (kk & 7));
    mb |= (c & 1u) << kk;
    const int slot = ((kk & 7) >> 1) * 4 + (kk >> 3) * 2 + (kk & 1);
    const u32 v = f32_to_f16_rn(e2m1_to_f32(c) * sv * FP16_DECODE_INV);
    h[slot >> 1] = (slot & 1) ? h[slot >> 1] | (v << 16) : v;
  }
  uint2 cw;
  cw.x = cw2[0];
  cw.y = cw2[1];
  const int seg = blk / o.seg_blocks, bi = blk - seg * o.seg_blocks;
  *reinterpret_cast<uint2*>(o.codes + seg * o.seg_codes + 8 * bi) = cw;
  o.scales[seg * o.seg_scales + bi] = (u8)sbyte;
  if (o.dq16) {
    uint4 d0, d1;
    d0.x = h[0], d0.y = h[1], d0.z = h[2], d0.w = h[3];
    d1.x = h[4], d1.y = h[5], d1.z = h[6], d1.w = h[7];
    uint4* dst = reinterpret_cast<uint4*>(o.dq16 + 16 * blk);
    dst[0] = d0;
    dst[1] = d1;
  }
  if (o.mbits) {
    *reinterpret_cast<u16*>(o.mbits + 2 * blk) = (u16)mb;
    o.rec_scales[blk] = (u8)sbyte;
  }
}

#define NVFP4_CTA_MAX_ROWS 64  // rows nvfp4_quantize_rows_cta takes (64 = 8 tokens x top-8)

// The whole CTA (every one of its NTHREADS threads calls this) NVFP4-quantizes `rows` (<= 64)
// rows of k bf16 values (k % 16 == 0): load(r, blk, x) puts the 16 values of block blk of row
// r into x (fp32), out(r) says where row r goes (an NVFP4RowOut). Thread i takes blocks i,
// i + NTHREADS, ... of the flattened [rows, k/16] (one each at decode sizes, then kept in
// registers); the row amax meets in shared memory (atomicMax on the bits: amax >= 0).
template <int NTHREADS, class Load, class Out>
__device__ __forceinline__ void nvfp4_quantize_rows_cta(int rows, int k, const Load& load,
                                                        const Out& out) {
  __shared__ float s_amax[NVFP4_CTA_MAX_ROWS];
  const int nb = k >> 4, total = rows * nb;
  for (int r = threadIdx.x; r < rows; r += NTHREADS) s_amax[r] = 0.f;
  __syncthreads();
  float x[16];
  for (int i = threadIdx.x; i < total; i += NTHREADS) {
    const int r = i / nb;
    load(r, i - r * nb, x);
    float m = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) m = fmaxf(m, fabsf(x[j]));
    atomicMax(reinterpret_cast<int*>(s_amax + r), __float_as_int(m));
  }
  __syncthreads();
  for (int i = threadIdx.x; i < total; i += NTHREADS) {
    const int r = i / nb, blk = i - r * nb;
    if (total > NTHREADS) load(r, blk, x);  // else x still holds this block
    const float g = nvfp4_scale_2(s_amax[r]);
    const NVFP4RowOut o = out(r);
    if (blk == 0) {
      *o.scale_2 = g;
      if (o.rec_g) *o.rec_g = g;
    }
    nvfp4_quantize_block(x, g, blk, o);
  }
}
