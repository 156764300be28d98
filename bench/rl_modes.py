"""Compare the four training modes (bf16, fp4, rtn, trace) on the same warm start, in process
(one replica, no staleness: every sample comes from the weights being trained, so the
discrepancy measured is the train-vs-rollout *path* difference only).

    .venv/bin/python bench/rl_modes.py --steps 40 --out docs/rl_modes.png
    .venv/bin/python bench/rl_modes.py --steps 40 --rollout-dtype bfloat16 --out docs/rl_modes_bf16.png

Rollouts record full guidance (deeper half) and routing in every FP4 mode so D_act, the code
flip rate and the routing mismatch are measured for all of them; only `trace` uses them.
Prints one table; writes a PNG of reward and |dlogp| per step for each mode.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import torch

from trace_common.device import resolve_device
from trace_common.launch.demo import DemoConfig, demo_model, evaluate_policy
from trace_common.launch.plots import moving_average
from trace_common.model import GuidanceConfig, QuantConfig
from trace_common.rl.core import TrainerConfig, TrainerCore
from trace_common.rl.dispatch import DispatchConfig, Dispatcher, StaticDirectory
from trace_common.rl.engine import LocalReplica
from trace_common.rl.local import LocalPublisher, MemoryRecordStore
from trace_common.rl.policy import LearnerConfig, ModelLearner
from trace_common.rl.types import TRAIN_MODES
from trace_common.rl.warmstart import WarmStartConfig, warm_start
from trace_common.rollout.engine import EngineHolder
from trace_common.rollout.select import EngineSettings, make_engine_factory
from trace_common.rollout.types import SamplingConfig
from trace_common.tasks import CharTokenizer, PromptStream, exact_match_reward, make_task


def run_mode(mode: str, init: dict[str, torch.Tensor], args: argparse.Namespace) -> dict:
    tok = CharTokenizer()
    task = make_task(args.task, args.difficulty)
    torch.manual_seed(args.seed)
    model = demo_model(DemoConfig.load(), tok.vocab_size)
    model.load_state_dict(init)
    learner = ModelLearner(
        model, LearnerConfig(mode=mode, lr=args.lr, measure_records=True),
        quant=QuantConfig(), guidance=GuidanceConfig(mode="full"),
        eos_id=tok.eos_id, pad_id=tok.pad_id,
    )  # fmt: skip
    store = MemoryRecordStore()
    holder = EngineHolder()
    core = TrainerCore(
        TrainerConfig(
            mode=mode, prompts_per_step=args.prompts, group_size=args.group, measure_records=True,
            sampling=SamplingConfig(max_new_tokens=task.max_answer_chars + 1, seed=args.seed),
        ),
        prompts=PromptStream(task, tok, seed=args.seed),
        dispatcher=Dispatcher(StaticDirectory([LocalReplica("r0", holder, store.put)]),
                              DispatchConfig(prompts_per_unit=args.prompts)),
        scorer=lambda s, p: exact_match_reward(s.completion_tokens, p.answer, tok),
        records=store, learner=learner,
        publisher=LocalPublisher([holder], make_engine_factory(EngineSettings(
            engine=args.rollout_engine, device=resolve_device(args.device),
            native_dtype=args.rollout_dtype))),
    )  # fmt: skip
    core.publish()
    rows = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        rows.append(core.step())
    seconds = time.perf_counter() - t0
    final = evaluate_policy(
        model.state_dict(),
        DemoConfig.load(mode=mode, task=args.task, difficulty=args.difficulty, seed=args.seed),
    )

    def mean(key: str) -> float:
        xs = [r[key] for r in rows if isinstance(r.get(key), float) and r[key] == r[key]]
        return sum(xs) / len(xs) if xs else float("nan")

    return {
        "mode": mode, "rows": rows, "final_eval": final, "seconds": seconds,
        "reward_first5": sum(r["reward_mean"] for r in rows[:5]) / 5,
        "reward_last5": sum(r["reward_mean"] for r in rows[-5:]) / 5,
        **{k: mean(k) for k in ("logp_abs_diff_mean", "logp_abs_diff_max", "k3_kl",
                                "d_act_mean", "code_flip_rate", "routing_mismatch")},
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--task", default="reverse")
    ap.add_argument("--difficulty", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(TRAIN_MODES))
    ap.add_argument("--out", type=pathlib.Path, default=None, help="PNG of the curves")
    ap.add_argument(
        "--rollout-dtype", default="float32", choices=("float32", "bfloat16"),
        help="rollout engine compute dtype (trainer stays fp32): bfloat16 makes the paths differ",
    )  # fmt: skip
    ap.add_argument("--rollout-engine", default="native", choices=("auto", "native", "cuda"),
                    help="the replica's engine (TRACE_ROLLOUT_ENGINE)")  # fmt: skip
    ap.add_argument("--device", default="cpu", help="the replica's device (TRACE_DEVICE)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = CharTokenizer()
    task = make_task(args.task, args.difficulty)
    model = demo_model(DemoConfig.load(), tok.vocab_size)
    torch.manual_seed(args.seed)
    ws = warm_start(model, PromptStream(task, tok, seed=args.seed),
                    WarmStartConfig(target_accuracy=0.3, eval_every=10),
                    max_new_tokens=task.max_answer_chars + 1)  # fmt: skip
    init = {k: v.clone() for k, v in model.state_dict().items()}
    print(f"warm start: {ws.steps} steps, greedy accuracy {ws.accuracy:.3f}")
    results = []
    for mode in args.modes.split(","):
        res = run_mode(mode, init, args)
        results.append(res)
        print(f"  {mode}: done in {res['seconds']:.0f}s", flush=True)
    cols = ("reward_first5", "reward_last5", "final_eval", "logp_abs_diff_mean",
            "logp_abs_diff_max", "k3_kl", "d_act_mean", "code_flip_rate", "routing_mismatch",
            "seconds")  # fmt: skip
    print("| mode | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for r in results:
        print(f"| {r['mode']} | " + " | ".join(f"{r[c]:.4g}" for c in cols) + " |")
    if args.out is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
        for r in results:
            steps = [x["step"] for x in r["rows"]]
            a1.plot(steps, moving_average([x["reward_mean"] for x in r["rows"]]), label=r["mode"])
            a2.plot(steps, [x["logp_abs_diff_mean"] for x in r["rows"]], label=r["mode"])
        a1.set(xlabel="RL step", ylabel="reward (5-step mean)")
        a2.set(xlabel="RL step", ylabel="mean |logp_train - logp_rollout|")
        for a in (a1, a2):
            a.grid(alpha=0.3)
            a.legend()
        fig.suptitle(
            f"{args.task} ({args.difficulty}), same warm start, in-process, no staleness, "
            f"rollout {args.rollout_dtype} / trainer float32"
        )
        fig.tight_layout()
        fig.savefig(args.out, dpi=110)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
