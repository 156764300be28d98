// Grouped routed-expert GEMM, W4A4 NVFP4, with warpgroup MMAs (wgmma, sm_90a only: compiled
// by cuda_launch.compiled_function(..., arch="sm_90a")), for 8- and 16-slot expert blocks.
//
// Same operands, decode and epilogue as moe_fp4.cu (its header describes them); what differs is
// the MMA and the split of the work. The BT = 8 or 16 token slots of an expert block are the N
// of wgmma.m64n{BT}k16: B is the block's activations, copied once per CTA into shared memory in
// the canonical K-major layout without swizzle (per 16-wide k-tile BT * 32 bytes: [k half][8-slot
// group][8 slots][8 halves], so the descriptor's leading (K) byte offset is BT * 16 and its
// stride (N) byte offset 128), read by the tensor cores directly. A is in registers: each of the 4
// warps decodes one 16-row weight tile per k-tile into the m16n8k16 A fragment, which is also
// wgmma's register-A layout for that warp's 16 rows of the 64. Each warp streams its own tile
// over all of K through a cp.async ring (no split of K, so no cross-warp reduction and no
// barrier per item); an item is 64 output features (GATED: 64 gate rows and the matching 64
// up rows, two accumulators). Per k group of 4 k-tiles a warp decodes all of them, fences and
// issues the group's wgmmas, and waits only for the group before (its A registers are reused),
// so the decode of one group overlaps the MMAs of the previous one.

#include "moe_fp4.cu"

__device__ __forceinline__ void wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Pin the accumulators after a wait: their reads may not move above it.
template <int N>
__device__ __forceinline__ void wg_fence_acc(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor of a BT-slot k-tile: no swizzle, K-adjacent core matrices
// BT * 16 bytes apart, N-adjacent ones 128 bytes apart (the layout in the header).
template <int BT>
__device__ __forceinline__ unsigned long long b_desc(u32 saddr) {
  return (unsigned long long)((saddr & 0x3FFFFu) >> 4) |
         ((unsigned long long)((BT * 16) >> 4) << 16) | ((unsigned long long)(128 >> 4) << 32);
}

// d (this thread's BT / 2 of the 64 x BT fp32 tile) (+)= A (registers) x B (descriptor);
// accumulate = 0 overwrites d.
__device__ __forceinline__ void wgmma_n(float (&d)[8], const u32 (&a)[4], unsigned long long desc,
                                        int accumulate) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %13, 0;\n\t"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, "
      "{%8,%9,%10,%11}, %12, p, 1, 1, 0; }"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_n(float (&d)[4], const u32 (&a)[4], unsigned long long desc,
                                        int accumulate) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %9, 0;\n\t"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, "
      "{%4,%5,%6,%7}, %8, p, 1, 1, 0; }"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
}

// The 4 k-tiles of one 64-wide k group of a tile in shared memory (this lane's 4 words at
// `words`, its row group's 2 scale words at `scales`) as decoded, block-scaled A fragments.
__device__ __forceinline__ void decode_group(u32 (&a)[4][4], u32 words, u32 scales) {
  u32 aw[4], sw[2];
  lds_v4(words, aw[0], aw[1], aw[2], aw[3]);
  lds_v2(scales, sw[0], sw[1]);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    decode_word(aw[q], a[q][0], a[q][1], a[q][2], a[q][3]);
    const u32 sc = (q & 1) ? tile_scale<1>(sw[q >> 1]) : tile_scale<0>(sw[q >> 1]);
    scale_fragment(sc, a[q][0], a[q][1], a[q][2], a[q][3]);
  }
}

