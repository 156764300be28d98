"""PNG plots of a run's metrics.jsonl: reward and train-rollout discrepancy over steps."""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

MOVING_AVERAGE_STEPS = 5


def read_metrics(path: pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def moving_average(xs: Sequence[float], n: int = MOVING_AVERAGE_STEPS) -> list[float]:
    out = []
    for i in range(len(xs)):
        window = [x for x in xs[max(0, i - n + 1) : i + 1] if math.isfinite(x)]
        out.append(sum(window) / len(window) if window else float("nan"))
    return out


def _series(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) if isinstance(r.get(key), int | float) else float("nan") for r in rows]


def plot_run(
    rows: list[dict[str, Any]],
    out_dir: pathlib.Path,
    *,
    title: str,
    warm_start_reward: float | None = None,
    final_reward: float | None = None,
) -> list[pathlib.Path]:
    """Write reward.png and discrepancy.png (and their side-by-side overview.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    reward = _series(rows, "reward_mean")

    def reward_axes(ax) -> None:
        ax.plot(steps, reward, "o-", ms=3, lw=1, alpha=0.45, label="reward per step (sampled)")
        ax.plot(steps, moving_average(reward), lw=2.2, label=f"{MOVING_AVERAGE_STEPS}-step mean")
        if warm_start_reward is not None:
            ax.axhline(warm_start_reward, color="grey", ls="--",
                       label=f"warm start, eval {warm_start_reward:.2f}")  # fmt: skip
        if final_reward is not None:
            ax.axhline(final_reward, color="green", ls=":",
                       label=f"after RL, eval {final_reward:.2f}")  # fmt: skip
        ax.set_xlabel("RL step")
        ax.set_ylabel("exact-match reward")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)

    def disc_axes(ax) -> None:
        for key, label, style in (
            ("logp_abs_diff_mean", "mean |logp_train - logp_rollout|", "-"),
            ("k3_kl", "k3 KL(rollout || train)", "-"),
            ("d_act_mean", "D_act (guided sites)", "-"),
            ("code_flip_rate", "code flip rate (guided sites)", "-"),
            ("logp_abs_diff_mean_stale", "mean |dlogp|, stale samples (policy drift)", "--"),
        ):
            ys = _series(rows, key)
            if any(math.isfinite(y) for y in ys):
                ax.plot(steps, ys, style, lw=1.5, label=label)
        ax.set_xlabel("RL step")
        ax.set_ylabel("discrepancy on fresh samples")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)

    paths = []
    for name, draw in (("reward.png", reward_axes), ("discrepancy.png", disc_axes)):
        fig, ax = plt.subplots(figsize=(6.4, 4))
        draw(ax)
        ax.set_title(title, fontsize=10)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        paths.append(out_dir / name)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    reward_axes(a1)
    disc_axes(a2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / "overview.png", dpi=110)
    plt.close(fig)
    paths.append(out_dir / "overview.png")
    return paths
