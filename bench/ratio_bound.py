"""How far the FP4/BF16 decode ratio can go while the precision-independent part of a layer
stays as it is: reads `bench/step_profile.py --timeline L` output (both engines, same batches
and context) and splits layer L's critical path into

- experts: the routed-expert GEMMs (+ FP4's activation quantize between them),
- attention: the decode attention (+ its split reduce),
- shared: everything else (projections, norms, RoPE + KV append, routing), which both
  engines run on the same BF16 weights,

then asks: with FP4's experts and attention moving their bytes at copy bandwidth and the shared
part as measured, what ratio is reachable; and how small would the shared part (in both engines)
have to become for the issue's target at each batch.

    python3 bench/ratio_bound.py sp1k.json sp32k.json --copy-tbs 4.28 --png docs/ratio_bound.png

Bytes per layer come from the model shape: the expected distinct experts a uniform router
touches (cuda_moe.expected_experts) times one expert's weight bytes, and the KV cache of
`batch` sequences of `context` tokens (engine_model.kv_bytes_per_sequence).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from dataclasses import dataclass

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from trace_common.kernels.cuda_moe import expected_experts
from trace_common.kernels.engine_model import EngineShape, kv_bytes_per_sequence

CATEGORIES = ("shared", "attention", "experts")


def target_for(context: int, batch: int) -> float | None:
    """Issue 7's FP4/BF16 target for a table row, None where it sets none (1K batch 8-16)."""
    if batch == 1:
        return 1.7
    if context >= 32768:
        return 3.2
    return 2.8 if batch >= 32 else None


def category(kernel: str) -> str:
    """Which part of a layer a kernel (step_profile's short name) belongs to."""
    if kernel.startswith("moe_") or kernel == "nvfp4_quant_kernel":
        return "experts"
    if "attn" in kernel:
        return "attention"
    return "shared"


def layer_split(timeline: list) -> dict[str, float]:
    """{category: us of the layer's critical path}: each kernel's "+end" (how much its end comes
    after the previous kernel's end) summed per category."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for name, _start, _end, inc in timeline:
        out[category(name)] += max(float(inc), 0.0)
    return out


def expert_bytes(shape: EngineShape, batch: int, fp4: bool) -> float:
    """Routed-expert weight bytes one layer reads for `batch` tokens (expected distinct experts
    of a uniform top-k router; NVFP4: 4 bits + an e4m3 scale per 16 values)."""
    distinct = expected_experts(batch, shape.top_k, shape.num_experts)
    per_value = 0.5 + 1 / 16 if fp4 else 2.0
    return distinct * 3 * shape.hidden * shape.moe_inter * per_value


def attention_bytes(shape: EngineShape, batch: int, context: int, fp4: bool) -> float:
    """KV-cache bytes one layer's decode attention reads."""
    return batch * kv_bytes_per_sequence(shape, fp4=fp4, tokens=context) / shape.num_layers


@dataclass(frozen=True, slots=True)
class Bound:
    context: int
    batch: int
    bf16: dict[str, float]  # us per layer by category, measured
    fp4: dict[str, float]
    fp4_copy: dict[str, float]  # FP4 with its experts and attention at copy bandwidth
    target: float | None

    @property
    def measured(self) -> float:
        return sum(self.bf16.values()) / sum(self.fp4.values())

    @property
    def at_copy(self) -> float:
        """The ratio with FP4's experts and attention at copy speed, shared part as measured."""
        return sum(self.bf16.values()) / sum(self.fp4_copy.values())

    def shared_for_target(self, fp4_parts: dict[str, float]) -> float | None:
        """The shared us per layer (the same in both engines) at which BF16 / FP4 reaches the
        target, FP4's experts + attention taking `fp4_parts`; None: no target, or unreachable
        even with no shared part at all."""
        if self.target is None:
            return None
        xb = self.bf16["experts"] + self.bf16["attention"]
        xf = fp4_parts["experts"] + fp4_parts["attention"]
        s = (xb - self.target * xf) / (self.target - 1)
        return s if s >= 0 else None


