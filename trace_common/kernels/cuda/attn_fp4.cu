// Split-KV decode attention over the contiguous FP4 (NVFP4) KV cache (Hopper, mma.sync).
//
// Cache (trace_common/kernels/attention.py, unchanged layout), kv = 0 for K and 1 for V:
//   codes  uint8 [2, B, HKV, S, 64]: E2M1 codes of d = 0..127, element 2j in the low nibble
//   scales uint8 [2, B, HKV, S, 8]:  e4m3 block scales, one per 16 d
//   rs     fp32  [2, B, S]:          per-token second-level scale (over all kv heads)
//
// One CTA = (split, kv head, sequence); its WARPS warps take the split's 16-token tiles in
// turn and merge their (max, sum, output) through shared memory at the end; the partial
// results go to the same scratch as the Triton kernel and its reduce kernel combines splits
// (FUSED: the last CTA of each (sequence, kv head) combines them, attn_common.cuh). Each warp
// runs flash-decoding for the G = 8 query heads of its kv head. Because the sum over d is
// order-free, lane (g, t) reads K bytes [16t, 16t+16) of a token (32 contiguous d) and Q is
// packed in the matching order (q_frags), so no shuffles are needed.
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

#include "attn_common.cuh"  // HEAD_D, GROUP, TILE, merge_warps, the fused combine

#define FP16_GAIN 16384.0f  // 2**14: the fp16 decode gain of the codes

__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
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

// Q row (head) of 128 bf16 -> lane t's d = 32t .. 32t+31 as fp16 fragments of 8 k-tiles: k-tile
// 2w takes d offsets (0, 2 | 4, 6) of the 8-group w, k-tile 2w+1 takes (1, 3 | 5, 7); the same
// order as fp4_bytes + h2_b01 / h2_b23 of the lane's 16 K bytes [16t, 16t + 16). In two steps,
// so that a kernel can issue the loads early and convert once they are needed.
__device__ __forceinline__ void load_q_raw(const u16* __restrict__ qrow, int t, uint4 (&raw)[4]) {
  const uint4* qp = (const uint4*)(qrow + 32 * t);
#pragma unroll
  for (int w = 0; w < 4; ++w) raw[w] = qp[w];
}

__device__ __forceinline__ void q_frags(const uint4 (&raw)[4], u32 (&qf)[8][2]) {
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const u32 x[4] = {raw[w].x, raw[w].y, raw[w].z, raw[w].w};
    float f[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(x[i] << 16);
      f[2 * i + 1] = __uint_as_float(x[i] & 0xFFFF0000u);
    }
    qf[2 * w][0] = pack_h2(f[0], f[2]);
    qf[2 * w][1] = pack_h2(f[4], f[6]);
    qf[2 * w + 1][0] = pack_h2(f[1], f[3]);
    qf[2 * w + 1][1] = pack_h2(f[5], f[7]);
  }
}

__device__ __forceinline__ void load_q_frags(const u16* __restrict__ qrow, int t, u32 (&qf)[8][2]) {
  uint4 raw[4];
  load_q_raw(qrow, t, raw);
  q_frags(raw, qf);
}

