// Grouped routed-expert GEMM, W4A4 NVFP4, for decode-sized token counts (Hopper, mma.sync).
//
// out[pair, n] = sum_k A[pair / a_div, k] * W[expert(pair), n, k]   (GATED: silu(gate) * up)
//
// Swap-AB: the weights are the MMA's A operand (16 output features per tile) and the tokens of
// one expert block are its B operand (8 per n-tile), so a block of <= 8 tokens wastes nothing.
//
// Weights are re-packed once at load (trace_common/kernels/cuda_moe.py, `pack_fp4_weights`):
// one 32-bit word holds the 8 E2M1 codes one lane needs for one m16n8k16 A fragment, with
// their bits placed so that each fp16x2 fragment register is 1-4 integer ops away:
//   fp16 bits of an E2M1 code c = (c & 8) << 12 | (c & 7) << 9  ==  value(c) * 2**-14
// (code 0b001 becomes the fp16 subnormal 2**-15 = 0.5 * 2**-14). The e4m3 block scale covers
// exactly one 16-wide k-tile, so each register gets one fp16 multiply by its row's scale:
// code * scale * 2**-14 is exact in fp16 (<= 6 significant bits, >= 2**-24, <= 0.17).
// Activations arrive already decoded the same way (fp16 code * block scale * 2**-14, written
// by the quantize kernel in B-fragment order), so every product is exact and the fp32
// accumulator differs from the reference only by summation order. The epilogue multiplies by
// 2**28, the activation row's and the expert's fp32 second-level scales (and the routing
// weight), then rounds to bf16.
//
// One CTA = WK warps over one expert block (NT*8 token slots) and RW output tiles of 16
// features (GATED: RW gate tiles + the RW matching up tiles); the warps split K (KGW groups
// of 64 per warp, all loads issued up front) and reduce through shared memory. MINB is the
// CTAs per SM asked of the register allocator (__launch_bounds__).
//
// No system headers: compiled by NVRTC (CuPy RawModule, -I on this folder) or nvcc alike.

#include "fp4_common.cuh"

#define FP16_GAIN_SQ 268435456.0f  // (2**14)**2: the fp16 decode gains of both operands

__device__ __forceinline__ void ldg_v4(const u32* p, u32& a, u32& b, u32& c, u32& d) {
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p));
}

__device__ __forceinline__ void ldg_v2(const u32* p, u32& a, u32& b) {
  asm("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(a), "=r"(b) : "l"(p));
}

__device__ __forceinline__ u16 f32_to_bf16(float v) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}

// One packed word -> the 4 fp16x2 A-fragment registers (value * 2**-14, unscaled).
// Bit layout (see pack_fp4_weights): register r, half h takes its magnitude bits (m, e0, e1)
// from word bits MAG[r] + 16 h .. +2 and its sign from SIGN[r] + 16 h, with
// MAG = (0, 3, 7, 10), SIGN = (6, 15, 13, 14).
__device__ __forceinline__ void decode_word(u32 w, u32& r0, u32& r1, u32& r2, u32& r3) {
  r0 = (w << 9) & 0x8E008E00u;
  r1 = ((w << 6) & 0x0E000E00u) | (w & 0x80008000u);
  r2 = (w << 2) & 0x8E008E00u;
  r3 = ((w >> 1) & 0x0E000E00u) | ((w << 1) & 0x80008000u);
}

// e4m3 scale bytes (row g, row g+8) of k-tile q, taken from the packed scale word `s` (k-tiles
// 2i, 2i+1 in its low, high half), -> fp16x2; the half is picked in PTX (a register half, no shift).
template <int Q>
__device__ __forceinline__ u32 tile_scale(u32 s) {
  u32 r;
  if (Q & 1) {
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, hi; }" : "=r"(r) : "r"(s));
  } else {
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(r) : "r"(s));
  }
  return r;
}

