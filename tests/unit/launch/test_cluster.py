"""LocalCluster hands the trainer its run as a recipe file (TRACE_RECIPE), as a deployment
does, and keeps run keys out of the processes' environment."""

from __future__ import annotations

import pathlib
from typing import Any, ClassVar

import pytest

from trace_common.config import ConfigError, load_run_config
from trace_common.launch import cluster as cluster_mod
from trace_common.launch.cluster import ClusterConfig, LocalCluster


class FakeService:
    """Records what the cluster would start."""

    started: ClassVar[list[FakeService]] = []

    def __init__(self, name: str, module: str, env: dict[str, str], log_dir: pathlib.Path,
                 argv: Any = None) -> None:  # fmt: skip
        self.name, self.env = name, env
        self.grpc_address = "127.0.0.1:1"
        FakeService.started.append(self)

    def launch(self) -> FakeService:
        return self

    def wait_ports(self) -> FakeService:
        return self


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path):
    monkeypatch.setattr(cluster_mod, "LocalService", FakeService)
    FakeService.started = []

    def make(cfg: ClusterConfig) -> LocalCluster:
        c = LocalCluster(cfg, tmp_path / "logs")
        c.quant_cache = c.weight_sync = FakeService("store", "", {}, tmp_path)  # type: ignore[assignment]
        return c

    return make


def test_recipe_keys_reach_the_trainer_as_its_recipe(cluster) -> None:
    c = cluster(
        ClusterConfig(
            run={"steps": 3, "task.name": "reverse", "objective": {"lr": 1e-4}},
            trainer_env={"TRACE_DEVICE": "cpu"},
        )
    )
    trainer = c.start_trainer(run={"steps": 5, "guidance.layers": "all"})
    env = trainer.env  # type: ignore[attr-defined]
    assert env["TRACE_DEVICE"] == "cpu" and "TRACE_STEPS" not in env
    run = load_run_config(env["TRACE_RECIPE"])  # what the trainer reads
    assert (run.steps, run.task.name, run.objective.lr, run.guidance.layers) == (
        5, "reverse", 1e-4, "all",
    )  # fmt: skip
    # a restart gets its own recipe; the configured run is unchanged
    again = load_run_config(c.start_trainer().env["TRACE_RECIPE"])  # type: ignore[attr-defined]
    assert (again.steps, again.guidance.layers) == (3, "deeper-half")


def test_run_keys_in_the_environment_or_bad_keys_are_refused_before_anything_starts(
    cluster,
) -> None:
    with pytest.raises(ConfigError, match=r"TRACE_STEPS \(put `steps = ...` in the recipe\)"):
        ClusterConfig(trainer_env={"TRACE_STEPS": "3"})
    with pytest.raises(ConfigError, match=r"unknown key task\.nme"):
        ClusterConfig(run={"task.nme": "reverse"})
    c = cluster(ClusterConfig())
    with pytest.raises(ConfigError, match="TRACE_GUIDANCE_MODE"):
        c.start_trainer(env={"TRACE_GUIDANCE_MODE": "full"})
    assert FakeService.started[-1].name == "store"  # no trainer was started
