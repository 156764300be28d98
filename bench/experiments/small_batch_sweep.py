"""Launch-shape sweep of the small-batch BF16 kernels (cuda_small) in the batch-1 engine step.

Builds the Qwen3-30B-A3B-shaped engine once (random weights, 48 layers) and tunes, one knob at
a time in the order given (coordinate descent from the committed defaults), the warps per CTA
of each call site (`cuda_small.WARPS`) and the cp.async ring depth (`RING_STAGES`) and stage
size (`RING_STAGE_CHUNKS`), timing the captured BF16 batch-1 step (small path + PDL; the best
of `--rounds` x `--steps` replays). A setting that does not launch (too much shared memory, too
many threads) is reported and skipped. Then an interleaved A/B of the defaults against the
best found, BF16 at each context and FP4 at the first. The best is what
`KernelSettings(small_launch=...)` takes:

    python3 bench/experiments/small_batch_sweep.py --contexts 1024 32768
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench/
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository

from rollout_gpu import time_engine

from trace_common.kernels import cuda_small
from trace_common.kernels.engine import EngineShape, EngineWeights
from trace_common.kernels.settings import KernelSettings

# knob -> values tried; WARPS keys are call sites, the rest module constants of cuda_small
KNOBS: dict[str, tuple[int, ...]] = {
    "RING_STAGES": (2, 3, 4, 5, 6),
    "RING_STAGE_CHUNKS": (1, 2, 4, 8),
    "qkv": (4, 8, 16),
    "o": (4, 8, 16),
    "router": (2, 4, 8, 16),
    "gate_up": (2, 4, 8, 16),
}


def current() -> dict[str, int]:
    return {k: v for k, v in cuda_small.config().items() if k in KNOBS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024])
    ap.add_argument("--rounds", type=int, default=3, help="timings per setting in the sweep")
    ap.add_argument("--ab-rounds", type=int, default=5, help="interleaved A/B rounds")
    ap.add_argument("--steps", type=int, default=20, help="graph replays per timing")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--best-out", type=pathlib.Path, help="write the best found as JSON here "
                    "(KernelSettings.small_launch)")  # fmt: skip
    args = ap.parse_args()
    shape = EngineShape.named(num_layers=args.layers)
    weights = EngineWeights.random(shape, "cuda")
    ctx0 = args.contexts[0]

    def ms(cfg: dict[str, int], ctx: int, rounds: int) -> float | None:
        settings = KernelSettings(small_launch=cfg)
        try:
            return 1e3 * min(time_engine(shape, weights, batch=1, context=ctx, steps=args.steps,
                                         small=True, pdl=True, settings=settings)[0]
                             for _ in range(rounds))  # fmt: skip
        except Exception as exc:  # a launch shape the kernels or the GPU refuse
            print(f"  {cfg}: does not run ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
            torch.cuda.synchronize()
            return None

    default = current()
    best, best_ms = dict(default), ms(default, ctx0, args.rounds)
    assert best_ms is not None, "the default configuration must run"
    print(f"BF16 batch 1 ctx {ctx0}, defaults {default}: {best_ms:.3f} ms/step", flush=True)
    for knob, values in KNOBS.items():
        for v in values:
            if v == best[knob]:
                continue
            cand = {**best, knob: v}
            t = ms(cand, ctx0, args.rounds)
            print(f"  {knob}={v}: {'-' if t is None else f'{t:.3f} ms'}", flush=True)
            if t is not None and t < best_ms:
                best, best_ms = cand, t
        print(f"after {knob}: {best} {best_ms:.3f} ms/step", flush=True)

    def ab(engine: str, ctx: int) -> None:
        times: dict[str, list[float]] = {"default": [], "best": []}
        for _ in range(args.ab_rounds):
            for name, cfg in (("default", default), ("best", best)):
                t = ms(cfg, ctx, 1)
                assert t is not None
                times[name].append(t)
        d, b = (statistics.median(times[n]) for n in ("default", "best"))
        print(f"A/B {engine} batch 1 ctx {ctx}: default {d:.3f} ms ({1e3 / d:.1f} tok/s), best "
              f"{b:.3f} ms ({1e3 / b:.1f} tok/s): {100 * (d / b - 1):+.1f}% tokens/s "
              f"(median of {args.ab_rounds} interleaved rounds)", flush=True)  # fmt: skip

    print(f"best: {best}", flush=True)
    for ctx in args.contexts:
        ab("BF16", ctx)
    weights.quantize_experts_("cuda")
    torch.cuda.empty_cache()
    ab("FP4", ctx0)
    KernelSettings().apply()  # back to the defaults
    if args.best_out:
        args.best_out.write_text(json.dumps(best))


if __name__ == "__main__":
    main()
