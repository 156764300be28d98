"""`trace-rl`: the project's command line (typer)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)


@app.command()
def demo(
    config: Annotated[
        Path | None,
        typer.Option(
            help="recipe file (TOML) of the run: recipes/demo-cpu.toml is the default, "
            "recipes/demo-gpu.toml on a CUDA device; the options below override it",
        ),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="run directory (default: runs/<timestamp>)")
    ] = None,
    device: str | None = typer.Option(
        None,
        help="auto | cpu | cuda | cuda:N: the warm start, trainer and replicas [CPU recipe: "
        "cpu]; without --config a CUDA device selects the GPU recipe (mid-1b, sorting 6 "
        "digits, 60 steps)",
    ),
    shape: str | None = typer.Option(None, help="named model shape: debug (CPU), mid-1b (GPU)"),
    mode: str | None = typer.Option(None, help="bf16 | fp4 | rtn | trace [trace]"),
    steps: int | None = typer.Option(None, min=1, help="RL steps [CPU: 40]"),
    task: str | None = typer.Option(None, help="addition | sort | reverse | mixed [CPU: reverse]"),
    difficulty: int | None = typer.Option(
        None, min=1, help="digits (addition) or sequence length [CPU: 3]"
    ),
    replicas: int | None = typer.Option(None, min=1, help="rollout replicas (processes) [2]"),
    prompts_per_step: int | None = typer.Option(None, min=1, help="[CPU: 16]"),
    group_size: int | None = typer.Option(
        None, min=2, help="completions per prompt (GRPO group) [CPU: 8]"
    ),
    lr: float | None = typer.Option(None, min=0.0, help="RL learning rate [CPU: 1e-3]"),
    warmstart_target: float | None = typer.Option(
        None, help="stop the warm start at this greedy accuracy [CPU: 0.3]"
    ),
    rollout_engine: str | None = typer.Option(
        None,
        help="replicas' engine: auto | native | cuda | vllm (needs vllm installed: "
        "make test-vllm builds .venv-vllm) [auto]",
    ),
    rollout_dtype: str | None = typer.Option(
        None,
        help="PyTorch engine's compute dtype: auto (bf16 on CUDA, else float32) | "
        "float32 | bfloat16 (the trainer keeps fp32 master weights) [auto]",
    ),
    export_hp_dtype: str | None = typer.Option(
        None,
        help="dtype of the high-precision (non-FP4) weights the trainer pushes: auto (bf16 on "
        "CUDA, else float32) | float32 | bfloat16 [auto]",
    ),
    seed: int | None = typer.Option(None, help="[0]"),
) -> None:
    """Run TRACE end to end on this machine: warm start, then RL of an MoE with a local
    Redis, quant-cache, weight-sync, the trainer and rollout replicas as processes."""
    from trace_common.rl.types import TRAIN_MODES

    if mode is not None and mode not in TRAIN_MODES:
        raise typer.BadParameter(f"unknown mode {mode!r}; choose from {TRAIN_MODES}")
    _play(
        config, "demo", device=device, out=out, mode=mode, steps=steps, task=task,
        difficulty=difficulty, replicas=replicas, prompts_per_step=prompts_per_step,
        group_size=group_size, lr=lr, warmstart_target=warmstart_target, seed=seed,
        shape=shape, rollout_engine=rollout_engine, rollout_dtype=rollout_dtype,
        export_hp_dtype=export_hp_dtype,
    )  # fmt: skip


def _play(recipe: Path | None, table: str, **options: object) -> None:
    """Load the recipe for the driver `table` (a bad key is a usage error) and run it."""
    from trace_common.launch.demo import DemoConfig, run_demo

    try:
        cfg = DemoConfig.load(recipe, table=table, **options)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    run_demo(cfg)


@app.command()
def train(
    config: Annotated[Path, typer.Option(help="recipe file (TOML) of the run")],
    out: Annotated[
        Path | None, typer.Option(help="run directory (default: runs/<timestamp>)")
    ] = None,
    device: str | None = typer.Option(
        None, help="auto | cpu | cuda | cuda:N: trainer and replicas [the recipe's [train] device]"
    ),
    steps: int | None = typer.Option(None, min=1, help="RL steps [the recipe's]"),
    replicas: int | None = typer.Option(None, min=1, help="rollout replicas (processes) [2]"),
    seed: int | None = typer.Option(None, help="[the recipe's]"),
) -> None:
    """Train on a recipe with the user's model, tokenizer, dataset and reward: the local
    cluster of `demo` (Redis, quant-cache, weight-sync, trainer, replicas as processes), a
    warm start only when the recipe's [train] table asks for one."""
    if not config.is_file():
        raise typer.BadParameter(f"--config {config}: not a file")
    _play(config, "train", device=device, out=out, steps=steps, replicas=replicas, seed=seed)


