"""PNG plots of a run's metrics.jsonl: reward and train-rollout discrepancy over steps.

The discrepancy measures have different units and ranges (nats, a relative error, a fraction),
and with TRACE they are often exactly 0, so each unit gets its own panel on a symmetric-log
axis: zero sits visibly above the bottom of the axis, and values from 1e-8 to 1 stay readable.
Legends go below their axes so they never cover a curve.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MOVING_AVERAGE_STEPS = 5
# What a good run looks like, printed under the overview's title.
GOOD_RUN = (
    "good: reward rises above the warm start; on fresh samples every discrepancy stays near 0 "
    "(trace mode: exactly 0)"
)
# Bounds of a symlog panel's linear region around 0 (it follows the smallest nonzero value).
LINTHRESH_MIN, LINTHRESH_MAX, LINTHRESH_DEFAULT = 1e-12, 1e-3, 1e-6


@dataclass(frozen=True, slots=True)
class Series:
    key: str  # metrics.jsonl field
    label: str
    style: str  # matplotlib line style
    marker: str = "o"  # distinct per series of a panel: series that coincide stay visible


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    ylabel: str  # the unit
    series: tuple[Series, ...]
    missing: str  # said on the panel when no step has the measure


DISCREPANCY_PANELS = (
    Panel(
        "|logp_train - logp_rollout| per token",
        "nats",
        (
            Series("logp_abs_diff_mean", "fresh samples, mean", "-"),
            Series("logp_abs_diff_max", "fresh samples, max", ":", "x"),
            Series("logp_abs_diff_mean_stale", "stale samples, mean (policy drift)", "--", "s"),
        ),
        "not logged",
    ),
    Panel(
        "k3 KL(rollout || train), fresh samples",
        "nats per token",
        (Series("k3_kl", "k3 KL", "-"),),
        "not logged",
    ),
    Panel(
        "D_act at guided sites, fresh samples",
        "relative error (Frobenius)",
        (Series("d_act_mean", "D_act, mean over guided layers", "-"),),
        "not measured: needs full guidance records",
    ),
    Panel(
        "code flip rate at guided sites, fresh samples",
        "fraction of elements",
        (Series("code_flip_rate", "flip rate", "-"),),
        "not measured: needs guidance records",
    ),
)


def read_metrics(path: pathlib.Path) -> list[dict[str, Any]]:
    """The step lines of a metrics.jsonl (lines of events, such as evaluations, left out)."""
    return [r for r in _read_lines(path) if "event" not in r]


def read_evals(path: pathlib.Path) -> list[dict[str, Any]]:
    """The held-out evaluations of a metrics.jsonl, in step order."""
    return [r for r in _read_lines(path) if r.get("event") == "eval"]


def _read_lines(path: pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def moving_average(xs: Sequence[float], n: int = MOVING_AVERAGE_STEPS) -> list[float]:
    out = []
    for i in range(len(xs)):
        window = [x for x in xs[max(0, i - n + 1) : i + 1] if math.isfinite(x)]
        out.append(sum(window) / len(window) if window else float("nan"))
    return out


def _series(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) if isinstance(r.get(key), int | float) else float("nan") for r in rows]


def linthresh_for(values: Sequence[float]) -> float:
    """The symlog axis' linear half-width: the power of ten at or below the smallest nonzero
    |value|, within [LINTHRESH_MIN, LINTHRESH_MAX]; LINTHRESH_DEFAULT when all are 0."""
    nonzero = [abs(v) for v in values if math.isfinite(v) and v != 0]
    if not nonzero:
        return LINTHRESH_DEFAULT
    power = 10.0 ** math.floor(math.log10(min(nonzero)))
    return min(max(power, LINTHRESH_MIN), LINTHRESH_MAX)


def _legend_below(ax: Any, ncol: int = 1) -> None:
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=ncol, fontsize=7,
              frameon=False)  # fmt: skip


def draw_reward(
    ax: Any,
    rows: list[dict[str, Any]],
    warm_start_reward: float | None = None,
    final_reward: float | None = None,
    evals: Sequence[dict[str, Any]] = (),
) -> None:
    """Sampled reward per step and its moving mean; the held-out evaluations (`evals`, mean
    reward and pass@k) where the run made them."""
    steps = [r["step"] for r in rows]
    reward = _series(rows, "reward_mean")
    ax.plot(steps, reward, "o-", ms=3, lw=1, alpha=0.45, label="reward per step (sampled)")
    ax.plot(steps, moving_average(reward), lw=2.2, label=f"{MOVING_AVERAGE_STEPS}-step mean")
    if evals:
        e_steps = [e["step"] for e in evals]
        k = evals[-1].get("eval_samples_per_prompt", "k")
        ax.plot(e_steps, _series(list(evals), "eval_reward_mean"), "s-", color="black", ms=5,
                lw=1.8, label="held-out reward (FP4 rollout)")  # fmt: skip
        ax.plot(e_steps, _series(list(evals), "eval_pass_at_k"), "^--", color="purple", ms=5,
                lw=1.2, label=f"held-out pass@{k}")  # fmt: skip
    if warm_start_reward is not None:
        ax.axhline(warm_start_reward, color="grey", ls="--",
                   label=f"warm start, eval {warm_start_reward:.2f}")  # fmt: skip
    if final_reward is not None:
        ax.axhline(final_reward, color="green", ls=":",
                   label=f"after RL, eval {final_reward:.2f}")  # fmt: skip
    ax.set_title("reward", fontsize=9)
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    _legend_below(ax, ncol=2)


def draw_discrepancy(ax: Any, rows: list[dict[str, Any]], panel: Panel) -> None:
    """One panel: its series on a symlog axis whose bottom lies below 0, so a measure that is
    exactly 0 is drawn as a visible line of markers, not hidden on the frame."""
    steps = [r["step"] for r in rows]
    drawn: list[float] = []
    n_series = 0
    all_zero = []  # labels of the series that are 0 at every step they were measured
    for s in panel.series:
        ys = _series(rows, s.key)
        finite = [y for y in ys if math.isfinite(y)]
        if finite:
            ax.plot(steps, ys, s.style, marker=s.marker, ms=3, lw=1.4, label=s.label)
            drawn += finite
            n_series += 1
            if not any(finite):
                all_zero.append(s.label)
    linthresh = linthresh_for(drawn)
    ax.set_yscale("symlog", linthresh=linthresh)
    top = max(drawn, default=0.0)
    ax.set_ylim(-0.5 * linthresh, max(top * 3, 10 * linthresh))
    ax.axhline(0.0, color="black", lw=0.6, alpha=0.5)
    if not drawn:
        if steps:
            ax.set_xlim(steps[0] - 1, steps[-1] + 1)
        ax.text(0.5, 0.5, panel.missing, transform=ax.transAxes, ha="center", va="center",
                fontsize=8, color="grey")  # fmt: skip
    elif all_zero:
        what = "; ".join(all_zero) if n_series > 1 else "0 at every step"
        ax.text(0.5, 0.35, what + (": 0 at every step" if n_series > 1 else ""),
                transform=ax.transAxes, ha="center", fontsize=7, color="grey")  # fmt: skip
    ax.set_title(panel.title, fontsize=9)
    ax.set_xlabel("RL step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    if n_series > 1:  # a single series is named by the panel's title
        _legend_below(ax)


def discrepancy_figure(rows: list[dict[str, Any]], title: str) -> Any:
    """A 2 x 2 figure, one panel per entry of DISCREPANCY_PANELS."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    for ax, panel in zip(axes.flat, DISCREPANCY_PANELS, strict=True):
        draw_discrepancy(ax, rows, panel)
    fig.suptitle(f"{title}\ntrain-rollout discrepancy (0 = the paths agree)", fontsize=10)
    fig.tight_layout()
    return fig