// Multiply the decoded A fragment by its rows' block scales sc = (row g, row g+8) in fp16x2:
// a0, a2 hold row g, a1, a3 row g+8. Each half is broadcast in PTX ({lo, lo}), which ptxas
// can fold into the HMUL2's operand selector instead of a PRMT. Exact (see the header).
__device__ __forceinline__ void scale_fragment(u32 sc, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm("{ .reg .b16 lo, hi; .reg .b32 slo, shi;\n\t"
      "mov.b32 {lo, hi}, %4;\n\tmov.b32 slo, {lo, lo};\n\tmov.b32 shi, {hi, hi};\n\t"
      "mul.rn.f16x2 %0, %0, slo;\n\tmul.rn.f16x2 %1, %1, shi;\n\t"
      "mul.rn.f16x2 %2, %2, slo;\n\tmul.rn.f16x2 %3, %3, shi; }"
      : "+r"(r0), "+r"(r1), "+r"(r2), "+r"(r3) : "r"(sc));
}

// Row of pair p in the activations, p / a_div, from the host's a_mul = ceil(2**32 / a_div)
// (2**32 for a_div = 1; cuda_moe.row_multiplier): the high word of p * a_mul, exact while
// p * a_div < 2**32. Two multiplies, no branch or select: the integer division it replaces
// (~25 dependent instructions and their registers) sat in the loads' address chain.
__device__ __forceinline__ int pair_row(int p, unsigned long long a_mul) {
  return (int)(__umulhi((u32)p, (u32)a_mul) + (u32)p * (u32)(a_mul >> 32));
}

// One warp's copy of a ring stage: KGW 64-wide k groups of a 16-row weight tile (512 bytes
// each: `words` at the lane's 4 words of the first) to `dst`, then their packed scales (lanes
// < 4 KGW: 16 bytes each from `scales`) right after them. cp.async; the caller commits.
template <int KGW>
__device__ __forceinline__ void copy_tile_stage(u32 dst, const u32* words, const u32* scales,
                                                int lane) {
#pragma unroll
  for (int kk = 0; kk < KGW; ++kk) cp_async16(dst + kk * 512 + lane * 16, words + kk * 128);
  if (lane < KGW * 4) cp_async16(dst + KGW * 512 + lane * 16, scales);
}

// Epilogue scalars of token slot threadIdx.x of expert block `blk`, held in registers until
// `put` stores those of threads < BT for the epilogue: its pair (`load_pair`), the activation
// row's second-level scale and the routing weight (1 unless mul_route_w) (`load_scales`).
// Every thread loads (threads >= BT slot 0's, unused): no divergent branch in the prologue.
struct SlotScalars {
  int pair = 0;
  float xg = 0.f, rw = 1.f;

  template <int BT>
  __device__ __forceinline__ void load_pair(const int* sorted_pair, int blk) {
    pair = sorted_pair[blk * BT + (threadIdx.x < BT ? threadIdx.x : 0)];
  }

  __device__ __forceinline__ void load_scales(const float* x_g, const float* route_w, int n_pairs,
                                              unsigned long long a_mul, int mul_route_w) {
    const bool ok = pair < n_pairs;
    xg = ok ? x_g[pair_row(pair, a_mul)] : 0.f;
    rw = ok && mul_route_w ? route_w[pair] : 1.f;
  }

  template <int BT>
  __device__ __forceinline__ void load(const int* sorted_pair, const float* x_g,
                                       const float* route_w, int blk, int n_pairs,
                                       unsigned long long a_mul, int mul_route_w) {
    load_pair<BT>(sorted_pair, blk);
    load_scales(x_g, route_w, n_pairs, a_mul, mul_route_w);
  }

  template <int BT>
  __device__ __forceinline__ void put(int* pair_s, float* xg_s, float* rw_s) const {
    if (threadIdx.x < BT) {
      pair_s[threadIdx.x] = pair;
      xg_s[threadIdx.x] = xg;
      rw_s[threadIdx.x] = rw;
    }
  }
};

// B fragments of a warp's K slice (KGW k groups from group kg0) for expert block `blk`: token
// slot nt*8 + g, k-tile kk, lane quad t; padding slots are zero. PAIRS: block blk is pair blk
// alone (slot 0), sorted_pair unread.
template <int NT, int KGW, int KT, bool PAIRS = false>
__device__ __forceinline__ void load_b_fragments(u32 (&b)[KGW * 4][NT][2], const u32* x_dq,
                                                 const int* sorted_pair, int blk, int kg0, int g,
                                                 int t, int n_pairs,
                                                 unsigned long long a_mul) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int pair = PAIRS ? (nt == 0 && g == 0 ? blk : n_pairs)
                           : sorted_pair[blk * NT * 8 + nt * 8 + g];
    const bool valid = pair < n_pairs;
    const long row = valid ? pair_row(pair, a_mul) : 0;
    const u32* xp = x_dq + ((row * KT + kg0 * 4) * 4 + t) * 2;
