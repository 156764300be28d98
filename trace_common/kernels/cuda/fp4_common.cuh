// Helpers shared by the CUDA kernels (moe_fp4.cu, attn_fp4.cu, attn_small.cu, small_batch.cu). No system headers:
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

// ---- tensor-core MMA m16n8k16, fp32 accumulate in place (A row-major, B column-major) -----

__device__ __forceinline__ void mma_f16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                        u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
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

// ---- programmatic dependent launch (cuda_launch.launch_ex; sm_90) ----------------------------
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

// 4 bf16 values at p (8-byte aligned) -> fp32, read from L2 (.cg: written by other CTAs of this
// grid before a fence + counter)
__device__ __forceinline__ void load_bf16x4_cg(const u16* p, float (&x)[4]) {
  u32 v0, v1;
  asm volatile("ld.global.cg.v2.u32 {%0,%1}, [%2];" : "=r"(v0), "=r"(v1) : "l"(p) : "memory");
  x[0] = __uint_as_float(v0 << 16);
  x[1] = __uint_as_float(v0 & 0xFFFF0000u);
  x[2] = __uint_as_float(v1 << 16);
  x[3] = __uint_as_float(v1 & 0xFFFF0000u);
}

// scale_2 of a row from its amax (NVFP4_ZERO_AMAX_SCALE_2 = 1 for an all-zero row)
__device__ __forceinline__ float nvfp4_scale_2(float amax) {
  const float g = div_rn_f32(amax, NVFP4_SCALE2_DIVISOR);
  return g == 0.f ? 1.0f : g;
}

// max / or over the 4 lanes of a quad (lanes 4j..4j+3, all of them active)
__device__ __forceinline__ float quad_max(float v) {
  const u32 m = 0xFu << (threadIdx.x & 28);
  v = fmaxf(v, __shfl_xor_sync(m, v, 1));
  return fmaxf(v, __shfl_xor_sync(m, v, 2));
}

__device__ __forceinline__ u32 quad_or(u32 v) {
  const u32 m = 0xFu << (threadIdx.x & 28);
  v |= __shfl_xor_sync(m, v, 1);
  return v | __shfl_xor_sync(m, v, 2);
}

// Lane q of a quad quantizes elements 4q..4q+3 (x) of block blk of a row whose scale_2 is g
// and block amax bamax (over the quad) into o (all but scale_2).
__device__ __forceinline__ void nvfp4_quantize_quarter(const float (&x)[4], float bamax, float g,
                                                       int blk, int q, const NVFP4RowOut& o) {
  float s = div_rn_f32(bamax, NVFP4_E2M1_MAX * g);  // fp32 product first, as the reference
  if (s == 0.f) s = 1.0f;  // NVFP4_ZERO_BLOCK_SCALE
  s = fminf(fmaxf(s, NVFP4_SCALE_MIN), NVFP4_SCALE_MAX);
  u32 sbyte;
  const float sv = f32_to_e4m3_rn(s, sbyte);
  const float divisor = sv * g;
  u32 cw = 0, mb = 0, h[2] = {0u, 0u};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const u32 c = f32_to_e2m1(div_rn_f32(x[j], divisor));
    cw |= c << (4 * j);  // element 2i: low nibble of byte i
    mb |= (c & 1u) << j;
    const u32 v = f32_to_f16_rn(e2m1_to_f32(c) * sv * FP16_DECODE_INV);
    h[j >> 1] |= v << (16 * (j & 1));
  }
  mb = quad_or(mb << (4 * q));
  const int seg = blk / o.seg_blocks, bi = blk - seg * o.seg_blocks;
  *reinterpret_cast<u16*>(o.codes + seg * o.seg_codes + 8 * bi + 2 * q) = (u16)cw;
  if (q == 0) o.scales[seg * o.seg_scales + bi] = (u8)sbyte;
  if (o.dq16) {  // B-fragment order: the pair (kk, kk + 1), kk even, is word ((kk % 8) / 2) * 2 + kk / 8
    u32* dq = reinterpret_cast<u32*>(o.dq16 + 16 * blk);
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int kk = 4 * q + 2 * p;
      dq[((kk & 7) >> 1) * 2 + (kk >> 3)] = h[p];
    }
  }
  if (o.mbits && q == 0) {
    *reinterpret_cast<u16*>(o.mbits + 2 * blk) = (u16)mb;
    o.rec_scales[blk] = (u8)sbyte;
  }
}

#define NVFP4_CTA_MAX_ROWS 64  // rows nvfp4_quantize_rows_cta takes (64 = 8 tokens x top-8)

// Quarter q of block blk of row r, once the rows' amax are in s_amax: the row's scale_2 (written
// by the block-0 quad's lane 0, with the record's) and the quarter's outputs.
template <class Out>
__device__ __forceinline__ void nvfp4_store_quarter(const float (&x)[4], float bamax, int r,
                                                    int blk, int q, const float* s_amax,
                                                    const Out& out) {
  const float g = nvfp4_scale_2(s_amax[r]);
  const NVFP4RowOut o = out(r);
  if (blk == 0 && q == 0) {
    *o.scale_2 = g;
    if (o.rec_g) *o.rec_g = g;
  }
  nvfp4_quantize_quarter(x, bamax, g, blk, q, o);
}

__device__ __forceinline__ float quad_block_amax(const float (&x)[4]) {
  return quad_max(fmaxf(fmaxf(fabsf(x[0]), fabsf(x[1])), fmaxf(fabsf(x[2]), fabsf(x[3]))));
}

// The whole CTA (every one of its NTHREADS threads calls this) NVFP4-quantizes `rows` (<= 64)
// rows of k bf16 values (k % 16 == 0): load(r, e, x) puts the 4 values from element e of row r
// into x (fp32), out(r) says where row r goes (an NVFP4RowOut). A quad of threads takes a block
// (lane q: elements 4q..4q+3; short per-thread chains, as the Triton kernel's), quad i of the
// CTA blocks i, i + NTHREADS / 4, ... of the flattened [rows, k/16] (one each at decode sizes,
// then kept in registers); the row amax meets in shared memory (atomicMax on the bits: >= 0).
// Ends without a barrier: sync before reading the outputs.
template <int NTHREADS, class Load, class Out>
__device__ __forceinline__ void nvfp4_quantize_rows_cta(int rows, int k, const Load& load,
                                                        const Out& out) {
  static_assert(NTHREADS % 32 == 0, "whole warps");
  __shared__ float s_amax[NVFP4_CTA_MAX_ROWS];
  const int nb = k >> 4, total = rows * nb * 4, q = threadIdx.x & 3;
  for (int r = threadIdx.x; r < rows; r += NTHREADS) s_amax[r] = 0.f;
  __syncthreads();
  float x[4], bamax = 0.f;
  for (int i = threadIdx.x; i < total; i += NTHREADS) {  // a quad is active or not as a whole
    const int r = i / (4 * nb), blk = (i >> 2) - r * nb;
    load(r, 16 * blk + 4 * q, x);
    bamax = quad_block_amax(x);
    if (q == 0) atomicMax(reinterpret_cast<int*>(s_amax + r), __float_as_int(bamax));
  }
  __syncthreads();
  for (int i = threadIdx.x; i < total; i += NTHREADS) {
    const int r = i / (4 * nb), blk = (i >> 2) - r * nb;
    if (total > NTHREADS) {  // else x and bamax still hold this block
      load(r, 16 * blk + 4 * q, x);
      bamax = quad_block_amax(x);
    }
    nvfp4_store_quarter(x, bamax, r, blk, q, s_amax, out);
  }
}
