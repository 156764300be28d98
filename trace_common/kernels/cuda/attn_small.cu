// Decode attention over the contiguous BF16 KV cache in one launch (Hopper, mma.sync): split-KV
// flash-decoding and, in the CTA that finishes a (sequence, kv head) last, the combine of its
// splits (attn_common.cuh), so there is no reduce kernel. Made for the batch-1 step, where the
// attention is all latency (2 MB of KV per layer at 1K context).
//
// Cache (trace_common/kernels/attention.py): values bf16 [2, B, HKV, S, 128], kv = 0 for K.
//
// One CTA = (split, kv head, sequence); its WARPS warps take the split's 16-token tiles in
// turn (loads of the next tile in flight while one is computed) and merge through shared
// memory; the partials go to the Triton kernels' scratch layout. Per tile, as attn_fp4_ring
// (swap-AB, no MMA row wasted):
//   S^T = K Q^T: A = K (16 tokens x 16 d), B = Q^T (16 d x 8 heads); 8 m16n8k16 per tile.
//     The sum over d is order-free, so lane (g, t) reads 16 bytes, d = 32c + 8t .. + 8 of each
//     32-wide chunk c, of K rows g and g + 8 and of Q row g (the same d order); words 0, 1 feed
//     one MMA and words 2, 3 the next.
//   O^T += V^T P^T: A = V^T (16 d x 16 tokens), B = P^T (16 tokens x 8 heads) from the S^T
//     accumulators (bf16, as the Triton kernel rounds p) by movmatrix.trans. Lane (g, t) reads
//     V rows 2t, 2t+1, 2t+8, 2t+9 at d = 8g .. + 8 and 64 + 8g .. + 8 (8 lanes cover 128
//     contiguous bytes per load); m-tile mt (< 4: first half, else second) holds d = 8g + 2mt'
//     (rows g) and d + 1 (rows g + 8), mt' = mt & 3, + 64 for mt >= 4: a PRMT pairs the two
//     tokens' values of one d.
//
// Programmatic dependent launch (cuda_launch.launch_ex): before `griddepcontrol.wait` a warp
// already loads its first tile's tokens older than the newest one (lens[b] - 1): those were
// written by earlier decode steps, and the kernel before this one (the qkv projection, which
// appends the newest K/V) writes only the newest position. The newest row, q and the scratch
// are touched only after the wait. `griddepcontrol.launch_dependents` right after the wait lets
// the o projection start streaming its weights while the attention runs. Launched normally,
// both are no-ops (and the kernel before has completed anyway).
//
// No system headers: compiled by NVRTC (CuPy RawModule, -I on this folder) or nvcc alike.

#include "attn_common.cuh"

// read-only streaming load (old cache rows: nobody writes them while this kernel runs)
__device__ __forceinline__ uint4 ldg_nc_v4(const u16* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// coherent load (the newest row, written by the kernel before this one)
__device__ __forceinline__ uint4 ldg_cg_v4(const u16* p) {
  uint4 r;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p) : "memory");
  return r;
}

__device__ __forceinline__ u32 word_of(const uint4& v, int w) {
  return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

__device__ __forceinline__ uint4 zero4() {
  uint4 z;
  z.x = z.y = z.z = z.w = 0u;
  return z;
}

// One lane's share of one 16-token tile (64 registers).
struct TileBf16 {
  uint4 k[2][4];  // K rows g (n = 0) and g + 8, chunk c: d = 32c + 8t .. + 8
  uint4 v[4][2];  // V rows 2t, 2t+1, 2t+8, 2t+9 (j): d = 8g .. + 8 (h = 0), 64 + 8g .. (h = 1)
};

__device__ __forceinline__ int k_tok(int t0, int n, int g) { return t0 + 8 * n + g; }
__device__ __forceinline__ int v_tok(int t0, int j, int t) { return t0 + 8 * (j >> 1) + 2 * t + (j & 1); }

// Tokens t0 .. t0 + 15 below `hi` from the cache (read-only path), the others zero.
__device__ __forceinline__ void tile_load(TileBf16& r, const u16* __restrict__ kv, long kbase,
                                          long vbase, int t0, int hi, int g, int t) {
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const int tok = k_tok(t0, n, g);
    const u16* p = kv + (kbase + tok) * HEAD_D + 8 * t;
#pragma unroll
    for (int c = 0; c < 4; ++c) r.k[n][c] = tok < hi ? ldg_nc_v4(p + 32 * c) : zero4();
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int tok = v_tok(t0, j, t);
    const u16* p = kv + (vbase + tok) * HEAD_D + 8 * g;
    r.v[j][0] = tok < hi ? ldg_nc_v4(p) : zero4();
    r.v[j][1] = tok < hi ? ldg_nc_v4(p + 64) : zero4();
  }
}

// The rows of token `tok` (if in this tile) from the cache, coherently (just written).
__device__ __forceinline__ void tile_patch(TileBf16& r, const u16* __restrict__ kv, long kbase,
                                           long vbase, int t0, int tok, int g, int t) {
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    if (k_tok(t0, n, g) != tok) continue;
    const u16* p = kv + (kbase + tok) * HEAD_D + 8 * t;
#pragma unroll
    for (int c = 0; c < 4; ++c) r.k[n][c] = ldg_cg_v4(p + 32 * c);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (v_tok(t0, j, t) != tok) continue;
    const u16* p = kv + (vbase + tok) * HEAD_D + 8 * g;
    r.v[j][0] = ldg_cg_v4(p);
    r.v[j][1] = ldg_cg_v4(p + 64);
  }
}

