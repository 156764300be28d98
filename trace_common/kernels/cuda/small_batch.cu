// Small-batch (1-8 tokens) BF16 decode kernels: bandwidth-bound GEMVs on the tensor cores, with
// the tiny ops around them fused in (trace_common/kernels/cuda_small.py is the wrapper).
//
// GEMV core (`WarpGemv`): swap-AB `mma.sync.m16n8k16` (bf16 in, fp32 accumulate). The weights
// [N, K] are the A operand (16 rows per tile) and the <= 8 tokens the B operand (column g =
// token g; missing tokens are zeros), so one MMA covers 16 rows x 16 k x 8 tokens. The sum over
// k is order-free, so lane (g, t) reads 16 contiguous bytes, k = [8t, 8t + 8) of each 32-wide
// chunk, of weight rows g and g + 8 and of its token's activation row, and feeds them as the
// fragments of two MMAs (logical k 2t.. / 2t+8.. -> physical 8t.. / 8t+2.. and 8t+4.. / 8t+6..).
// Weights stream through a per-warp cp.async ring in shared memory (bypassing L1), NS stages of
// U chunks in flight. A CTA is WK warps that split K and reduce through shared memory in a fixed
// order (deterministic: a replayed graph equals the eager step bit for bit).
//
// Fused around it (each a pass the decode step made as its own launch before):
//  - add + RMSNorm prologue: every CTA recomputes resid + sum(delta rows) and the RMSNorm of
//    its (<= 8) tokens into shared memory (cheap next to its weight tile, and no launch); CTA 0
//    writes the new residual to a second buffer (ping-pong: others still read the old one).
//  - q/k RMSNorm + RoPE + BF16 KV append after the qkv GEMV: CTA 0 of the head's thread-block
//    cluster, from the rows the others stored into its shared memory (or, without the
//    cluster, the last CTA to finish the head: atomic counter per head, reset by that CTA)
//    normalizes, rotates and appends it.
//  - router softmax + top-k + block alignment after the router GEMV: CTA 0 of the router's one
//    thread-block cluster does them from the logits the others stored into its shared memory
//    (or, without the cluster, the last CTA to finish, through L2).
//  - routed experts: gate_up grouped by expert block (silu * up epilogue), down per token with
//    one warp per chosen expert, the routing weights and the top-k sum in its epilogue (the
//    same bf16 roundings as the per-pair path: bf16(w * acc) summed in fp32 in order j).
//  - FP4 engine (optional): NVFP4 quantize of the experts' input (router: its last CTA, or
//    one extra CTA without the cluster) and the FP4 KV append (qkv, the last CTA of the k / v
//    heads), fp4_common.cuh's quantizer.
// Rounding points follow the Triton kernels (trace_common/kernels/_tl_attn.py, _tl_moe.py).
//
// Programmatic dependent launch (cuda_launch.launch_ex; the engine's default on sm_90): every
// kernel here calls pdl_wait() before it reads an activation or writes anything, and
// pdl_launch_dependents() right after it. The projections issue their first weight stages before the wait (no kernel
// writes weights), so their prefetch overlaps the previous kernel's tail; gate_up waits first
// (the routing picks its weights), down streams its weights before the wait (the routing is
// complete when it starts: see moe_down_bf16). Launched without the attribute, both are no-ops.
//
// No system headers: compiled by NVRTC (CuPy RawModule, -I on this folder) or nvcc alike.

#include "fp4_common.cuh"

#define HEAD_DIM 128
#define TILE_ROWS 16
#define MAX_TOK 8
#define MAX_PAIRS 64     // MAX_TOK * top_k (top_k <= 8)
#define MAX_EXPERTS 256
#define MAX_SLOTS 1536   // sorted_pair entries the router kernel lays out in shared memory

// coherent (L2) loads of values other CTAs of this launch wrote before a fence + counter
__device__ __forceinline__ u16 ld_cg_u16(const u16* p) {
  u16 v;
  asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
  return v;
}
// ... or that another grid wrote (the routing, read by moe_down_bf16 before its PDL wait)
__device__ __forceinline__ int ld_cg_s32(const int* p) {
  int v;
  asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// ---- thread-block clusters (sm_90): the router's logits exchange -----------------------------
// barrier.cluster phases: every thread arrives once and waits once per phase, in order.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// the shared::cluster address of `p` (this CTA's shared memory) in cluster CTA `rank`
__device__ __forceinline__ u32 cluster_map(const void* p, u32 rank) {
  u32 a;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_addr(p)), "r"(rank));
  return a;
}
__device__ __forceinline__ void st_cluster_u16(u32 addr, u16 v) {
  asm volatile("st.shared::cluster.u16 [%0], %1;" ::"r"(addr), "h"(v) : "memory");
}

__device__ __forceinline__ uint4 u32x4(u32 a, u32 b, u32 c, u32 d) {
  uint4 v;
  v.x = a;
  v.y = b;
  v.z = c;
  v.w = d;
  return v;
}

__device__ __forceinline__ float bf16_to_f32(u16 v) { return __uint_as_float((u32)v << 16); }
__device__ __forceinline__ float bf16lo_to_f32(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16hi_to_f32(u32 v) { return __uint_as_float(v & 0xFFFF0000u); }

__device__ __forceinline__ u16 f32_to_bf16_rn(float v) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}

__device__ __forceinline__ float round_bf16(float v) { return bf16_to_f32(f32_to_bf16_rn(v)); }