#pragma unroll
    for (int kk = 0; kk < KGW * 4; ++kk) {
      if (valid) {
        ldg_v2(xp + kk * 8, b[kk][nt][0], b[kk][nt][1]);
      } else {
        b[kk][nt][0] = 0u;
        b[kk][nt][1] = 0u;
      }
    }
  }
}

// acc += (packed word of k-tile Q of its group, decoded and block-scaled by the scale word sw)
// x the B fragments bq of that k-tile, for each n-tile. RAW (timing probe only): the word goes
// to the MMA undecoded.
template <int NT, int Q, bool RAW = false>
__device__ __forceinline__ void mma_word(float (&acc)[NT][4], u32 word, u32 sw,
                                         const u32 (&bq)[NT][2]) {
  u32 r0 = word, r1 = word, r2 = word, r3 = word;
  if (!RAW) {
    decode_word(word, r0, r1, r2, r3);
    scale_fragment(tile_scale<Q & 1>(sw), r0, r1, r2, r3);
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) mma_f16(acc[nt], r0, r1, r2, r3, bq[nt][0], bq[nt][1]);
}

// One output from its fp32 sum(s) (GATED: gate v and up u): times `gain` (2**28, the expert's
// and the row's scales), silu(gate) * up, times the routing weight `rw`. Every expert GEMM's
// epilogue.
template <bool GATED>
__device__ __forceinline__ float expert_output(float v, float u, float gain, float rw) {
  v *= gain;
  if (GATED) {
    u *= gain;
    v = v / (1.0f + __expf(-v)) * u;
  }
  return v * rw;
}

// Output (feature f, token slot c) of RW tiles from the WK warps' partial sums
// red [WK][TILES][NT][4 regs][32 lanes], features fastest for coalesced stores, into columns
// col0 + f: times 2**28, the expert's and the row's scales, silu(gate) * up (GATED) and the
// routing weight, rounded to bf16.
template <int NT, int RW, int WK, bool GATED>
__device__ __forceinline__ void store_outputs(const float* red, const int* pair_s,
                                              const float* xg_s, const float* rw_s, float wgain,
                                              u16* out, int n_pairs, int n_out, int col0,
                                              int tid = threadIdx.x, int nthreads = WK * 32) {
  constexpr int BT = NT * 8;
  constexpr int TILES = GATED ? 2 * RW : RW;
  for (int o = tid; o < RW * 16 * BT; o += nthreads) {
    const int f = o % (RW * 16), c = o / (RW * 16);
    const int pair = pair_s[c];
    if (pair >= n_pairs) continue;
    const int ti = f >> 4, rr = f & 15, nt = c >> 3, cc = c & 7;
    const int ln = (rr & 7) * 4 + (cc >> 1), idx = (rr >> 3) * 2 + (cc & 1);
    float v = 0.f, u = 0.f;
#pragma unroll
    for (int w = 0; w < WK; ++w) {
      v += red[((w * TILES + ti) * NT + nt) * 128 + idx * 32 + ln];
      if (GATED) u += red[((w * TILES + ti + RW) * NT + nt) * 128 + idx * 32 + ln];
    }
    out[(long)pair * n_out + col0 + f] = f32_to_bf16(expert_output<GATED>(v, u, wgain * xg_s[c],
                                                                       rw_s[c]));
  }
}