template <int WARPS>
__global__ void __launch_bounds__(WARPS * 32) attn_bf16_fused(
    const u16* __restrict__ q,     // bf16 [B, HQ, 128]
    const u16* __restrict__ kv,    // bf16 [2, B, HKV, S, 128]
    const int* __restrict__ lens,  // [B] valid tokens (new one included), >= 1
    float* __restrict__ part_o,    // [B, HQ, NSPLIT, 128] scratch
    float* __restrict__ part_ml,   // [B, HQ, NSPLIT, 2] scratch
    int* __restrict__ counters,    // [B, HKV] zero (and zero again after the launch)
    u16* __restrict__ out,         // bf16 [B, HQ * 128]
    int n_batch, int hkv, int cap, int chunk, int nsplit, float qk_scale) {
  __shared__ __align__(16) float o_s[WARPS][GROUP][HEAD_D + 4];
  __shared__ float ml_s[WARPS][GROUP][2];

  const int sp = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int len = lens[b];  // written by an earlier step (see the header)
  const int start = sp * chunk;
  if (start >= len) return;  // past the sequence's end: not counted (nvalid below)
  const int end = min(start + chunk, len);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int hq = hkv * GROUP;
  const long kbase = ((long)b * hkv + hk) * cap;
  const long vbase = ((long)(n_batch + b) * hkv + hk) * cap;
  const int ntiles = (end - start + TILE - 1) / TILE;
  const int newest = len - 1;

  TileBf16 cur;
  const int t_first = start + warp * TILE;
  if (warp < ntiles) tile_load(cur, kv, kbase, vbase, t_first, min(end, newest), g, t);
  pdl_wait();
  pdl_launch_dependents();
  if (warp < ntiles && newest >= t_first && newest < t_first + TILE)
    tile_patch(cur, kv, kbase, vbase, t_first, newest, g, t);

  // Q of head g as B fragments: chunk c, words (x, y) for the first MMA, (z, w) for the second
  uint4 qb[4];
  {
    const u16* qrow = q + ((long)b * hq + hk * GROUP + g) * HEAD_D + 8 * t;
#pragma unroll
    for (int c = 0; c < 4; ++c) qb[c] = ldg_cg_v4(qrow + 32 * c);
  }

  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;  // heads 2t, 2t+1
  float acc[8][4];
#pragma unroll
  for (int r = 0; r < 8; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.f;

  for (int i = warp; i < ntiles; i += WARPS) {
    const int t0 = start + i * TILE;
    TileBf16 nxt;
    if (i + WARPS < ntiles) tile_load(nxt, kv, kbase, vbase, t0 + WARPS * TILE, end, g, t);

    // ---- S^T = K Q^T: rows tokens g (c0, c1) and g + 8 (c2, c3), columns heads 2t, 2t+1
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const uint4 k0 = cur.k[0][c], k1 = cur.k[1][c];
      mma_bf16(s[0], k0.x, k1.x, k0.y, k1.y, qb[c].x, qb[c].y);
      mma_bf16(s[1], k0.z, k1.z, k0.w, k1.w, qb[c].z, qb[c].w);
    }
    const SoftmaxTile p = online_softmax_tile(s, qk_scale, qk_scale, t0 + g < end,
                                              t0 + g + 8 < end, m0, m1, l0, l1);
    // P^T fragments: b0 = heads g x tokens 2t, 2t+1; b1 = tokens 2t+8, 2t+9
    const u32 pb0 = movm_trans(attn_f32x2_to_bf16x2(p.p0, p.p1));
    const u32 pb1 = movm_trans(attn_f32x2_to_bf16x2(p.p2, p.p3));
    rescale_acc(acc, p.al0, p.al1);

    // ---- O^T += V^T P^T: a0/a1 = d, d + 1 of tokens 2t, 2t+1; a2/a3 of tokens 2t+8, 2t+9
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) {
      const int h = mt >> 2, w = mt & 3;
      const u32 v0 = word_of(cur.v[0][h], w), v1 = word_of(cur.v[1][h], w);
      const u32 v2 = word_of(cur.v[2][h], w), v3 = word_of(cur.v[3][h], w);
      mma_bf16(acc[mt], __byte_perm(v0, v1, 0x5410u), __byte_perm(v0, v1, 0x7632u),
               __byte_perm(v2, v3, 0x5410u), __byte_perm(v2, v3, 0x7632u), pb0, pb1);
    }
    cur = nxt;
  }

  // ---- merge the warps through shared memory, write this split's partials
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o);
  }
#pragma unroll
  for (int mt = 0; mt < 8; ++mt) {
    const int d = 8 * g + 2 * (mt & 3) + 64 * (mt >> 2);
    float2 e, o;  // head 2t, head 2t + 1 at d, d + 1
    e.x = acc[mt][0];
    e.y = acc[mt][2];
    o.x = acc[mt][1];
    o.y = acc[mt][3];
    *(float2*)&o_s[warp][2 * t][d] = e;
    *(float2*)&o_s[warp][2 * t + 1][d] = o;
  }
  if (g == 0) {
    ml_s[warp][2 * t][0] = m0;
    ml_s[warp][2 * t][1] = l0;
    ml_s[warp][2 * t + 1][0] = m1;
    ml_s[warp][2 * t + 1][1] = l1;
  }
  __syncthreads();
  const long row0 = ((long)b * hq + hk * GROUP) * nsplit;
  merge_warps<WARPS>(&o_s[0][0][0], GROUP * (HEAD_D + 4), ml_s, part_o, part_ml, row0 + sp,
                     nsplit);

  // ---- the last split of (b, hk) to finish combines them all
  const int nvalid = min(nsplit, (len + chunk - 1) / chunk);
  if (!last_split_cta(counters + (long)b * hkv + hk, nvalid)) return;
  combine_splits<WARPS * 32>(part_o, part_ml, out + ((long)b * hq + hk * GROUP) * HEAD_D, row0,
                             nsplit, nvalid);
}
