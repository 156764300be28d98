"""`trace-rl numerics-demo`: rollout-guided rounding vs plain round-to-nearest on one layer.

A rollout and a trainer compute the same activation x = h @ W in BF16 but with different
kernels: the rollout accumulates split-K partial sums in BF16 (as a decode kernel might),
the trainer accumulates in FP32 (a full-sequence GEMM). The pre-quantization difference is
tiny, yet after FP4 quantization codes flip. The demo prints, per format and method, the
code flip rate and D_act = ||Q_train(x_train) - Q_rollout(x_rollout)||_F / ||Q_rollout||_F,
plus the guidance record's size per element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from trace_common.fp4 import get_format
from trace_common.fp4.e2m1 import e2m1_to_f32
from trace_common.fp4.guided import guided_grid, guided_quantize
from trace_common.fp4.record import make_record


@dataclass(kw_only=True, slots=True)
class NumericsDemoConfig:
    """Sizes of the synthetic layer (tokens x hidden -> tokens x K) and the perturbations."""

    tokens: int = 256  # rows (tokens) of the activation
    hidden: int = 1024  # reduction dim of the producing GEMM
    k: int = 2048  # last dim of the quantized activation (a multiple of 32)
    split_k: int = 8  # the rollout kernel's split-K chunks, summed in BF16
    # relative upstream drift of the GEMM input (earlier layers already disagree), one
    # scenario each, on top of the different accumulation order
    drifts: tuple[float, ...] = (0.01, 0.2)
    outlier_channels: int = 16  # channels of h 20x larger than the rest (LLM-like outliers)
    seed: int = 0


def make_activations(cfg: NumericsDemoConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h bf16 [T, H], W bf16 [H, K], channel-outlier mask) with heavy-tailed, LLM-like stats."""
    g = torch.Generator().manual_seed(cfg.seed)
    h = torch.randn(cfg.tokens, cfg.hidden, generator=g)
    h = h * torch.exp(0.5 * torch.randn(cfg.tokens, 1, generator=g))  # per-token norms vary
    outliers = torch.randperm(cfg.hidden, generator=g)[: cfg.outlier_channels]
    h[:, outliers] *= 20.0
    w = torch.randn(cfg.hidden, cfg.k, generator=g) / cfg.hidden**0.5
    return h.bfloat16(), w.bfloat16(), outliers


def rollout_gemm(h: torch.Tensor, w: torch.Tensor, split_k: int) -> torch.Tensor:
    """BF16 split-K: each chunk's partial product rounded to BF16, partial sums in BF16."""
    acc = None
    for h_c, w_c in zip(h.chunk(split_k, dim=1), w.chunk(split_k, dim=0), strict=True):
        part = (h_c.float() @ w_c.float()).bfloat16()  # [T, K]
        acc = part if acc is None else acc + part
    assert acc is not None
    return acc


def trainer_gemm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """FP32 accumulation over the whole reduction, one rounding to BF16 at the end."""
    return (h.float() @ w.float()).bfloat16()


def _d_act(q_train: torch.Tensor, q_rollout: torch.Tensor) -> float:
    diff = (q_train.float() - q_rollout.float()).norm()
    return (diff / q_rollout.float().norm()).item()


def compare(
    x_rollout: torch.Tensor, x_train: torch.Tensor, fmt: str
) -> list[tuple[str, float, float, str]]:
    """Rows (method, flip rate, D_act, record bytes/element) for one format."""
    spec = get_format(fmt)
    kw = {"scale_granularity": "row"} if fmt == "nvfp4" else {}
    q_roll = spec.quantize(x_rollout, **kw)
    y_roll = spec.dequantize(q_roll, x_rollout.dtype)
    grid_roll = e2m1_to_f32(q_roll.codes())
    q_rtn = spec.quantize(x_train, **kw)  # the trainer quantizing on its own
    rows = [
        (
            "RTN, own scales",
            (e2m1_to_f32(q_rtn.codes()) != grid_roll).float().mean().item(),
            _d_act(spec.dequantize(q_rtn, x_train.dtype), y_roll),
            "0",
        )
    ]
    numel = x_rollout.numel()
    for mode in ("compact", "full"):
        rec = make_record(q_roll, mode)
        y = guided_quantize(x_train, rec)
        flips = (guided_grid(x_train, rec) != grid_roll).float().mean().item()
        rows.append((f"guided, {mode}", flips, _d_act(y, y_roll), f"{rec.nbytes / numel:.4f}"))
    return rows


def run_demo(cfg: NumericsDemoConfig | None = None, console: Console | None = None) -> None:
    """Print the flip-rate / D_act table for NVFP4 and MXFP4, two perturbation scenarios."""
    cfg = cfg or NumericsDemoConfig()
    console = console or Console()
    console.print(
        "[bold]TRACE FP4 numerics demo[/bold]: one activation computed by two kernels, "
        "quantized by the rollout and re-quantized by the trainer"
    )
    h, w, _ = make_activations(cfg)
    x_rollout = rollout_gemm(h, w, cfg.split_k)  # [T, K] bf16
    scenarios = [("accumulation order only", trainer_gemm(h, w))]
    g = torch.Generator().manual_seed(cfg.seed + 1)
    noise = torch.randn(h.shape, generator=g) * h.float().abs().mean(-1, keepdim=True)
    for drift in cfg.drifts:
        x_drifted = trainer_gemm((h.float() + drift * noise).bfloat16(), w)
        scenarios.append((f"+ {drift:.0%} upstream drift", x_drifted))

    table = Table(title=f"activation [{cfg.tokens} tokens x {cfg.k}] BF16: trainer vs rollout")
    for col in ("format", "method", "code flips", "D_act", "record B/elem"):
        table.add_column(col, justify="left" if col in ("format", "method") else "right")
    for name, x_train in scenarios:
        rel = ((x_train.float() - x_rollout.float()).norm() / x_rollout.float().norm()).item()
        table.add_row(f"[bold]{name}[/bold]", f"[dim]pre-quant diff {rel:.1e}[/dim]")
        for fmt in ("nvfp4", "mxfp4"):
            for method, flips, d_act, bpe in compare(x_rollout, x_train, fmt):
                table.add_row(fmt, method, f"{flips:.3%}", f"{d_act:.2e}", bpe)
        table.add_section()
    console.print(table)
    console.print(
        "Record bytes/element: compact = 1 bit + 1 scale byte per block (+ 4 B per token for "
        "NVFP4); full = 4 bits + the same scales. BF16 itself is 2 B/element."
    )
