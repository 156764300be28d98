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
    mode: str = typer.Option("trace", help="bf16 | fp4 | rtn | trace"),
    steps: int = typer.Option(40, min=1, help="RL steps"),
    task: str = typer.Option("reverse", help="addition | sort | reverse | mixed"),
    difficulty: int = typer.Option(3, min=1, help="digits (addition) or sequence length"),
    replicas: int = typer.Option(2, min=1, help="rollout replicas (processes)"),
    prompts_per_step: int = typer.Option(16, min=1),
    group_size: int = typer.Option(8, min=2, help="completions per prompt (GRPO group)"),
    lr: float = typer.Option(1e-3, min=0.0),
    warmstart_target: float = typer.Option(0.3, help="stop the warm start at this greedy accuracy"),
    rollout_dtype: str = typer.Option(
        "float32", help="rollout engine compute dtype: float32 | bfloat16 (trainer: float32)"
    ),
    seed: int = typer.Option(0),
) -> None:
    """Run TRACE end to end on this machine: warm start, then RL of the tiny MoE with a local
    Redis, quant-cache, weight-sync, the trainer and rollout replicas as processes."""
    from trace_common.rl.demo import DemoConfig, run_demo
    from trace_common.rl.types import TRAIN_MODES

    if mode not in TRAIN_MODES:
        raise typer.BadParameter(f"unknown mode {mode!r}; choose from {TRAIN_MODES}")
    if rollout_dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter(f"unknown rollout dtype {rollout_dtype!r}: float32 | bfloat16")
    run_demo(
        DemoConfig(
            out=out, mode=mode, steps=steps, task=task, difficulty=difficulty, replicas=replicas,
            prompts_per_step=prompts_per_step, group_size=group_size, lr=lr,
            warmstart_target=warmstart_target, seed=seed, rollout_dtype=rollout_dtype,
        )
    )  # fmt: skip


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
