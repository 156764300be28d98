"""`trace-rl demo`: RL of an MoE with TRACE, end to end on this machine.

On the CPU (the default) it trains the tiny debug shape; with ``--device cuda`` it follows
``GPU_RECIPE``: the mid-1b shape with the trainer and every replica on the GPU.

1. supervised warm start (in this process) so RL has signal;
2. a local Redis + quant-cache + weight-sync + trainer + N rollout replicas as processes;
3. a live progress bar (step, reward, mismatch, tokens/s, weight version) from the trainer;
4. a run directory: metrics.jsonl, reward/discrepancy PNGs, the final checkpoint, a summary,
   and the logs of every service.

The warm-start policy and the final policy are both evaluated on the same held-out prompts
with the FP4 rollout path (sampled at the training temperature), so the summary compares like
with like.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import pathlib
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from trace_common.rl.cluster import ClusterConfig, LocalCluster

EVAL_SEED_OFFSET = 7_777_777  # held-out evaluation prompts, disjoint from training streams
POLL_S = 0.5
ROLLOUT_DTYPES = ("auto", "float32", "bfloat16")

# What `--device cuda` changes (any option given explicitly still wins). The task: 4-digit
# addition. Its 1-5 character answers need carries propagated across digits, exact match scores
# a whole answer, and the warm start stops at 20% greedy accuracy, so a 1B model has most of
# the reward range left to climb, one carry pattern at a time, over 100+ steps (reverse and
# sort of a few digits are solved within tens of steps on the CPU demo's tiny model). The
# learning rates are the usual scale for a model of this size (untuned: no GPU run yet).
GPU_RECIPE: dict[str, Any] = {
    "shape": "mid-1b",
    "task": "addition",
    "difficulty": 4,
    "steps": 100,
    "prompts_per_step": 32,
    "group_size": 8,
    "lr": 1e-4,
    "warmstart_lr": 5e-4,
    "warmstart_target": 0.2,
    "warmstart_max_steps": 400,
    "checkpoint_every": 100,  # 12 GB per mid-1b checkpoint (weights + AdamW): the last only
    # The CUDA engine records compact guidance only (full records would send every replica to
    # the PyTorch engine); D_act needs full records, so on the GPU it is not measured.
    "guidance_mode": "compact",
}


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """The demo's knobs (defaults: a few minutes on 2 CPU cores; see `GPU_RECIPE`)."""

    out: pathlib.Path | None = None
    mode: str = "trace"
    steps: int = 40
    task: str = "reverse"
    difficulty: int = 3
    replicas: int = 2
    prompts_per_step: int = 16
    group_size: int = 8
    lr: float = 1e-3
    temperature: float = 1.0
    warmstart_target: float = 0.3
    warmstart_max_steps: int = 300
    warmstart_lr: float = 3e-3
    eval_prompts: int = 256
    shape: str = "debug"  # named model shape (trace_common.model.config.NAMED_CONFIGS)
    device: str = "cpu"  # TRACE_DEVICE of the warm start, the trainer and every replica
    rollout_engine: str = "auto"  # TRACE_ROLLOUT_ENGINE of the replicas: auto | native | cuda
    rollout_dtype: str = "auto"  # PyTorch engine's dtype (auto: bf16 on CUDA, else fp32)
    checkpoint_every: int | None = None  # None: a quarter of the steps
    guidance_mode: str = "full"  # full records make D_act measurable every step
    seed: int = 0

    def __post_init__(self) -> None:
        from trace_common.device import DEVICE_HELP, DEVICE_RE
        from trace_common.model import get_config

        if not DEVICE_RE.match(self.device):
            raise ValueError(f"device {self.device!r}: expected {DEVICE_HELP}")
        get_config(self.shape)  # ValueError naming the known shapes
        if self.rollout_engine not in ("auto", "native", "cuda"):
            raise ValueError(f"rollout engine {self.rollout_engine!r}: auto | native | cuda")
        if self.guidance_mode not in ("full", "compact"):
            raise ValueError(f"guidance mode {self.guidance_mode!r}: full | compact")
        if self.rollout_dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"rollout dtype {self.rollout_dtype!r}: one of {ROLLOUT_DTYPES}")

    @classmethod
    def for_device(cls, device: str = "cpu", **options: Any) -> DemoConfig:
        """The defaults for `device` (`GPU_RECIPE` on CUDA), then the options that are not
        None."""
        cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        base = dict(GPU_RECIPE) if cuda else {}
        base.update({k: v for k, v in options.items() if v is not None})
        return cls(device=device, **base)