// QOUT: the last of the gridDim.x CTAs of expert block blk to finish (counters[blk], zero
// before and after) NVFP4-quantizes the block's pair rows of `out` (as quant.quantize_rows with
// per-row scale_2, read back from L2): the next GEMM's input, one quantize launch fewer, spread
// over the blocks' CTAs. Outputs as the quantize kernel's: codes [n_pairs, n_out/2], e4m3
// scales [n_pairs, n_out/16], scale_2 [n_pairs], dq16 [n_pairs, n_out] (the down GEMM's).
template <int NTHREADS, int BT>
__device__ __forceinline__ void quantize_block_rows_if_last(const u16* out, const int* pair_s,
                                                            int n_pairs, int n_out,
                                                            int* counters, u8* q_codes,
                                                            u8* q_scales, float* q_g, u16* q_dq) {
  __shared__ int is_last, s_nrows, s_rows[BT];
  __threadfence();  // this CTA's outputs, before the block's counter
  __syncthreads();
  if (threadIdx.x == 0) {
    is_last = atomicAdd(counters + blockIdx.y, 1) == (int)gridDim.x - 1;
    if (is_last) counters[blockIdx.y] = 0;
    int n = 0;
    for (int c = 0; c < BT; ++c)
      if (pair_s[c] < n_pairs) s_rows[n++] = pair_s[c];
    s_nrows = n;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  auto load = [&](int r, int e, float (&x)[4]) {
    load_bf16x4_cg(out + (long)s_rows[r] * n_out + e, x);
  };
  auto dst = [&](int r) {
    const long p = s_rows[r];
    NVFP4RowOut o = nvfp4_row_out(q_codes + p * (n_out / 2), q_scales + p * (n_out / 16), q_g + p);
    o.dq16 = q_dq ? q_dq + p * n_out : nullptr;
    return o;
  };
  nvfp4_quantize_rows_cta<NTHREADS>(s_nrows, n_out, load, dst);
}

// PDL: launched as a programmatic dependent launch (cuda_launch.launch_ex): every CTA waits for
// the previous grid first (the routing picks the weights, so nothing is prefetched before),
// then lets the next grid start its CTAs. A template flag, not always compiled in: with the
// griddepcontrol instructions the 64-register gate_up instance spills.
// PAIRS (NT = 1): one block per pair, without the block layout: block_expert is then the
// top-k ids ([n_pairs], pair-major as route_w), block blk holds pair blk in slot 0 alone, and
// sorted_pair is not read (one dependent load fewer; an expert two pairs share is read twice).
template <int NT, int RW, int WK, int KGW, bool GATED, int MINB, bool QOUT = false,
          bool PDL = false, bool PAIRS = false>
__global__ void __launch_bounds__(WK * 32, MINB > 0 ? MINB : 1) moe_fp4_mma(
    const u32* __restrict__ wq,        // packed codes [E][N_W/16][K/64][32 lanes][4]
    const u32* __restrict__ ws,        // packed e4m3 scales [E][N_W/16][K/64][8 g][2]
    const float* __restrict__ w_g,     // [E] per-expert second-level scale
    const u32* __restrict__ x_dq,      // fp16 activations, B-fragment order [rows][K/16][4][4]
    const float* __restrict__ x_g,     // [rows] per-row second-level scale
    const int* __restrict__ sorted_pair,   // [MAXB * NT * 8]
    const int* __restrict__ block_expert,  // [MAXB]
    const float* __restrict__ route_w,     // [n_pairs]
    u16* __restrict__ out,                 // bf16 [n_pairs][n_out]
    int n_pairs, int n_out, unsigned long long a_mul, int mul_route_w,
    int* __restrict__ counter,             // QOUT: int32 [MAXB], zero
    u8* __restrict__ q_codes, u8* __restrict__ q_scales, float* __restrict__ q_g,
    u16* __restrict__ q_dq) {              // QOUT: the quantized `out` (see above)
  constexpr int K = WK * KGW * 64;
  constexpr int KT = K / 16;
  constexpr int KG = K / 64;
  constexpr int BT = NT * 8;
  constexpr int TILES = GATED ? 2 * RW : RW;
  __shared__ float red[WK][TILES][NT][4][32];
  __shared__ int pair_s[BT];
  __shared__ float xg_s[BT], rw_s[BT];

  if (PDL) {
    pdl_wait();
    pdl_launch_dependents();
  }
  const int blk = blockIdx.y;  // slow grid dimension: the empty blocks' CTAs come last
  const int e = block_expert[blk];
  if (e < 0) return;
  // The loads in order of need, each chain short: the B fragments (block_expert ->
  // sorted_pair -> activations), the weights (block_expert -> weights), and only then the
  // epilogue scalars (into registers; stored for the epilogue after the MMAs), so no divergent
  // sorted_pair -> x_g chain with an integer division runs ahead of the weight loads.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n_w_tiles = (GATED ? 2 * n_out : n_out) / 16;
  const int kg0 = warp * KGW;

  static_assert(!PAIRS || NT == 1, "PAIRS: one pair per 8-slot block");
  SlotScalars slot;
  if (PAIRS)
    slot.pair = threadIdx.x == 0 || threadIdx.x >= BT ? blk : n_pairs;
  else
    slot.load_pair<BT>(sorted_pair, blk);
  u32 b[KGW * 4][NT][2];
  load_b_fragments<NT, KGW, KT, PAIRS>(b, x_dq, sorted_pair, blk, kg0, g, t, n_pairs, a_mul);

  // A: packed codes and scales of every tile of this warp's K slice.
  u32 a[TILES][KGW][4];
  u32 s[TILES][KGW][2];
#pragma unroll
  for (int ti = 0; ti < TILES; ++ti) {
    const int tile = (GATED && ti >= RW) ? n_out / 16 + blockIdx.x * RW + (ti - RW)
                                         : blockIdx.x * RW + ti;
    const long base = ((long)e * n_w_tiles + tile) * KG + kg0;
#pragma unroll
    for (int j = 0; j < KGW; ++j) {
      ldg_v4(wq + ((base + j) * 32 + lane) * 4, a[ti][j][0], a[ti][j][1], a[ti][j][2],
             a[ti][j][3]);
      ldg_v2(ws + ((base + j) * 8 + g) * 2, s[ti][j][0], s[ti][j][1]);
    }
  }
  slot.load_scales(x_g, route_w, n_pairs, a_mul, mul_route_w);
  const float wgain = w_g[e] * FP16_GAIN_SQ;

  float acc[TILES][NT][4];
#pragma unroll
  for (int ti = 0; ti < TILES; ++ti)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[ti][nt][i] = 0.f;

#pragma unroll
  for (int ti = 0; ti < TILES; ++ti) {
#pragma unroll
    for (int j = 0; j < KGW; ++j) {
      mma_word<NT, 0>(acc[ti], a[ti][j][0], s[ti][j][0], b[j * 4 + 0]);
      mma_word<NT, 1>(acc[ti], a[ti][j][1], s[ti][j][0], b[j * 4 + 1]);
      mma_word<NT, 2>(acc[ti], a[ti][j][2], s[ti][j][1], b[j * 4 + 2]);
      mma_word<NT, 3>(acc[ti], a[ti][j][3], s[ti][j][1], b[j * 4 + 3]);
    }
  }

#pragma unroll
  for (int ti = 0; ti < TILES; ++ti)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][ti][nt][i][lane] = acc[ti][nt][i];
  slot.put<BT>(pair_s, xg_s, rw_s);
  __syncthreads();
  store_outputs<NT, RW, WK, GATED>(&red[0][0][0][0][0], pair_s, xg_s, rw_s, wgain, out, n_pairs,
                                   n_out, blockIdx.x * RW * 16);
  if (QOUT)
    quantize_block_rows_if_last<WK * 32, BT>(out, pair_s, n_pairs, n_out, counter, q_codes,
                                             q_scales, q_g, q_dq);
}

