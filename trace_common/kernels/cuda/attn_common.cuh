// Helpers shared by the decode attention kernels (attn_fp4.cu: FP4 cache; attn_small.cu: BF16
// cache): the query-group geometry, the merge of a CTA's warps into one split's partials, and
// the in-kernel combine of the splits by the CTA that finishes a (sequence, kv head) last.
//
// Split partials (the layout of the Triton split kernel and its reduce kernel, _tl_attn.py):
//   part_o  fp32 [B, HQ, NSPLIT, 128]: unnormalized output of split s
//   part_ml fp32 [B, HQ, NSPLIT, 2]:   its running max (log2 domain) and sum of exp2
//
// No system headers: compiled by NVRTC (CuPy RawModule, -I on this folder) or nvcc alike.
#pragma once

#include "fp4_common.cuh"

#define HEAD_D 128
#define GROUP 8  // query heads per kv head
#define TILE 16  // tokens per warp step
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// m8n8 b16 transpose within the warp: lane (g, t) gets row g of the transpose (elements 2t, 2t+1)
__device__ __forceinline__ u32 movm_trans(u32 x) {
  u32 r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

// coherent (L2) loads of partials other CTAs of this grid wrote before a fence + counter
// (volatile: kept after the barrier; no memory clobber, so a batch of them issues together)
__device__ __forceinline__ float attn_ld_cg_f32(const float* p) {
  float r;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ float4 attn_ld_cg_f32x4(const float* p) {
  float4 r;
  asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ u32 attn_f32x2_to_bf16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// One 16-token tile's online-softmax step (log2 domain) on the lane's swap-AB S^T fragment:
// scores (s[0] + s[1]) of tokens g (c0, c1) and g + 8 (c2, c3) for heads 2t, 2t+1, scaled by
// scale0 / scale1 and masked to -inf where in0 / in1 is false. Updates the running max m and
// sum l of the two heads; returns the tile's probabilities p (token g: p0, p1; g + 8: p2, p3)
// and the factors al0, al1 the old accumulators are to be rescaled by (`rescale_acc`).
struct SoftmaxTile {
  float p0, p1, p2, p3, al0, al1;
};

__device__ __forceinline__ SoftmaxTile online_softmax_tile(const float (&s)[2][4], float scale0,
                                                           float scale1, bool in0, bool in1,
                                                           float& m0, float& m1, float& l0,
                                                           float& l1) {
  const float x0 = in0 ? (s[0][0] + s[1][0]) * scale0 : NEG_INF;  // token g, head 2t
  const float x1 = in0 ? (s[0][1] + s[1][1]) * scale0 : NEG_INF;  // token g, head 2t + 1
  const float x2 = in1 ? (s[0][2] + s[1][2]) * scale1 : NEG_INF;  // token g + 8, head 2t
  const float x3 = in1 ? (s[0][3] + s[1][3]) * scale1 : NEG_INF;
  float mt0 = fmaxf(x0, x2), mt1 = fmaxf(x1, x3);
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    mt0 = fmaxf(mt0, __shfl_xor_sync(0xffffffffu, mt0, o));
    mt1 = fmaxf(mt1, __shfl_xor_sync(0xffffffffu, mt1, o));
  }
  const float mn0 = fmaxf(m0, mt0), mn1 = fmaxf(m1, mt1);
  SoftmaxTile r;
  r.al0 = ex2(m0 - mn0);
  r.al1 = ex2(m1 - mn1);
  m0 = mn0;
  m1 = mn1;
  r.p0 = ex2(x0 - mn0);
  r.p1 = ex2(x1 - mn1);
  r.p2 = ex2(x2 - mn0);
  r.p3 = ex2(x3 - mn1);
  l0 = l0 * r.al0 + (r.p0 + r.p2);
  l1 = l1 * r.al1 + (r.p1 + r.p3);
  return r;
}

// O^T accumulators (8 m-tiles; c0/c2 head 2t, c1/c3 head 2t + 1) times the tile's rescale
// factors, skipped while no lane's running max moved.
__device__ __forceinline__ void rescale_acc(float (&acc)[8][4], float al0, float al1) {
  if (__any_sync(0xffffffffu, al0 != 1.f || al1 != 1.f)) {
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      acc[r][0] *= al0;
      acc[r][1] *= al1;
      acc[r][2] *= al0;
      acc[r][3] *= al1;
    }
  }
}

// The CTA combines its warps' (max, sum, output) of the 8 heads and writes split `row0`'s
// partials (row0 = (b * HQ + first head) * nsplit + split). o_s: warp w's [GROUP][HEAD_D + 4]
// outputs start at o_s + w * o_stride.
template <int WARPS>
__device__ __forceinline__ void merge_warps(const float* o_s, int o_stride,
                                            const float (*ml_s)[GROUP][2],
                                            float* __restrict__ part_o,
                                            float* __restrict__ part_ml, long row0, int nsplit) {
  for (int o = threadIdx.x; o < GROUP * HEAD_D; o += WARPS * 32) {
    const int h = o / HEAD_D, d = o % HEAD_D;
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, ml_s[w][h][0]);
    float ov = 0.f, lv = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float wt = ex2(ml_s[w][h][0] - mx);
      ov += o_s[w * o_stride + h * (HEAD_D + 4) + d] * wt;
      lv += ml_s[w][h][1] * wt;
    }
    const long row = row0 + (long)h * nsplit;
    part_o[row * HEAD_D + d] = ov;
    if (d == 0) {
      part_ml[row * 2] = mx;
      part_ml[row * 2 + 1] = lv;
    }
  }
}