// K: the GEMM's K; KGW: 64-wide k groups per ring stage (>= 2: a stage's last group is the
// only one still in flight when the next stage's first group reuses its A registers); S: ring
// stages per warp; NWG: warpgroups per CTA, sharing the block's B and taking every NWG-th item;
// BT: token slots per expert block (8 or 16).
template <int K, int KGW, bool GATED, int S, int NWG = 1, int BT = 16>
__global__ void __launch_bounds__(NWG * 128, 1) moe_fp4_wg(
    const u32* __restrict__ wq,        // packed codes [E][N_W/16][K/64][32 lanes][4]
    const u32* __restrict__ ws,        // packed e4m3 scales [E][N_W/16][K/64][8 g][2]
    const float* __restrict__ w_g,     // [E] per-expert second-level scale
    const u32* __restrict__ x_dq,      // fp16 activations, B-fragment order [rows][K/16][8]
    const float* __restrict__ x_g,     // [rows] per-row second-level scale
    const int* __restrict__ sorted_pair,   // [MAXB * BT]
    const int* __restrict__ block_expert,  // [MAXB]
    const float* __restrict__ route_w,     // [n_pairs]
    u16* __restrict__ out,                 // bf16 [n_pairs][n_out]
    int n_pairs, int n_out, unsigned long long a_mul, int mul_route_w, int items_per_cta) {
  constexpr int KG = K / 64;
  constexpr int TILE_B = BT * 32;                // one k-tile of B in shared memory
  constexpr int KT = K / 16;
  constexpr int TILES = GATED ? 2 : 1;           // per warp and item: gate (+ up) tile
  constexpr int A_BYTES = KGW * 512;             // one tile's words of a stage
  constexpr int HALF = A_BYTES + KGW * 64;       // + their scales
  constexpr int STAGE = TILES * HALF;
  constexpr int NSTAGE = KG / KGW;               // stages per item
  static_assert(KG % KGW == 0 && KGW >= 2 && S >= 2 && KGW * 4 <= 32,
                "K groups per stage; ring depth");
  static_assert(BT == 8 || BT == 16, "8 or 16 token slots");
  extern __shared__ __align__(128) unsigned char smem[];  // B [KT][TILE_B], then the rings
  __shared__ int pair_s[BT];
  __shared__ float xg_s[BT], rw_s[BT];

  const int blk = blockIdx.y;
  const int e = block_expert[blk];
  if (e < 0) return;
  const int n_items = n_out / 64;
  const int item0 = blockIdx.x * items_per_cta;
  if (item0 >= n_items) return;
  const int n_cta = items_per_cta < n_items - item0 ? items_per_cta : n_items - item0;
  const int wgi = threadIdx.x >> 7;  // this warp's warpgroup: items item0 + wgi + NWG * i
  const int n_my = n_cta > wgi ? (n_cta - wgi + NWG - 1) / NWG : 0;
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n_w_tiles = (GATED ? 2 * n_out : n_out) / 16;
  const u32* wq_e = wq + (long)e * n_w_tiles * KG * 128 + lane * 4;
  const u32* ws_e = ws + (long)e * n_w_tiles * KG * 16 + lane * 4;
  const u32 b_base = smem_addr(smem);
  const u32 ring_s = smem_addr(smem + KT * TILE_B + (threadIdx.x >> 5) * S * STAGE);
  const int up0 = n_out / 16;

  const int total = n_my * NSTAGE;
  int nx_j = 0, nx_slot = 0;
  auto issue = [&]() {
    if (nx_j < total) {
      const int item = item0 + wgi + NWG * (nx_j / NSTAGE);
      const int kg0 = (nx_j % NSTAGE) * KGW;
#pragma unroll
      for (int ti = 0; ti < TILES; ++ti) {
        const int tile = item * 4 + warp + (ti ? up0 : 0);
        const u32 dst = ring_s + nx_slot * STAGE + ti * HALF;
        copy_tile_stage<KGW>(dst, wq_e + ((long)tile * KG + kg0) * 128,
                             ws_e + ((long)tile * KG + kg0) * 16, lane);
      }
    }
    cp_async_commit();
    ++nx_j;
    nx_slot = nx_slot == S - 1 ? 0 : nx_slot + 1;
  };
#pragma unroll
  for (int j = 0; j < S - 1; ++j) issue();

  const float wgain = w_g[e] * FP16_GAIN_SQ;
  SlotScalars slot;
  slot.load<BT>(sorted_pair, x_g, route_w, blk, n_pairs, a_mul, mul_route_w);
  slot.put<BT>(pair_s, xg_s, rw_s);
  // B: (slot c, k-tile kt) from the row's 8 words (positions 2i, 2i + 1 in word i: words 0, 2,
  // 4, 6 hold k 0..7, words 1, 3, 5, 7 k 8..15); padding slots are zeros
  for (int idx = threadIdx.x; idx < BT * KT; idx += NWG * 128) {
    const int c = idx % BT, kt = idx / BT;
    const int pair = sorted_pair[blk * BT + c];
    uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
    if (pair < n_pairs) {
      const u32* src = x_dq + ((long)pair_row(pair, a_mul) * KT + kt) * 8;
      ldg_v4(src, lo.x, lo.y, lo.z, lo.w);
      ldg_v4(src + 4, hi.x, hi.y, hi.z, hi.w);
    }
    unsigned char* dst = smem + kt * TILE_B + (c >> 3) * 128 + (c & 7) * 16;
    *reinterpret_cast<uint4*>(dst) = make_uint4(lo.x, lo.z, hi.x, hi.z);
    *reinterpret_cast<uint4*>(dst + BT * 16) = make_uint4(lo.y, lo.w, hi.y, hi.w);
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // visible to the tensor cores
  __syncthreads();

  constexpr int NACC = BT / 2;  // this thread's accumulators per 64 x BT tile
  float accg[NACC], accu[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) accg[i] = accu[i] = 0.f;
  int rd_slot = 0;
  for (int it = 0; it < n_my; ++it) {
    for (int sg = 0; sg < NSTAGE; ++sg) {
      cp_async_wait<S - 2>();  // this lane's copies of this stage have landed
      __syncwarp();            // ... and every lane's (scales); the previous slot is free again
      issue();
      const u32 st = ring_s + rd_slot * STAGE;
      rd_slot = rd_slot == S - 1 ? 0 : rd_slot + 1;
#pragma unroll
      for (int kk = 0; kk < KGW; ++kk) {
        u32 ag[4][4], au[4][4];
        decode_group(ag, st + kk * 512 + lane * 16, st + A_BYTES + kk * 64 + g * 8);
        if (GATED)
          decode_group(au, st + HALF + kk * 512 + lane * 16, st + HALF + A_BYTES + kk * 64 + g * 8);
        wg_fence();
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int kt = (sg * KGW + kk) * 4 + q;
          const unsigned long long desc = b_desc<BT>(b_base + kt * TILE_B);
          const int acc = (sg | kk | q) != 0;  // the item's first k-tile overwrites
          wgmma_n(accg, ag[q], desc, acc);
          if (GATED) wgmma_n(accu, au[q], desc, acc);
        }
        wg_commit();
        wg_wait<1>();  // the group before has finished reading its A registers
      }
    }
    wg_wait<0>();
    wg_fence_acc(accg);
    if (GATED) wg_fence_acc(accu);
    // epilogue: d[i] is (row g + 8 ((i >> 1) & 1), slot 2t + (i & 1) + 8 (i >> 2)) of the tile
    const int f0 = (item0 + wgi + NWG * it) * 64 + warp * 16 + g;
#pragma unroll
    for (int i = 0; i < NACC; ++i) {
      const int c = 2 * t + (i & 1) + 8 * (i >> 2);
      const int pair = pair_s[c];
      if (pair >= n_pairs) continue;
      const float v = expert_output<GATED>(accg[i], accu[i], wgain * xg_s[c], rw_s[c]);
      out[(long)pair * n_out + f0 + 8 * ((i >> 1) & 1)] = f32_to_bf16(v);
    }
  }
}