// ================================================================================================
// attn_fp4_ring: reads the cache through a per-warp cp.async ring of NS 16-token stages in
// shared memory, with both products swapped so no MMA row is wasted.
//
// Swap-AB (as the expert GEMM): S^T = K Q^T with A = K (16 tokens x 16 d), B = Q^T (16 d x
// 8 heads); O^T += V^T P^T with A = V^T (16 d x 16 tokens), B = P^T (16 tokens x 8 heads).
// That is 8 + 8 m16n8k16 per tile (with Q as the A operand, 16 + 16 with half the rows
// zero). The S^T
// accumulators (lane (g, t): tokens g, g+8 x heads 2t, 2t+1) are exactly two m8n8 b16 matrices
// once packed, and `movmatrix.trans` turns each into the P^T B fragment (heads g x tokens 2t,
// 2t+1): no shared memory round trip. Lane (g, t) reads K bytes [16t, 16t+16) of tokens g and
// g+8 (Q packed in the matching d order, as above) and V bytes [8g, 8g+8) of tokens 2t, 2t+1,
// 2t+8, 2t+9 (16 d of one scale block); its accumulator m-tile mt holds O[head 2t + (0|1)] at
// d = 16g + 2mt (c0, c1) and 16g + 2mt + 1 (c2, c3).
//
// Memory: each warp owns NS stages of RING_STAGE bytes (K codes, V codes, K/V block scales, K/V
// row scales of 16 tokens), filled by cp.async (16-byte code chunks, 8-byte scale rows, 4-byte
// row scales; tokens past `end` are zero-filled) NS - 1 tiles ahead of the one it computes. The
// 64-byte code rows are stored in 128-byte row pairs with their 16-byte chunks XOR-swizzled
// (position = ((row & 1) << 2 | chunk) ^ 2 * ((row >> 1) & 3)), so both the K reads (16 bytes,
// rows g / g+8) and the V reads (8 bytes, rows 2t..) are bank-conflict free.
// ================================================================================================

#define RING_STAGE 2432  // bytes per 16-token stage
#define ST_KC 0          // K codes, 16 rows x 64 B, swizzled
#define ST_VC 1024       // V codes, same
#define ST_KS 2048       // K block scales, 16 x 8 B (V's follow at 2176)
#define ST_KR 2304       // K row scales, 16 x fp32 (V's follow at 2368)

// byte offset of (row, 16-byte chunk) of a stage's code block (see the swizzle above)
__device__ __forceinline__ int ring_code_off(int row, int chunk) {
  return (row >> 1) * 128 + ((((row & 1) << 2) | chunk) ^ (((row >> 1) & 3) << 1)) * 16;
}

// The warp copies tokens [t0, t0 + 16) (those < end; the rest zero-filled) into stage `st`.
__device__ __forceinline__ void ring_fill(u32 st, const u8* __restrict__ codes,
                                          const u8* __restrict__ scales,
                                          const float* __restrict__ krs,
                                          const float* __restrict__ vrs, long kbase, long vbase,
                                          int t0, int end, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int c = lane + 32 * h, row = c >> 2, chunk = c & 3;
    const bool ok = t0 + row < end;
    const long tok = ok ? t0 + row : t0;  // a valid address either way
    const u32 off = ring_code_off(row, chunk);
    cp_async16(st + ST_KC + off, codes + (kbase + tok) * 64 + chunk * 16, ok ? 16u : 0u);
    cp_async16(st + ST_VC + off, codes + (vbase + tok) * 64 + chunk * 16, ok ? 16u : 0u);
  }
  const int row = lane & 15;
  const bool ok = t0 + row < end;
  const long tok = ok ? t0 + row : t0;
  cp_async8(st + ST_KS + 8 * lane, scales + ((lane < 16 ? kbase : vbase) + tok) * 8,
            ok ? 8u : 0u);
  cp_async4(st + ST_KR + 4 * lane, (lane < 16 ? krs : vrs) + tok, ok ? 4u : 0u);
}

// Where this lane's cp.async sources of the warp's next tile are: lane l copies code chunk
// l & 3 of rows l >> 2 and (l >> 2) + 8 (K and V), the block-scale row and row scale of token
// l & 15 (K for l < 16, V above). Advanced by one warp stride (WARPS tiles) per fill.
struct RingSrc {
  const u8* k;     // K code chunk, row l >> 2 (row + 8 at + 512)
  const u8* v;     // V code chunk
  const u8* s;     // 8-byte block-scale row
  const float* r;  // row scale
};

