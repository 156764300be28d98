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
