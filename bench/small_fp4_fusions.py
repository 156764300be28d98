"""A/B of the FP4 small-batch step's fusions (cuda_small.fp4_fuse_parts) on an H200.

Builds the Qwen3-30B-A3B-shaped FP4 engine once (random weights, 48 layers), then times the
captured batch-1 step for each TRACE_SMALL_FP4_FUSE setting given, interleaved over rounds
(the median per setting is reported); the first and last settings also with guidance capture
of the deeper half:

    python3 bench/small_fp4_fusions.py --specs none pdl pdl,xq pdl,xq,act all --rounds 3
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from rollout_gpu import time_engine

from trace_common.kernels.engine import EngineShape, EngineWeights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--specs", nargs="+", default=["none", "all"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="timed graph replays per config")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--profile", action="store_true", help="kernel table of the last spec")
    ap.add_argument("--best-out", type=pathlib.Path, help="write the fastest setting here")
    args = ap.parse_args()
    os.environ.setdefault("TRACE_FP4_GEMM", "cuda")
    shape = EngineShape.named(num_layers=args.layers)
    weights = EngineWeights.random(shape, "cuda")
    weights.quantize_experts_("cuda")
    guided = tuple(range(shape.num_layers // 2, shape.num_layers))
    times: dict[tuple[str, bool], list[float]] = {}
    for rnd in range(args.rounds):
        for spec in args.specs:
            os.environ["TRACE_SMALL_FP4_FUSE"] = spec
            for cap in (False, True) if spec in (args.specs[0], args.specs[-1]) else (False,):
                last = rnd == args.rounds - 1 and spec == args.specs[-1] and not cap
                sec, _ = time_engine(shape, weights, batch=args.batch, context=args.context,
                                     steps=args.steps, guided=guided if cap else (),
                                     profile=args.profile and last, small=True, pdl=True)  # fmt: skip
                times.setdefault((spec, cap), []).append(sec)
    print(f"FP4 batch {args.batch} ctx {args.context}, {args.layers} layers, small + PDL, "
          f"median of {args.rounds} rounds x {args.steps} replays")  # fmt: skip
    base = statistics.median(times[(args.specs[0], False)])
    for spec in args.specs:
        ms = statistics.median(times[(spec, False)]) * 1e3
        cap = ""
        if (spec, True) in times:
            ms_cap = statistics.median(times[(spec, True)]) * 1e3
            cap = f"; capture {ms_cap:6.3f} ms (+{100 * (ms_cap / ms - 1):4.1f}%)"
        print(f"  fuse={spec:14s} {ms:6.3f} ms/step {args.batch / ms * 1e3:7.1f} tok/s "
              f"({base * 1e3 / ms:5.3f}x of {args.specs[0]}){cap}", flush=True)  # fmt: skip
    best = min(args.specs, key=lambda sp: statistics.median(times[(sp, False)]))
    print(f"fastest: {best}")
    if args.best_out:
        args.best_out.write_text(best)
    del weights
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
