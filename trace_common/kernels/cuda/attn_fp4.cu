// Split-KV decode attention over the contiguous FP4 (NVFP4) KV cache (Hopper, mma.sync).
//
// Cache (trace_common/kernels/attention.py, unchanged layout), kv = 0 for K and 1 for V:
//   codes  uint8 [2, B, HKV, S, 64]: E2M1 codes of d = 0..127, element 2j in the low nibble
//   scales uint8 [2, B, HKV, S, 8]:  e4m3 block scales, one per 16 d
//   rs     fp32  [2, B, S]:          per-token second-level scale (over all kv heads)
//
// One CTA = (split, kv head, sequence); its WARPS warps take the split's 16-token tiles in
// turn and merge their (max, sum, output) through shared memory at the end; the partial
// results go to the same scratch as the Triton kernel and its reduce kernel combines splits.
// Each warp runs flash-decoding for the G = 8 query heads of its kv head:
//   S = Q K^T: mma m16n8k16, A = Q (rows = heads, 8..15 zero), B = K^T (8 tokens per n-tile);
//   O += P V:  A = P (the S accumulators re-packed in place, as in FlashAttention-2),
//              B = V (k = 16 tokens, n = 8 d per n-tile).
// Because the sum over d is order-free, lane (g, t) reads K bytes [16t, 16t+16) of its token
// (32 contiguous d) and Q is packed in the matching order, so no shuffles are needed; for V
// it reads bytes [8g, 8g+8) (16 d, one scale block) of tokens 2t, 2t+1, 2t+8, 2t+9.
//
// E2M1 decode, the same fp16 bits as the expert GEMM (moe_fp4.cu): a code c becomes the fp16
// with bits (c & 8) << 12 | (c & 7) << 9 == value(c) * 2**-14. Here the codes arrive in their
// natural order, so a word of 8 codes is turned into 8 bytes holding that fp16's high byte
// (2 LOP3 + 2 shifts per 4 codes) and one PRMT places two bytes as an fp16x2 register. The
// e4m3 block scale multiplies each register in fp16 (exact: <= 6 significant bits, >= 2**-24);
// the per-token scale (and 2**14) multiplies the scores for K and the probabilities for V, so
// the numerics are the Triton kernel's up to summation order.
//
// No system headers: compiled by NVRTC (CuPy RawModule, -I on this folder) or nvcc alike.

#include "fp4_common.cuh"

#define HEAD_D 128
#define GROUP 8
#define TILE 16
#define FP16_GAIN 16384.0f  // 2**14: the fp16 decode gain of the codes
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ void ldg_v4(const u32* p, u32* r) {
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
}

__device__ __forceinline__ void ldg_v2(const u32* p, u32* r) {
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];"
               : "=r"(r[0]), "=r"(r[1]) : "l"(p));
}

__device__ __forceinline__ u32 ldg_u16(const u16* p) {
  u16 r;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ u32 ldg_u8(const u8* p) {
  u16 r;
  asm volatile("ld.global.nc.u8 %0, [%1];" : "=h"(r) : "l"(p));
  return r & 0xFFu;
}

__device__ __forceinline__ float ldg_f32(const float* p) {
  float r;
  asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// 8 codes (word w, code j in bits 4j..4j+3) -> lo: bytes = fp16 high bytes of codes 0,2,4,6;
// hi: of codes 1,3,5,7 (high byte of fp16 = sign << 7 | (e1 e0 m) << 1).
__device__ __forceinline__ void fp4_bytes(u32 w, u32& lo, u32& hi) {
  lo = ((w << 4) & 0x80808080u) | ((w << 1) & 0x0E0E0E0Eu);
  hi = (w & 0x80808080u) | ((w >> 3) & 0x0E0E0E0Eu);
}

// bytes 0, 1 (or 2, 3) of e -> the high bytes of an fp16x2 (low half from the lower byte)
__device__ __forceinline__ u32 h2_b01(u32 e) { return __byte_perm(e, 0u, 0x1404); }
__device__ __forceinline__ u32 h2_b23(u32 e) { return __byte_perm(e, 0u, 0x3424); }

// D = A B + C with A rows 8..15 zero: (c0, c1) are row g's accumulators, rows g+8 discarded.
__device__ __forceinline__ void mma_half(float& c0, float& c1, u32 a0, u32 a2, u32 b0, u32 b1) {
  float d2, d3;
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%10,%11};"
      : "+f"(c0), "+f"(c1), "=f"(d2), "=f"(d3)
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(0.f), "f"(0.f));
}

// One lane's raw bytes of one 16-token tile.
struct Raw {
  u32 k[2][4];  // K codes, tokens g and 8 + g, bytes [16t, 16t + 16)
  u32 ks[2];    // their e4m3 scales of blocks 2t, 2t + 1 (u16)
  u32 v[4][2];  // V codes, tokens 2t, 2t+1, 8+2t, 9+2t, bytes [8g, 8g + 8)
  u32 vs[2];    // their e4m3 scales of block g: (2t, 2t+1), (8+2t, 9+2t) as u16
  float kr[4];  // K row scales of tokens 2t, 2t+1, 8+2t, 9+2t
  float vr[4];  // V row scales of the same tokens
};

