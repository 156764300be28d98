"""Plot `bench/rollout_service_gpu.py` results: generated tokens/s through the rollout
service against the raw decode engine, per engine and batch, and the share of the service's
time spent in prefill.

    python3 bench/plot_rollout_service.py docs/rollout_service_gpu_h200.json \\
        --out docs/rollout_service_gpu_h200.png
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=pathlib.Path)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    args = ap.parse_args()
    data = json.loads(args.results.read_text())
    rows = data["results"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    labels = [f"{r['engine'].upper()}\nbatch {r['batch']}" for r in rows]
    x = range(len(rows))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [r["raw_tok_s"] for r in rows], w, label="raw decode engine",
           color="#bbbbbb")  # fmt: skip
    ax.bar([i + w / 2 for i in x], [r["service_tok_s"] for r in rows], w,
           label="through the rollout service", color="#1f77b4")  # fmt: skip
    for i, r in enumerate(rows):
        ax.text(i + w / 2, r["service_tok_s"], f"{r['service_over_raw']:.0%}", ha="center",
                va="bottom", fontsize=9)  # fmt: skip
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("generated tokens / s")
    ax.set_title("service vs raw engine (label: service / raw)")
    ax.legend(loc="upper left")
    ax2.bar(list(x), [r["prefill_share"] for r in rows], color="#ff7f0e", label="prefill")
    ax2.bar(list(x), [r["decode_share"] for r in rows], bottom=[r["prefill_share"] for r in rows],
            color="#1f77b4", label="decode steps")  # fmt: skip
    ax2.set_xticks(list(x), labels, fontsize=8)
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("share of the service's time")
    ax2.set_title("where the service's time goes")
    ax2.legend(loc="lower right", fontsize=8)
    cfg = data.get("config", {})
    fig.suptitle(f"Rollout service on one H200: Qwen3-30B-A3B layer shape, "
                 f"{cfg.get('num_layers', '?')} layers; prompts 256-1024, completions 128-2048")  # fmt: skip
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
