// Helpers shared by the CUDA FP4 kernels (moe_fp4.cu, attn_fp4.cu). No system headers:
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