__device__ __forceinline__ u32 f32x2_to_bf16x2(float lo, float hi) {
  return (u32)f32_to_bf16_rn(lo) | ((u32)f32_to_bf16_rn(hi) << 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

__device__ __forceinline__ u32 warp_max_u32(u32 v) {
  u32 r;
  asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
  return r;
}

// Router top-k key of logit bits x (bf16) of expert e < 2**16: the bits made monotonic in the
// value (negative: inverted, the rest above them; -0 counts as +0) above 0xFFFF - e, so keys
// are unique, a larger key is a larger logit or, between equal logits, the lower expert, and
// any key is > 0 (0: no expert). The picks' order is the reference's (ties: lowest index).
__device__ __forceinline__ u32 topk_key(u16 x, int e) {
  if (x == 0x8000u) x = 0;
  const u32 m = (x & 0x8000u) ? (~(u32)x & 0xFFFFu) : ((u32)x | 0x8000u);
  return (m << 16) | (0xFFFFu - (u32)e);
}
__device__ __forceinline__ int topk_key_expert(u32 k) { return (int)(0xFFFFu - (k & 0xFFFFu)); }
__device__ __forceinline__ float topk_key_logit(u32 k) {
  const u32 m = k >> 16;
  return bf16_to_f32((u16)((m & 0x8000u) ? (m & 0x7FFFu) : (~m & 0xFFFFu)));
}

// Shared-memory ring of one warp: NS stages of U chunks x RT tiles x (rows g, g + 8) x 32 lanes.
template <int RT, int U, int NS>
struct Ring {
  static constexpr int STAGE = U * RT * 2 * 32;  // uint4 per stage
  static constexpr int UINT4 = NS * STAGE;       // per warp
};

// One warp's share of a GEMV: acc[r] += W rows [wtile[r], +16) x k in [kbeg, kbeg + 32 KCW)
// times the B columns. Lane (g, t)'s column is token row `xrow` (global or shared memory; null
// = a zero column). acc[r][0..3] = (row g, token 2t), (row g, token 2t+1), (row g+8, token 2t),
// (row g+8, token 2t+1). The weights stream through `ring` (this warp's NS-stage cp.async ring,
// Ring<RT, U, NS>): the copies are asynchronous, so all of them are in flight at once (ptxas
// keeps register loads only a few instructions ahead of their MMA: too few bytes in flight
// for HBM); each lane reads back only the 16 bytes it copied, so no barrier is needed.
// start() issues the first NS - 1 stages (before a prologue, to overlap it); run() the rest.
// FULL: start() fills all NS stages and a stage is refilled after its MMAs (more bytes in
// flight before the first MMA; used by the down GEMV and the router, where it pays).
template <int RT, int KCW, int U, int NS, bool FULL = false>
struct WarpGemv {
  static_assert(KCW % U == 0, "U must divide KCW");
  static constexpr int NR = KCW / U;
  static constexpr int STAGE = Ring<RT, U, NS>::STAGE;
  const u16* wa[RT];
  long half;
  uint4* ring;
  int kbeg, cstride;

  // cstride: k from one of this warp's chunks to its next (32: a contiguous K slice)
  __device__ __forceinline__ WarpGemv(const u16* const (&wtile)[RT], int k_row, int kbeg_,
                                      uint4* ring_, int cstride_ = 32)
      : half(8L * k_row), ring(ring_), kbeg(kbeg_), cstride(cstride_) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < RT; ++r) wa[r] = wtile[r] + (long)g * k_row + kbeg + 8 * t;
  }

  __device__ __forceinline__ void issue(int round) {
    const int lane = threadIdx.x & 31;
    if (round < NR) {
      uint4* st = ring + (round % NS) * STAGE;
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          const u16* src = wa[r] + cstride * (round * U + u);
          cp_async16(smem_addr(st + ((u * RT + r) * 2) * 32 + lane), src);
          cp_async16(smem_addr(st + ((u * RT + r) * 2 + 1) * 32 + lane), src + half);
        }
    }
    cp_async_commit();
  }

  __device__ __forceinline__ void start() {
#pragma unroll
    for (int s = 0; s < (FULL ? NS : NS - 1); ++s) issue(s);
  }

  __device__ __forceinline__ void run(const u16* xrow, float (&acc)[RT][4]) {
    const int lane = threadIdx.x & 31, t = (lane & 3);
    const u16* xp = xrow ? xrow + kbeg + 8 * t : nullptr;
#pragma unroll 1
    for (int i = 0; i < NR; ++i) {
      if (!FULL) issue(i + NS - 1);  // into the slot of round i - 1 (its MMAs are done)
      uint4 xv[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        xv[u] = xp ? *reinterpret_cast<const uint4*>(xp + cstride * (i * U + u))
                   : u32x4(0u, 0u, 0u, 0u);
      cp_async_wait<NS - 1>();
      const uint4* st = ring + (i % NS) * STAGE;
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          const uint4 a = st[((u * RT + r) * 2) * 32 + lane];
          const uint4 b = st[((u * RT + r) * 2 + 1) * 32 + lane];
          mma_bf16(acc[r], a.x, b.x, a.y, b.y, xv[u].x, xv[u].y);
          mma_bf16(acc[r], a.z, b.z, a.w, b.w, xv[u].z, xv[u].w);
        }
      if (FULL) issue(i + NS);  // into this round's slot: this lane's LDS of it fed the MMAs
    }
  }

  // run() for NB B tiles of 8 tokens each (RT = 1): acc[j] += W rows x tokens 8j .. 8j + 7 of
  // x [ntok, k_row] (rows >= ntok are zero columns); each stage's A fragments feed NB MMAs.
  template <int NB>
  __device__ __forceinline__ void run_tiles(const u16* x, int k_row, int ntok,
                                            float (&acc)[NB][4]) {
    static_assert(RT == 1 && !FULL, "run_tiles: one row tile, ring refilled ahead");
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u16* xp[NB];
#pragma unroll
    for (int j = 0; j < NB; ++j)
      xp[j] = 8 * j + g < ntok ? x + (long)(8 * j + g) * k_row + kbeg + 8 * t : nullptr;
#pragma unroll 1
    for (int i = 0; i < NR; ++i) {
      issue(i + NS - 1);
      uint4 xv[NB][U];
#pragma unroll
      for (int j = 0; j < NB; ++j)
#pragma unroll
        for (int u = 0; u < U; ++u)
          xv[j][u] = xp[j] ? *reinterpret_cast<const uint4*>(xp[j] + cstride * (i * U + u))
                           : u32x4(0u, 0u, 0u, 0u);
      cp_async_wait<NS - 1>();
      const uint4* st = ring + (i % NS) * STAGE;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint4 a = st[(u * 2) * 32 + lane];
        const uint4 b = st[(u * 2 + 1) * 32 + lane];
#pragma unroll
        for (int j = 0; j < NB; ++j) {
          mma_bf16(acc[j], a.x, b.x, a.y, b.y, xv[j][u].x, xv[j][u].y);
          mma_bf16(acc[j], a.z, b.z, a.w, b.w, xv[j][u].z, xv[j][u].w);
        }
      }
    }
  }
};