// Fill stage `st` with the warp's next tile (tokens t0 .. t0 + 15): a full tile from the running
// pointers (no per-row checks), the split's last, partial tile through ring_fill.
template <int WARPS>
__device__ __forceinline__ void ring_fill_next(u32 st, RingSrc& src, u32 dcode,
                                               const u8* __restrict__ codes,
                                               const u8* __restrict__ scales,
                                               const float* __restrict__ krs,
                                               const float* __restrict__ vrs, long kbase,
                                               long vbase, int t0, int end, int lane) {
  if (end - t0 >= TILE) {
    cp_async16(st + ST_KC + dcode, src.k, 16u);
    cp_async16(st + ST_KC + dcode + 512, src.k + 512, 16u);
    cp_async16(st + ST_VC + dcode, src.v, 16u);
    cp_async16(st + ST_VC + dcode + 512, src.v + 512, 16u);
    cp_async8(st + ST_KS + 8 * lane, src.s, 8u);
    cp_async4(st + ST_KR + 4 * lane, src.r, 4u);
  } else {
    ring_fill(st, codes, scales, krs, vrs, kbase, vbase, t0, end, lane);
  }
  src.k += WARPS * TILE * 64;
  src.v += WARPS * TILE * 64;
  src.s += WARPS * TILE * 8;
  src.r += WARPS * TILE;
}

// S^T = K Q^T of one stage: rows tokens g (c0, c1) and g + 8 (c2, c3), columns heads 2t, 2t+1
// (offk: ring_code_off(g, t); qb: Q as B fragments, load_q_frags).
__device__ __forceinline__ void stage_scores(const u8* st, int offk, int g, int t,
                                             const u32 (&qb)[8][2], float (&s)[2][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) s[0][i] = s[1][i] = 0.f;
  const uint4 kv0 = *(const uint4*)(st + ST_KC + offk);
  const uint4 kv1 = *(const uint4*)(st + ST_KC + offk + 512);
  const u32 k0[4] = {kv0.x, kv0.y, kv0.z, kv0.w}, k1[4] = {kv1.x, kv1.y, kv1.z, kv1.w};
  const u32 s20 = e4m3x2_to_f16x2(*(const u16*)(st + ST_KS + 8 * g + 2 * t));
  const u32 s21 = e4m3x2_to_f16x2(*(const u16*)(st + ST_KS + 8 * (g + 8) + 2 * t));
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const u32 sel = w < 2 ? 0x1010u : 0x3232u;  // block 2t (words 0, 1) or 2t + 1
    const u32 sc0 = __byte_perm(s20, 0u, sel), sc1 = __byte_perm(s21, 0u, sel);
    u32 lo0, hi0, lo1, hi1;
    fp4_bytes(k0[w], lo0, hi0);
    fp4_bytes(k1[w], lo1, hi1);
    mma_f16(s[0], hmul2(h2_b01(lo0), sc0), hmul2(h2_b01(lo1), sc1), hmul2(h2_b23(lo0), sc0),
            hmul2(h2_b23(lo1), sc1), qb[2 * w][0], qb[2 * w][1]);
    mma_f16(s[1], hmul2(h2_b01(hi0), sc0), hmul2(h2_b01(hi1), sc1), hmul2(h2_b23(hi0), sc0),
            hmul2(h2_b23(hi1), sc1), qb[2 * w + 1][0], qb[2 * w + 1][1]);
  }
}

