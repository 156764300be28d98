"""`trace-rl demo` and `trace-rl train`: RL of an MoE with TRACE, end to end on this machine.

`train` plays a recipe as it is (the user's model, tokenizer, dataset and reward; a warm start
only when its `[train]` table asks for one, held-out evaluation as its `[eval]` section says);
`demo` plays the demo recipes, warm start included.

Its run is a recipe: ``recipes/demo-cpu.toml`` (the default) trains the tiny debug shape on
the CPU; with ``--device cuda`` it follows ``recipes/demo-gpu.toml``: the mid-1b shape with the
trainer and every replica on the GPU. ``--config FILE`` names another recipe.

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

import dataclasses
import datetime as dt
import gc
import json
import pathlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from trace_common.config import (
    DRIVER_TABLES,
    RECIPES_DIR,
    RunConfig,
    build_run_config,
    build_section,
    dump_toml,
    merge,
    read_recipe,
    run_config_dict,
)
from trace_common.launch.cluster import ClusterConfig, LocalCluster
from trace_common.rollout.select import check_engine

if TYPE_CHECKING:
    from trace_common.tasks import Problem, Tokenizer

POLL_S = 0.5
ROLLOUT_DTYPES = ("auto", "float32", "bfloat16")
DEMO_CPU_RECIPE = RECIPES_DIR / "demo-cpu.toml"  # the default: a few minutes on 2 CPU cores
DEMO_GPU_RECIPE = RECIPES_DIR / "demo-gpu.toml"  # `--device cuda`: mid-1b on one GPU

# The demo's command-line options that set a key of the run tree (`trace-rl demo --steps 3`).
RUN_OPTIONS: dict[str, str] = {
    "mode": "mode",
    "steps": "steps",
    "prompts_per_step": "prompts_per_step",
    "group_size": "group_size",
    "seed": "seed",
    "task": "task.name",
    "difficulty": "task.difficulty",
    "shape": "model.name",
    "lr": "objective.lr",
    "temperature": "sampling.temperature",
    "guidance_mode": "guidance.mode",
    "checkpoint_every": "checkpoint.every",
}


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """The demo: the run (`run`, from a recipe) and how this machine plays it (a recipe's
    `[demo]` table). Defaults: `recipes/demo-cpu.toml`; `recipes/demo-gpu.toml` on CUDA."""

    run: RunConfig
    out: pathlib.Path | None = None  # run directory (default: runs/<timestamp>)
    device: str = "cpu"  # TRACE_DEVICE of the warm start, the trainer and every replica
    replicas: int = 2  # rollout replicas (processes)
    warmstart_target: float = 0.3  # stop the supervised warm start at this greedy accuracy
    warmstart_max_steps: int = 300
    warmstart_lr: float = 3e-3
    eval_prompts: int = 256  # held-out prompts of the warm-start and final evaluations
    rollout_engine: str = "auto"  # TRACE_ROLLOUT_ENGINE of the replicas (rollout.select.ENGINES)
    rollout_dtype: str = "auto"  # PyTorch engine's dtype (auto: bf16 on CUDA, else fp32)
    export_hp_dtype: str = "auto"  # the trainer's TRACE_EXPORT_HP_DTYPE (auto: bf16 on CUDA)
    warmstart: bool = True  # supervised warm start first (`trace-rl train`: only if asked)

    def __post_init__(self) -> None:
        from trace_common.device import DEVICE_HELP, DEVICE_RE

        if not DEVICE_RE.match(self.device):
            raise ValueError(f"device {self.device!r}: expected {DEVICE_HELP}")
        check_engine(self.rollout_engine)
        if self.rollout_dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"rollout dtype {self.rollout_dtype!r}: one of {ROLLOUT_DTYPES}")
        if self.export_hp_dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"export_hp_dtype {self.export_hp_dtype!r}: one of {ROLLOUT_DTYPES}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")

    @classmethod
    def load(
        cls, recipe: pathlib.Path | str | None = None, *, device: str | None = None,
        table: str = "demo", **options: Any,
    ) -> DemoConfig:  # fmt: skip
        """The recipe (default: `DEMO_GPU_RECIPE` for a CUDA `device`, else `DEMO_CPU_RECIPE`),
        then the options that are not None: run keys by `RUN_OPTIONS`, the others keys of the
        driver's table (`[demo]`, or `[train]` for `trace-rl train`, where a warm start is off
        unless the table turns it on). Unless given, checkpoints come every quarter of the
        steps and a work unit is an even share of the prompts for twice the replicas.
        ConfigError names a bad key."""
        if recipe is None:
            cuda = device is not None and (
                device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
            )
            recipe = DEMO_GPU_RECIPE if cuda else DEMO_CPU_RECIPE
        raw = read_recipe(recipe)
        drivers = {t: raw.pop(t, None) for t in DRIVER_TABLES}
        demo = dict(drivers.get(table) or {})
        if table == "train":
            demo.setdefault("warmstart", False)
        if device is not None:
            demo["device"] = device
        for key, value in options.items():
            if value is None:
                continue
            if key in RUN_OPTIONS:
                merge(raw, RUN_OPTIONS[key], value)
            else:
                demo[key] = value
        source = f"recipe {recipe}"
        run = build_run_config(raw, source=source)
        cfg = build_section(cls, demo, f"{table}.", source, run=run)
        if "every" not in (raw.get("checkpoint") or {}):
            run.checkpoint = dataclasses.replace(run.checkpoint, every=max(1, run.steps // 4))
        if "prompts_per_unit" not in (raw.get("dispatch") or {}):
            unit = max(1, run.prompts_per_step // (2 * cfg.replicas))
            run.dispatch = dataclasses.replace(run.dispatch, prompts_per_unit=unit)
        return cfg


def default_out_dir() -> pathlib.Path:
    return pathlib.Path("runs") / dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def demo_model(cfg: DemoConfig, vocab_size: int):
    """The demo's shape, initialized from the seed, on the CPU (callers move it)."""
    from trace_common.rl.warmstart import initial_model

    return initial_model(cfg.run.model.config(vocab_size), cfg.run.seed)


