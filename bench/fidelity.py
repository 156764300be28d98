"""Does rollout-guided QAT keep FP4 RL on-policy when rollout and trainer really differ?
The RL system on the GPU (CUDA engine rollout, trainer on its own PyTorch ops), one arm per
training mode, the same warm start and seeds for every arm.

Arms (name: trainer mode, guided layers):
  bf16       bf16 rollout, no FP4 anywhere; its final policy is also quantized to FP4 after
             training and evaluated on the FP4 path ("PTQ after BF16")
  fp4        FP4 rollout, trainer without QAT
  rtn        FP4 rollout, vanilla QAT (round to nearest)
  trace      TRACE, default guidance (the deeper half of the layers)
  trace-all  TRACE, every layer guided
  trace-25 / trace-10: TRACE, the deepest 25% / 10% of the layers guided

Per seed, a warm start (supervised, in its own process) that every arm starts from, and a
probe of the guided K/V sites on it: the CUDA engine generates with records, the trainer's
forward (trace and rtn) replays them, and its K/V are compared with the FP4 codes in the
engine's cache (D_act, code flip rate). Per arm: a LocalCluster (Redis, quant-cache,
weight-sync, the trainer, one CUDA-engine replica), `--steps` RL steps, then the served
final version pulled from weight-sync and evaluated on held-out prompts.

    python3 bench/fidelity.py run --out runs/fidelity --seeds 0 1 --ablation-seeds 0 --steps 30 \\
        --devices cuda:0,cuda:1
    python3 bench/fidelity.py plot runs/fidelity/fidelity.json --out docs/

`--set KEY=VALUE` overrides a field of the run's `Setup` (e.g. `--set task=reverse --set
warmstart_max_steps=400`). `run` writes fidelity.json (every arm's rows, evals and probe figures) and prints the table;
`plot` draws the reward and mismatch curves (mean and spread across seeds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MAIN_ARMS = ("bf16", "fp4", "rtn", "trace", "trace-all")
ABLATION_ARMS = ("trace-25", "trace-10")
ARM_MODE = {"bf16": "bf16", "fp4": "fp4", "rtn": "rtn"}  # every other arm: trace
ARM_FRACTION = {"trace": 0.5, "trace-all": 1.0, "trace-25": 0.25, "trace-10": 0.1}
SHAPE = "mid-1b"
EVAL_SEED = 7_777_777  # held-out prompts: a stream disjoint from the training ones


@dataclass(frozen=True, slots=True)
class Setup:
    """The experiment's run: the GPU demo's task and scale (sorting 6 digits: mid-1b learns
    it gradually, so a warm start stopped at 20% leaves most of the reward range to climb)."""

    seed: int
    device: str
    shape: str = SHAPE
    task: str = "sort"
    difficulty: int = 6
    prompts_per_step: int = 16
    group_size: int = 8
    lr: float = 1e-4
    temperature: float = 1.0
    warmstart_lr: float = 1e-3
    warmstart_target: float = 0.2
    warmstart_max_steps: int = 300
    eval_prompts: int = 256

    def trainer_run(self, mode: str, steps: int, init: str) -> dict[str, Any]:
        """The trainer's recipe keys for one arm (`ClusterConfig.run`)."""
        return {
            "run_id": "fidelity",
            "model": {"name": self.shape, "init_weights": init},
            "mode": mode,
            "steps": steps,
            "task": {"name": self.task, "difficulty": self.difficulty},
            "prompts_per_step": self.prompts_per_step,
            "group_size": self.group_size,
            "dispatch.prompts_per_unit": self.prompts_per_step // 2,
            "objective.lr": self.lr,
            "sampling.temperature": self.temperature,
            "seed": self.seed,
            "guidance.mode": "compact",  # what the CUDA engine records
        }

    def trainer_env(self, out: pathlib.Path) -> dict[str, str]:
        """The trainer's wiring: its device and where metrics go."""
        return {"TRACE_DEVICE": self.device, "TRACE_METRICS_FILE": str(out / "metrics.jsonl")}


SMOKE = dict(shape="debug", task="reverse", difficulty=2, prompts_per_step=4, group_size=4,
             lr=1e-3, warmstart_lr=3e-3, warmstart_max_steps=20, eval_prompts=16)  # fmt: skip


