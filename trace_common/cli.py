"""`trace-rl`: the project's command line (typer)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)


@app.command()
def demo(
    out: Annotated[
        Path | None, typer.Option(help="run directory (default: runs/<timestamp>)")
    ] = None,
    device: str = typer.Option(
        "cpu",
        help="auto | cpu | cuda | cuda:N: the warm start, trainer and replicas; a CUDA "
        "device selects the GPU recipe (mid-1b, addition of 4 digits, 100 steps), which the "
        "options below override",
    ),
    shape: str | None = typer.Option(None, help="named model shape: debug (CPU), mid-1b (GPU)"),
    mode: str = typer.Option("trace", help="bf16 | fp4 | rtn | trace"),
    steps: int | None = typer.Option(None, min=1, help="RL steps [CPU: 40]"),
    task: str | None = typer.Option(None, help="addition | sort | reverse | mixed [CPU: reverse]"),
    difficulty: int | None = typer.Option(
        None, min=1, help="digits (addition) or sequence length [CPU: 3]"
    ),
    replicas: int = typer.Option(2, min=1, help="rollout replicas (processes)"),
    prompts_per_step: int | None = typer.Option(None, min=1, help="[CPU: 16]"),
    group_size: int | None = typer.Option(
        None, min=2, help="completions per prompt (GRPO group) [CPU: 8]"
    ),
    lr: float | None = typer.Option(None, min=0.0, help="RL learning rate [CPU: 1e-3]"),
    warmstart_target: float | None = typer.Option(
        None, help="stop the warm start at this greedy accuracy [CPU: 0.3]"
    ),
    rollout_engine: str = typer.Option("auto", help="replicas' engine: auto | native | cuda"),
    rollout_dtype: str = typer.Option(
        "auto",
        help="PyTorch engine's compute dtype: auto (bf16 on CUDA, else float32) | "
        "float32 | bfloat16 (the trainer keeps fp32 master weights)",
    ),
    seed: int = typer.Option(0),
) -> None:
    """Run TRACE end to end on this machine: warm start, then RL of an MoE with a local
    Redis, quant-cache, weight-sync, the trainer and rollout replicas as processes."""
    from trace_common.rl.demo import DemoConfig, run_demo
    from trace_common.rl.types import TRAIN_MODES

    if mode not in TRAIN_MODES:
        raise typer.BadParameter(f"unknown mode {mode!r}; choose from {TRAIN_MODES}")
    try:
        cfg = DemoConfig.for_device(
            device, out=out, mode=mode, steps=steps, task=task, difficulty=difficulty,
            replicas=replicas, prompts_per_step=prompts_per_step, group_size=group_size, lr=lr,
            warmstart_target=warmstart_target, seed=seed, shape=shape,
            rollout_engine=rollout_engine, rollout_dtype=rollout_dtype,
        )  # fmt: skip
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    run_demo(cfg)


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
) -> None:
    """Run one TRACE service in the foreground (configured by TRACE_* environment variables)."""
    import importlib

    if name not in SERVICES:
        raise typer.BadParameter(f"unknown service {name!r}; choose from {sorted(SERVICES)}")
    importlib.import_module(SERVICES[name]).main()


@app.command()
def version() -> None:
    """Print the installed version."""
    from importlib.metadata import version as _version

    typer.echo(_version("trace-rl"))


if __name__ == "__main__":
    app()
