"""`trace-rl`: the project's command line (typer)."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)


@app.command()
def demo() -> None:
    """Run the project's main job on this machine.

    Until the RL loop lands this runs the FP4 numerics demonstration: rollout-guided
    rounding against plain round-to-nearest on perturbed activations.
    """
    from trace_common.fp4.demo import run_demo

    run_demo()


# Service name -> module whose `main()` runs it (`python -m <module>` does the same).
SERVICES: dict[str, str] = {
    "quant-cache": "services.quant_cache.__main__",
    "weight-sync": "services.weight_sync.__main__",
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