@app.command()
def export(
    out: Annotated[Path, typer.Argument(help="output directory (must be empty or absent)")],
    checkpoint: Annotated[
        Path | None,
        typer.Option(help="trainer checkpoint: its directory (uses `latest`) or a step-N dir"),
    ] = None,
    model: str = typer.Option(
        "debug", help="the run's model.name: a named shape or an HF checkpoint directory"
    ),
    tokenizer: str = typer.Option("char", help="the run's task.tokenizer"),
    quant_sites: str = typer.Option(
        "default", help="the run's quant.sites: default or comma-separated sites"
    ),
    task: str = typer.Option("reverse", help="calibration prompts: the run's task"),
    difficulty: int = typer.Option(3, min=1, help="the run's task difficulty"),
    calib_samples: int = typer.Option(64, min=1, help="calibration sequences"),
    dtype: str = typer.Option("bfloat16", help="high-precision tensors: bfloat16 | float32"),
    master: bool = typer.Option(True, help="also write the master weights (OUT/master)"),
) -> None:
    """Write the FP4 policy as a ModelOpt NVFP4 checkpoint (OUT/nvfp4: vLLM's modelopt_fp4
    loads it) and its master weights as a plain Hugging Face Qwen3-MoE checkpoint (OUT/master)."""
    import torch

    from trace_common.export_job import ExportConfig, run_export
    from trace_common.model import QuantConfig

    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    try:
        if dtype not in dtypes:
            raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(dtypes)}")
        sites = [s.strip() for s in quant_sites.split(",") if s.strip()]
        quant = QuantConfig() if quant_sites == "default" else QuantConfig(sites=frozenset(sites))
        cfg = ExportConfig(
            out=out, model=model, checkpoint=checkpoint, tokenizer=tokenizer, quant=quant,
            task=task, difficulty=difficulty, calib_samples=calib_samples, dtype=dtypes[dtype],
            master=master,
        )  # fmt: skip
        written = run_export(cfg)
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from None
    for name, path in written.items():
        typer.echo(f"{name}: {path}")


@app.command("numerics-demo")
def numerics_demo() -> None:
    """The FP4 numerics demonstration: rollout-guided rounding against plain round-to-nearest
    on perturbed activations."""
    from trace_common.fp4.demo import run_demo

    run_demo()


# Service name -> module whose `main()` runs it (`python -m <module>` does the same).
SERVICES: dict[str, str] = {
    "quant-cache": "services.quant_cache.__main__",
    "weight-sync": "services.weight_sync.__main__",
    "rollout": "services.rollout.__main__",
    "trainer": "services.trainer.__main__",
}


@app.command()
def serve(
    name: str = typer.Argument(..., help="service to run: " + ", ".join(SERVICES)),
    config: Annotated[
        Path | None,
        typer.Option(help="trainer: the run's recipe file (TOML; sets TRACE_RECIPE)"),
    ] = None,
) -> None:
    """Run one TRACE service in the foreground (wiring from TRACE_* environment variables;
    the trainer's run from a recipe)."""
    import importlib
    import os

    from trace_common.config import RECIPE_ENV

    if name not in SERVICES:
        raise typer.BadParameter(f"unknown service {name!r}; choose from {sorted(SERVICES)}")
    if config is not None:
        if name != "trainer":
            raise typer.BadParameter(
                f"--config is the trainer's run recipe; {name} has no run settings"
            )
        if not config.is_file():
            raise typer.BadParameter(f"--config {config}: not a file")
        os.environ[RECIPE_ENV] = str(config)
    importlib.import_module(SERVICES[name]).main()


@app.command()
def version() -> None:
    """Print the installed version."""
    from importlib.metadata import version as _version

    typer.echo(_version("trace-rl"))


if __name__ == "__main__":
    app()
