"""When each CTA of the decode step's CUDA C++ kernels starts, passes its PDL wait and exits.

Compiles instrumented copies of the kernel sources (cuda/small_batch.cu, attn_small.cu,
attn_fp4.cu, moe_fp4.cu): thread 0 of every CTA writes %globaltimer (ns; it ticks in 32 ns
steps on the H200) at kernel entry (slot 0), after its first `pdl_wait()` (slot 1), at any
`--anchor` (slots 2-6) and at exit (slot 7, every return). Runs the bench's engine (random
weights, fewer layers than the model: every layer runs the same kernels) as a CUDA graph and
prints, for each kernel instance, the span of each slot over its CTAs relative to the
earliest entry. Each instance's stamps hold the last launch of it: the last layer (the LM
head's GEMV is an instance of its own). Where a kernel's time goes after its wait (the
critical path that `bench/step_profile.py --timeline` shows from the outside) and, with
anchors, inside it:

    python bench/experiments/cta_stamps.py --engine bf16 --batch 1 \\
        --anchor "cluster_wait_acquire();  // phase 1: every CTA's logits are in s_lg=4"

An anchor is TEXT=SLOT: the stamp goes after the (single) line containing TEXT, in whichever
source has it.
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench/
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository

SLOTS = 8  # 0 entry, 1 after the PDL wait, 2-6 anchors, 7 exit
MAX_CTAS = 8192
PRELUDE = f"""
__device__ unsigned long long cta_stamps[{SLOTS}][{MAX_CTAS}];
__device__ __forceinline__ unsigned long long cta_stamp_now() {{
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}}
#define CTA_STAMP(s) do {{ \\
    const unsigned i_ = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); \\
    if (threadIdx.x == 0 && i_ < {MAX_CTAS}) cta_stamps[s][i_] = cta_stamp_now(); }} while (0)
struct CtaStampExit {{ __device__ ~CtaStampExit() {{ CTA_STAMP({SLOTS - 1}); }} }};
"""


def instrument(src: str, anchors: dict[str, int] | None = None) -> str:
    """`src` with the stamps: the prelude after its first #include, slot 0 and the exit stamp
    at the top of every __global__ function's body, slot 1 after the first `pdl_wait();` in it,
    each anchor's slot after the line holding its text (which must occur once)."""
    inc = re.search(r'^#include "[^"]+".*\n', src, re.M)
    if inc is None:
        raise ValueError("no #include line to put the stamp prelude after")
    src = src[: inc.end()] + PRELUDE + src[inc.end() :]
    starts = [m.start() for m in re.finditer(r"__global__", src)] + [len(src)]
    out = [src[: starts[0]]]
    for a, b in itertools.pairwise(starts):
        opening = re.compile(r"\)\s*\{[^\n]*\n").search(src, a)  # the body's "{" line
        if opening is None or opening.end() > b:
            raise ValueError(f"no body found for the __global__ function at {a}")
        body = opening.end()
        part = src[a:body] + "  CTA_STAMP(0);\n  CtaStampExit cta_stamp_exit_;\n"
        rest = src[body:b]
        wait = rest.find("pdl_wait();")
        if wait >= 0:
            end = rest.index("\n", wait) + 1
            rest = rest[:end] + "  CTA_STAMP(1);\n" + rest[end:]
        out.append(part + rest)
    src = "".join(out)
    for text, slot in (anchors or {}).items():
        if not 2 <= slot < SLOTS - 1:
            raise ValueError(f"anchor {text!r}: slot {slot} (2..{SLOTS - 2} are free)")
        if src.count(text) != 1:
            raise ValueError(f"anchor {text!r} occurs {src.count(text)} times")
        end = src.index("\n", src.index(text)) + 1
        src = src[:end] + f"  CTA_STAMP({slot});\n" + src[end:]
    return src


