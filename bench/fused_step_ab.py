"""A/B of the fused launches of the standard decode step (trace_common/kernels/fused.py): the
same engine and weights as bench/rollout_gpu.py, each configuration timed with TRACE_FUSED_STEP
= none, each fused part alone (at `--part-batches`), and all; one line per configuration.

    python bench/fused_step_ab.py --batches 8 32 128 --part-batches 32 --long-batches 8
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from rollout_gpu import copy_bandwidth, fits, time_engine

from trace_common.kernels.engine import EngineShape, EngineWeights
from trace_common.kernels.fused import FUSED_PARTS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--part-batches", type=int, nargs="*", default=[32])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--long-context", type=int, default=32768)
    ap.add_argument("--long-batches", type=int, nargs="*", default=[8])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--engines", nargs="+", choices=("bf16", "fp4"), default=["bf16", "fp4"])
    args = ap.parse_args()
    os.environ.setdefault("TRACE_FP4_GEMM", "cuda")
    os.environ.setdefault("TRACE_FP4_ATTN", "cuda")
    shape = EngineShape.named()
    print(f"copy bandwidth {copy_bandwidth():.2f} TB/s", flush=True)
    weights = EngineWeights.random(shape, "cuda")
    configs = [(args.context, b) for b in args.batches]
    configs += [(args.long_context, b) for b in args.long_batches]
    for engine in sorted(args.engines):  # bf16 first: quantize_experts_ works in place
        if engine == "fp4":
            weights.quantize_experts_("cuda")
        wbytes = weights.nbytes()
        for ctx, b in configs:
            if not fits(wbytes, shape, fp4=engine == "fp4", batch=b, context=ctx):
                print(f"{engine} ctx {ctx} batch {b}: does not fit", flush=True)
                continue
            settings = ["none", "all"]
            if b in args.part_batches and ctx == args.context:
                settings[1:1] = [p for p in FUSED_PARTS if engine == "fp4" or p != "norm_quant"]
            base = None
            for parts in settings:
                os.environ["TRACE_FUSED_STEP"] = parts
                sec, _ = time_engine(shape, weights, batch=b, context=ctx, steps=args.steps)
                base = base or sec
                print(f"{engine:5s} ctx {ctx:6d} batch {b:4d} fused {parts:10s}: "
                      f"{b / sec:9.1f} tok/s {sec * 1e3:7.3f} ms/step "
                      f"({100 * (base / sec - 1):+5.1f}% vs none)", flush=True)  # fmt: skip
    os.environ.pop("TRACE_FUSED_STEP")


if __name__ == "__main__":
    main()