def bounds(rows: list[dict], copy_tbs: float, shape: EngineShape | None = None) -> list[Bound]:
    """A Bound per (context, batch) profiled for both engines."""
    shape = shape or EngineShape.named()
    by = {(r["engine"], r["context"], r["batch"]): r for r in rows}
    out = []
    for ctx, b in sorted({(c, b) for e, c, b in by if e == "fp4" and ("bf16", c, b) in by}):
        for eng in ("bf16", "fp4"):
            if "timeline" not in by[(eng, ctx, b)]:
                raise ValueError(f"{eng} context {ctx} batch {b}: no timeline; run step_profile "
                                 "with --timeline L")  # fmt: skip
        bf, f4 = (layer_split(by[(e, ctx, b)]["timeline"]) for e in ("bf16", "fp4"))
        us = 1e6 / (copy_tbs * 1e12)  # us per byte at copy bandwidth
        f4c = {"shared": f4["shared"], "experts": expert_bytes(shape, b, True) * us,
               "attention": attention_bytes(shape, b, ctx, True) * us}  # fmt: skip
        out.append(Bound(ctx, b, bf, f4, f4c, target_for(ctx, b)))
    return out


def table(bs: list[Bound]) -> str:
    """The markdown table docs/benchmarks.md keeps."""
    lines = [
        "| context | batch | BF16 layer us (shared / attention / experts) | FP4 layer us (same) "
        "| FP4 at copy: attention / experts | FP4/BF16 measured | with FP4 parts at copy | target "
        "| shared us for the target (FP4 parts at copy) | (FP4 parts as measured) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def parts(d: dict[str, float]) -> str:
        return (
            f"{sum(d.values()):.1f} ({d['shared']:.1f} / {d['attention']:.1f} / {d['experts']:.1f})"
        )

    def need(v: float | None, b: Bound) -> str:
        if b.target is None:
            return "-"
        return "unreachable" if v is None else f"{v:.1f}"

    for b in bs:
        lines.append(
            f"| {b.context} | {b.batch} | {parts(b.bf16)} | {parts(b.fp4)} | "
            f"{b.fp4_copy['attention']:.1f} / {b.fp4_copy['experts']:.1f} | {b.measured:.2f}x | "
            f"{b.at_copy:.2f}x | {'-' if b.target is None else f'{b.target}x'} | "
            f"{need(b.shared_for_target(b.fp4_copy), b)} | {need(b.shared_for_target(b.fp4), b)} |"
        )
    return "\n".join(lines)


def plot(bs: list[Bound], path: pathlib.Path) -> None:
    """Stacked bars per row: BF16, FP4 and FP4 with its own parts at copy speed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"shared": "#888888", "attention": "#4c72b0", "experts": "#dd8452"}
    fig, ax = plt.subplots(figsize=(max(6, 1.9 * len(bs)), 4.5))
    labels, x = [], 0.0
    for b in bs:
        for name, parts in (("BF16", b.bf16), ("FP4", b.fp4), ("FP4*", b.fp4_copy)):
            bottom = 0.0
            for cat in CATEGORIES:
                ax.bar(x, parts[cat], bottom=bottom, color=colors[cat], width=0.8,
                       label=cat if not labels else None)  # fmt: skip
                bottom += parts[cat]
            labels.append((x, f"{name}\n{b.context // 1024}K b{b.batch}"))
            x += 1
        x += 0.6
    ax.set_xticks([p for p, _ in labels], [t for _, t in labels], fontsize=7)
    ax.set_ylabel("us per layer (critical path, layer 24)")
    ax.set_title("Decode layer time by part; FP4* = FP4 with its experts and attention at copy "
                 "bandwidth", fontsize=9)  # fmt: skip
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profiles", nargs="+", type=pathlib.Path, help="step_profile.py --out JSONs")
    ap.add_argument("--copy-tbs", type=float, default=4.28,
                    help="copy bandwidth in TB/s (default: an H200's device copy)")  # fmt: skip
    ap.add_argument("--png", type=pathlib.Path, default=None)
    args = ap.parse_args()
    rows = [r for p in args.profiles for r in json.loads(p.read_text())]
    bs = bounds(rows, args.copy_tbs)
    if not bs:
        raise SystemExit("no (context, batch) was profiled for both engines")
    print(table(bs))
    if args.png:
        plot(bs, args.png)
        print(f"plot: {args.png}")


if __name__ == "__main__":
    main()
