"""How fast does a shape learn a task in the supervised warm start? One process per
configuration (task, difficulty, learning rate), all at once on one device, each logging the
held-out greedy accuracy every `--eval-every` steps. Picks the recipe's task: RL needs a warm
start that reaches some accuracy quickly (GRPO learns nothing from all-wrong groups) and
leaves most of the reward range to climb.

    python3 bench/warmstart.py run --device cuda --shape mid-1b --steps 300 \\
        --configs reverse:6:1e-3 sort:5:1e-3 addition:3:1e-3 --out runs/warmstart.json
    python3 bench/warmstart.py plot runs/warmstart.json --out docs/warmstart_mid-1b.png

A configuration is TASK:DIFFICULTY:LR. `run` prints a table (steps to reach 10/20/50%
accuracy, the last accuracy and loss, seconds per step) and writes every curve to --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

THRESHOLDS = (0.1, 0.2, 0.5)


def one(args: argparse.Namespace) -> None:
    """One configuration in this process: the curve as one JSON line on stdout."""
    import torch

    from trace_common.model import get_config
    from trace_common.rl.warmstart import WarmStartConfig, initial_model, warm_start
    from trace_common.tasks import CharTokenizer, PromptStream, make_task

    task_name, difficulty, lr = parse_config(args.config)
    torch.manual_seed(args.seed)
    tok = CharTokenizer()
    task = make_task(task_name, difficulty)
    cfg = get_config(args.shape).replace(vocab_size=tok.vocab_size)
    model = initial_model(cfg, args.seed).to(args.device)
    curve: list[tuple[int, float, float]] = []
    last_acc = [-1.0]

    def progress(step: int, loss: float, acc: float) -> None:
        if step % args.eval_every == 0:
            curve.append((step, loss, acc))
            if acc != last_acc[0]:
                print(f"# {args.config} step {step} loss {loss:.3f} acc {acc:.3f}", flush=True)
                last_acc[0] = acc

    cfg = WarmStartConfig(
        max_steps=args.steps, target_accuracy=1.0, seed=args.seed, eval_every=args.eval_every,
        lr=lr, eval_prompts=args.eval_prompts,
    )  # fmt: skip
    t0 = time.perf_counter()
    res = warm_start(
        model, PromptStream(task, tok, seed=args.seed), cfg,
        max_new_tokens=task.max_answer_chars + 1, progress=progress,
    )  # fmt: skip
    seconds = time.perf_counter() - t0
    print(json.dumps({
        "config": args.config, "shape": args.shape, "seed": args.seed, "steps": res.steps,
        "accuracy": res.accuracy, "loss": res.loss, "seconds": seconds, "curve": curve,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device != "cpu" else None,
    }), flush=True)  # fmt: skip


def parse_config(text: str) -> tuple[str, int, float]:
    try:
        task, difficulty, lr = text.split(":")
        return task, int(difficulty), float(lr)
    except ValueError as exc:
        raise SystemExit(f"configuration {text!r}: expected TASK:DIFFICULTY:LR") from exc


def first_step_at(curve: list[list[float]], threshold: float) -> str:
    return next((str(int(s)) for s, _, a in curve if a >= threshold), "-")


def run(args: argparse.Namespace) -> None:
    for c in args.configs:
        parse_config(c)
    common = ["--device", args.device, "--shape", args.shape, "--steps", str(args.steps),
              "--seed", str(args.seed), "--eval-every", str(args.eval_every),
              "--eval-prompts", str(args.eval_prompts)]  # fmt: skip
    procs = {
        c: subprocess.Popen(
            [sys.executable, __file__, "one", "--config", c, *common],
            stdout=subprocess.PIPE,
            text=True,
        )
        for c in args.configs
    }
    results: list[dict[str, Any]] = []
    for c, p in procs.items():
        out, _ = p.communicate()
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            print(f"{c}: failed (rc {p.returncode})\n{out[-2000:]}")
            continue
        results.append(json.loads(lines[-1]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": results, "parallel": len(procs)}, indent=1))
    head = "| config | " + " | ".join(f"step at {t:.0%}" for t in THRESHOLDS)
    print(f"{args.shape}, {len(procs)} configurations at once on {args.device}, seed {args.seed}")
    print(head + " | last acc | last loss | s/step | peak GiB |")
    print("|---" * (len(THRESHOLDS) + 5) + "|")
    for r in results:
        cells = [first_step_at(r["curve"], t) for t in THRESHOLDS]
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        print(f"| {r['config']} | " + " | ".join(cells) + f" | {r['accuracy']:.3f} | "
              f"{r['loss']:.3f} | {r['seconds'] / r['steps']:.3f} | {peak} |")  # fmt: skip


def plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(args.json.read_text())
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for r in data["runs"]:
        steps = [s for s, _, _ in r["curve"]]
        ax.plot(steps, [a for _, _, a in r["curve"]], marker=".", label=r["config"])
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xlabel("supervised warm-start step")
    ax.set_ylabel("held-out greedy exact-match accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8, title="task:size:lr")
    shape = data["runs"][0]["shape"] if data["runs"] else "?"
    ax.set_title(f"warm start of {shape}: a usable recipe reaches 20% early")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110, bbox_inches="tight")
    print(args.out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--configs", nargs="+", required=True, help="TASK:DIFFICULTY:LR ...")
    r.add_argument("--out", type=pathlib.Path, required=True)
    o = sub.add_parser("one")
    o.add_argument("--config", required=True)
    for sp in (r, o):
        sp.add_argument("--device", default="cuda")
        sp.add_argument("--shape", default="mid-1b")
        sp.add_argument("--steps", type=int, default=300)
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--eval-every", type=int, default=25)
        sp.add_argument("--eval-prompts", type=int, default=128)
    pl = sub.add_parser("plot")
    pl.add_argument("json", type=pathlib.Path)
    pl.add_argument("--out", type=pathlib.Path, required=True)
    args = p.parse_args()
    {"run": run, "one": one, "plot": plot}[args.cmd](args)


if __name__ == "__main__":
    main()
