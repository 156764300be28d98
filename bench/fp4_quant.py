"""CPU throughput of the plain-PyTorch FP4 reference, and guidance-record sizes.

Measures quantize / dequantize / guided_quantize (compact record) throughput in GB/s of the
high-precision input (bytes of the [rows, K] input tensor per second, median of repeats) for
NVFP4 ("row" scales) and MXFP4, then the record bytes per element for full and compact
guidance. Usage:

    .venv/bin/python bench/fp4_quant.py [--sizes 256x2048,4096x2048] [--repeats 5] [--threads N]
                                        [--device cpu|cuda] [--clock wall|cpu]

`--clock cpu` divides by the process's CPU time instead of wall time: on a shared, busy
machine that is the better estimate of what an idle core would do (use with --threads 1).

(`--device cuda` times the same plain-PyTorch reference on a GPU, for comparison with the
fused kernels; it is not a kernel benchmark.)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from trace_common.fp4 import get_format
from trace_common.fp4.guided import guided_quantize
from trace_common.fp4.record import make_record, record_nbytes

FORMATS = ("nvfp4", "mxfp4")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
BYTES_PER_GB = 1e9


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    """What to measure."""

    sizes: list[tuple[int, int]] = field(
        default_factory=lambda: [(256, 2048), (4096, 2048), (4096, 8192)]
    )
    dtypes: list[str] = field(default_factory=lambda: ["bf16", "fp32"])
    repeats: int = 5  # timed repeats per cell (median reported), after one warm-up
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    record_k: int = 2048  # hidden size for the record-size table
    device: str = "cpu"  # where the reference runs
    clock: str = "wall"  # "wall" (perf_counter) or "cpu" (process CPU time, CPU device only)


def _median_seconds(fn: Callable[[], object], cfg: BenchConfig) -> float:
    sync = torch.cuda.synchronize if cfg.device.startswith("cuda") else (lambda: None)
    clock = time.process_time if cfg.clock == "cpu" else time.perf_counter
    fn()  # warm-up
    sync()
    times = []
    for _ in range(cfg.repeats):
        t0 = clock()
        fn()
        sync()
        times.append(clock() - t0)
    return statistics.median(times)


def run(cfg: BenchConfig, console: Console) -> None:
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    where = cfg.device if cfg.device != "cpu" else f"CPU, {torch.get_num_threads()} threads"
    per = "CPU-second" if cfg.clock == "cpu" else "second"
    table = Table(title=f"FP4 reference ({where}), GB of input per {per}, median of {cfg.repeats}")
    for col in ("format", "input", "shape", "quantize", "dequantize", "guided (compact)"):
        table.add_column(col, justify="left" if col in ("format", "input", "shape") else "right")
    cells = [(f, d, s) for f in FORMATS for d in cfg.dtypes for s in cfg.sizes]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(cells))
        for fmt, dname, (rows, k) in cells:
            spec = get_format(fmt)
            kw = {"scale_granularity": "row"} if fmt == "nvfp4" else {}
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(0))
            x = x.to(device=cfg.device, dtype=DTYPES[dname])
            q = spec.quantize(x, **kw)
            rec = make_record(q, "compact")
            x_train = x * 1.001
            gb = x.numel() * x.element_size() / BYTES_PER_GB
            t_q = _median_seconds(lambda: spec.quantize(x, **kw), cfg)  # noqa: B023
            t_d = _median_seconds(lambda: spec.dequantize(q, x.dtype), cfg)  # noqa: B023
            t_g = _median_seconds(lambda: guided_quantize(x_train, rec), cfg)  # noqa: B023
            table.add_row(
                fmt, dname, f"{rows}x{k}", f"{gb / t_q:.2f}", f"{gb / t_d:.2f}", f"{gb / t_g:.2f}"
            )
            progress.advance(task)
    console.print(table)

    sizes = Table(title=f"guidance record size per element (K = {cfg.record_k}, per token)")
    for col in ("format", "mode", "bytes/token", "bytes/element", "bits/element", "vs BF16"):
        sizes.add_column(col, justify="left" if col in ("format", "mode") else "right")
    for fmt in FORMATS:
        for mode in ("compact", "full"):
            nbytes = record_nbytes(fmt, mode, (1, cfg.record_k))
            per_elem = nbytes / cfg.record_k
            sizes.add_row(
                fmt,
                mode,
                str(nbytes),
                f"{per_elem:.4f}",
                f"{8 * per_elem:.3f}",
                f"{per_elem / 2:.1%}",
            )
    console.print(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default=None, help="comma-separated ROWSxK, e.g. 256x2048,4096x2048"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    if args.clock == "cpu" and args.device != "cpu":
        parser.error("--clock cpu measures host CPU time; use it with --device cpu")
    cfg = BenchConfig(
        repeats=args.repeats, threads=args.threads, device=args.device, clock=args.clock
    )
    if args.sizes:
        try:
            cfg.sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]  # type: ignore[misc]
        except ValueError as exc:
            parser.error(f"--sizes {args.sizes!r}: expected ROWSxK[,ROWSxK...] ({exc})")
    run(cfg, Console())


if __name__ == "__main__":
    main()