__device__ __forceinline__ void load_tile(Raw& r, const u32* __restrict__ codes,
                                          const u8* __restrict__ scales,
                                          const float* __restrict__ krs,
                                          const float* __restrict__ vrs, long kbase, long vbase,
                                          int t0, int end, int g, int t) {
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const int tok = t0 + 8 * n + g;
    if (tok < end) {
      ldg_v4(codes + (kbase + tok) * 16 + 4 * t, r.k[n]);
      r.ks[n] = ldg_u16((const u16*)scales + (kbase + tok) * 4 + t);
    } else {
      r.k[n][0] = r.k[n][1] = r.k[n][2] = r.k[n][3] = 0u;
      r.ks[n] = 0u;
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int tok = t0 + 8 * (j >> 1) + 2 * t + (j & 1);
    u32 sb = 0u;
    if (tok < end) {
      ldg_v2(codes + (vbase + tok) * 16 + 2 * g, r.v[j]);
      sb = ldg_u8(scales + (vbase + tok) * 8 + g);
      r.kr[j] = ldg_f32(krs + tok);
      r.vr[j] = ldg_f32(vrs + tok);
    } else {
      r.v[j][0] = r.v[j][1] = 0u;
      r.kr[j] = r.vr[j] = 0.f;
    }
    if (j & 1)
      r.vs[j >> 1] |= sb << 8;
    else
      r.vs[j >> 1] = sb;
  }
}

template <int WARPS, int MINB>
__global__ void __launch_bounds__(WARPS * 32, MINB) attn_fp4_split(
    const u16* __restrict__ q,          // bf16 [B, HQ, 128]
    const u32* __restrict__ codes,      // [2, B, HKV, S, 64] bytes
    const u8* __restrict__ scales,      // [2, B, HKV, S, 8]
    const float* __restrict__ rs,       // [2, B, S]
    const int* __restrict__ lens,       // [B] valid tokens (new one included)
    float* __restrict__ part_o,         // [B, HQ, NSPLIT, 128] unnormalized partial outputs
    float* __restrict__ part_ml,        // [B, HQ, NSPLIT, 2] max (log2 domain), sum
    int n_batch, int hkv, int cap, int chunk, int nsplit, float qk_scale) {
  __shared__ float o_s[WARPS][GROUP][HEAD_D + 4];
  __shared__ float ml_s[WARPS][GROUP][2];

  const int sp = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int len = lens[b];
  const int start = sp * chunk;
  if (start >= len) return;
  const int end = min(start + chunk, len);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int hq = hkv * GROUP;

  // Q of head hk*8 + g, d = 32t .. 32t+31, as the A fragments (a0, a2) of 8 k-tiles: k-tile
  // 2w takes d offsets (0, 2 | 4, 6) of the 8-group w, k-tile 2w+1 takes (1, 3 | 5, 7).
  u32 qa[8][2];
  {
    const u32* qp = (const u32*)(q + ((long)b * hq + hk * GROUP + g) * HEAD_D + 32 * t);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint4 v = *(const uint4*)(qp + 4 * w);
      const u32 x[4] = {v.x, v.y, v.z, v.w};
      float f[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(x[i] << 16);
        f[2 * i + 1] = __uint_as_float(x[i] & 0xFFFF0000u);
      }
      qa[2 * w][0] = pack_h2(f[0], f[2]);
      qa[2 * w][1] = pack_h2(f[4], f[6]);
      qa[2 * w + 1][0] = pack_h2(f[1], f[3]);
      qa[2 * w + 1][1] = pack_h2(f[5], f[7]);
    }
  }

  const long kbase = ((long)b * hkv + hk) * cap;
  const long vbase = ((long)(n_batch + b) * hkv + hk) * cap;
  const float* krs = rs + (long)b * cap;
  const float* vrs = rs + (long)(n_batch + b) * cap;
  const float kgain = FP16_GAIN * qk_scale;

  float m = NEG_INF, l = 0.f;
  float acc[16][2];