// The rest of one stage (tokens t0 .. t0 + 15, those < end) given its scores s: online softmax
// (running m, l of heads 2t, 2t+1), rescale of acc, then O^T += V^T P^T: lane's V rows 2t, 2t+1
// (pair 0) and 2t+8, 2t+9 (pair 1) (offv0 / offv1: ring_code_off of V rows 2t / 2t+1).
__device__ __forceinline__ void stage_softmax_pv(const u8* st, const float (&s)[2][4], int offv0,
                                                 int offv1, int g, int t, int t0, int end,
                                                 float kgain, float& m0, float& m1, float& l0,
                                                 float& l1, float (&acc)[8][4]) {
  const float* rk = (const float*)(st + ST_KR);
  const float* rv = (const float*)(st + ST_KR + 64);
  const float g0 = rk[g] * kgain, g1 = rk[g + 8] * kgain;
  const SoftmaxTile p =
      online_softmax_tile(s, g0, g1, t0 + g < end, t0 + g + 8 < end, m0, m1, l0, l1);
  const float v0 = rv[g] * FP16_GAIN, v1 = rv[g + 8] * FP16_GAIN;
  // P^T fragments: b0 = heads g x tokens 2t, 2t+1; b1 = tokens 2t+8, 2t+9
  const u32 pb0 = movm_trans(pack_h2(p.p0 * v0, p.p1 * v0));
  const u32 pb1 = movm_trans(pack_h2(p.p2 * v1, p.p3 * v1));
  rescale_acc(acc, p.al0, p.al1);
  const uint2 va = *(const uint2*)(st + ST_VC + offv0);
  const uint2 vb = *(const uint2*)(st + ST_VC + offv1);
  const uint2 vc = *(const uint2*)(st + ST_VC + offv0 + 512);
  const uint2 vd = *(const uint2*)(st + ST_VC + offv1 + 512);
  const u8* vsc = st + ST_KS + 128 + 16 * t + g;  // V block scale g of row 2t
  const u32 sv0 = e4m3x2_to_f16x2(__byte_perm(vsc[0], vsc[8], 0x0040u));
  const u32 sv1 = e4m3x2_to_f16x2(__byte_perm(vsc[64], vsc[72], 0x0040u));
  const u32 w0[2] = {va.x, va.y}, w1[2] = {vb.x, vb.y};
  const u32 w2[2] = {vc.x, vc.y}, w3[2] = {vd.x, vd.y};
#pragma unroll
  for (int k = 0; k < 2; ++k) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const u32 sel = h ? 0x7362u : 0x5140u;
      u32 lo0, hi0, lo1, hi1;
      fp4_bytes(__byte_perm(w0[k], w1[k], sel), lo0, hi0);
      fp4_bytes(__byte_perm(w2[k], w3[k], sel), lo1, hi1);
      const int mt = 2 * (2 * k + h);
      mma_f16(acc[mt], hmul2(h2_b01(lo0), sv0), hmul2(h2_b01(hi0), sv0),
              hmul2(h2_b01(lo1), sv1), hmul2(h2_b01(hi1), sv1), pb0, pb1);
      mma_f16(acc[mt + 1], hmul2(h2_b23(lo0), sv0), hmul2(h2_b23(hi0), sv0),
              hmul2(h2_b23(lo1), sv1), hmul2(h2_b23(hi1), sv1), pb0, pb1);
    }
  }
}

// KVQ: the FP4 KV append of the newest token (position len - 1, as quant.kv_append_fp4, bit for
// bit) by the CTAs of the split that holds it, one per kv head: each reads the token's whole K
// and V rows (kv_new bf16 [2, B, HKV * 128]: the per-token scale_2 is over all kv heads); the
// warp of its kv head quantizes that head from registers into `tok` (shared memory: per kind
// 64 code bytes, 8 scale bytes, scale_2), then writes them to the cache, with its head's part of
// the compact guidance record (rows k: b, v: B + b; head 0's CTA the token's scale_2 in the
// cache and the record). The CTA's own ring never reads that row from the cache: its loads
// stop before it (issued before this, so they overlap the append) and `patch_newest_row` puts
// `tok` into the stage instead. Needs hkv <= WARPS (cuda_attn checks it). Ends with a barrier.
struct alignas(16) NewestToken {
  u8 codes[2][64];
  u8 scales[2][8];
  float g[2];
};