def span_table(stamps: dict[str, list[list[int]]]) -> list[tuple[str, int, list[tuple]]]:
    """Per kernel (its stamps [SLOTS][CTAs], 0 = not written), in order of first entry:
    (name, CTAs stamped, [(slot, first, last, CTA 0's) in us from the earliest entry])."""
    rows = []
    for name, st in stamps.items():
        if not any(st[0]):
            continue
        rows.append((min(v for v in st[0] if v), name, st))
    rows.sort()
    if not rows:
        return []
    t0 = rows[0][0]
    out = []
    for _, name, st in rows:
        spans = []
        for s in range(SLOTS):
            vals = [v for v in st[s] if v]
            if vals:
                c0 = (st[s][0] - t0) / 1e3 if st[s][0] else None
                spans.append((s, (min(vals) - t0) / 1e3, (max(vals) - t0) / 1e3, c0))
        out.append((name, sum(1 for v in st[0] if v), spans))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("bf16", "fp4"), default="bf16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--anchor", action="append", default=[], metavar="TEXT=SLOT")
    args = ap.parse_args()
    anchors = {}
    for a in args.anchor:
        text, eq, slot = a.rpartition("=")
        if not eq or not slot.isdigit():
            raise SystemExit(f"--anchor {a!r}: expected TEXT=SLOT")
        anchors[text] = int(slot)

    import numpy as np
    import torch
    from rollout_gpu import STEP_MARGIN

    from trace_common.kernels import cuda_attn, cuda_moe, cuda_small
    from trace_common.kernels.cuda_launch import require_cupy
    from trace_common.kernels.engine import DecodeEngine, EngineShape, EngineWeights

    cp = require_cupy()
    targets = [(cuda_small, "SOURCE"), (cuda_attn, "SOURCE"), (cuda_attn, "SMALL_SOURCE"),
               (cuda_moe, "SOURCE")]  # fmt: skip
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr in targets]
    copies = []
    modules: dict[str, object] = {}
    raw_module = cp.RawModule

    def recording_module(*a, **kw):
        m = raw_module(*a, **kw)
        for name in kw.get("name_expressions") or ():
            modules[name] = m
        return m

    try:
        for mod, attr, path in saved:
            text = path.read_text()
            mine = {t: s for t, s in anchors.items() if t in text}
            copy = path.with_name(f".cta_stamps_{path.name}")
            copy.write_text(instrument(text, mine))
            copies.append(copy)
            setattr(mod, attr, copy)
        placed = {t for t in anchors for c in copies if t in c.read_text()}
        if placed != set(anchors):
            raise SystemExit(f"anchors in no kernel source: {sorted(set(anchors) - placed)}")
        cp.RawModule = recording_module
        shape = EngineShape.named(num_layers=args.layers)
        weights = EngineWeights.random(shape, "cuda")
        if args.engine == "fp4":
            weights.quantize_experts_("cuda")
        eng = DecodeEngine(shape, weights, batch=args.batch,
                           capacity=args.context + STEP_MARGIN, context=args.context)  # fmt: skip
        eng.fill_context_()
        eng.tokens.random_(0, shape.vocab)
        eng.capture(warmup=2)
        for _ in range(3):
            eng.replay()
        torch.cuda.synchronize()
        views = {}
        for name, m in modules.items():
            try:
                ptr = m.get_global("cta_stamps")
            except Exception:  # a module compiled from an uninstrumented source
                continue
            views[name] = cp.ndarray((SLOTS, MAX_CTAS), dtype=cp.uint64, memptr=ptr)
            views[name].fill(0)
        eng.replay()
        torch.cuda.synchronize()
        stamps = {n: v.get().astype(np.int64).tolist() for n, v in views.items()}
    finally:
        cp.RawModule = raw_module
        for mod, attr, path in saved:
            setattr(mod, attr, path)
        for c in copies:
            c.unlink(missing_ok=True)
    print(f"{args.engine} batch {args.batch} context {args.context}, {args.layers} layers: "
          f"us from the earliest entry (first..last CTA; [CTA 0]); slots 0 entry, 1 after the "
          f"PDL wait, 2-6 anchors, 7 exit")  # fmt: skip
    for name, n, spans in span_table(stamps):
        cells = "  ".join(f"{s}: {lo:7.2f}..{hi:7.2f}" + (f" [{c0:.2f}]" if c0 is not None else "")
                          for s, lo, hi, c0 in spans)  # fmt: skip
        print(f"{name[:60]:60s} {n:5d} CTAs  {cells}")


if __name__ == "__main__":
    main()