def setup_of(args: argparse.Namespace) -> Setup:
    """The run's setup; `--smoke`: the debug shape on a small task (a quick CPU check);
    `--set KEY=VALUE` (repeatable) overrides one field of `Setup`, e.g. task=reverse."""
    fields = dict(SMOKE if args.smoke else {})
    base = Setup(seed=0, device="cpu")
    types = {f: type(getattr(base, f)) for f in Setup.__slots__ if f not in ("seed", "device")}
    for item in args.set or []:
        key, _, value = item.partition("=")
        if key not in types:
            raise SystemExit(f"--set {item!r}: settable fields are {sorted(types)}")
        fields[key] = types[key](value)
    return Setup(seed=args.seed, device=args.device, **fields)


def evaluate(tensors: dict[str, Any], meta: dict[str, Any], setup: Setup) -> float:
    """Mean exact-match reward of a policy version, served by the replicas' engine on this
    device, on held-out prompts sampled at the training temperature."""
    import torch

    from trace_common.rollout.select import EngineSettings, make_engine_factory
    from trace_common.rollout.types import SamplingConfig
    from trace_common.tasks import CharTokenizer, PromptStream, exact_match_reward, make_task

    tok = CharTokenizer()
    task = make_task(setup.task, setup.difficulty)
    factory = make_engine_factory(EngineSettings(device=torch.device(setup.device)))
    engine = factory(tensors, {k: v for k, v in meta.items() if isinstance(v, str)}, 0)
    try:
        ps = PromptStream(task, tok, seed=setup.seed + EVAL_SEED).next_batch(setup.eval_prompts)
        out = engine.generate(
            [p.token_ids for p in ps], 1,
            SamplingConfig(temperature=setup.temperature,
                           max_new_tokens=task.max_answer_chars + 1, seed=setup.seed + 1),
            with_records=False,
        )  # fmt: skip
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    rewards = [exact_match_reward(x.completion_tokens, ps[x.prompt_index].problem.answer, tok)
               for x in out]  # fmt: skip
    return sum(rewards) / len(rewards)


def export(state: dict[str, Any], setup: Setup, mode: str, guidance: Any = None) -> tuple:
    """The FP4 version the trainer would push for master weights `state` (and its learner)."""
    import torch

    from trace_common.model import MoECausalLM, QuantConfig, get_config
    from trace_common.rl.policy import LearnerConfig, ModelLearner
    from trace_common.tasks import CharTokenizer

    tok = CharTokenizer()
    model = MoECausalLM(get_config(setup.shape).replace(vocab_size=tok.vocab_size))
    model.load_state_dict(state)
    learner = ModelLearner(
        model, LearnerConfig(mode=mode), quant=QuantConfig(), guidance=guidance,
        eos_id=tok.eos_id, pad_id=tok.pad_id, device=torch.device(setup.device),
    )  # fmt: skip
    tensors, meta = learner.export_weights()
    return tensors, meta, learner


def guided_layers(arm: str, num_layers: int) -> str:
    """TRACE_GUIDANCE_LAYERS of an arm: the deepest ceil(fraction * layers) layers."""
    frac = ARM_FRACTION.get(arm, 0.5)
    n = max(1, math.ceil(round(frac * num_layers, 6)))
    return ",".join(str(i) for i in range(num_layers - n, num_layers))


# -- warm start + site probe (one process per seed) ----------------------------------------