// ---------------------------------------------------------------------------------------------
// Streaming variant (`moe_fp4_stream`): the same math and operand layouts, with the weights
// streamed through a per-warp cp.async shared-memory ring instead of being loaded up front.
//
// One CTA = WK warps over one expert block and a run of `items_per_cta` consecutive items; an
// item is RW output tiles of 16 features (GATED: RW gate tiles + the RW matching up tiles).
// Warp w owns K slice [w * KGW * 64, (w + 1) * KGW * 64) for the whole CTA: its B fragments
// (the block's activations over that slice) are loaded into registers once, and the packed
// words + scales of every tile of every item of the CTA pass through its own ring of S stages
// (one stage = one tile's K slice: KGW * 512 bytes of words + KGW * 64 bytes of scales), S - 1
// stages in flight while the current one is decoded and multiplied. Each lane copies and later
// reads back its own 16-byte words (no barrier needed for them); the scales are copied by a
// few lanes and read by all, hence one __syncwarp per stage. The ring runs on across item
// boundaries, so the loads stay in flight during the per-item cross-warp reduction (partial
// sums through shared memory, double-buffered: one __syncthreads per item) and epilogue.
// Dynamic shared memory: WK * S * STAGE bytes of ring + 2 * WK * TILES * NT * 512 bytes.
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ void lds_v4(u32 addr, u32& a, u32& b, u32& c, u32& d) {
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(addr) : "memory");
}