// Sum the WK warps' partial tiles (in warp order) into warp 0's acc. red: WK * RT * 128 floats.
template <int RT, int WK>
__device__ __forceinline__ void cta_reduce(float (&acc)[RT][4], float* red) {
  if (WK == 1) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int i = 0; i < 4; ++i) red[((warp * RT + r) * 4 + i) * 32 + lane] = acc[r][i];
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < WK; ++w) s += red[((w * RT + r) * 4 + i) * 32 + lane];
        acc[r][i] = s;
      }
  }
}

extern __shared__ uint4 dyn_ring[];  // the warps' cp.async rings (dynamic shared memory)

// Warp 0: out[token][row] = bf16(acc) for the tile at row0 of tokens < nt (out: [nt, n_out]).
__device__ __forceinline__ void store_tile_rows(u16* out, int n_out, int row0,
                                                const float (&acc)[4], int nt) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int t0 = 2 * t, t1 = 2 * t + 1;
  if (t0 < nt) {
    out[(long)t0 * n_out + row0 + g] = f32_to_bf16_rn(acc[0]);
    out[(long)t0 * n_out + row0 + g + 8] = f32_to_bf16_rn(acc[2]);
  }
  if (t1 < nt) {
    out[(long)t1 * n_out + row0 + g] = f32_to_bf16_rn(acc[1]);
    out[(long)t1 * n_out + row0 + g + 8] = f32_to_bf16_rn(acc[3]);
  }
}

template <int NT>
__device__ __forceinline__ void store_tile(u16* out, int n_out, int row0, const float (&acc)[4]) {
  store_tile_rows(out, n_out, row0, acc, NT);
}

// store_tile into the shared memory of a cluster CTA: `base` its shared::cluster address of a
// bf16 [NT][n_out] array.
template <int NT>
__device__ __forceinline__ void store_tile_cluster(u32 base, int n_out, int row0,
                                                   const float (&acc)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int t0 = 2 * t, t1 = 2 * t + 1;
  if (t0 < NT) {
    st_cluster_u16(base + 2u * (t0 * n_out + row0 + g), f32_to_bf16_rn(acc[0]));
    st_cluster_u16(base + 2u * (t0 * n_out + row0 + g + 8), f32_to_bf16_rn(acc[2]));
  }
  if (t1 < NT) {
    st_cluster_u16(base + 2u * (t1 * n_out + row0 + g), f32_to_bf16_rn(acc[1]));
    st_cluster_u16(base + 2u * (t1 * n_out + row0 + g + 8), f32_to_bf16_rn(acc[3]));
  }
}

// The RMSNorm weight's 8-value chunks c = threadIdx.x + i WK 32 of one thread, in registers:
// loaded before the PDL wait (no kernel writes weights), so the prologue's only global round
// trip after the wait is the one for its input rows.
// chunk(i) is the prologue's i-th chunk of this thread (>= K / 8: none).
template <int K, int WK>
struct NormW {
  static constexpr int N = (K / 8 + WK * 32 - 1) / (WK * 32);
  uint4 v[N];
  static __device__ __forceinline__ int chunk(int i) { return threadIdx.x + i * WK * 32; }
  __device__ __forceinline__ void load(const u16* __restrict__ w) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int c = chunk(i);
      v[i] = c < K / 8 ? *reinterpret_cast<const uint4*>(w + 8 * c) : u32x4(0u, 0u, 0u, 0u);
    }
  }
};