def overview_figure(
    rows: list[dict[str, Any]],
    title: str,
    warm_start_reward: float | None = None,
    final_reward: float | None = None,
    evals: Sequence[dict[str, Any]] = (),
) -> Any:
    """Reward on the left, the four discrepancy panels on the right."""
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(15, 7.5))
    grid = fig.add_gridspec(2, 3)
    draw_reward(fig.add_subplot(grid[:, 0]), rows, warm_start_reward, final_reward, evals)
    for (r, c), panel in zip(((0, 1), (0, 2), (1, 1), (1, 2)), DISCREPANCY_PANELS, strict=True):
        draw_discrepancy(fig.add_subplot(grid[r, c]), rows, panel)
    fig.suptitle(f"{title}\n{GOOD_RUN}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_run(
    rows: list[dict[str, Any]],
    out_dir: pathlib.Path,
    *,
    title: str,
    warm_start_reward: float | None = None,
    final_reward: float | None = None,
    evals: Sequence[dict[str, Any]] = (),
) -> list[pathlib.Path]:
    """Write reward.png, discrepancy.png and overview.png (both side by side) into out_dir."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    draw_reward(ax, rows, warm_start_reward, final_reward, evals)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    figures = {
        "reward.png": fig,
        "discrepancy.png": discrepancy_figure(rows, title),
        "overview.png": overview_figure(rows, title, warm_start_reward, final_reward, evals),
    }
    paths = []
    for name, figure in figures.items():
        figure.savefig(out_dir / name, dpi=110)
        plt.close(figure)
        paths.append(out_dir / name)
    return paths