__device__ __forceinline__ void lds_v2(u32 addr, u32& a, u32& b) {
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(a), "=r"(b) : "r"(addr) : "memory");
}

// acc += one 64-wide k group of a tile held in shared memory: this lane's 4 packed words at
// `words` (16 bytes) and its row group's 2 scale words at `scales` (8 bytes), times the B
// fragments bq[0..3] of the group's 4 k-tiles. RAW: see mma_word.
template <int NT, bool RAW = false>
__device__ __forceinline__ void mma_group_smem(float (&acc)[NT][4], u32 words, u32 scales,
                                               const u32 (*bq)[NT][2]) {
  u32 aw[4], sw[2];
  lds_v4(words, aw[0], aw[1], aw[2], aw[3]);
  lds_v2(scales, sw[0], sw[1]);
  mma_word<NT, 0, RAW>(acc, aw[0], sw[0], bq[0]);
  mma_word<NT, 1, RAW>(acc, aw[1], sw[0], bq[1]);
  mma_word<NT, 2, RAW>(acc, aw[2], sw[1], bq[2]);
  mma_word<NT, 3, RAW>(acc, aw[3], sw[1], bq[3]);
}

// One tile's partial sums over this warp's KGW k groups into the reduction buffer `red`
// [NT][4][32] (this warp's and tile's slice): the tile's words from `words` (512 bytes per k
// group), its scales from `scales` (64 bytes per group), times the B fragments b[0..4 KGW).
template <int NT, int KGW, bool RAW = false>
__device__ __forceinline__ void tile_partials(float* red, u32 words, u32 scales,
                                              const u32 (*b)[NT][2], int lane, int g) {
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
#pragma unroll
  for (int kk = 0; kk < KGW; ++kk)
    mma_group_smem<NT, RAW>(acc, words + kk * 512 + lane * 16, scales + kk * 64 + g * 8,
                            b + kk * 4);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) red[(nt * 4 + i) * 32 + lane] = acc[nt][i];
}

