"""What a real run's weight pushes send, full versions against deltas, for each export dtype of
the high-precision (non-FP4) weights.

Runs the demo (`trace-rl demo`: the supervised warm start, then RL on the local system of real
processes) for `--steps` RL steps, once per `--hp-dtypes` value of its `--export-hp-dtype`
(the trainer's TRACE_EXPORT_HP_DTYPE), and reads each step's push from metrics.jsonl: the
bytes sent (`weight_push_bytes`), a full version's (`weight_push_full_bytes`) and the changed
fraction by dtype. Every push after the first is a delta whose result the receivers check
against the full version's CRC-32s, so these are the bytes of a bit-identical transfer.

    python bench/weight_deltas.py --steps 8 --out weight_deltas_cpu.json
    python bench/weight_deltas.py --device cuda --steps 8 --out weight_deltas_gpu.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trace_common.launch.plots import read_metrics  # noqa: E402

MiB = 1 << 20


def run_one(hp_dtype: str, args: argparse.Namespace, out: pathlib.Path) -> list[dict[str, Any]]:
    """The metrics rows of one demo run with the high-precision weights exported as
    `hp_dtype` (its own progress on this terminal)."""
    cmd = [sys.executable, "-m", "trace_common.cli", "demo", "--device", args.device,
           "--steps", str(args.steps), "--export-hp-dtype", hp_dtype, "--out", str(out),
           *args.demo_args]  # fmt: skip
    Console().print(f"[bold]{hp_dtype}[/]: {' '.join(cmd[1:])}")
    subprocess.run(cmd, check=True, cwd=ROOT)
    return read_metrics(out / "metrics.jsonl")


def summarize(hp_dtype: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    deltas = [r for r in rows[1:] if "weight_push_full_bytes" in r]
    if not deltas:
        raise SystemExit(f"{hp_dtype}: no delta pushes in {len(rows)} steps")
    ratios = [r["weight_push_full_bytes"] / max(r["weight_push_bytes"], 1) for r in deltas]
    changed: dict[str, list[float]] = {}
    for r in deltas:
        for dtype, frac in (r.get("weight_changed_fraction") or {}).items():
            changed.setdefault(dtype, []).append(frac)
    if not any(any(v) for v in changed.values()):
        raise SystemExit(f"{hp_dtype}: no weight changed between versions (did the run learn?)")
    return {
        "hp_dtype": hp_dtype,
        "steps": len(rows),
        "full_mib": deltas[0]["weight_push_full_bytes"] / MiB,
        "delta_mib": [r["weight_push_bytes"] / MiB for r in deltas],
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "changed_fraction_median": {k: statistics.median(v) for k, v in changed.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hp-dtypes", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16"])  # fmt: skip
    ap.add_argument("--demo-args", nargs=argparse.REMAINDER, default=[],
                    help="more options of trace-rl demo (last on the line)")  # fmt: skip
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args()
    if args.steps < 2:
        raise SystemExit(f"--steps {args.steps}: a delta needs at least 2 steps")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for hp_dtype in args.hp_dtypes:
            rows = run_one(hp_dtype, args, pathlib.Path(tmp) / hp_dtype)
            results.append(summarize(hp_dtype, rows))
    table = Table(title=f"weight pushes of the demo: {args.steps} RL steps on {args.device}")
    for col in ("hp export", "full MiB", "delta MiB (steps 2..)", "full / delta (median, min)",
                "changed fraction by dtype (median)"):  # fmt: skip
        table.add_column(col)
    for r in results:
        table.add_row(
            r["hp_dtype"],
            f"{r['full_mib']:.2f}",
            f"{min(r['delta_mib']):.2f}-{max(r['delta_mib']):.2f}",
            f"{r['ratio_median']:.1f}x, {r['ratio_min']:.1f}x",
            ", ".join(f"{k} {v:.2%}" for k, v in r["changed_fraction_median"].items()),
        )
    Console().print(table)
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                        "results": results}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