def warm(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file

    from trace_common.model import MoECausalLM, QuantConfig, get_config
    from trace_common.model.quant import quantize_policy
    from trace_common.rl.warmstart import WarmStartConfig, warm_start
    from trace_common.tasks import CharTokenizer, PromptStream, make_task

    setup = setup_of(args)
    torch.manual_seed(setup.seed)
    tok = CharTokenizer()
    task = make_task(setup.task, setup.difficulty)
    model = MoECausalLM(get_config(setup.shape).replace(vocab_size=tok.vocab_size))
    model.init_weights(setup.seed)
    quantize_policy(model, QuantConfig.none())
    model = model.to(setup.device)
    wcfg = WarmStartConfig(
        max_steps=setup.warmstart_max_steps, target_accuracy=setup.warmstart_target,
        seed=setup.seed, eval_every=25, lr=setup.warmstart_lr,
    )  # fmt: skip
    t0 = time.perf_counter()
    res = warm_start(model, PromptStream(task, tok, seed=setup.seed), wcfg,
                     max_new_tokens=task.max_answer_chars + 1)  # fmt: skip
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    del model
    path = args.dir / f"warm-{args.seed}.safetensors"
    save_file(state, path)
    tensors, meta, learner = export(state, setup, "trace")
    del learner
    out = {
        "steps": res.steps,
        "greedy_accuracy": res.accuracy,
        "loss": res.loss,
        "seconds": time.perf_counter() - t0,
        "weights": str(path),
        "eval_reward": evaluate(tensors, meta, setup),
        "probe": site_probe(state, setup) if setup.device.startswith("cuda") else None,
    }
    (args.dir / f"warm-{args.seed}.json").write_text(json.dumps(out, indent=2))


def site_probe(state: dict[str, Any], setup: Setup, prompts: int = 16) -> dict[str, Any]:
    """D_act and code flip rate at the guided K/V sites (every layer guided): the trainer's
    forward with the rollout's records (trace) and without guidance (rtn), against the FP4
    K/V the CUDA engine stored for the same tokens."""
    import torch

    from trace_common.model import GuidanceConfig, get_config
    from trace_common.model.discrepancy import code_flip_rate, d_act
    from trace_common.model.records import SampleRecords
    from trace_common.model.train_forward import forward_logprobs
    from trace_common.rollout.cuda import CudaEngine
    from trace_common.rollout.types import SamplingConfig
    from trace_common.tasks import CharTokenizer, PromptStream, make_task

    tok = CharTokenizer()
    task = make_task(setup.task, setup.difficulty)
    n_layers = get_config(setup.shape).num_layers
    guidance = GuidanceConfig(layers=tuple(range(n_layers)), mode="compact")
    device = torch.device(setup.device)
    tensors, meta, learner = export(state, setup, "trace", guidance)
    meta = {k: v for k, v in meta.items() if isinstance(v, str)}
    engine = CudaEngine(tensors, meta, 0, device=device, max_batch=prompts, max_context=128)
    try:
        ps = PromptStream(task, tok, seed=setup.seed + EVAL_SEED + 1).next_batch(prompts)
        got = engine.generate(
            [p.token_ids for p in ps], 1,
            SamplingConfig(temperature=1.0, max_new_tokens=task.max_answer_chars + 1, seed=3),
            with_records=True,
        )  # fmt: skip
        report: dict[str, Any] = {}
        for mode in ("trace", "rtn"):
            dacts: list[float] = []
            flips: list[float] = []
            for s in got:  # sample i ran in slot i: all fit in one batch, group 1
                rec = SampleRecords.from_bytes(s.records)
                seq = [*ps[s.prompt_index].token_ids, *s.completion_tokens]
                with torch.no_grad(), learner.compute():
                    fwd = forward_logprobs(
                        learner.model, [seq], qat_mode=mode, records=[rec], collect=True,
                        routing_replay=True,
                    )  # fmt: skip
                n = len(seq) - 1
                for (li, site), vals in fwd.site_values.items():
                    if site not in ("k", "v") or (li, site) not in rec.guidance:
                        continue
                    ref, grid = engine.cached_kv(li, s.prompt_index, n, site)
                    dacts.append(d_act(vals.float(), ref))
                    flips.append(code_flip_rate(fwd.site_codes[(li, site)].float(), grid))
            report[mode] = {
                "d_act": sum(dacts) / len(dacts),
                "code_flip_rate": sum(flips) / len(flips),
                "site_samples": len(dacts),
            }
        return report
    finally:
        engine.close()


# -- one arm (one process per arm and seed) ------------------------------------------------


def arm(args: argparse.Namespace) -> None:
    import torch

    from trace_common.clients import WeightSyncClient
    from trace_common.model import get_config
    from trace_common.model.quant import load_quantized_state_dict
    from trace_common.rl.cluster import ClusterConfig, LocalCluster
    from trace_common.rl.plots import read_metrics

    mode = ARM_MODE.get(args.arm, "trace")
    setup = setup_of(args)
    out = args.dir / f"{args.arm}-{args.seed}"
    out.mkdir(parents=True, exist_ok=True)
    warm_res = json.loads((args.dir / f"warm-{args.seed}.json").read_text())
    run = setup.trainer_run(mode, args.steps, warm_res["weights"])
    run["guidance.layers"] = guided_layers(args.arm, get_config(setup.shape).num_layers)
    cluster_cfg = ClusterConfig(
        replicas=1, run=run, trainer_env=setup.trainer_env(out),
        rollout_env={"TRACE_DEVICE": setup.device, "TRACE_ROLLOUT_MAX_CONTEXT": "256"},
        redis_maxmemory_bytes=1 << 30,
    )  # fmt: skip
    t0 = time.perf_counter()
    deadline = time.monotonic() + args.budget_s
    with LocalCluster(cluster_cfg, out / "logs") as cluster:
        shown = -1
        while (st := cluster.trainer_status())["state"] not in ("finished", "failed"):
            if time.monotonic() > deadline:
                break
            if st["step"] != shown:  # the arm's log shows where it is
                shown = st["step"]
                print(f"{time.perf_counter() - t0:.0f} s: {st['state']}, step {shown}", flush=True)
            time.sleep(1.0)
        assert cluster.weight_sync is not None
        client = WeightSyncClient(cluster.weight_sync.grpc_address, token=cluster.config.token)
        version, tensors, meta = client.pull_version()
        client.close()
    result: dict[str, Any] = {
        "arm": args.arm,
        "seed": args.seed,
        "mode": mode,
        "guided_layers": run["guidance.layers"],
        "state": st["state"],
        "detail": st.get("detail"),
        "seconds": time.perf_counter() - t0,
        "final_version": version,
        "warm_eval": warm_res["eval_reward"],
        "rows": read_metrics(out / "metrics.jsonl"),
    }
    result["final_eval"] = evaluate(tensors, meta, setup)  # on the path it served
    if mode == "bf16":  # PTQ after BF16: the trained policy quantized, on the FP4 path
        state = load_quantized_state_dict(tensors, meta, dtype=torch.float32).state_dict()
        fp4, fp4_meta, learner = export(state, setup, "trace")
        del learner
        result["final_eval_ptq_fp4"] = evaluate(fp4, fp4_meta, setup)
    (args.dir / f"arm-{args.arm}-{args.seed}.json").write_text(json.dumps(result))


# -- the whole experiment ------------------------------------------------------------------


def launch(
    sub: list[str], device: str, log: pathlib.Path, smoke: bool, sets: list[str]
) -> subprocess.Popen:
    # One GPU per process tree: the arm's trainer and replica see only `device` (as cuda).
    env = dict(os.environ)
    if device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        device = "cuda"
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), *sub, "--device", device]
    if smoke:
        cmd.append("--smoke")
    for item in sets:
        cmd += ["--set", item]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def run_all(args: argparse.Namespace) -> None:
    from rich.progress import Progress

    args.out.mkdir(parents=True, exist_ok=True)
    gpus = [d.strip() for d in args.devices.split(",") if d.strip()]
    jobs = [(a, s) for a in args.arms for s in args.seeds]  # an arm's seeds start together
    jobs += [(a, s) for s in args.ablation_seeds for a in ABLATION_ARMS]
    with Progress() as bar:
        w = bar.add_task("warm starts", total=len(args.seeds))
        procs = [
            launch(["warm", "--seed", str(s), "--dir", str(args.out)], gpus[i % len(gpus)],
                   args.out / f"warm-{s}.log", args.smoke, args.set or [])
            for i, s in enumerate(args.seeds)
        ]  # fmt: skip
        for p in procs:
            p.wait()
            bar.advance(w)
        for s in args.seeds:
            if not (args.out / f"warm-{s}.json").exists():
                raise SystemExit(f"warm start {s} failed:\n{tail(args.out / f'warm-{s}.log')}")
        a = bar.add_task("arms", total=len(jobs))
        queue = list(enumerate(jobs))
        running: list[tuple[subprocess.Popen, str]] = []
        while queue or running:
            while queue and len(running) < args.max_parallel:
                i, (arm_name, seed) = queue.pop(0)
                sub = ["arm", "--arm", arm_name, "--seed", str(seed), "--dir", str(args.out),
                       "--steps", str(args.steps), "--budget-s", str(args.arm_budget_s)]  # fmt: skip
                log = args.out / f"arm-{arm_name}-{seed}.log"
                running.append((launch(sub, gpus[i % len(gpus)], log, args.smoke, args.set or []),
                                f"{arm_name}-{seed}"))  # fmt: skip
            time.sleep(1.0)
            for p, name in [r for r in running if r[0].poll() is not None]:
                running.remove((p, name))
                bar.update(a, advance=1, description=f"arms ({name} done)")
    merged = merge(args.out)
    (args.out / "fidelity.json").write_text(json.dumps(merged))
    print(table(merged))


