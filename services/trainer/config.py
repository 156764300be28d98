"""trainer settings (environment `TRACE_*`, optional YAML via `TRACE_CONFIG_FILE`).

The settings here are the trainer's deployment wiring: the services it talks to, its device,
where checkpoints and metrics go. The run itself (model, quant, guidance, sampling,
objective, dispatch, checkpointing, stores) is `settings.run`, a `trace_common.config.RunConfig`
built from the recipe named by `TRACE_RECIPE` (`trace-rl serve trainer --config FILE`) and,
in code, the overrides passed as `run=`. An environment variable that names a run key stops
start-up, naming it and the recipe key (`check_no_run_env`). `python -m services.trainer` with
`TRACE_WEIGHT_SYNC_ADDRESS`, `TRACE_QUANT_CACHE_ADDRESS` and `TRACE_AUTH_TOKEN` set runs the
defaults.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, InstanceOf, model_validator

from trace_common.config import (
    RunConfig,
    check_no_run_env,
    load_run_config,
    run_env_names,
)
from trace_common.device import DEVICE_HELP, DEVICE_RE
from trace_common.service.config import StoreClientSettings


class TrainerSettings(StoreClientSettings):
    grpc_port: int = Field(50054, ge=0, le=65535)
    http_port: int = Field(8054, ge=0, le=65535)
    weight_deltas: bool = Field(
        True,
        description="push each policy version as a delta against the one pushed before it "
        "(keeps one host copy of the policy); the full version when weight-sync lacks that one",
    )
    export_hp_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="dtype of the policy's high-precision weights in each pushed version; "
        "auto: bfloat16 on a CUDA trainer (what the CUDA rollout engines compute in: the same "
        "bits in half the bytes), float32 on the CPU",
    )
    cuda_ipc: bool = Field(
        True,
        description="on a CUDA trainer, offer each version over CUDA IPC before pushing it: "
        "replicas on this node copy it GPU to GPU (two more policy copies stay on the GPU)",
    )
    broadcast: Literal["auto", "off", "nccl", "gloo"] = Field(
        "auto",
        description="broadcast each version, before pushing it, to the replicas on other "
        "nodes that join (their TRACE_BROADCAST): nccl GPU to GPU, gloo from host memory; "
        "auto: nccl on a CUDA trainer, off on the CPU",
    )
    broadcast_host: str = Field(
        "127.0.0.1",
        min_length=1,
        max_length=255,
        description="the host replicas reach this trainer's broadcast store at (its pod IP "
        "or DNS name in a cluster)",
    )
    broadcast_port: int = Field(
        29510, ge=0, le=65535, description="the broadcast store's TCP port (0: any free port)"
    )
    broadcast_timeout_seconds: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="how long a broadcast waits for its group to form and its bytes to "
        "arrive before the members fall back to pulling",
    )

    recipe: pathlib.Path | None = Field(
        None,
        description="the run's recipe (TOML, e.g. recipes/deploy.toml): model, quant, "
        "guidance, sampling, objective, dispatch, checkpoint, stores (trace_common.config)",
    )
    run: InstanceOf[RunConfig] = Field(
        default_factory=load_run_config,
        description="the run, built by trace_common.config.load_run_config from the recipe; "
        "in code, `run=` takes a RunConfig or dotted/nested keys overriding the recipe's",
    )
    checkpoint_dir: pathlib.Path | None = Field(None, description="where checkpoints go")
    data_root: pathlib.Path | None = Field(
        None,
        description="the directory that relative paths of the run (dataset splits, a tokenizer "
        "or model directory) resolve against; default: the working directory",
    )
    # Wiring, not the run: what this start does with what it finds in checkpoint_dir (the same
    # recipe resumed or not is the same run; a restarted pod or container resumes).
    resume: bool = Field(True, description="continue from <checkpoint_dir>/latest if present")
    metrics_file: pathlib.Path | None = Field(None, description="metrics.jsonl path")
    generate_timeout_seconds: float = Field(300.0, gt=0)
    torch_threads: int = Field(1, ge=1)
    device: str = Field("auto", pattern=DEVICE_RE.pattern, description=DEVICE_HELP)
    start_paused: bool = Field(False, description="restore/publish, then wait for Resume")
    record_audit_file: pathlib.Path | None = Field(
        None, description="append a sha256 line per record blob trained on (tests, debugging)"
    )

    @classmethod
    def env_names(cls) -> frozenset[str]:
        """The settings' variables; `run` is built from the recipe, never read as TRACE_RUN."""
        return super().env_names() - {"TRACE_RUN"}

    @model_validator(mode="before")
    @classmethod
    def _build_run(cls, data: Any) -> Any:
        """The run tree from the recipe (`recipe`, TRACE_RECIPE) and the overrides given as
        `run=` (a RunConfig as it is); run keys in the environment or among the settings (a
        YAML file of TRACE_CONFIG_FILE) are refused, naming them."""
        if not isinstance(data, dict):
            return data
        check_no_run_env(os.environ, settings=cls.env_names())
        stray = sorted(
            f"{k} (put `{run_env_names()[name]} = ...` in the recipe)"
            for k in data
            if (name := f"TRACE_{str(k).upper()}") in run_env_names()
            and name not in cls.env_names()
        )
        if stray:
            raise ValueError(f"run keys are set in the recipe, not as settings: {'; '.join(stray)}")
        run = data.get("run")
        if isinstance(run, RunConfig):
            return data
        if run is not None and not isinstance(run, Mapping):
            raise ValueError(f"run={run!r}: the run comes from the recipe (TRACE_RECIPE)")
        return {**data, "run": load_run_config(data.get("recipe") or None, overrides=run)}