def _device(cfg: DemoConfig) -> torch.device:
    from trace_common.device import resolve_device

    return resolve_device(cfg.device)


def _release_gpu() -> None:
    """Hand this process's cached CUDA memory back, so that the trainer and the replicas (other
    processes on the same GPU) get it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


def run_tokenizer(cfg: DemoConfig) -> Tokenizer:
    from trace_common.tasks import load_tokenizer

    return load_tokenizer(cfg.run.task.tokenizer)


def inline_score(cfg: DemoConfig) -> Callable[[Problem, str | None], float]:
    """The run's reward, called in this process: (problem, completion text or None when cut
    off) -> score (a reward that raises scores 0, as in the trainer's pool)."""
    from trace_common.rewards import load_reward

    reward = load_reward(cfg.run.reward.name, cfg.run.reward.options)
    truncated = cfg.run.reward.truncated

    def score(problem: Problem, text: str | None) -> float:
        if text is None and truncated == "zero":
            return 0.0
        try:
            return reward(problem.row, text or "")
        except Exception:
            return 0.0

    return score


@torch.no_grad()
def evaluate_policy(model_state: dict[str, torch.Tensor], cfg: DemoConfig) -> float:
    """Mean reward of the FP4 rollout path (as the replicas run it) on held-out prompts."""
    from trace_common.model import QuantConfig
    from trace_common.rl.policy import LearnerConfig, ModelLearner

    tok = run_tokenizer(cfg)
    model = demo_model(cfg, tok.vocab_size)
    model.load_state_dict(model_state)
    learner = ModelLearner(
        model, LearnerConfig(mode=cfg.run.mode), quant=QuantConfig(), guidance=None,
        eos_id=tok.eos_id, pad_id=tok.pad_id, device=_device(cfg),
    )  # fmt: skip
    tensors, meta = learner.export_weights()  # quantized on the device, returned on the CPU
    del learner, model
    return evaluate_weights(tensors, meta, cfg)


@torch.no_grad()
def evaluate_weights(
    tensors: dict[str, torch.Tensor], meta: dict[str, Any], cfg: DemoConfig
) -> float:
    """Mean reward of a policy version as exported (or pulled from weight-sync), served by the
    engine the replicas build (the same TRACE_ROLLOUT_ENGINE / device / dtype), on the
    held-out prompts, sampled at the training temperature."""
    from trace_common.data.recipe import eval_prompts
    from trace_common.rollout.select import EngineSettings, make_engine_factory
    from trace_common.tasks import completion_text

    run = cfg.run
    tok = run_tokenizer(cfg)
    score = inline_score(cfg)
    factory = make_engine_factory(
        EngineSettings(
            engine=cfg.rollout_engine, device=_device(cfg), native_dtype=cfg.rollout_dtype
        )  # type: ignore[arg-type]
    )
    engine = factory(tensors, {k: v for k, v in meta.items() if isinstance(v, str)}, 0)
    prompts = eval_prompts(run, tok, cfg.eval_prompts)
    out = engine.generate(
        [p.token_ids for p in prompts], 1, dataclasses.replace(run.sampling, seed=run.seed + 1),
        with_records=False,
    )  # fmt: skip
    rewards = [
        score(prompts[s.prompt_index].problem, completion_text(s.completion_tokens, tok))
        for s in out
    ]
    close = getattr(engine, "close", None)
    if close is not None:
        close()
    del engine, factory
    _release_gpu()
    return sum(rewards) / len(rewards)


def warm_start_phase(
    cfg: DemoConfig, out: pathlib.Path, console: Any, *, evaluate: bool = True
) -> dict[str, Any]:
    """The supervised warm start; its weights go to `out`/warmstart.safetensors (and its
    held-out FP4 reward is measured in this process with `evaluate`)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from safetensors.torch import save_file

    from trace_common.data.recipe import is_dataset, open_split, prompt_format, train_prompts
    from trace_common.rl.warmstart import WarmStartConfig, warm_start

    torch.manual_seed(cfg.run.seed)
    tok = run_tokenizer(cfg)
    stream = train_prompts(cfg.run, tok)
    held_out, score = None, None
    if is_dataset(cfg.run):
        from trace_common.data.prompts import DatasetPrompts

        score = inline_score(cfg)
        if cfg.run.dataset.eval is not None:
            held_out = DatasetPrompts(open_split(cfg.run, "eval"), prompt_format(cfg.run), tok)
    model = demo_model(cfg, tok.vocab_size).to(_device(cfg))
    wcfg = WarmStartConfig(
        max_steps=cfg.warmstart_max_steps, target_accuracy=cfg.warmstart_target,
        seed=cfg.run.seed,
        eval_every=10, lr=cfg.warmstart_lr,
    )  # fmt: skip
    t0 = time.perf_counter()
    with Progress(
        TextColumn("[bold]warm start[/]"), BarColumn(), TextColumn("{task.description}"),
        TimeElapsedColumn(), console=console, transient=False,
    ) as bar:  # fmt: skip
        job = bar.add_task("", total=wcfg.max_steps)
        res = warm_start(
            model, stream, wcfg, max_new_tokens=cfg.run.sampling.max_new_tokens,
            held_out=held_out, score=score,
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
        "eval_reward": evaluate_policy(state, cfg) if evaluate else None,
    }


def trainer_run(cfg: DemoConfig, init: str | None) -> RunConfig:
    """The run the trainer plays: the recipe's, starting from the warm start `init` (if any),
    its files named by absolute paths (the trainer runs in another directory)."""
    from trace_common.data.recipe import resolve_run_paths

    run = cfg.run
    if init is not None:
        run = dataclasses.replace(
            run, model=dataclasses.replace(run.model, init_weights=pathlib.Path(init))
        )
    return resolve_run_paths(run)


def trainer_env(cfg: DemoConfig, out: pathlib.Path) -> dict[str, str]:
    """The trainer's wiring: its device, the dtype of its exported high-precision weights,
    where metrics and checkpoints go."""
    return {
        "TRACE_DEVICE": cfg.device,
        "TRACE_EXPORT_HP_DTYPE": cfg.export_hp_dtype,
        "TRACE_METRICS_FILE": str(out / "metrics.jsonl"),
        "TRACE_CHECKPOINT_DIR": str(out / "checkpoints"),
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
        job = bar.add_task("starting", total=cfg.run.steps, mode=cfg.run.mode)
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
                        + (
                            f"  held-out {st['last_eval']['eval_reward_mean']:.2f}"
                            if st.get("last_eval")
                            else ""
                        )
                    ),
                )
            if st["state"] in ("finished", "failed"):
                return st
            assert cluster.trainer is not None
            if not cluster.trainer.alive():
                raise RuntimeError(f"trainer exited:\n{cluster.trainer.log()[-4000:]}")
            time.sleep(POLL_S)


def run_demo(cfg: DemoConfig) -> pathlib.Path:
    """Run the whole demo (or `trace-rl train`: `cfg.warmstart` off unless asked); returns
    the run directory."""
    from rich.console import Console

    from trace_common.launch.plots import plot_run, read_evals, read_metrics
    from trace_common.rl.checkpoint import latest_checkpoint, load_checkpoint

    console = Console()
    out = cfg.out or default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), default=str, indent=2))
    console.print(f"[bold]TRACE[/] {cfg.run.run_id}: {cfg.run.model.name} on {cfg.device}, "
                  f"{task_label(cfg)} -> {out}")  # fmt: skip
    # The trainer's own held-out evaluation (eval.every) replaces the in-process one.
    evaluates_inline = not cfg.run.eval.every
    warm: dict[str, Any] | None = None
    if cfg.warmstart:
        warm = warm_start_phase(cfg, out, console, evaluate=evaluates_inline)
        console.print(
            f"warm start: {warm['steps']} steps, greedy accuracy {warm['greedy_accuracy']:.2f}"
            + (f", FP4 sampled eval reward {warm['eval_reward']:.3f}" if evaluates_inline else "")
        )
    console.print(
        f"starting Redis, quant-cache, weight-sync, trainer, {cfg.replicas} rollout replicas"
    )
    run = trainer_run(cfg, warm["weights"] if warm else None)
    (out / "run.toml").write_text(dump_toml(run_config_dict(run)))  # a recipe that replays it
    cluster = LocalCluster(
        ClusterConfig(
            replicas=cfg.replicas,
            run=run,
            trainer_env=trainer_env(cfg, out),
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
    rows = read_metrics(out / "metrics.jsonl")
    evals = read_evals(out / "metrics.jsonl")
    warm_reward = warm["eval_reward"] if warm and evaluates_inline else None
    if evaluates_inline:
        final_reward: float | None = evaluate_policy(load_checkpoint(ckpt_path).model, cfg)
    else:
        final_reward = evals[-1]["eval_reward_mean"] if evals else None
    plots = plot_run(
        rows, out, title=f"TRACE: {task_label(cfg)}, mode {cfg.run.mode}",
        warm_start_reward=warm_reward, final_reward=final_reward if evaluates_inline else None,
        evals=evals,
    )  # fmt: skip
    summary = {
        "mode": cfg.run.mode,
        "steps": len(rows),
        "warm_start": warm,
        "eval_reward_warm_start": warm_reward,
        "eval_reward_start": evals[0]["eval_reward_mean"] if evals else warm_reward,
        "eval_reward_final": final_reward,
        "evals": [
            {k: e[k] for k in ("step", "eval_reward_mean", "eval_pass_at_1", "eval_pass_at_k")}
            for e in evals
        ],
        "eval_samples_per_prompt": evals[-1]["eval_samples_per_prompt"] if evals else 1,
        "reward_first_5_steps": _mean([r["reward_mean"] for r in rows[:5]]),
        "reward_last_5_steps": _mean([r["reward_mean"] for r in rows[-5:]]),
        "logp_abs_diff_mean": _mean([r.get("logp_abs_diff_mean", float("nan")) for r in rows]),
        "steps_with_fresh_samples": sum("logp_abs_diff_mean" in r for r in rows),
        "d_act_mean": _mean([r["d_act_mean"] for r in rows if "d_act_mean" in r]),
        "samples_dropped_stale": sum(r["samples_dropped_stale"] for r in rows),
        "reward_errors": sum(r.get("reward_errors", 0) for r in rows),
        "reward_timeouts": sum(r.get("reward_timeouts", 0) for r in rows),
        "completions_truncated": sum(r.get("completions_truncated", 0) for r in rows),
        "prompts_skipped": final.get("prompts_skipped", {}),
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
    start = summary["eval_reward_start"]
    console.print(
        f"[bold green]done[/] in {rl_seconds:.0f}s of RL: held-out reward "
        + (f"{start:.3f} -> " if start is not None else "")
        + (f"{final_reward:.3f}" if final_reward is not None else "(not evaluated)")
        + f" after {len(rows)} steps; mean |dlogp| {summary['logp_abs_diff_mean']:.4f}; "
        f"plots and checkpoint in {out}"
    )
    return out


def task_label(cfg: DemoConfig) -> str:
    t = cfg.run.task
    if t.name == "dataset":
        return f"dataset {cfg.run.dataset.train}, reward {cfg.run.reward.name}"
    return f"{t.name} ({t.difficulty})"


def summary_markdown(s: dict[str, Any], cfg: DemoConfig) -> str:
    """The run in a few lines, for people."""
    w, run = s["warm_start"], cfg.run
    lines = [
        f"# TRACE: {task_label(cfg)}, mode {run.mode}",
        "",
        f"- model: {run.model.name} on {cfg.device} (rollout engine {cfg.rollout_engine})",
    ]
    if w is not None:
        lines.append(
            f"- warm start: {w['steps']} supervised steps, greedy accuracy "
            f"{w['greedy_accuracy']:.3f}, {w['seconds']:.0f} s"
        )
    lines.append(
        f"- RL: {s['steps']} steps x {run.prompts_per_step} prompts x {run.group_size} "
        f"completions, {cfg.replicas} rollout replicas, {s['rl_seconds']:.0f} s"
    )
    if s["evals"]:
        k = s["eval_samples_per_prompt"]
        first, last = s["evals"][0], s["evals"][-1]
        lines.append(
            f"- held-out evaluation on the replicas (FP4 rollout path, {run.eval.prompts} "
            f"prompts x {k} samples, temperature {run.sampling.temperature}): mean reward "
            f"{first['eval_reward_mean']:.3f} (step {first['step']}) -> "
            f"{last['eval_reward_mean']:.3f} (step {last['step']}); pass@{k} "
            f"{first['eval_pass_at_k']:.3f} -> {last['eval_pass_at_k']:.3f}"
        )
    elif s["eval_reward_final"] is not None:
        start = s["eval_reward_warm_start"]
        lines.append(
            f"- held-out reward (FP4 rollout path, {cfg.eval_prompts} prompts, temperature "
            f"{run.sampling.temperature}): "
            + (f"{start:.3f} after the warm start -> " if start is not None else "")
            + f"{s['eval_reward_final']:.3f} after RL"
        )
    lines += [
        f"- per-step sampled reward: {s['reward_first_5_steps']:.3f} (steps 1-5) -> "
        f"{s['reward_last_5_steps']:.3f} (last 5)",
        f"- rewards that failed: {s['reward_errors']} raised, {s['reward_timeouts']} timed out; "
        f"completions cut off: {s['completions_truncated']}; prompts skipped: "
        f"{s['prompts_skipped'] or 'none'}",
        f"- train-rollout |dlogp| on fresh samples: {s['logp_abs_diff_mean']:.2e} (mean over "
        f"the {s['steps_with_fresh_samples']} of {s['steps']} steps that had some); "
        f"D_act at guided sites: {s['d_act_mean']:.2e}"
        + (" (compact records: not measured)" if run.guidance.mode == "compact" else ""),
        "- step time split (mean s): "
        + ", ".join(f"{k} {v:.3f}" for k, v in s["step_time_split_s"].items()),
        f"- trainer: {s['train_tokens_per_s']:.0f} tokens/s (whole train step)"
        + (
            f", peak {s['train_peak_memory_bytes'] / 2**30:.1f} GiB"
            if s["train_peak_memory_bytes"]
            else ""
        )
        + f"; weight push {s['weight_push_seconds']:.2f} s + pull "
        f"{s['weight_pull_seconds']:.2f} s per version",
        f"- samples dropped as stale: {s['samples_dropped_stale']}",
        f"- final checkpoint: {s['final_checkpoint']}",
        "- plots: reward.png, discrepancy.png, overview.png; per-step metrics: metrics.jsonl",
        "",
    ]
    return "\n".join(lines)


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")