def tail(path: pathlib.Path, n: int = 3000) -> str:
    return path.read_text()[-n:] if path.exists() else "(no log)"


def merge(d: pathlib.Path) -> dict[str, Any]:
    warm = {p.stem: json.loads(p.read_text()) for p in sorted(d.glob("warm-*.json"))}
    arms = [json.loads(p.read_text()) for p in sorted(d.glob("arm-*.json"))]
    failed = sorted(p.stem for p in d.glob("arm-*.log") if not (d / f"{p.stem}.json").exists())
    return {"shape": SHAPE, "warm": warm, "arms": arms, "failed": failed,
            "failed_logs": {f: tail(d / f"{f}.log", 1500) for f in failed}}  # fmt: skip


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if isinstance(x, int | float) and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(run: dict[str, Any]) -> dict[str, float]:
    rows = run["rows"]
    # The trainer measures the mismatch on a step's fresh samples (generated by the weights
    # it trains); a step with none measures all of them, policy drift included: left out.
    fresh = [r for r in rows if r.get("fresh_fraction", 1.0) > 0 and "logp_abs_diff_mean" in r]
    return {
        "steps": len(rows),
        "fresh_steps": len(fresh),
        "reward_first5": _mean([r["reward_mean"] for r in rows[:5]]),
        "reward_last5": _mean([r["reward_mean"] for r in rows[-5:]]),
        "final_eval": run["final_eval"],
        "final_eval_ptq_fp4": run.get("final_eval_ptq_fp4", float("nan")),
        "dlogp_mean": _mean([r["logp_abs_diff_mean"] for r in fresh]),
        "dlogp_max": max((r.get("logp_abs_diff_max", 0.0) for r in fresh), default=float("nan")),
        "k3_kl": _mean([r.get("k3_kl", float("nan")) for r in fresh]),
        "routing_mismatch": _mean([r.get("routing_mismatch", float("nan")) for r in fresh]),
        "tis_capped_frac": _mean([r.get("tis_capped_frac", float("nan")) for r in rows]),
        "clip_frac": _mean([r.get("clip_frac", float("nan")) for r in rows]),
        "step_s": _mean([sum(r.get(f"time_{p}_s", 0.0) for p in PHASES) for r in rows[1:]]),
        "train_s": _mean([r.get("time_train_s", float("nan")) for r in rows[1:]]),
        "record_bytes_per_token": _mean([r.get("record_bytes_per_token", 0.0) for r in rows]),
    }