// Prologue, whole CTA: x = resid_in + bf16(sum of nsum delta rows) (bf16), y = RMSNorm(x) * w
// into xs [NT][XS] (bf16); CTA 0 writes x to resid_out and (if given) y to xn_out. red: >=
// WK * NT floats. Same roundings as add_rmsnorm_kernel.
template <int NT, int K, int XS, int WK>
__device__ void add_rmsnorm_to_smem(const u16* __restrict__ resid_in,
                                    const u16* __restrict__ delta, int nsum,
                                    const NormW<K, WK>& nw, float eps,
                                    u16* __restrict__ resid_out, u16* __restrict__ xn_out,
                                    u16* xs, float* red) {
  const bool writer = blockIdx.x == 0 && blockIdx.y == 0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float ss[NT];
#pragma unroll
  for (int tk = 0; tk < NT; ++tk) ss[tk] = 0.f;
#pragma unroll
  for (int i = 0; i < NormW<K, WK>::N; ++i) {
    const int c = NormW<K, WK>::chunk(i);
    if (c >= K / 8) break;
#pragma unroll
    for (int tk = 0; tk < NT; ++tk) {
      const uint4 r = *reinterpret_cast<const uint4*>(resid_in + (long)tk * K + 8 * c);
      const u32 rv[4] = {r.x, r.y, r.z, r.w};
      float x[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[2 * i] = bf16lo_to_f32(rv[i]);
        x[2 * i + 1] = bf16hi_to_f32(rv[i]);
      }
      if (nsum > 0) {
        float d[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) d[i] = 0.f;
        for (int j = 0; j < nsum; ++j) {
          const uint4 q = *reinterpret_cast<const uint4*>(delta + ((long)tk * nsum + j) * K + 8 * c);
          const u32 qv[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            d[2 * i] += bf16lo_to_f32(qv[i]);
            d[2 * i + 1] += bf16hi_to_f32(qv[i]);
          }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = round_bf16(x[i] + round_bf16(d[i]));
      }
      uint4 o;
      o.x = f32x2_to_bf16x2(x[0], x[1]);
      o.y = f32x2_to_bf16x2(x[2], x[3]);
      o.z = f32x2_to_bf16x2(x[4], x[5]);
      o.w = f32x2_to_bf16x2(x[6], x[7]);
      *reinterpret_cast<uint4*>(xs + tk * XS + 8 * c) = o;
      if (writer) *reinterpret_cast<uint4*>(resid_out + (long)tk * K + 8 * c) = o;
#pragma unroll
      for (int i = 0; i < 8; ++i) ss[tk] += x[i] * x[i];
    }
  }
#pragma unroll
  for (int tk = 0; tk < NT; ++tk) {
    const float s = warp_sum(ss[tk]);
    if (lane == 0) red[warp * NT + tk] = s;
  }
  __syncthreads();
  float rs[NT];
#pragma unroll
  for (int tk = 0; tk < NT; ++tk) {
    float s = 0.f;
    for (int ww = 0; ww < WK; ++ww) s += red[ww * NT + tk];
    rs[tk] = rsqrtf(s / (float)K + eps);
  }
#pragma unroll
  for (int i = 0; i < NormW<K, WK>::N; ++i) {
    const int c = NormW<K, WK>::chunk(i);
    if (c >= K / 8) break;
    const uint4 wq = nw.v[i];
    const u32 wv[4] = {wq.x, wq.y, wq.z, wq.w};
#pragma unroll
    for (int tk = 0; tk < NT; ++tk) {
      uint4* p = reinterpret_cast<uint4*>(xs + tk * XS + 8 * c);
      const uint4 xq = *p;
      const u32 xv[4] = {xq.x, xq.y, xq.z, xq.w};
      u32 ov[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float lo = round_bf16(bf16lo_to_f32(xv[i]) * rs[tk]) * bf16lo_to_f32(wv[i]);
        const float hi = round_bf16(bf16hi_to_f32(xv[i]) * rs[tk]) * bf16hi_to_f32(wv[i]);
        ov[i] = f32x2_to_bf16x2(lo, hi);
      }
      const uint4 o = u32x4(ov[0], ov[1], ov[2], ov[3]);
      *p = o;
      if (writer && xn_out) *reinterpret_cast<uint4*>(xn_out + (long)tk * K + 8 * c) = o;
    }
  }
  __syncthreads();
}

// out [NT, N] = x [NT, K] @ w [N, K]^T. Grid N / 16, WK warps.
template <int NT, int WK, int KCW, int U, int NS>
__global__ void __launch_bounds__(WK * 32) gemv_bf16(const u16* __restrict__ w,
                                                     const u16* __restrict__ x,
                                                     u16* __restrict__ out, int n) {
  constexpr int K = WK * KCW * 32;
  __shared__ float red[WK * 4 * 32];
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  const int row0 = blockIdx.x * TILE_ROWS;
  const u16* wt[1] = {w + (long)row0 * K};
  float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
  WarpGemv<1, KCW, U, NS> gv(wt, K, warp * KCW * 32, dyn_ring + warp * Ring<1, U, NS>::UINT4);
  gv.start();  // the weights: no earlier kernel writes them
  pdl_wait();
  pdl_launch_dependents();
  gv.run(g < NT ? x + (long)g * K : nullptr, acc);
  cta_reduce<1, WK>(acc, red);
  if (warp == 0) store_tile<NT>(out, n, row0, acc[0]);
}

// out [ntok, N] = x [ntok, K] @ w [N, K]^T for 8 < ntok <= 8 NB (the standard decode step's
// projections at batch 9-32): as gemv_bf16, each weight stage feeding NB 8-token MMA columns.
// Grid N / 16, WK warps.
template <int NB, int WK, int KCW, int U, int NS>
__global__ void __launch_bounds__(WK * 32) gemv_bf16_tiles(const u16* __restrict__ w,
                                                           const u16* __restrict__ x,
                                                           u16* __restrict__ out, int n,
                                                           int ntok) {
  constexpr int K = WK * KCW * 32;
  __shared__ float red[WK * NB * 4 * 32];
  const int warp = threadIdx.x >> 5;
  const int row0 = blockIdx.x * TILE_ROWS;
  const u16* wt[1] = {w + (long)row0 * K};
  float acc[NB][4] = {};
  WarpGemv<1, KCW, U, NS> gv(wt, K, warp * KCW * 32, dyn_ring + warp * Ring<1, U, NS>::UINT4);
  gv.start();
  gv.template run_tiles<NB>(x, K, ntok, acc);
  cta_reduce<NB, WK>(acc, red);
  if (warp != 0) return;
#pragma unroll
  for (int j = 0; j < NB; ++j) store_tile_rows(out + 8L * j * n, n, row0, acc[j], ntok - 8 * j);
}

// Fused qkv projection. PRO: add + RMSNorm prologue (resid_in + nsum delta rows, ln_w) and the
// residual to resid_out; else the input is xn [NT, K]. Then qkv [NT, N] (N = (hq + 2 hkv) 128),
// and the last CTA of each head: q/k RMSNorm (norm_w [2, 128]) + rotate-half RoPE at pos[b]
// -> q_out [NT, hq, 128] and kv_new [2, NT, hkv 128] (k, v); with a BF16 cache [2, NT, hkv, S,
// 128] it also writes k and v at position pos[b].
// Launched in clusters of CL = 128 / 16 = 8 CTAs, one cluster per head: each CTA also stores its
// tile into the cluster's CTA 0's shared memory (st.shared::cluster), and after one cluster
// barrier CTA 0 finishes the head.
template <int NT, int WK, int KCW, int U, int NS, bool PRO>
__global__ void __launch_bounds__(WK * 32) qkv_rope_bf16(
    const u16* __restrict__ resid_in, const u16* __restrict__ delta, int nsum,
    const u16* __restrict__ ln_w, float eps, u16* __restrict__ resid_out,
    const u16* __restrict__ xn, const u16* __restrict__ w, u16* __restrict__ qkv,
    const u16* __restrict__ norm_w, const int* __restrict__ pos,
    const float* __restrict__ inv_freq, u16* __restrict__ q_out, u16* __restrict__ kv_new,
    u16* __restrict__ cache, int cap, int hq, int hkv) {
  constexpr int K = WK * KCW * 32;
  constexpr int XS = K + 32;  // padded smem row: token rows start 64 bytes apart in bank space
  __shared__ __align__(16) u16 xs[PRO ? NT * XS : 8];
  __shared__ float red[WK * 4 * 32];
  __shared__ u16 s_head[NT * HEAD_DIM];  // the head's rows (CTA 0's)
  cluster_arrive_relaxed();  // phase 0: this CTA runs (its shared memory exists)
  const int n = (hq + 2 * hkv) * HEAD_DIM;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int row0 = blockIdx.x * TILE_ROWS;
  const u16* wt[1] = {w + (long)row0 * K};
  WarpGemv<1, KCW, U, NS> gv(wt, K, warp * KCW * 32, dyn_ring + warp * Ring<1, U, NS>::UINT4);
  gv.start();  // weight copies in flight during the prologue
  NormW<K, WK> nw;
  if (PRO) nw.load(ln_w);
  pdl_wait();
  pdl_launch_dependents();
  if (PRO) add_rmsnorm_to_smem<NT, K, XS, WK>(resid_in, delta, nsum, nw, eps, resid_out,
                                              nullptr, xs, red);
  float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
  gv.run(g < NT ? (PRO ? xs + g * XS : xn + (long)g * K) : nullptr, acc);
  cta_reduce<1, WK>(acc, red);
  if (warp == 0) store_tile<NT>(qkv, n, row0, acc[0]);
  const int head = row0 / HEAD_DIM;
  cluster_wait_acquire();  // phase 0: CTA 0 runs
  if (warp == 0)  // the same bf16 values into CTA 0's s_head
    store_tile_cluster<NT>(cluster_map(s_head, 0), HEAD_DIM, row0 % HEAD_DIM, acc[0]);
  cluster_arrive_release();  // phase 1: this CTA's rows are in CTA 0
  if (cluster_rank() != 0) return;
  cluster_wait_acquire();  // phase 1: the head's rows are all in s_head
  for (int b = warp; b < NT; b += WK) {
    u16 raw[4];  // d = lane, lane + 32 (first half), 64 + lane, 96 + lane (their partners)
#pragma unroll
    for (int i = 0; i < 4; ++i) raw[i] = s_head[b * HEAD_DIM + lane + 32 * i];
    const int p = pos[b];
    if (head >= hq + hkv) {  // v: copy
      const int hv = head - hq - hkv;
      u16* dst = kv_new + ((long)(NT + b) * hkv + hv) * HEAD_DIM;
      u16* cdst = cache ? cache + (((long)(NT + b) * hkv + hv) * cap + p) * HEAD_DIM : nullptr;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        dst[lane + 32 * i] = raw[i];
        if (cdst) cdst[lane + 32 * i] = raw[i];
      }
      continue;
    }
    float x[4];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[i] = bf16_to_f32(raw[i]);
      ss += x[i] * x[i];
    }
    const float r = rsqrtf(warp_sum(ss) / (float)HEAD_DIM + eps);
    const u16* nw = norm_w + (head >= hq ? HEAD_DIM : 0);
    float y[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      y[i] = round_bf16(round_bf16(x[i] * r) * bf16_to_f32(nw[lane + 32 * i]));
    u16* dst;
    u16* cdst = nullptr;
    if (head < hq) {
      dst = q_out + ((long)b * hq + head) * HEAD_DIM;
    } else {
      const int hk = head - hq;
      dst = kv_new + ((long)b * hkv + hk) * HEAD_DIM;
      if (cache) cdst = cache + (((long)b * hkv + hk) * cap + p) * HEAD_DIM;
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // pairs (d, d + 64), d = lane + 32 i
      const int d = lane + 32 * i;
      float sn, cs;
      sincosf((float)p * inv_freq[d], &sn, &cs);
      const float c = round_bf16(cs), s = round_bf16(sn);
      const float y1 = y[i], y2 = y[i + 2];
      const u16 o1 = f32_to_bf16_rn(y1 * c - y2 * s);
      const u16 o2 = f32_to_bf16_rn(y2 * c + y1 * s);
      dst[d] = o1;
      dst[d + HEAD_DIM / 2] = o2;
      if (cdst) {
        cdst[d] = o1;
        cdst[d + HEAD_DIM / 2] = o2;
      }
    }
  }
}

