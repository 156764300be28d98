"""`trace-rl demo`'s configuration: the recipes (recipes/demo-cpu.toml, the default, and
recipes/demo-gpu.toml behind `--device cuda`), explicit options over them, and the settings
each service process gets (the run as a recipe, device, engine)."""

from __future__ import annotations

import pathlib

import pytest
from typer.testing import CliRunner

from trace_common.cli import app
from trace_common.config import dump_toml, load_run_config
from trace_common.launch.cluster import ClusterConfig
from trace_common.launch.demo import (
    DEMO_CPU_RECIPE,
    DEMO_GPU_RECIPE,
    DemoConfig,
    rollout_env,
    trainer_env,
    trainer_run,
)

# The demo's settings on the CPU (the default) and on the GPU (`--device cuda`).
CPU = {
    "mode": "trace", "steps": 40, "task": "reverse", "difficulty": 3, "replicas": 2,
    "prompts_per_step": 16, "group_size": 8, "lr": 1e-3, "temperature": 1.0,
    "warmstart_target": 0.3, "warmstart_max_steps": 300, "warmstart_lr": 3e-3,
    "eval_prompts": 256, "shape": "debug", "device": "cpu", "rollout_engine": "auto",
    "rollout_dtype": "auto", "checkpoint_every": 10, "guidance_mode": "full", "seed": 0,
    "prompts_per_unit": 4,
}  # fmt: skip
GPU = {
    **CPU, "shape": "mid-1b", "task": "sort", "difficulty": 6, "steps": 60,
    "prompts_per_step": 32, "group_size": 8, "lr": 1e-4, "warmstart_lr": 1e-3,
    "warmstart_target": 0.2, "warmstart_max_steps": 300, "checkpoint_every": 100,
    "guidance_mode": "compact", "device": "cuda", "prompts_per_unit": 8,
}  # fmt: skip


def flat(cfg: DemoConfig) -> dict[str, object]:
    r = cfg.run
    return {
        "mode": r.mode, "steps": r.steps, "task": r.task.name, "difficulty": r.task.difficulty,
        "replicas": cfg.replicas, "prompts_per_step": r.prompts_per_step,
        "group_size": r.group_size, "lr": r.objective.lr, "temperature": r.sampling.temperature,
        "warmstart_target": cfg.warmstart_target, "warmstart_max_steps": cfg.warmstart_max_steps,
        "warmstart_lr": cfg.warmstart_lr, "eval_prompts": cfg.eval_prompts,
        "shape": r.model.name, "device": cfg.device, "rollout_engine": cfg.rollout_engine,
        "rollout_dtype": cfg.rollout_dtype, "checkpoint_every": r.checkpoint.every,
        "guidance_mode": r.guidance.mode, "seed": r.seed,
        "prompts_per_unit": r.dispatch.prompts_per_unit,
    }  # fmt: skip


def test_the_recipes_hold_the_demo_settings() -> None:
    assert flat(DemoConfig.load()) == CPU
    assert flat(DemoConfig.load(DEMO_CPU_RECIPE)) == CPU
    assert flat(DemoConfig.load(device="cuda")) == GPU
    assert flat(DemoConfig.load(DEMO_GPU_RECIPE)) == GPU
    assert DemoConfig.load(device="cpu").run.run_id == "demo"


def test_explicit_options_win_over_the_recipe() -> None:
    mine = DemoConfig.load(device="cuda:1", steps=7, shape="debug", lr=0.5, task=None)
    assert (mine.run.steps, mine.run.model.name, mine.run.objective.lr) == (7, "debug", 0.5)
    assert (mine.run.task.name, mine.device) == ("sort", "cuda:1")
    assert mine.run.checkpoint.every == 100  # the recipe's, not a quarter of the steps
    cpu = DemoConfig.load(steps=8, replicas=1, prompts_per_step=4)
    assert (cpu.run.checkpoint.every, cpu.run.dispatch.prompts_per_unit) == (2, 2)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"device": "gpu"}, "device 'gpu'"),
        ({"shape": "huge"}, "unknown model shape 'huge'"),
        ({"rollout_engine": "tensorrt"}, "rollout engine 'tensorrt'"),
        ({"rollout_dtype": "float16"}, "rollout dtype 'float16'"),
        ({"export_hp_dtype": "float16"}, "export_hp_dtype 'float16'"),
        ({"guidance_mode": "half"}, "guidance.mode = 'half'"),
        ({"replicas": "two"}, "demo.replicas = 'two': expected an integer"),
        ({"colour": "red"}, "unknown key demo.colour"),
    ],
)
def test_bad_values_are_named(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DemoConfig.load(**kw)


def test_every_process_gets_the_run_device_and_engine(tmp_path: pathlib.Path) -> None:
    cfg = DemoConfig.load(device="cuda", rollout_engine="native")
    t = trainer_env(cfg, tmp_path)
    assert t["TRACE_DEVICE"] == "cuda" and t["TRACE_CHECKPOINT_DIR"] == str(
        tmp_path / "checkpoints"
    )
    assert t["TRACE_EXPORT_HP_DTYPE"] == "auto"
    assert trainer_env(DemoConfig.load(export_hp_dtype="bfloat16"), tmp_path)[
        "TRACE_EXPORT_HP_DTYPE"] == "bfloat16"  # fmt: skip

    def played(cfg: DemoConfig, init: str):  # the recipe the cluster hands the trainer
        recipe = tmp_path / "run.toml"
        recipe.write_text(dump_toml(ClusterConfig(run=trainer_run(cfg, init)).run))
        return load_run_config(recipe)

    run = played(cfg, "w.safetensors")
    assert run.model.init_weights == pathlib.Path("w.safetensors").resolve()  # absolute
    assert (run.model.name, run.task.name, run.checkpoint.every) == ("mid-1b", "sort", 100)
    assert run.guidance.mode == "compact"  # what the CUDA engine records
    assert run.sampling == cfg.run.sampling and run.objective == cfg.run.objective
    r = rollout_env(cfg)
    assert r == {"TRACE_DEVICE": "cuda", "TRACE_ROLLOUT_ENGINE": "native",
                 "TRACE_ENGINE_DTYPE": "auto"}  # fmt: skip
    cpu = played(DemoConfig.load(), "w")
    assert (cpu.model.name, cpu.checkpoint.every, cpu.guidance.mode) == ("debug", 10, "full")
    assert (cpu.run_id, cpu.dispatch.prompts_per_unit) == ("demo", 4)


def test_the_command_line_reads_a_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    got: list[DemoConfig] = []
    monkeypatch.setattr("trace_common.launch.demo.run_demo", got.append)
    help_ = CliRunner().invoke(app, ["demo", "--config", str(DEMO_CPU_RECIPE), "--help"])
    assert help_.exit_code == 0 and "--config" in help_.output
    args = ["demo", "--config", str(DEMO_GPU_RECIPE), "--device", "cpu", "--steps", "7"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (cfg,) = got
    assert (cfg.run.model.name, cfg.run.steps, cfg.device) == ("mid-1b", 7, "cpu")
    bad = CliRunner().invoke(app, ["demo", "--config", str(DEMO_CPU_RECIPE), "--mode", "fp8"])
    assert bad.exit_code != 0 and "unknown mode 'fp8'" in bad.output