template <int WARPS>
__device__ __forceinline__ void append_newest_token(const u16* __restrict__ kv_new, u8* codes,
                                                    u8* scales, float* rs, u8* r_mbits,
                                                    u8* r_scales, float* r_g, int n_batch,
                                                    int b, int hk, int hkv, int cap, int pos,
                                                    NewestToken& tok) {
  __shared__ float amax_s[2][WARPS];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, width = hkv * HEAD_D;
  float x[2][4], bamax[2];
#pragma unroll
  for (int kind = 0; kind < 2; ++kind) {
    const int e = 4 * threadIdx.x;
    if (e < width) {
      load_bf16x4_cg(kv_new + (long)(kind * n_batch + b) * width + e, x[kind]);
    } else {
      x[kind][0] = x[kind][1] = x[kind][2] = x[kind][3] = 0.f;
    }
  }
#pragma unroll
  for (int kind = 0; kind < 2; ++kind) {
    bamax[kind] = quad_block_amax(x[kind]);
    float wmax = bamax[kind];
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) wmax = fmaxf(wmax, __shfl_xor_sync(0xffffffffu, wmax, o));
    if (lane == 0) amax_s[kind][warp] = wmax;
  }
  __syncthreads();
  if (warp == hk) {
#pragma unroll
    for (int kind = 0; kind < 2; ++kind) {
      float amax = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) amax = fmaxf(amax, amax_s[kind][w]);
      const float g = nvfp4_scale_2(amax);
      const int r = kind * n_batch + b;  // the record's row
      NVFP4RowOut o = nvfp4_row_out(tok.codes[kind], tok.scales[kind], &tok.g[kind]);
      if (r_mbits) {  // the head's part of the row: blocks 8 hk ..
        o.mbits = r_mbits + (long)r * (width / 8) + hk * (HEAD_D / 8);
        o.rec_scales = r_scales + (long)r * (width / 16) + hk * (HEAD_D / 16);
      }
      nvfp4_quantize_quarter(x[kind], bamax[kind], g, lane >> 2, lane & 3, o);
      if (lane == 0) {
        tok.g[kind] = g;
        if (hk == 0) {
          rs[(long)r * cap + pos] = g;
          if (r_mbits) r_g[r] = g;
        }
      }
    }
    __syncwarp();
    if (lane < 10) {  // the head's codes (4 x 16 B per kind) and block scales (8 B) to the cache
      const int kind = lane < 8 ? lane >> 2 : lane - 8;
      const long at = ((long)(kind * n_batch + b) * hkv + hk) * cap + pos;  // (kind, b, hk, pos)
      if (lane < 8) {
        *reinterpret_cast<uint4*>(codes + at * 64 + (lane & 3) * 16) =
            *reinterpret_cast<const uint4*>(tok.codes[kind] + (lane & 3) * 16);
      } else {
        *reinterpret_cast<uint2*>(scales + at * 8) = *reinterpret_cast<const uint2*>(tok.scales[kind]);
      }
    }
  }
  __syncthreads();  // tok complete for every warp
}

// The newest token's row (row rr of stage st, whose cp.async left it zero) from `tok`: lanes
// 0-7 the code chunks, 8-9 the block scales, 10-11 the row scales. The caller syncs the warp
// before and after.
__device__ __forceinline__ void patch_newest_row(u8* st, int rr, const NewestToken& tok,
                                                 int lane) {
  if (lane < 8) {
    const int kind = lane >> 2, c = lane & 3;
    *reinterpret_cast<uint4*>(st + (kind ? ST_VC : ST_KC) + ring_code_off(rr, c)) =
        *reinterpret_cast<const uint4*>(tok.codes[kind] + c * 16);
  } else if (lane < 10) {
    const int kind = lane - 8;
    *reinterpret_cast<uint2*>(st + ST_KS + kind * 128 + 8 * rr) =
        *reinterpret_cast<const uint2*>(tok.scales[kind]);
  } else if (lane < 12) {
    const int kind = lane - 10;
    *reinterpret_cast<float*>(st + ST_KR + kind * 64 + 4 * rr) = tok.g[kind];
  }
}