// Fused router: add + RMSNorm prologue (resid_in + nsum delta rows, ln_w; CTA 0 writes
// resid_out and xn_out), logits [NT, E] (bf16) = xn @ w [E, K]^T, then the last CTA: softmax,
// top-k (ties: lowest index; weights renormalized), and the block layout of the grouped expert
// GEMMs exactly as moe.align_reference (pairs of an expert in (j, t) order, padded to bm,
// experts ascending; pad = n_pairs; block_expert -1 past the end; sorted_pair null: no layout,
// for gate_up by pairs). counter: zero before/after. The top-k picks one expert per warp-wide
// max of unique keys (topk_key): one shuffle tree per pick instead of an argmax's two.
// QX: one more CTA (the grid's last, no weight tile) NVFP4-quantizes the normalized rows it
// computed like the others (the FP4 experts' input, as quant.quantize_rows with per-row
// scale_2): codes q_codes [NT, K/2], e4m3 scales q_scales [NT, K/16], scale_2 q_g [NT], the
// CUDA expert GEMM's operand q_dq [NT, K] (null: none) and, with r_mbits, the compact guidance
// record (r_mbits [NT, K/8], r_scales [NT, K/16], r_g [NT]); one launch fewer per layer.
// CL > 0: the grid is one cluster of CL = E / 16 CTAs (launched with that cluster size, no extra
// CTA): each CTA also stores its logits tile into CTA 0's shared memory (st.shared::cluster),
// one cluster barrier replaces the fence + counter + L2 reads, CTA 0 runs the tail from its
// shared memory, and with QX the last CTA quantizes after its tile (counter unused).
template <int NT, int WK, int KCW, int U, int NS, bool QX, int CL = 0>
__global__ void __launch_bounds__(WK * 32) router_topk_bf16(
    const u16* __restrict__ resid_in, const u16* __restrict__ delta, int nsum,
    const u16* __restrict__ ln_w, float eps, u16* __restrict__ resid_out,
    u16* __restrict__ xn_out, const u16* __restrict__ w, u16* __restrict__ logits,
    int* __restrict__ counter, int* __restrict__ topk_ids, float* __restrict__ topk_w,
    int* __restrict__ sorted_pair, int* __restrict__ block_expert, int n_exp, int top_k, int bm,
    int maxb, u8* __restrict__ q_codes, u8* __restrict__ q_scales, float* __restrict__ q_g,
    u16* __restrict__ q_dq, u8* __restrict__ r_mbits, u8* __restrict__ r_scales,
    float* __restrict__ r_g) {
  constexpr int K = WK * KCW * 32;
  constexpr int XS = K + 32;
  __shared__ __align__(16) u16 xs[NT * XS];
  __shared__ float red[WK * 4 * 32];
  __shared__ int is_last;
  __shared__ int s_ids[MAX_PAIRS], s_rank[MAX_PAIRS];
  __shared__ int s_nblk[MAX_EXPERTS], s_start[MAX_EXPERTS], s_wsum[WK];
  __shared__ int s_slots[MAX_SLOTS];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  if (CL) cluster_arrive_relaxed();  // phase 0: this CTA runs (its shared memory exists)
  const bool quant_cta = QX && !CL && blockIdx.x == gridDim.x - 1;  // the extra CTA (no tile)
  const int row0 = blockIdx.x * TILE_ROWS;
  // CTA 0's copy of the logits [NT][n_exp] (bf16) in cluster mode: in s_slots, which CTA 0
  // fills only after it has read them all
  u16* s_lg = reinterpret_cast<u16*>(s_slots);
  const u16* wt[1] = {w + (long)(quant_cta ? 0 : row0) * K};
  // FULL: every stage of the warp's K slice in flight before the PDL wait (the router's weights
  // do not depend on the previous kernel, so they stream while it finishes)
  WarpGemv<1, KCW, U, NS, true> gv(wt, K, warp * KCW * 32,
                                   dyn_ring + warp * Ring<1, U, NS>::UINT4);
  if (!quant_cta) gv.start();  // weight copies in flight during the prologue
  NormW<K, WK> nw;
  nw.load(ln_w);
  pdl_wait();
  pdl_launch_dependents();
  add_rmsnorm_to_smem<NT, K, XS, WK>(resid_in, delta, nsum, nw, eps, resid_out, xn_out, xs,
                                     red);
  // the experts' NVFP4 input, from the normalized rows in xs (the extra CTA, or CL's last)
  auto xq_load = [&](int tk, int e, float (&x)[4]) {
    const uint2 v = *reinterpret_cast<const uint2*>(xs + tk * XS + e);
    x[0] = bf16lo_to_f32(v.x);
    x[1] = bf16hi_to_f32(v.x);
    x[2] = bf16lo_to_f32(v.y);
    x[3] = bf16hi_to_f32(v.y);
  };
  auto xq_dst = [&](int tk) {
    NVFP4RowOut o = nvfp4_row_out(q_codes + (long)tk * (K / 2), q_scales + (long)tk * (K / 16),
                                  q_g + tk);
    o.dq16 = q_dq ? q_dq + (long)tk * K : nullptr;
    if (r_mbits) {
      o.mbits = r_mbits + (long)tk * (K / 8);
      o.rec_scales = r_scales + (long)tk * (K / 16);
      o.rec_g = r_g + tk;
    }
    return o;
  };
  if (quant_cta) {
    nvfp4_quantize_rows_cta<WK * 32>(NT, K, xq_load, xq_dst);
  } else {
    float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
    gv.run(g < NT ? xs + g * XS : nullptr, acc);
    cta_reduce<1, WK>(acc, red);
    if (warp == 0) store_tile<NT>(logits, n_exp, row0, acc[0]);
    if (CL) {
      cluster_wait_acquire();  // phase 0: CTA 0 runs
      if (warp == 0)  // the same bf16 values into CTA 0's s_lg
        store_tile_cluster<NT>(cluster_map(s_lg, 0), n_exp, row0, acc[0]);
      cluster_arrive_release();  // phase 1: this CTA's logits are in CTA 0
    }
  }
  if (CL) {
    if (QX && (int)cluster_rank() == CL - 1)
      nvfp4_quantize_rows_cta<WK * 32>(NT, K, xq_load, xq_dst);
    if (cluster_rank() != 0) return;
    cluster_wait_acquire();  // phase 1: every CTA's logits are in s_lg
  } else {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
  }
  const float neg_inf = __int_as_float(0xFF800000);
  for (int b = warp; b < NT; b += WK) {  // softmax + top-k of token b, one warp
    float v[MAX_EXPERTS / 32];
    u32 key[MAX_EXPERTS / 32];  // topk_key: unique, ordered as the picks (0: no expert)
#pragma unroll
    for (int i = 0; i < MAX_EXPERTS / 32; ++i) {
      const int e = lane + 32 * i;
      const u16 x = e >= n_exp ? (u16)0
                    : CL ? s_lg[b * n_exp + e] : ld_cg_u16(logits + (long)b * n_exp + e);
      v[i] = e >= n_exp ? neg_inf : bf16_to_f32(x);
      key[i] = e >= n_exp ? 0u : topk_key(x, e);
    }
    float mx = neg_inf;
#pragma unroll
    for (int i = 0; i < MAX_EXPERTS / 32; ++i) mx = fmaxf(mx, v[i]);
    mx = warp_max(mx);
    float den = 0.f;
#pragma unroll
    for (int i = 0; i < MAX_EXPERTS / 32; ++i)
      if (lane + 32 * i < n_exp) den += expf(v[i] - mx);
    den = warp_sum(den);
    // pick kk: the largest key not yet taken (one redux per pick); lane kk keeps it
    u32 taken = 0, mine = 0;
    for (int kk = 0; kk < top_k; ++kk) {
      u32 best = 0;
#pragma unroll
      for (int i = 0; i < MAX_EXPERTS / 32; ++i)
        if (!((taken >> i) & 1u)) best = max(best, key[i]);
      best = warp_max_u32(best);
      const int e = topk_key_expert(best);
      if ((e & 31) == lane) taken |= 1u << (e >> 5);
      if (lane == kk) mine = best;
    }
    // the picks' probabilities (lane kk), renormalized by their sum taken in pick order
    const float p = lane < top_k ? expf(topk_key_logit(mine) - mx) / den : 0.f;
    float wsum = 0.f;
    for (int kk = 0; kk < top_k; ++kk) wsum += __shfl_sync(0xFFFFFFFFu, p, kk);
    if (lane < top_k) {
      const int e = topk_key_expert(mine);
      topk_w[b * top_k + lane] = p / wsum;
      topk_ids[b * top_k + lane] = e;
      s_ids[b * top_k + lane] = e;
    }
  }
  __syncthreads();
  if (!sorted_pair) {  // no block layout (gate_up by pairs)
    if (!CL && threadIdx.x == 0) *counter = 0;
    return;
  }
  // block layout: rank of each pair within its expert in (j, t) order, blocks per expert
  const int n_pairs = NT * top_k;
  for (int q = threadIdx.x; q < n_pairs; q += WK * 32) {
    const int j = q / NT, b = q % NT, p = b * top_k + j, e = s_ids[p];
    int rank = 0;
    for (int q2 = 0; q2 < q; ++q2) rank += s_ids[(q2 % NT) * top_k + q2 / NT] == e;
    s_rank[p] = rank;
  }
  // blocks per expert (s_nblk) and their exclusive prefix sum (s_start): each thread counts a
  // run of experts, then one scan over the threads (a serial sum per expert took up to E
  // dependent shared-memory reads)
  const int per = (n_exp + WK * 32 - 1) / (WK * 32), e0 = threadIdx.x * per;
  const int e1 = min(e0 + per, n_exp);
  int mine = 0;
  for (int e = e0; e < e1; ++e) {
    int c = 0;
    for (int p = 0; p < n_pairs; ++p) c += s_ids[p] == e;
    s_nblk[e] = (c + bm - 1) / bm;
    mine += s_nblk[e];
  }
  int inc = mine;  // inclusive scan over the warp's lanes
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xFFFFFFFFu, inc, o);
    if (lane >= o) inc += v;
  }
  if (lane == 31) s_wsum[warp] = inc;
  for (int s = threadIdx.x; s < maxb * bm; s += WK * 32) s_slots[s] = n_pairs;
  __syncthreads();
  int st = inc - mine;
  for (int w = 0; w < warp; ++w) st += s_wsum[w];
  for (int e = e0; e < e1; ++e) {
    s_start[e] = st;
    st += s_nblk[e];
  }
  __syncthreads();
  const int total = s_start[n_exp - 1] + s_nblk[n_exp - 1];
  for (int p = threadIdx.x; p < n_pairs; p += WK * 32) s_slots[s_start[s_ids[p]] * bm + s_rank[p]] = p;
  for (int e = threadIdx.x; e < n_exp; e += WK * 32)
    for (int i = 0; i < s_nblk[e]; ++i) block_expert[s_start[e] + i] = e;
  for (int bb = total + threadIdx.x; bb < maxb; bb += WK * 32) block_expert[bb] = -1;
  __syncthreads();
  for (int s = threadIdx.x; s < maxb * bm; s += WK * 32) sorted_pair[s] = s_slots[s];
  if (!CL && threadIdx.x == 0) *counter = 0;
}