#pragma unroll
  for (int r = 0; r < 16; ++r) acc[r][0] = acc[r][1] = 0.f;

  const int ntiles = (end - start + TILE - 1) / TILE;
  Raw cur;
  if (warp < ntiles)
    load_tile(cur, codes, scales, krs, vrs, kbase, vbase, start + warp * TILE, end, g, t);
  for (int i = warp; i < ntiles; i += WARPS) {
    Raw nxt;
    if (i + WARPS < ntiles)
      load_tile(nxt, codes, scales, krs, vrs, kbase, vbase, start + (i + WARPS) * TILE, end, g,
                t);
    const int t0 = start + i * TILE;

    // ---- scores: 2 n-tiles of 8 tokens, two accumulator chains each (even / odd k-tiles)
    float sc[2][2][2];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const u32 s2 = e4m3x2_to_f16x2(cur.ks[n]);
      const u32 s_a = __byte_perm(s2, 0u, 0x1010), s_b = __byte_perm(s2, 0u, 0x3232);
      sc[n][0][0] = sc[n][0][1] = sc[n][1][0] = sc[n][1][1] = 0.f;
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const u32 s = w < 2 ? s_a : s_b;
        u32 lo, hi;
        fp4_bytes(cur.k[n][w], lo, hi);
        mma_half(sc[n][0][0], sc[n][0][1], qa[2 * w][0], qa[2 * w][1], hmul2(h2_b01(lo), s),
                 hmul2(h2_b23(lo), s));
        mma_half(sc[n][1][0], sc[n][1][1], qa[2 * w + 1][0], qa[2 * w + 1][1],
                 hmul2(h2_b01(hi), s), hmul2(h2_b23(hi), s));
      }
    }
    // lane holds head g's scores of tokens 2t, 2t+1 (n-tile 0) and 8+2t, 9+2t (n-tile 1)
    float p[4];
    float mt = NEG_INF;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = j >> 1, c = j & 1;
      const int tok = t0 + 8 * n + 2 * t + c;
      const float s = (sc[n][0][c] + sc[n][1][c]) * (cur.kr[j] * kgain);
      p[j] = tok < end ? s : NEG_INF;
      mt = fmaxf(mt, p[j]);
    }
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
    const float m_new = fmaxf(m, mt);
    const float alpha = ex2(m - m_new);
    m = m_new;
    l *= alpha;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      p[j] = ex2(p[j] - m_new);
      l += p[j];
      p[j] *= cur.vr[j] * FP16_GAIN;
    }
    const u32 pa0 = pack_h2(p[0], p[1]), pa2 = pack_h2(p[2], p[3]);
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      acc[r][0] *= alpha;
      acc[r][1] *= alpha;
    }

    // ---- O += P V: token pairs (2t, 2t+1) -> b0, (8+2t, 9+2t) -> b1; n-tile r = d 16c + r
    const u32 sv0 = e4m3x2_to_f16x2(cur.vs[0]), sv1 = e4m3x2_to_f16x2(cur.vs[1]);
#pragma unroll
    for (int k = 0; k < 2; ++k) {     // codes 8k .. 8k+7 of the block
#pragma unroll
      for (int h = 0; h < 2; ++h) {   // bytes (0, 1) or (2, 3) of the word: codes 8k+4h ..
        const u32 sel = h ? 0x7362u : 0x5140u;
        u32 lo0, hi0, lo1, hi1;
        fp4_bytes(__byte_perm(cur.v[0][k], cur.v[1][k], sel), lo0, hi0);
        fp4_bytes(__byte_perm(cur.v[2][k], cur.v[3][k], sel), lo1, hi1);
        const int r = 8 * k + 4 * h;
        mma_half(acc[r][0], acc[r][1], pa0, pa2, hmul2(h2_b01(lo0), sv0),
                 hmul2(h2_b01(lo1), sv1));
        mma_half(acc[r + 1][0], acc[r + 1][1], pa0, pa2, hmul2(h2_b01(hi0), sv0),
                 hmul2(h2_b01(hi1), sv1));
        mma_half(acc[r + 2][0], acc[r + 2][1], pa0, pa2, hmul2(h2_b23(lo0), sv0),
                 hmul2(h2_b23(lo1), sv1));
        mma_half(acc[r + 3][0], acc[r + 3][1], pa0, pa2, hmul2(h2_b23(hi0), sv0),
                 hmul2(h2_b23(hi1), sv1));
      }
    }
    cur = nxt;
  }

  // ---- merge the warps: lane (g, t) holds head g, d = 32t + r (c0) and 32t + 16 + r (c1)
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    o_s[warp][g][32 * t + r] = acc[r][0];
    o_s[warp][g][32 * t + 16 + r] = acc[r][1];
  }
  if (t == 0) {
    ml_s[warp][g][0] = m;
    ml_s[warp][g][1] = l;
  }
  __syncthreads();
  for (int o = threadIdx.x; o < GROUP * HEAD_D; o += WARPS * 32) {
    const int h = o / HEAD_D, d = o % HEAD_D;
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, ml_s[w][h][0]);
    float ov = 0.f, lv = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float wt = ex2(ml_s[w][h][0] - mx);
      ov += o_s[w][h][d] * wt;
      lv += ml_s[w][h][1] * wt;
    }
    const long row = ((long)b * hq + hk * GROUP + h) * nsplit + sp;
    part_o[row * HEAD_D + d] = ov;
    if (d == 0) {
      part_ml[row * 2] = mx;
      part_ml[row * 2 + 1] = lv;
    }
  }
}
