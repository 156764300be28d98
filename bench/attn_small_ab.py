"""A/B of the batch-1 attention: fused one-launch kernels (TRACE_ATTN_FUSED=on, split size by
the plan's wave rule or TRACE_ATTN_FUSED_CHUNK) against split + reduce (off), in the engine's
small-batch step with PDL, same weights, alternating variants over `--rounds` to spread drift.

    python bench/attn_small_ab.py --contexts 1024 --chunks 0 32 128 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from rollout_gpu import time_engine

from trace_common.kernels.engine import EngineShape, EngineWeights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024])
    ap.add_argument("--chunks", type=int, nargs="*", default=[0],
                    help="fused variants: split size (0: the plan's rule)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--engines", nargs="+", default=["bf16", "fp4"])
    args = ap.parse_args()
    shape = EngineShape.named()
    weights = EngineWeights.random(shape, "cuda")
    variants = [("off", 0)] + [("on", c) for c in args.chunks]
    for engine in sorted(args.engines):  # bf16 first: quantize_experts_ works in place
        if engine == "fp4":
            weights.quantize_experts_()
        for ctx in args.contexts:
            ms: dict[tuple[str, int], list[float]] = {v: [] for v in variants}
            for _ in range(args.rounds):
                for mode, chunk in variants:
                    os.environ["TRACE_ATTN_FUSED"] = mode
                    os.environ.pop("TRACE_ATTN_FUSED_CHUNK", None)
                    if chunk:
                        os.environ["TRACE_ATTN_FUSED_CHUNK"] = str(chunk)
                    sec, _ = time_engine(shape, weights, batch=1, context=ctx, steps=args.steps,
                                         small=True, pdl=True)  # fmt: skip
                    ms[(mode, chunk)].append(sec * 1e3)
            base = statistics.median(ms[("off", 0)])
            for (mode, chunk), v in ms.items():
                m = statistics.median(v)
                print(f"{engine} ctx {ctx} fused {mode} chunk {chunk or 'plan'}: {1e3 / m:7.1f} "
                      f"tok/s {m:.3f} ms/step ({m - base:+.3f} ms, per layer "
                      f"{(m - base) * 1e3 / shape.num_layers:+.2f} us; runs "
                      f"{', '.join(f'{x:.3f}' for x in v)})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
