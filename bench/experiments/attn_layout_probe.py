"""Probe: would the FP4 ring attention read faster from a cache laid out as one contiguous record
per 16 tokens? Times, in isolation (CUDA graphs, every call reading its cache from HBM):

- `current`: `attn_fp4_ring` on today's cache (K codes, V codes, block scales, row scales in
  four tensors: six streams per 16-token stage);
- `record`: the same kernel with only its stage fill changed (the source rewritten at run time,
  nothing kept in the package) to copy one contiguous 2432-byte record per (sequence, kv head,
  16 tokens), already in the stage's shared-memory layout (row scales repeated per kv head,
  +2.7% bytes). It computes on whatever the record holds (random bytes), so only its time means
  anything; the engine must not run it;
- `read`: a plain streaming read of the record buffer's bytes (the read-only roofline).

    python bench/experiments/attn_layout_probe.py
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import re
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository

from rollout_gpu_kernels import _graph_us_per_call, cold_copies, copy_bandwidth

from trace_common.kernels import attention as attn
from trace_common.kernels import cuda_attn
from trace_common.kernels.cuda_launch import compiled_function, launch_on_torch_stream, pointers

HQ, HKV, D = 32, 4, 128
STAGE = 2432  # bytes per 16-token stage (RING_STAGE in cuda/attn_fp4.cu)

RECORD_FILL = """__device__ __forceinline__ void ring_fill_next(u32 st, RingSrc& src, u32 dcode,
                                               const u8* __restrict__ codes,
                                               const u8* __restrict__ scales,
                                               const float* __restrict__ krs,
                                               const float* __restrict__ vrs, long kbase,
                                               long vbase, int t0, int end, int lane) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
    cp_async16(st + 16 * (lane + 32 * i), src.k + 16 * (lane + 32 * i), 16u);
  if (lane < 24) cp_async16(st + 16 * (lane + 128), src.k + 16 * (lane + 128), 16u);
  src.k += WARPS * RING_STAGE;
}
"""

READ_SRC = r"""
extern "C" __global__ void read_all(const uint4* __restrict__ x, long n, unsigned* out) {
  unsigned acc = 0;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
       i += (long)gridDim.x * blockDim.x) {
    const uint4 v = __ldcs(x + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345679u) out[0] = acc;  // keeps the loads
}
"""


def record_source(tmp: pathlib.Path) -> pathlib.Path:
    """attn_fp4.cu with the ring's stage fill reading one contiguous record per stage."""
    src = cuda_attn.SOURCE.read_text()
    head = "__device__ __forceinline__ void ring_fill_next("
    start = src.index(head)
    end = src.index("\n}\n", start) + 3
    src = src[:start] + RECORD_FILL + src[end:]
    line = re.compile(r"  src\.k = codes \+ \(kbase \+ first.*\n")
    assert line.search(src), "attn_fp4_ring's src.k line moved: update the probe"
    src = line.sub("  src.k = codes + (((long)b * hkv + hk) * (cap / TILE) + first / TILE)"
                   " * RING_STAGE;\n", src)  # fmt: skip
    out = tmp / "attn_fp4_record_probe.cu"
    out.write_text(src)
    for inc in cuda_attn.SOURCE.parent.glob("*.cuh"):
        (tmp / inc.name).write_text(inc.read_text())
    return out


def run_current(c: attn.KVCacheGPU, geo: tuple, config: tuple) -> None:
    q, lens, plan, _, _, qk = geo
    cuda_attn.decode_attn_split_cuda(q, c.codes, c.scales, c.row_scales, lens, plan.part_o,
                                     plan.part_ml, chunk=plan.chunk, qk_scale=qk,
                                     config=config)  # fmt: skip


def run_record(r: torch.Tensor, geo: tuple, fn, warps: int) -> None:
    import numpy as np

    q, lens, plan, b, ctx, qk = geo
    a = (*pointers(q, r, r, r, lens, plan.part_o, plan.part_ml), np.int32(b), np.int32(HKV),
         np.int32(ctx), np.int32(plan.chunk), np.int32(plan.nsplit), np.float32(qk),
         *pointers(None, None, None, None, None, None))  # fmt: skip
    launch_on_torch_stream(fn, (plan.nsplit, HKV, b), (warps * 32,), a, q.device)


def run_read(r: torch.Tensor, fn, sink: torch.Tensor) -> None:
    import numpy as np

    launch_on_torch_stream(fn, (132 * 8,), (512,),
                           (*pointers(r), np.int64(r.numel() // 16), *pointers(sink)), r.device)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["8x32768", "16x32768", "32x8192"],
                    help="batch x context")  # fmt: skip
    args = ap.parse_args()
    import cupy as cp

    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw:.2f} TB/s (read + write)\n")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="attn_probe_"))
    rec_src = record_source(tmp)
    config = cuda_attn.DEFAULT_CONFIG
    name, warps = cuda_attn.kernel_name(config, False, False)
    rec_fn = compiled_function(rec_src, name)
    read_fn = cp.RawModule(code=READ_SRC).get_function("read_all")
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    print("| batch | context | variant | us | MB read | TB/s | % copy |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        b, ctx = (int(v) for v in shape.split("x"))
        plan = attn.DecodeAttnPlan.make(batch=b, q_heads=HQ, kv_heads=HKV, capacity=ctx,
                                        head_dim=D, context_hint=ctx, device="cuda",
                                        cuda_fp4=True)  # fmt: skip
        q = torch.randn(b, HQ, D, device="cuda").bfloat16()
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        cur_bytes = b * ctx * attn.KVCacheGPU.bytes_per_token(fp4=True, kv_heads=HKV, head_dim=D)
        rec_bytes = b * HKV * (ctx // 16) * STAGE
        caches, recs = [], []
        for _ in range(cold_copies(rec_bytes)):
            c = attn.KVCacheGPU.allocate(fp4=True, batch=b, kv_heads=HKV, capacity=ctx,
                                         head_dim=D, device="cuda")  # fmt: skip
            c.fill_random_()
            caches.append(c)
            recs.append(
                torch.empty(rec_bytes, dtype=torch.uint8, device="cuda").random_(0x30, 0x50)
            )
        qk = D**-0.5 * attn.LOG2E

        geo = (q, lens, plan, b, ctx, qk)
        currents = [functools.partial(run_current, c, geo, config) for c in caches]
        records = [functools.partial(run_record, r, geo, rec_fn, warps) for r in recs]
        reads = [functools.partial(run_read, r, read_fn, sink) for r in recs]
        for variant, fns, nbytes in (
            ("current", currents, cur_bytes),
            ("record", records, rec_bytes),
            ("read", reads, rec_bytes),
        ):
            us = _graph_us_per_call(fns)
            tbs = nbytes / (us * 1e-6) / 1e12
            print(f"| {b} | {ctx} | {variant} | {us:.1f} | {nbytes / 1e6:.0f} | {tbs:.2f} | "
                  f"{100 * tbs / bw:.0f} |", flush=True)  # fmt: skip
        del caches, recs


if __name__ == "__main__":
    main()