// After the CTA wrote its split's partials: whether it is the last of the `nvalid` splits of
// its (sequence, kv head) to finish (counter: zero before the first split arrives; the last
// CTA sets it back to zero, so the next launch finds it clean). Every thread calls it.
__device__ __forceinline__ bool last_split_cta(int* counter, int nvalid) {
  __shared__ int is_last;
  __threadfence();  // this CTA's partials are visible device-wide before its arrival counts
  __syncthreads();
  if (threadIdx.x == 0) {
    is_last = atomicAdd(counter, 1) == nvalid - 1;
    if (is_last) *counter = 0;  // every split has arrived: nobody else touches it this launch
  }
  __syncthreads();
  if (is_last) __threadfence();
  return is_last;
}

// The last CTA: out[h, :] (bf16) for the GROUP heads of rows row0 + h * nsplit (row0 = (b * HQ
// + first head) * nsplit) = sum_s exp2(m_s - M) o_s / sum_s exp2(m_s - M) l_s over the splits
// s < nvalid (M = max m_s), as decode_attn_reduce_kernel computes it. Thread i: head i / 16,
// d = 8 (i % 16) .. + 8. The partials are read COMBINE_BATCH splits at a time, all loads of a
// batch in flight together (one L2 round trip per batch, not per split); across batches the
// running max rescales the sums (as flash-decoding does). Fixed order, so the result does not
// depend on which CTA came last.
#define COMBINE_BATCH 8

template <int THREADS>
__device__ __forceinline__ void combine_splits(const float* part_o, const float* part_ml,
                                               u16* __restrict__ out, long row0, int nsplit,
                                               int nvalid) {
  for (int i = threadIdx.x; i < GROUP * HEAD_D / 8; i += THREADS) {
    const int h = i / (HEAD_D / 8), d0 = 8 * (i % (HEAD_D / 8));
    const long r0 = row0 + (long)h * nsplit;
    float mx = NEG_INF, l = 0.f;
    float o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int s0 = 0; s0 < nvalid; s0 += COMBINE_BATCH) {
      float m[COMBINE_BATCH], ls[COMBINE_BATCH];
      float4 a[COMBINE_BATCH], c[COMBINE_BATCH];
#pragma unroll
      for (int j = 0; j < COMBINE_BATCH; ++j) {
        const long r = r0 + s0 + j;
        if (s0 + j < nvalid) {
          m[j] = attn_ld_cg_f32(part_ml + r * 2);
          ls[j] = attn_ld_cg_f32(part_ml + r * 2 + 1);
          a[j] = attn_ld_cg_f32x4(part_o + r * HEAD_D + d0);
          c[j] = attn_ld_cg_f32x4(part_o + r * HEAD_D + d0 + 4);
        } else {
          m[j] = NEG_INF;
          ls[j] = 0.f;
          a[j] = c[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
      float mn = mx;
#pragma unroll
      for (int j = 0; j < COMBINE_BATCH; ++j) mn = fmaxf(mn, m[j]);
      const float sc = ex2(mx - mn);  // 0 on the first batch (mx = -inf): o, l are 0 there
      l *= sc;
#pragma unroll
      for (int k = 0; k < 8; ++k) o[k] *= sc;
#pragma unroll
      for (int j = 0; j < COMBINE_BATCH; ++j) {
        const float w = ex2(m[j] - mn);  // 0 past nvalid
        l += ls[j] * w;
        o[0] += a[j].x * w;
        o[1] += a[j].y * w;
        o[2] += a[j].z * w;
        o[3] += a[j].w * w;
        o[4] += c[j].x * w;
        o[5] += c[j].y * w;
        o[6] += c[j].z * w;
        o[7] += c[j].w * w;
      }
      mx = mn;
    }
    uint4 v;
    v.x = attn_f32x2_to_bf16x2(o[0] / l, o[1] / l);
    v.y = attn_f32x2_to_bf16x2(o[2] / l, o[3] / l);
    v.z = attn_f32x2_to_bf16x2(o[4] / l, o[5] / l);
    v.w = attn_f32x2_to_bf16x2(o[6] / l, o[7] / l);
    *(uint4*)(out + (long)h * HEAD_D + d0) = v;
  }
}