def default_out_dir() -> pathlib.Path:
    return pathlib.Path("runs") / dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def demo_model(cfg: DemoConfig, vocab_size: int):
    """The demo's shape, initialized from the seed, on the CPU (callers move it)."""
    from trace_common.model import MoECausalLM, QuantConfig, get_config
    from trace_common.model.quant import quantize_policy

    model = MoECausalLM(get_config(cfg.shape).replace(vocab_size=vocab_size))
    model.init_weights(cfg.seed)
    quantize_policy(model, QuantConfig.none())
    return model


def _device(cfg: DemoConfig) -> torch.device:
    from trace_common.device import resolve_device

    return resolve_device(cfg.device)


def _release_gpu() -> None:
    """Hand this process's cached CUDA memory back, so that the trainer and the replicas (other
    processes on the same GPU) get it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


@torch.no_grad()
def evaluate_policy(model_state: dict[str, torch.Tensor], cfg: DemoConfig) -> float:
    """Mean reward of the FP4 rollout path (as the replicas run it) on held-out prompts."""
    from trace_common.model import QuantConfig
    from trace_common.rl.policy import LearnerConfig, ModelLearner
    from trace_common.rollout.select import EngineSettings, make_engine_factory
    from trace_common.rollout.types import SamplingConfig
    from trace_common.tasks import CharTokenizer, PromptStream, exact_match_reward, make_task

    tok = CharTokenizer()
    task = make_task(cfg.task, cfg.difficulty)
    model = demo_model(cfg, tok.vocab_size)
    model.load_state_dict(model_state)
    learner = ModelLearner(
        model, LearnerConfig(mode=cfg.mode), quant=QuantConfig(), guidance=None,
        eos_id=tok.eos_id, pad_id=tok.pad_id, device=_device(cfg),
    )  # fmt: skip
    tensors, meta = learner.export_weights()  # quantized on the device, returned on the CPU
    del learner, model
    # The engine the replicas build (the same TRACE_ROLLOUT_ENGINE / device / dtype).
    factory = make_engine_factory(
        EngineSettings(
            engine=cfg.rollout_engine, device=_device(cfg), native_dtype=cfg.rollout_dtype
        )  # type: ignore[arg-type]
    )
    engine = factory(tensors, {k: v for k, v in meta.items() if isinstance(v, str)}, 0)
    stream = PromptStream(task, tok, seed=cfg.seed + EVAL_SEED_OFFSET)
    prompts = stream.next_batch(cfg.eval_prompts)
    out = engine.generate(
        [p.token_ids for p in prompts], 1,
        SamplingConfig(temperature=cfg.temperature, max_new_tokens=task.max_answer_chars + 1,
                       seed=cfg.seed + 1),
        with_records=False,
    )  # fmt: skip
    rewards = [
        exact_match_reward(s.completion_tokens, prompts[s.prompt_index].problem.answer, tok)
        for s in out
    ]
    del engine, factory
    _release_gpu()
    return sum(rewards) / len(rewards)


def warm_start_phase(cfg: DemoConfig, out: pathlib.Path, console: Any) -> dict[str, Any]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from safetensors.torch import save_file

    from trace_common.rl.warmstart import WarmStartConfig, warm_start
    from trace_common.tasks import CharTokenizer, PromptStream, make_task

    torch.manual_seed(cfg.seed)
    tok = CharTokenizer()
    task = make_task(cfg.task, cfg.difficulty)
    model = demo_model(cfg, tok.vocab_size).to(_device(cfg))
    wcfg = WarmStartConfig(
        max_steps=cfg.warmstart_max_steps, target_accuracy=cfg.warmstart_target, seed=cfg.seed,
        eval_every=10, lr=cfg.warmstart_lr,
    )  # fmt: skip
    t0 = time.perf_counter()
    with Progress(
        TextColumn("[bold]warm start[/]"), BarColumn(), TextColumn("{task.description}"),
        TimeElapsedColumn(), console=console, transient=False,
    ) as bar:  # fmt: skip
        job = bar.add_task("", total=wcfg.max_steps)
        res = warm_start(
            model, PromptStream(task, tok, seed=cfg.seed), wcfg,
            max_new_tokens=task.max_answer_chars + 1,
            progress=lambda s, loss, acc: bar.update(
                job, completed=s, description=f"step {s} loss {loss:.3f} greedy acc {acc:.2f}"
            ),
        )  # fmt: skip
        bar.update(job, total=res.steps, completed=res.steps)
    path = out / "warmstart.safetensors"
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    del model
    _release_gpu()
    save_file(state, path)
    return {
        "steps": res.steps,
        "greedy_accuracy": res.accuracy,
        "loss": res.loss,
        "seconds": time.perf_counter() - t0,
        "weights": str(path),
        "eval_reward": evaluate_policy(state, cfg),
    }


def trainer_env(cfg: DemoConfig, out: pathlib.Path, init: str) -> dict[str, str]:
    return {
        "TRACE_RUN_ID": "demo",
        "TRACE_DEVICE": cfg.device,
        "TRACE_MODEL": cfg.shape,
        "TRACE_MODE": cfg.mode,
        "TRACE_STEPS": str(cfg.steps),
        "TRACE_TASK": cfg.task,
        "TRACE_TASK_DIFFICULTY": str(cfg.difficulty),
        "TRACE_PROMPTS_PER_STEP": str(cfg.prompts_per_step),
        "TRACE_GROUP_SIZE": str(cfg.group_size),
        "TRACE_PROMPTS_PER_UNIT": str(max(1, cfg.prompts_per_step // (2 * cfg.replicas))),
        "TRACE_LR": str(cfg.lr),
        "TRACE_TEMPERATURE": str(cfg.temperature),
        "TRACE_SEED": str(cfg.seed),
        "TRACE_INIT_WEIGHTS": init,
        "TRACE_METRICS_FILE": str(out / "metrics.jsonl"),
        "TRACE_CHECKPOINT_DIR": str(out / "checkpoints"),
        "TRACE_CHECKPOINT_EVERY": str(cfg.checkpoint_every or max(1, cfg.steps // 4)),
        "TRACE_GUIDANCE_MODE": cfg.guidance_mode,
    }


def rollout_env(cfg: DemoConfig) -> dict[str, str]:
    return {
        "TRACE_DEVICE": cfg.device,
        "TRACE_ROLLOUT_ENGINE": cfg.rollout_engine,
        "TRACE_ENGINE_DTYPE": cfg.rollout_dtype,
    }


def rl_phase(cluster: LocalCluster, cfg: DemoConfig, console: Any) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("[bold]RL ({task.fields[mode]})[/]"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
    ) as bar:  # fmt: skip
        job = bar.add_task("starting", total=cfg.steps, mode=cfg.mode)
        while True:
            st = cluster.trainer_status()
            m = st.get("last_metrics") or {}
            if m:
                bar.update(
                    job,
                    completed=st["step"],
                    description=(
                        f"reward {m['reward_mean']:.2f}  |dlogp| {m.get('logp_abs_diff_mean', 0):.4f}"
                        f"  rollout {m['rollout_tokens_per_s']:.0f} tok/s"
                        f"  train {m.get('train_tokens_per_s', 0):.0f} tok/s"
                        f"  v{st['policy_version']}"
                    ),
                )
            if st["state"] in ("finished", "failed"):
                return st
            assert cluster.trainer is not None
            if not cluster.trainer.alive():
                raise RuntimeError(f"trainer exited:\n{cluster.trainer.log()[-4000:]}")
            time.sleep(POLL_S)


def run_demo(cfg: DemoConfig) -> pathlib.Path:
    """Run the whole demo; returns the run directory."""
    from rich.console import Console

    from trace_common.rl.checkpoint import latest_checkpoint, load_checkpoint
    from trace_common.rl.plots import plot_run, read_metrics

    console = Console()
    out = cfg.out or default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), default=str, indent=2))
    console.print(f"[bold]TRACE demo[/] ({cfg.shape} on {cfg.device}) -> {out}")
    warm = warm_start_phase(cfg, out, console)
    console.print(
        f"warm start: {warm['steps']} steps, greedy accuracy {warm['greedy_accuracy']:.2f}, "
        f"FP4 sampled eval reward {warm['eval_reward']:.3f}"
    )
    console.print(
        f"starting Redis, quant-cache, weight-sync, trainer, {cfg.replicas} rollout replicas"
    )
    cluster = LocalCluster(
        ClusterConfig(
            replicas=cfg.replicas,
            trainer_env=trainer_env(cfg, out, warm["weights"]),
            rollout_env=rollout_env(cfg),
        ),
        out / "logs",
    )
    t0 = time.perf_counter()
    with cluster:
        final = rl_phase(cluster, cfg, console)
    rl_seconds = time.perf_counter() - t0
    if final["state"] != "finished":
        raise RuntimeError(f"trainer {final['state']}: {final['detail']} (logs: {out / 'logs'})")
    ckpt_path = latest_checkpoint(out / "checkpoints")
    assert ckpt_path is not None
    final_reward = evaluate_policy(load_checkpoint(ckpt_path).model, cfg)
    rows = read_metrics(out / "metrics.jsonl")
    plots = plot_run(
        rows, out, title=f"TRACE demo: {cfg.task} ({cfg.difficulty}), mode {cfg.mode}",
        warm_start_reward=warm["eval_reward"], final_reward=final_reward,
    )  # fmt: skip
    summary = {
        "mode": cfg.mode,
        "steps": len(rows),
        "warm_start": warm,
        "eval_reward_warm_start": warm["eval_reward"],
        "eval_reward_final": final_reward,
        "reward_first_5_steps": _mean([r["reward_mean"] for r in rows[:5]]),
        "reward_last_5_steps": _mean([r["reward_mean"] for r in rows[-5:]]),
        "logp_abs_diff_mean": _mean([r.get("logp_abs_diff_mean", float("nan")) for r in rows]),
        "d_act_mean": _mean([r["d_act_mean"] for r in rows if "d_act_mean" in r]),
        "samples_dropped_stale": sum(r["samples_dropped_stale"] for r in rows),
        "step_time_split_s": {
            phase: _mean([r.get(f"time_{phase}_s", float("nan")) for r in rows])
            for phase in ("rollout", "records", "train", "push")
        },
        "train_tokens_per_s": _mean([r.get("train_tokens_per_s", float("nan")) for r in rows]),
        "train_peak_memory_bytes": max(
            (r.get("train_peak_memory_bytes", 0) for r in rows), default=0
        ),
        "weight_push_seconds": _mean([r.get("weight_push_seconds", float("nan")) for r in rows]),
        "weight_pull_seconds": _mean([r.get("weight_pull_seconds", float("nan")) for r in rows]),
        "rl_seconds": rl_seconds,
        "final_checkpoint": str(ckpt_path),
        "plots": [str(p) for p in plots],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(summary_markdown(summary, cfg))
    console.print(
        f"[bold green]done[/] in {rl_seconds:.0f}s of RL: eval reward "
        f"{warm['eval_reward']:.3f} (warm start) -> {final_reward:.3f} (after {len(rows)} steps); "
        f"mean |dlogp| {summary['logp_abs_diff_mean']:.4f}; plots and checkpoint in {out}"
    )
    return out


def summary_markdown(s: dict[str, Any], cfg: DemoConfig) -> str:
    """The run in a few lines, for people."""
    w = s["warm_start"]
    return "\n".join(
        [
            f"# TRACE demo: {cfg.task} ({cfg.difficulty}), mode {cfg.mode}",
            "",
            f"- model: {cfg.shape} on {cfg.device} (rollout engine {cfg.rollout_engine})",
            f"- warm start: {w['steps']} supervised steps, greedy accuracy "
            f"{w['greedy_accuracy']:.3f}, {w['seconds']:.0f} s",
            f"- RL: {s['steps']} steps x {cfg.prompts_per_step} prompts x {cfg.group_size} "
            f"completions, {cfg.replicas} rollout replicas, {s['rl_seconds']:.0f} s",
            f"- held-out reward (FP4 rollout path, {cfg.eval_prompts} prompts, temperature "
            f"{cfg.temperature}): {s['eval_reward_warm_start']:.3f} after the warm start -> "
            f"{s['eval_reward_final']:.3f} after RL",
            f"- per-step sampled reward: {s['reward_first_5_steps']:.3f} (steps 1-5) -> "
            f"{s['reward_last_5_steps']:.3f} (last 5)",
            f"- train-rollout |dlogp| on fresh samples: {s['logp_abs_diff_mean']:.2e} (mean); "
            f"D_act at guided sites: {s['d_act_mean']:.2e}"
            + (" (compact records: not measured)" if cfg.guidance_mode == "compact" else ""),
            "- step time split (mean s): "
            + ", ".join(f"{k} {v:.3f}" for k, v in s["step_time_split_s"].items()),
            f"- trainer: {s['train_tokens_per_s']:.0f} tokens/s (whole train step)"
            + (
                f", peak {s['train_peak_memory_bytes'] / 2**30:.1f} GiB"
                if s["train_peak_memory_bytes"]
                else ""
            )
            + f"; weight push "
            f"{s['weight_push_seconds']:.2f} s + pull {s['weight_pull_seconds']:.2f} s per version",
            f"- samples dropped as stale: {s['samples_dropped_stale']}",
            f"- final checkpoint: {s['final_checkpoint']}",
            "- plots: reward.png, discrepancy.png, overview.png; per-step metrics: metrics.jsonl",
            "",
        ]
    )


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")
