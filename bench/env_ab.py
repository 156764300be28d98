"""A/B of engine settings read from the environment when an engine is built (TRACE_FUSED_STEP,
TRACE_ATTN_FUSED, TRACE_FP4_CUDA_KERNEL, ...): the bench's engine and weights
(bench/rollout_gpu.py), every setting timed at every (engine, context, batch), the settings
interleaved over `--rounds` rounds so that clock and thermal drift hit them alike; prints the
median tokens/s per setting and its change against the first setting.

    python bench/env_ab.py --engines fp4 --batches 8 32 \
        --setting "" --setting "TRACE_FUSED_STEP=norm_quant,qk_kv,act" \
        --setting "TRACE_ATTN_FUSED=all"

A setting is space-separated VAR=value assignments ("" = the defaults). Each engine takes the
path the engine itself picks under its setting (the small-batch kernels with PDL at batch <= 2 by
default), as bench/rollout_gpu.py does. TRACE_SMALL_CONFIG is applied per setting (the module
reads it only at import). Three variables exist for A/Bs of kernel sources:
TRACE_AB_SMALL_SOURCE=<file>, TRACE_AB_MOE_SOURCE=<file> and TRACE_AB_ATTN_SOURCE=<file> compile
the small-batch kernels (cuda/small_batch.cu), the CUDA expert GEMMs (cuda/moe_fp4.cu) or the
CUDA FP4 attention (cuda/attn_fp4.cu) from <file>, e.g. an older revision saved beside them (its
#includes resolve there):

    git show HEAD~:trace_common/kernels/cuda/small_batch.cu > trace_common/kernels/cuda/small_old.cu
    python bench/env_ab.py --engines bf16 --batches 1 \
        --setting "TRACE_AB_SMALL_SOURCE=trace_common/kernels/cuda/small_old.cu" --setting ""
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from rollout_gpu import copy_bandwidth, fits, time_engine

from trace_common.kernels import cuda_attn, cuda_moe, cuda_small
from trace_common.kernels.cuda_launch import pdl_enabled
from trace_common.kernels.cuda_small import small_batch_enabled
from trace_common.kernels.engine import EngineShape, EngineWeights, small_batch_supported


def parse_setting(text: str) -> dict[str, str]:
    """'A=1 B=x,y' -> {'A': '1', 'B': 'x,y'}; a word without '=' is refused, naming it."""
    out = {}
    for word in text.split():
        name, eq, value = word.partition("=")
        if not eq or not name:
            raise ValueError(f"setting {text!r}: {word!r} is not VAR=value")
        out[name] = value
    return out


# VAR=<file>: that module's kernels compiled from <file> (compiled_function caches per file name)
SOURCES = {
    "TRACE_AB_SMALL_SOURCE": cuda_small,
    "TRACE_AB_MOE_SOURCE": cuda_moe,
    "TRACE_AB_ATTN_SOURCE": cuda_attn,
}
_DEFAULT_SOURCES = {name: mod.SOURCE for name, mod in SOURCES.items()}


def apply(setting: dict[str, str], names: set[str]) -> None:
    """The environment for one setting: its variables set, the others' unset; then the kernel
    sources and small-batch launch shapes it names (the defaults where it names none)."""
    for name in names:
        os.environ.pop(name, None)
    os.environ.update(setting)
    for name, mod in SOURCES.items():
        path = os.environ.get(name)
        if path and not pathlib.Path(path).is_file():
            raise ValueError(f"{name}={path}: no such file")
        mod.SOURCE = pathlib.Path(path).resolve() if path else _DEFAULT_SOURCES[name]
    cuda_small.configure()  # the defaults, with this setting's TRACE_SMALL_CONFIG on top


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setting", action="append", default=None, help="VAR=value ... (repeat)")
    ap.add_argument("--engines", nargs="+", choices=("bf16", "fp4"), default=["bf16", "fp4"])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed graph replays per measurement")
    args = ap.parse_args()
    texts = args.setting or [""]
    settings = [parse_setting(s) for s in texts]
    names = {n for s in settings for n in s}
    shape = EngineShape.named()
    print(f"copy bandwidth {copy_bandwidth():.2f} TB/s", flush=True)
    weights = EngineWeights.random(shape, "cuda")
    for engine in sorted(args.engines):  # bf16 first: quantize_experts_ works in place
        if engine == "fp4":
            weights.quantize_experts_("cuda")
        for ctx in args.contexts:
            for b in args.batches:
                if not fits(weights.nbytes(), shape, fp4=engine == "fp4", batch=b, context=ctx):
                    print(f"{engine} ctx {ctx} batch {b}: does not fit", flush=True)
                    continue
                secs: list[list[float]] = [[] for _ in settings]
                for _ in range(args.rounds):
                    for i, s in enumerate(settings):
                        apply(s, names)
                        # the engine's own choices under this setting (the small-batch kernels
                        # and PDL at batch 1 by default)
                        small = small_batch_enabled(b) and small_batch_supported(shape, b)
                        secs[i].append(time_engine(shape, weights, batch=b, context=ctx,
                                                   steps=args.steps, small=small,
                                                   pdl=small and pdl_enabled())[0])  # fmt: skip
                base = statistics.median(secs[0])
                for s, sec in zip(texts, secs, strict=True):
                    med = statistics.median(sec)
                    print(f"{engine:5s} ctx {ctx:6d} batch {b:4d} [{s or 'defaults'}]: "
                          f"{b / med:9.1f} tok/s {med * 1e3:7.3f} ms/step "
                          f"({100 * (base / med - 1):+5.1f}%)", flush=True)  # fmt: skip
    apply({}, names)


if __name__ == "__main__":
    main()