// Routed experts' gate_up, grouped by expert block of 8 pair slots (sorted_pair/block_expert of
// a plan with bm = 8): act [n_pairs, inter] = silu(x W_gate^T) * (x W_up^T), x row = pair /
// top_k of x [T, K]; w [E, 2 inter, K] (gate rows, then up rows). Grid (maxb, inter / 16).
// topk_ids (not null): by pairs instead, block = pair (expert topk_ids[pair], one MMA column),
// grid (n_pairs, inter / 16): no block layout to wait for, one dependent read fewer; an expert
// two pairs chose is read twice (none at batch 1).
template <int WK, int KCW, int U, int NS>
__global__ void __launch_bounds__(WK * 32) moe_gate_up_bf16(
    const u16* __restrict__ w, const u16* __restrict__ x, const int* __restrict__ sorted_pair,
    const int* __restrict__ block_expert, const int* __restrict__ topk_ids,
    u16* __restrict__ act, int inter, int n_pairs, int top_k) {
  constexpr int K = WK * KCW * 32;
  __shared__ float red[WK * 2 * 4 * 32];
  pdl_wait();  // the expert (and so the weights) comes from the router
  pdl_launch_dependents();
  const int e = topk_ids ? topk_ids[blockIdx.x] : block_expert[blockIdx.x];
  if (e < 0) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // column g's pair (n_pairs: none)
  const int pg = topk_ids ? (g == 0 ? (int)blockIdx.x : n_pairs) : sorted_pair[blockIdx.x * 8 + g];
  const u16* xrow = pg < n_pairs ? x + (long)(pg / top_k) * K : nullptr;
  const int i0 = blockIdx.y * TILE_ROWS;
  const u16* gate = w + ((long)e * 2 * inter + i0) * K;
  const u16* wt[2] = {gate, gate + (long)inter * K};
  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  // the warps' chunks interleaved (warp w: chunks w, w + WK, ...): at a time a CTA reads
  // WK U 64 contiguous bytes of each row, not WK pieces a K slice apart
  WarpGemv<2, KCW, U, NS> gv(wt, K, warp * 32, dyn_ring + warp * Ring<2, U, NS>::UINT4, WK * 32);
  gv.start();
  gv.run(xrow, acc);
  cta_reduce<2, WK>(acc, red);
  if (warp != 0) return;
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // (row g + 8 (i >> 1), slot 2t + (i & 1))
    const int slot = 2 * t + (i & 1);
    const int p = topk_ids ? (slot == 0 ? (int)blockIdx.x : n_pairs)
                           : sorted_pair[blockIdx.x * 8 + slot];
    if (p >= n_pairs) continue;
    const float gt = acc[0][i], up = acc[1][i];
    act[(long)p * inter + i0 + g + 8 * (i >> 1)] = f32_to_bf16_rn(gt / (1.0f + expf(-gt)) * up);
  }
}