PHASES = ("rollout", "records", "train", "push")
COLUMNS = (
    "steps", "fresh_steps", "reward_first5", "reward_last5", "final_eval", "final_eval_ptq_fp4", "dlogp_mean",
    "dlogp_max", "k3_kl", "routing_mismatch", "tis_capped_frac", "clip_frac", "step_s",
    "train_s", "record_bytes_per_token",
)  # fmt: skip


def by_arm(merged: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in merged["arms"]:
        out.setdefault(r["arm"], []).append(r)
    order = [*MAIN_ARMS, *ABLATION_ARMS]
    return {k: out[k] for k in sorted(out, key=lambda a: order.index(a) if a in order else 99)}


def table(merged: dict[str, Any]) -> str:
    lines = ["| arm | seeds | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    for name, runs in by_arm(merged).items():
        sums = [summarize(r) for r in runs]
        cells = []
        for c in COLUMNS:
            vals = [s[c] for s in sums if math.isfinite(s[c])]
            if not vals:
                cells.append("-")
            elif len(vals) > 1:
                cells.append(f"{statistics.mean(vals):.4g} ± {statistics.stdev(vals):.2g}")
            else:
                cells.append(f"{vals[0]:.4g}")
        lines.append(f"| {name} | {len(runs)} | " + " | ".join(cells) + " |")
    for name, w in merged["warm"].items():
        p = w["probe"]
        if p is None:
            lines.append(f"\n{name}: {w['steps']} warm-start steps (no K/V probe on the CPU)")
            continue
        lines.append(
            f"\n{name}: {w['steps']} warm-start steps, greedy acc {w['greedy_accuracy']:.2f}, "
            f"FP4 eval {w['eval_reward']:.3f}; guided K/V sites vs the CUDA engine's FP4 cache: "
            f"trace D_act {p['trace']['d_act']:.3e} flip {p['trace']['code_flip_rate']:.3e}, "
            f"rtn D_act {p['rtn']['d_act']:.3e} flip {p['rtn']['code_flip_rate']:.3e} "
            f"({p['trace']['site_samples']} site-samples)"
        )
    if merged["failed"]:
        lines.append(f"\nfailed: {merged['failed']}")
    return "\n".join(lines)


def value(row: dict[str, Any], key: str, figure: str) -> float:
    """A row's `key` for a curve; a mismatch of a step without fresh samples is a gap."""
    if figure == "mismatch" and row.get("fresh_fraction", 1.0) == 0:
        return float("nan")
    return row.get(key, float("nan"))


def plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    merged = json.loads(args.json.read_text())
    arms = by_arm(merged)
    args.out.mkdir(parents=True, exist_ok=True)
    specs = [
        ("reward", [("reward_mean", "reward (mean over the step's samples)", False)]),
        ("mismatch", [
            ("logp_abs_diff_mean", "mean |dlogp| (nats)", True),
            ("k3_kl", "k3 KL", True),
            ("routing_mismatch", "routing mismatch", False),
        ]),
    ]  # fmt: skip
    for name, panels in specs:
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
        for ax, (key, label, log) in zip(axes[0], panels, strict=True):
            for arm_name, runs in arms.items():
                curves = [[value(r, key, name) for r in run["rows"]] for run in runs]
                n = min(len(c) for c in curves)
                if n == 0:
                    continue
                steps = list(range(1, n + 1))
                mean = [_mean([c[i] for c in curves]) for i in range(n)]
                lo = [min(c[i] for c in curves) for i in range(n)]
                hi = [max(c[i] for c in curves) for i in range(n)]
                (line,) = ax.plot(
                    steps, mean, marker="o", ms=4, label=f"{arm_name} ({len(runs)} seeds)"
                )
                if len(runs) > 1:
                    ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
            ax.set_xlabel("RL step")
            ax.set_ylabel(label)
            if log:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes[0][-1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8)
        title = {
            "reward": f"FP4 RL fidelity ({merged['shape']}, CUDA-engine rollout): reward "
            "(higher is better; band = seed range)",
            "mismatch": "train-vs-rollout mismatch per step (lower is better: closer to on-policy)",
        }[name]
        fig.suptitle(title)
        fig.tight_layout()
        path = args.out / f"fidelity_{name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        print(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="warm starts, every arm, merge")
    r.add_argument("--out", type=pathlib.Path, required=True)
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    r.add_argument("--arms", nargs="+", default=list(MAIN_ARMS), choices=MAIN_ARMS)
    r.add_argument("--ablation-seeds", type=int, nargs="*", default=[0])
    r.add_argument("--steps", type=int, default=30)
    r.add_argument("--max-parallel", type=int, default=12, help="arms running at once")
    r.add_argument("--arm-budget-s", type=float, default=330.0, help="an arm stops after this")
    r.add_argument(
        "--devices", default="cuda:0", help="comma-separated (cuda:0,cuda:1): arms round-robin"
    )
    w = sub.add_parser("warm")
    w.add_argument("--seed", type=int, required=True)
    w.add_argument("--dir", type=pathlib.Path, required=True)
    w.add_argument("--device", required=True)
    a = sub.add_parser("arm")
    a.add_argument("--arm", required=True, choices=[*MAIN_ARMS, *ABLATION_ARMS])
    a.add_argument("--seed", type=int, required=True)
    a.add_argument("--dir", type=pathlib.Path, required=True)
    a.add_argument("--device", required=True)
    a.add_argument("--steps", type=int, required=True)
    a.add_argument("--budget-s", type=float, required=True)
    m = sub.add_parser("merge", help="merge a run directory's results into fidelity.json")
    m.add_argument("dir", type=pathlib.Path)
    pl = sub.add_parser("plot")
    pl.add_argument("json", type=pathlib.Path)
    pl.add_argument("--out", type=pathlib.Path, required=True)
    for sp in (r, w, a):
        sp.add_argument("--smoke", action="store_true", help="debug shape, small task (CPU)")
        sp.add_argument(
            "--set",
            action="append",
            metavar="KEY=VALUE",
            help="override a Setup field (task, difficulty, lr, warmstart_lr, ...)",
        )
    args = p.parse_args(argv)
    if args.cmd == "run":
        run_all(args)
    elif args.cmd == "warm":
        warm(args)
    elif args.cmd == "arm":
        arm(args)
    elif args.cmd == "merge":
        merged = merge(args.dir)
        (args.dir / "fidelity.json").write_text(json.dumps(merged))
        print(table(merged))
    else:
        plot(args)


if __name__ == "__main__":
    main()