// FUSED: one launch for the whole attention (the small-batch step): the CTA that finishes a
// (sequence, kv head) last combines its splits into `out` (attn_common.cuh; counters [B, HKV]
// zero before and after), and as a programmatic dependent launch it waits (griddepcontrol) for
// the kernel before it (the KV append) and lets the o projection start at once. Not FUSED:
// partials only (counters, out unused), combined by the Triton reduce kernel. KVQ: the split
// holding the newest token appends it to the FP4 cache while its ring loads the older rows, and
// takes the new row from shared memory (append_newest_token; kv_new and the record pointers,
// else unused).
template <int WARPS, int MINB, int NS, bool FUSED = false, bool KVQ = false>
__global__ void __launch_bounds__(WARPS * 32, MINB) attn_fp4_ring(
    const u16* __restrict__ q,          // bf16 [B, HQ, 128]
    const u8* __restrict__ codes,       // [2, B, HKV, S, 64]
    const u8* __restrict__ scales,      // [2, B, HKV, S, 8]
    const float* __restrict__ rs,       // [2, B, S]
    const int* __restrict__ lens,       // [B] valid tokens (new one included)
    float* __restrict__ part_o,         // [B, HQ, NSPLIT, 128] unnormalized partial outputs
    float* __restrict__ part_ml,        // [B, HQ, NSPLIT, 2] max (log2 domain), sum
    int n_batch, int hkv, int cap, int chunk, int nsplit, float qk_scale,
    int* __restrict__ counters,         // FUSED: [B, HKV]
    u16* __restrict__ out,              // FUSED: bf16 [B, HQ * 128]
    const u16* __restrict__ kv_new,     // KVQ: bf16 [2, B, HKV * 128] the new token's k, v
    u8* __restrict__ r_mbits, u8* __restrict__ r_scales,  // KVQ: its record (or null), rows
    float* __restrict__ r_g) {                            // [2 B, HKV * 128]
  static_assert(NS >= 2, "a ring needs two stages");
  static_assert(NS * RING_STAGE >= GROUP * (HEAD_D + 4) * 4, "merge buffer aliases the ring");
  __shared__ alignas(128) u8 ring[WARPS][NS][RING_STAGE];
  __shared__ float ml_s[WARPS][GROUP][2];

  const int sp = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int len = lens[b];
  const int start = sp * chunk;
  if (start >= len) return;  // past the sequence's end: the reduce skips this split
  if (FUSED) {  // lens was written by an earlier step; the cache and q by the kernel before
    pdl_wait();
    pdl_launch_dependents();
  }
  const int end = min(start + chunk, len);
  // KVQ: this CTA appends the newest token (position end - 1) and loads only the rows before it
  const bool append = KVQ && end == len;
  const int load_end = append ? end - 1 : end;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int hq = hkv * GROUP;

  const long kbase = ((long)b * hkv + hk) * cap;
  const long vbase = ((long)(n_batch + b) * hkv + hk) * cap;
  const float* krs = rs + (long)b * cap;
  const float* vrs = rs + (long)(n_batch + b) * cap;
  const int ntiles = (end - start + TILE - 1) / TILE;
  const int nj = warp < ntiles ? (ntiles - warp + WARPS - 1) / WARPS : 0;  // this warp's tiles
  const u32 ring0 = smem_addr(&ring[warp][0][0]);
  const long first = start + warp * TILE;  // the warp's first tile
  RingSrc src;
  src.k = codes + (kbase + first + (lane >> 2)) * 64 + (lane & 3) * 16;
  src.v = codes + (vbase + first + (lane >> 2)) * 64 + (lane & 3) * 16;
  src.s = scales + ((lane < 16 ? kbase : vbase) + first + (lane & 15)) * 8;
  src.r = (lane < 16 ? krs : vrs) + first + (lane & 15);
  const u32 dcode = ring_code_off(lane >> 2, lane & 3);

  // Q first: issued after the first stages' copies, its loads waited behind up to the whole
  // wave's KV bytes (ncu, batch 32 at 1K: a fifth of all stall samples on its conversion)
  uint4 qraw[4];
  load_q_raw(q + ((long)b * hq + hk * GROUP + g) * HEAD_D, t, qraw);
#pragma unroll
  for (int s = 0; s < NS - 1; ++s) {
    if (s < nj)
      ring_fill_next<WARPS>(ring0 + s * RING_STAGE, src, dcode, codes, scales, krs, vrs, kbase,
                            vbase, start + (warp + WARPS * s) * TILE, load_end, lane);
    cp_async_commit();
  }
  __shared__ NewestToken tok;
  if (append)  // while the older rows are in flight
    append_newest_token<WARPS>(kv_new, const_cast<u8*>(codes), const_cast<u8*>(scales),
                               const_cast<float*>(rs), r_mbits, r_scales, r_g, n_batch, b, hk,
                               hkv, cap, len - 1, tok);

  // Q of head g as the B fragments (b0, b1) of 8 k-tiles (the same registers as the A
  // fragments above: the k index of both is 2t + (0, 1 | 8, 9))
  u32 qb[8][2];
  q_frags(qraw, qb);

  // loop-invariant shared-memory offsets of this lane's fragments
  const int offk = ring_code_off(g, t);             // K row g (row g + 8: + 512)
  const int offv0 = ring_code_off(2 * t, g >> 1) + 8 * (g & 1);      // V row 2t (2t+8: + 512)
  const int offv1 = ring_code_off(2 * t + 1, g >> 1) + 8 * (g & 1);  // V row 2t+1
  const float kgain = FP16_GAIN * qk_scale;

  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;  // heads 2t, 2t+1
  float acc[8][4];
#pragma unroll
  for (int r = 0; r < 8; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.f;

  // Stage j of the warp's ring holds its tile j (token t0(j)); the fill of tile j + NS - 1
  // goes into the slot of tile j - 1 once every lane has finished reading it.
  auto t0_of = [&](int j) { return start + (warp + WARPS * j) * TILE; };
  for (int j = 0; j < nj; ++j) {
    cp_async_wait<NS - 2>();
    __syncwarp();  // every lane's copies of stage j landed; stage j - 1 is no longer read
    const int jn = j + NS - 1;
    if (jn < nj)
      ring_fill_next<WARPS>(ring0 + (jn % NS) * RING_STAGE, src, dcode, codes, scales, krs, vrs,
                            kbase, vbase, t0_of(jn), load_end, lane);
    cp_async_commit();
    u8* st = &ring[warp][j % NS][0];
    if (append && t0_of(j) + TILE >= end) {  // the tile holding the newest token
      patch_newest_row(st, end - 1 - t0_of(j), tok, lane);
      __syncwarp();
    }
    float s[2][4];
    stage_scores(st, offk, g, t, qb, s);
    stage_softmax_pv(st, s, offv0, offv1, g, t, t0_of(j), end, kgain, m0, m1, l0, l1, acc);
  }
  cp_async_wait<0>();

  // ---- merge the warps through shared memory (the ring is free once every warp is done)
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o);
  }
  __syncthreads();
  float* o_w = (float*)&ring[warp][0][0];  // [GROUP][HEAD_D + 4] of this warp