// PROBE (a timing probe for the bench only; its outputs are meaningless): the packed words
// go to the MMA as they are, without the decode and the block scale, to time what those cost.
template <int NT, int RW, int WK, int KGW, bool GATED, int S, int MINB, bool PROBE = false>
__global__ void __launch_bounds__(WK * 32, MINB > 0 ? MINB : 1) moe_fp4_stream(
    const u32* __restrict__ wq,        // packed codes [E][N_W/16][K/64][32 lanes][4]
    const u32* __restrict__ ws,        // packed e4m3 scales [E][N_W/16][K/64][8 g][2]
    const float* __restrict__ w_g,     // [E] per-expert second-level scale
    const u32* __restrict__ x_dq,      // fp16 activations, B-fragment order [rows][K/16][4][4]
    const float* __restrict__ x_g,     // [rows] per-row second-level scale
    const int* __restrict__ sorted_pair,   // [MAXB * NT * 8]
    const int* __restrict__ block_expert,  // [MAXB]
    const float* __restrict__ route_w,     // [n_pairs]
    u16* __restrict__ out,                 // bf16 [n_pairs][n_out]
    int n_pairs, int n_out, unsigned long long a_mul, int mul_route_w, int items_per_cta) {
  static_assert(S >= 2 && KGW * 4 <= 32, "ring depth >= 2; scales copied by <= 32 lanes");
  constexpr int K = WK * KGW * 64;
  constexpr int KT = K / 16;
  constexpr int KG = K / 64;
  constexpr int BT = NT * 8;
  constexpr int TILES = GATED ? 2 * RW : RW;
  constexpr int A_BYTES = KGW * 512;         // one tile's words over a warp's K slice
  constexpr int STAGE = A_BYTES + KGW * 64;  // + its scales
  constexpr int RED = WK * TILES * NT * 4 * 32;  // floats of one item's partial sums
  extern __shared__ __align__(16) unsigned char smem[];
  float* red = reinterpret_cast<float*>(smem + WK * S * STAGE);  // [2][WK][TILES][NT][4][32]
  __shared__ int pair_s[BT];
  __shared__ float xg_s[BT], rw_s[BT];

  const int blk = blockIdx.y;  // slow grid dimension, as in moe_fp4_mma
  const int e = block_expert[blk];
  if (e < 0) return;
  const int n_items = n_out / (16 * RW);
  const int item0 = blockIdx.x * items_per_cta;
  if (item0 >= n_items) return;
  const int n_my = items_per_cta < n_items - item0 ? items_per_cta : n_items - item0;
  const int total = n_my * TILES;  // stages this CTA streams (the same for every warp)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n_w_tiles = (GATED ? 2 * n_out : n_out) / 16;
  const int kg0 = warp * KGW;
  const u32* wq_e = wq + ((long)e * n_w_tiles * KG + kg0) * 128 + lane * 4;
  const u32* ws_e = ws + ((long)e * n_w_tiles * KG + kg0) * 16 + lane * 4;
  const u32 ring_s = smem_addr(smem + warp * S * STAGE);

  // The stream's next stage to copy: item (relative), tile of the item, ring slot, and its
  // stage count. Each call copies that tile into its slot (or, past the end, commits nothing).
  int nx_item = 0, nx_ti = 0, nx_slot = 0, nx_j = 0;
  const int up0 = n_out / 16 - RW;  // up tile = up0 + item * RW + ti for ti >= RW (GATED)
  auto issue = [&]() {
    if (nx_j < total) {
      const int item = item0 + nx_item;
      const int tile = item * RW + nx_ti + ((GATED && nx_ti >= RW) ? up0 : 0);
      const u32 dst = ring_s + nx_slot * STAGE;
      copy_tile_stage<KGW>(dst, wq_e + tile * (KG * 128), ws_e + tile * (KG * 16), lane);
    }
    cp_async_commit();
    ++nx_j;
    nx_slot = nx_slot == S - 1 ? 0 : nx_slot + 1;
    if (++nx_ti == TILES) {
      nx_ti = 0;
      ++nx_item;
    }
  };
#pragma unroll
  for (int j = 0; j < S - 1; ++j) issue();

  const float wgain = w_g[e] * FP16_GAIN_SQ;
  SlotScalars slot;
  slot.load<BT>(sorted_pair, x_g, route_w, blk, n_pairs, a_mul, mul_route_w);
  slot.put<BT>(pair_s, xg_s, rw_s);
  u32 b[KGW * 4][NT][2];
  load_b_fragments<NT, KGW, KT>(b, x_dq, sorted_pair, blk, kg0, g, t, n_pairs, a_mul);

  int rd_slot = 0;  // ring slot of the stage consumed now
  for (int it = 0; it < n_my; ++it) {
    float* red_it = red + (it & 1) * RED;
#pragma unroll
    for (int ti = 0; ti < TILES; ++ti) {
      cp_async_wait<S - 2>();  // this lane's copies of this stage have landed
      __syncwarp();            // ... and every lane's (scales); the previous slot is free again
      issue();                 // the stage S - 1 ahead, into the slot freed
      const u32 st = ring_s + rd_slot * STAGE;
      rd_slot = rd_slot == S - 1 ? 0 : rd_slot + 1;
      tile_partials<NT, KGW, PROBE>(red_it + ((warp * TILES + ti) * NT) * 128, st, st + A_BYTES,
                                    b, lane, g);
    }
    __syncthreads();  // all warps' partial sums of this item are in red_it

    // Epilogue; the other buffer takes the next item's partials, so no second barrier here.
    store_outputs<NT, RW, WK, GATED>(red_it, pair_s, xg_s, rw_s, wgain, out, n_pairs, n_out,
                                     (item0 + it) * RW * 16);
  }
}
