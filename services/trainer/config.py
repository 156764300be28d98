"""trainer settings (environment `TRACE_*`, optional YAML via `TRACE_CONFIG_FILE`).

The settings here are the trainer's deployment wiring: the services it talks to, its device,
where checkpoints and metrics go. The run itself (model, quant, guidance, sampling,
objective, dispatch, checkpointing, stores) is `settings.run`, a `trace_common.config.RunConfig`
built from the recipe named by `TRACE_CONFIG` (`trace-rl serve trainer --config FILE`).
`python -m services.trainer` with `TRACE_WEIGHT_SYNC_ADDRESS`, `TRACE_QUANT_CACHE_ADDRESS` and
`TRACE_AUTH_TOKEN` set runs the defaults.
"""

from __future__ import annotations

import pathlib
from typing import Any, Literal

from pydantic import Field, InstanceOf, model_validator

from trace_common.config import RUN_ENV, RUN_KEYS_FLAT, RunConfig, load_run_config
from trace_common.device import DEVICE_HELP, DEVICE_RE
from trace_common.service import ServiceSettings


class TrainerSettings(ServiceSettings):
    grpc_port: int = Field(50054, ge=0, le=65535)
    http_port: int = Field(8054, ge=0, le=65535)
    weight_sync_address: str = Field(..., description="host:port of weight-sync (required)")
    quant_cache_address: str = Field(..., description="host:port of quant-cache (required)")
    quant_cache_data_path: Literal["auto", "direct", "grpc"] = Field(
        "auto",
        description="record bytes straight to/from Redis (direct, coordinates from quant-cache) "
        "or through quant-cache (grpc); auto = direct when Redis is reachable",
    )

    config: pathlib.Path | None = Field(
        None,
        description="the run's recipe (TOML, e.g. recipes/demo-cpu.toml): model, quant, "
        "guidance, sampling, objective, dispatch, checkpoint, stores (trace_common.config)",
    )
    run: InstanceOf[RunConfig] = Field(
        default_factory=lambda: load_run_config(env={}),
        description="the run (built by trace_common.config.load_run_config from the recipe, "
        "the run keys of the environment and the flat run keys given here)",
    )
    checkpoint_dir: pathlib.Path | None = Field(None, description="where checkpoints go")
    metrics_file: pathlib.Path | None = Field(None, description="metrics.jsonl path")
    generate_timeout_seconds: float = Field(300.0, gt=0)
    lost_records: Literal["regenerate", "unguided", "drop"] = Field(
        "regenerate",
        description="a group whose records are lost for good (a Redis restart, eviction): "
        "regenerate = generate its prompt again in the same step and train it guided (up to "
        "regenerate_attempts rounds, then dropped); unguided = train it without records "
        "(round-to-nearest QAT, own routing); drop = do not train it. Counted in "
        "samples_regenerated / samples_unguided / samples_dropped_records. A sharded "
        "(torchrun) trainer drops",
    )
    regenerate_attempts: int = Field(
        2, ge=1, description="lost_records=regenerate: rounds per step before a group is dropped"
    )
    torch_threads: int = Field(1, ge=1)
    device: str = Field("auto", pattern=DEVICE_RE.pattern, description=DEVICE_HELP)
    start_paused: bool = Field(False, description="restore/publish, then wait for Resume")
    record_audit_file: pathlib.Path | None = Field(
        None, description="append a sha256 line per record blob trained on (tests, debugging)"
    )

    @classmethod
    def env_names(cls) -> frozenset[str]:
        """The settings' variables and the run keys still read from the environment."""
        return super().env_names() | frozenset(RUN_ENV)

    @model_validator(mode="before")
    @classmethod
    def _build_run(cls, data: Any) -> Any:
        """The run tree from the recipe (`config`, TRACE_CONFIG), the environment's run keys
        and the flat run keys passed here (`steps=3`, as `TRACE_STEPS` names it)."""
        if not isinstance(data, dict) or data.get("run") is not None:
            return data
        data = dict(data)
        flat = {RUN_KEYS_FLAT[k]: data.pop(k) for k in list(data) if k in RUN_KEYS_FLAT}
        data["run"] = load_run_config(data.get("config") or None, overrides=flat)
        return data