#pragma unroll
  for (int mt = 0; mt < 8; ++mt) {
    const int d = 16 * g + 2 * mt;
    float2 e, o;  // head 2t, head 2t + 1 at d, d + 1
    e.x = acc[mt][0];
    e.y = acc[mt][2];
    o.x = acc[mt][1];
    o.y = acc[mt][3];
    *(float2*)&o_w[(2 * t) * (HEAD_D + 4) + d] = e;
    *(float2*)&o_w[(2 * t + 1) * (HEAD_D + 4) + d] = o;
  }
  if (g == 0) {
    ml_s[warp][2 * t][0] = m0;
    ml_s[warp][2 * t][1] = l0;
    ml_s[warp][2 * t + 1][0] = m1;
    ml_s[warp][2 * t + 1][1] = l1;
  }
  __syncthreads();
  const long row0 = ((long)b * hq + hk * GROUP) * nsplit;
  merge_warps<WARPS>((const float*)&ring[0][0][0], NS * RING_STAGE / 4, ml_s, part_o, part_ml,
                     row0 + sp, nsplit);
  if (!FUSED) return;
  const int nvalid = min(nsplit, (len + chunk - 1) / chunk);
  if (!last_split_cta(counters + (long)b * hkv + hk, nvalid)) return;
  combine_splits<WARPS * 32>(part_o, part_ml, out + ((long)b * hq + hk * GROUP) * HEAD_D, row0,
                             nsplit, nvalid);
}
