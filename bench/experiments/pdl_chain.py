"""Per-kernel cost of a chain of dependent kernels in a CUDA graph: plain launches, programmatic
dependent launches (each kernel's `griddepcontrol.wait`), or PDL launches whose kernels wait
on a done-counter the previous kernel's CTAs bump (fence + atomic; thread 0 spins with
ld.acquire) instead of the grid-completion wait. Each kernel reads `--kb` KB per CTA.

    python bench/experiments/pdl_chain.py            # a table: grid x bytes -> us per kernel, per mode

The question it answers: would a kernel starting on a flag set by its predecessor's CTAs
(before that grid completes) shorten the decode step's chain of small kernels?
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository

SOURCE = r"""
__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// mode 0: griddepcontrol.wait; 1: spin until *prev_done >= prev_n, bump *self_done at the end
extern "C" __global__ void link(const int* prev_done, int prev_n, int* self_done, int mode,
                                const float4* buf, int per_cta, float* sink) {
  if (mode == 0) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
  } else {
    if (threadIdx.x == 0) while (ld_acquire(prev_done) < prev_n) {}
    __syncthreads();
  }
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  float s = 0.f;
  for (int i = threadIdx.x; i < per_cta; i += blockDim.x) {
    const float4 v = buf[(long)blockIdx.x * per_cta + i];
    s += v.x + v.w;
  }
  if (s == 12345.f) sink[0] = s;  // keeps the loads
  if (mode == 1) {
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(self_done, 1);
    }
  }
}
"""
MODES = (("plain", 0, False), ("pdl", 0, True), ("flag", 1, True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=288, help="chain length (48 layers x 6)")
    ap.add_argument("--shapes", default="8:0,132:0,384:0,132:128,384:32",
                    help="comma list of CTAs:KB read per CTA")  # fmt: skip
    ap.add_argument("--replays", type=int, default=10)
    args = ap.parse_args()

    import numpy as np
    import torch

    from trace_common.kernels.cuda_launch import launch_ex, require_cupy

    cp = require_cupy()
    fn = cp.RawModule(code=SOURCE).get_function("link")
    n = args.kernels
    buf = torch.zeros(64 << 20, dtype=torch.float32, device="cuda")  # 256 MB, cycled through
    sink = torch.zeros(4, device="cuda")
    done = torch.zeros(n + 1, dtype=torch.int32, device="cuda")

    def step(mode: int, pdl: bool, grid: int, per: int) -> None:
        done.zero_()
        stream = torch.cuda.current_stream().cuda_stream
        span = buf.numel() // 4 - grid * per - 1
        for k in range(n):
            off = (k * grid * per) % max(span, 1)
            kargs = (np.uint64(done.data_ptr() + 4 * k), np.int32(0 if k == 0 else grid),
                     np.uint64(done.data_ptr() + 4 * (k + 1)), np.int32(mode),
                     np.uint64(buf.data_ptr() + 16 * off), np.int32(per),
                     np.uint64(sink.data_ptr()))  # fmt: skip
            launch_ex(fn, (grid,), (128,), kargs, stream, 0, pdl=pdl)

    print(f"{n} kernels of 128 threads per graph; us per kernel (best of 5 x {args.replays} "
          f"replays)")  # fmt: skip
    print(f"| CTAs | KB/CTA | {' | '.join(m for m, _, _ in MODES)} |")
    print(f"|---|---|{'---|' * len(MODES)}")
    for shape in args.shapes.split(","):
        grid, kb = (int(v) for v in shape.split(":"))
        per = kb * 1024 // 16
        res = []
        for _, mode, pdl in MODES:
            graph = torch.cuda.CUDAGraph()
            step(mode, pdl, grid, per)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                step(mode, pdl, grid, per)
            graph.replay()
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(args.replays):
                    graph.replay()
                torch.cuda.synchronize()
                best = min(best, (time.perf_counter() - t) / args.replays / n * 1e6)
            if mode == 1 and int(done[n]) != grid:
                raise RuntimeError(f"flag chain: the last kernel counted {int(done[n])} CTAs")
            res.append(best)
        print(f"| {grid} | {kb} | {' | '.join(f'{v:.2f}' for v in res)} |", flush=True)


if __name__ == "__main__":
    main()