// Routed experts' down projection per token: warp j takes the token's j-th expert, so y [T, H]
// = sum_j bf16(w_j * act[t top_k + j] @ W_down[e_j]^T) in fp32, in order j, then bf16 -- the
// per-pair outputs and the top-k sum the next residual add would make. w [E, H, K], act
// [T top_k, K]. Grid (T, H / 16), TOPK warps.
// The expert ids come from the router, two kernels back: launched after moe_gate_up_bf16,
// whose every CTA waits for the router before it lets dependents launch, this kernel starts
// only once the router has completed, so it reads topk_ids (from L2) and streams its weights
// before its own wait, while gate_up drains; act and topk_w are read after the wait.
template <int TOPK, int KCW, int U, int NS>
__global__ void __launch_bounds__(TOPK * 32) moe_down_bf16(
    const u16* __restrict__ w, const u16* __restrict__ act, const int* __restrict__ topk_ids,
    const float* __restrict__ topk_w, u16* __restrict__ y, int hidden) {
  constexpr int K = KCW * 32;
  __shared__ float part[TOPK][TILE_ROWS];
  __shared__ __align__(16) u16 s_act[TOPK][K];  // each warp's act row, one load round
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int tok = blockIdx.x, p = tok * TOPK + warp;
  const int e = ld_cg_s32(topk_ids + p);  // the router's, complete (above)
  const int h0 = blockIdx.y * TILE_ROWS;
  const u16* wt[1] = {w + ((long)e * hidden + h0) * K};
  float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
  WarpGemv<1, KCW, U, NS, true> gv(wt, K, 0, dyn_ring + warp * Ring<1, U, NS>::UINT4);
  gv.start();
  pdl_wait();  // act: gate_up's
  pdl_launch_dependents();
  const float rw = topk_w[p];
  // the pair's act row into shared memory in one round of loads: read from global in the ring
  // loop, each of its KCW / U rounds waited for an L2 round trip of its own
  const uint4* arow = reinterpret_cast<const uint4*>(act + (long)p * K);
  uint4* srow = reinterpret_cast<uint4*>(s_act[warp]);
  for (int i = lane; i < K / 8; i += 32) srow[i] = arow[i];
  __syncwarp();
  gv.run(g == 0 ? s_act[warp] : nullptr, acc);
  if (t == 0) {  // column 0 = this pair
    part[warp][g] = round_bf16(acc[0][0] * rw);
    part[warp][g + 8] = round_bf16(acc[0][2] * rw);
  }
  __syncthreads();
  if (threadIdx.x < TILE_ROWS) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < TOPK; ++j) s += part[j][threadIdx.x];
    y[(long)tok * hidden + h0 + threadIdx.x] = f32_to_bf16_rn(s);
  }
}
