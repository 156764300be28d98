"""Where a captured decode step's time goes, per kernel, on one GPU.

Builds the bench's engine (Qwen3-30B-A3B shape, random weights), captures the decode step as a
CUDA graph, times graph replays with CUDA events, then profiles a few replays with the torch
profiler (CUPTI sees the kernels inside the graph). Prints per kernel name: launches and GPU
microseconds per step, the share of the step, and the step time not covered by any kernel
("gaps": launch latency between dependent kernels, drained pipelines). Writes the table as JSON.
`--timeline L` also prints layer L's kernels in launch order: start and end relative to the
layer's first start, and how much each end comes after the previous kernel's end (the
kernel's share of the step's critical path; with PDL a kernel starts before its predecessor
ends, so its duration alone overstates it).

    python bench/step_profile.py --engines bf16 fp4 --batches 1 8 32 --context 1024 --out o.json
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import sys
from collections import defaultdict

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from rollout_gpu import STEP_MARGIN, seconds_per_replay

from trace_common.kernels.engine import DecodeEngine, EngineShape, EngineWeights


def short(name: str) -> str:
    """A kernel name without template arguments and parameter lists."""
    for sep in ("<", "("):
        name = name.split(sep)[0]
    return name.removeprefix("void ").strip()[:48]


def layer_timeline(kernels: list[tuple[float, float, str]], replays: int, layers: int,
                   layer: int) -> list[tuple[str, float, float, float]]:  # fmt: skip
    """Layer `layer` of the middle replay from (start, end, name) of every profiled kernel:
    [(name, start, end, end - previous end)] in us from the layer's first start. A layer is
    the kernels from one launch of the first kernel name launched `layers` times per step to
    the next."""
    if not 0 <= layer < layers:
        raise ValueError(f"--timeline {layer}: the model has layers 0..{layers - 1}")
    kernels = sorted(kernels)
    per_step = len(kernels) // replays
    step = kernels[(replays // 2) * per_step : (replays // 2 + 1) * per_step]
    count: dict[str, int] = defaultdict(int)
    for _, _, name in step:
        count[name] += 1
    first = next((n for _, _, n in step if count[n] == layers), None)
    if first is None:
        raise ValueError(f"no kernel is launched {layers} times per step")
    marks = [i for i, (_, _, n) in enumerate(step) if n == first] + [len(step)]
    rows = step[marks[layer] : marks[layer + 1]]
    t0, prev_end, out = rows[0][0], rows[0][0], []
    for s, e, n in rows:
        out.append((n, s - t0, e - t0, e - prev_end))
        prev_end = max(prev_end, e)
    return out


def profile_step(eng: DecodeEngine, replays: int
                 ) -> tuple[dict[str, tuple[int, float]], float, list[tuple[float, float, str]]]:  # fmt: skip
    """({kernel: (launches per step, us per step)}, union of kernel busy time per step in us,
    (start, end, name) of every profiled kernel in us)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            eng.replay()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    spans = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or "Memcpy" in ev.name:
            continue
        p = per[short(ev.name)]
        p[0] += 1
        p[1] += ev.time_range.elapsed_us()
        spans.append((ev.time_range.start, ev.time_range.end, short(ev.name)))
    spans.sort()
    busy, end = 0.0, float("-inf")
    for s, e, _ in spans:  # union of the kernels' intervals (PDL kernels overlap)
        if e > end:
            busy += e - max(s, end)
            end = e
    table = {k: (round(n / replays), us / replays) for k, (n, us) in per.items()}
    return table, busy / replays, spans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", nargs="+", default=["bf16", "fp4"], choices=("bf16", "fp4"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--replays", type=int, default=3, help="graph replays profiled")
    ap.add_argument("--top", type=int, default=16, help="kernels shown per configuration")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="JSON of every table")
    ap.add_argument("--timeline", type=int, default=None, metavar="L",
                    help="also print layer L's kernels in order, with start / end offsets")  # fmt: skip
    args = ap.parse_args()
    shape = EngineShape.named(num_layers=args.layers)
    weights = EngineWeights.random(shape, "cuda")
    results = []
    for engine in sorted(args.engines):  # bf16 first: quantize_experts_ works in place
        if engine == "fp4":
            weights.quantize_experts_()
        for b in args.batches:
            eng = DecodeEngine(shape, weights, batch=b, capacity=args.context + STEP_MARGIN,
                               context=args.context)  # fmt: skip
            eng.fill_context_()
            eng.tokens.random_(0, shape.vocab)
            eng.capture(warmup=2)
            step_us = seconds_per_replay(eng.replay, 10) * 1e6
            table, busy, spans = profile_step(eng, args.replays)
            kern = sum(us for _, us in table.values())
            print(f"\n{engine} batch {b} ctx {args.context} small {int(eng.small)}: step "
                  f"{step_us:.0f} us, kernels {kern:.0f} us summed, {busy:.0f} us busy "
                  f"(union), gaps {step_us - busy:.0f} us ({100 * (1 - busy / step_us):.1f}%)")  # fmt: skip
            print(
                f"  {'kernel':48s} {'n/step':>6s} {'us/step':>9s} {'us/launch':>9s} {'share':>6s}"
            )
            for name, (n, us) in sorted(table.items(), key=lambda kv: -kv[1][1])[: args.top]:
                print(f"  {name:48s} {n:6d} {us:9.1f} {us / max(n, 1):9.2f} "
                      f"{100 * us / step_us:5.1f}%")  # fmt: skip
            res = {"engine": engine, "batch": b, "context": args.context, "small": eng.small,
                   "step_us": step_us, "busy_us": busy, "kernels": table}  # fmt: skip
            if args.timeline is not None:
                tl = layer_timeline(spans, args.replays, args.layers, args.timeline)
                print(f"  layer {args.timeline}: {'kernel':40s} {'start':>7s} {'end':>7s} "
                      f"{'+end':>6s}  (us from the layer's first start)")  # fmt: skip
                for name, s, e, inc in tl:
                    print(f"  {'':9s}{name:40s} {s:7.1f} {e:7.1f} {inc:6.1f}")
                res["timeline"] = tl
            results.append(res)
            del eng
            gc.collect()
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
