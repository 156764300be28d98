"""trainer settings (environment `TRACE_*`, optional YAML via `TRACE_CONFIG_FILE`).

One settings object describes a run: the services it talks to, the task, the model, the RL
loop and the checkpointing. `python -m services.trainer` with `TRACE_WEIGHT_SYNC_ADDRESS`,
`TRACE_QUANT_CACHE_ADDRESS` and `TRACE_AUTH_TOKEN` set runs the defaults.
"""

from __future__ import annotations

import pathlib
from typing import Literal

from pydantic import Field, model_validator

from trace_common.device import DEVICE_HELP, DEVICE_RE
from trace_common.model import GuidanceConfig, QuantConfig
from trace_common.rl.objective import DEFAULT_CLIP_EPS, DEFAULT_MAX_STALENESS, DEFAULT_TIS_CAP
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

    run_id: str = Field("trace-run", pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    mode: Literal["bf16", "fp4", "rtn", "trace"] = Field("trace", description="training mode")
    steps: int = Field(50, ge=1, description="RL steps of the run")
    prompts_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=2, description="completions per prompt (GRPO group)")
    prompts_per_unit: int = Field(4, ge=1, description="prompts per rollout generate call")
    max_staleness: int = Field(DEFAULT_MAX_STALENESS, ge=0, description="max version gap")
    tis_cap: float = Field(DEFAULT_TIS_CAP, gt=0, description="truncated IS weight cap")
    clip_eps: float = Field(DEFAULT_CLIP_EPS, gt=0, lt=1)
    lr: float = Field(1e-3, gt=0)
    minibatches: int = Field(2, ge=1, description="optimizer steps per RL step")
    temperature: float = Field(1.0, gt=0, description="rollout sampling temperature")
    max_new_tokens: int = Field(0, ge=0, description="0 = the task's answer length + 1")
    seed: int = Field(0)

    task: Literal["addition", "sort", "reverse", "mixed"] = "addition"
    task_difficulty: int = Field(1, ge=1, description="digits (addition) or length")
    tokenizer: str = Field("char", description='"char" or a Hugging Face tokenizer directory')
    model: str = Field("debug", description="named shape (debug, ...) or an HF checkpoint dir")
    init_weights: pathlib.Path | None = Field(
        None, description="safetensors of master weights to start from (e.g. a warm start)"
    )
    quant_format: Literal["nvfp4", "mxfp4"] = "nvfp4"
    quant_sites: str = Field(
        "default",
        description='FP4 sites: "default" (routed experts W4A4 + KV, the paper\'s setting), '
        '"all" (every site the model has) or comma-separated site names (README table)',
    )
    guidance_layers: str = Field(
        "deeper-half", description='"deeper-half", "all", or comma-separated layer ids'
    )
    guidance_sites: str = Field(
        "default", description='"default" (moe_in,k,v) or comma-separated guidable site names'
    )
    guidance_mode: Literal["compact", "full"] = "compact"
    routing_replay: bool = True
    measure_records: bool = Field(
        False, description="non-trace modes: rollouts record guidance too, to measure D_act"
    )

    checkpoint_dir: pathlib.Path | None = Field(None, description="where checkpoints go")
    checkpoint_every: int = Field(10, ge=1)
    resume: bool = Field(True, description="continue from checkpoint_dir/latest if present")
    checkpoint_export: bool = Field(
        False,
        description="also write <checkpoint>/export/{nvfp4,master}: the policy as a ModelOpt "
        "NVFP4 and a plain HF checkpoint, calibrated on the task (docs/export.md)",
    )
    metrics_file: pathlib.Path | None = Field(None, description="metrics.jsonl path")
    replica_wait_seconds: float = Field(120.0, gt=0, description="give up without replicas")
    generate_timeout_seconds: float = Field(300.0, gt=0)
    store_retry_seconds: float = Field(
        60.0,
        ge=0,
        description="how long an unavailable store (weight-sync restarting, a Redis blip) is "
        "retried, with backoff, before the run fails",
    )
    max_dropped_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="the run fails (state failed, /healthz 503) once more than this fraction "
        "of the samples received so far were dropped untrained (records lost, too stale)",
    )
    torch_threads: int = Field(1, ge=1)
    device: str = Field("auto", pattern=DEVICE_RE.pattern, description=DEVICE_HELP)
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="autocast dtype of the train step (auto: bfloat16 on CUDA, float32 on the "
        "CPU); master weights, gradients and AdamW state stay float32",
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each decoder layer in the backward (less memory)"
    )
    start_paused: bool = Field(False, description="restore/publish, then wait for Resume")
    record_audit_file: pathlib.Path | None = Field(
        None, description="append a sha256 line per record blob trained on (tests, debugging)"
    )

    @model_validator(mode="after")
    def _check_guidance(self) -> TrainerSettings:
        g = self.guidance_layers
        if g not in ("deeper-half", "all"):
            try:
                [int(x) for x in g.split(",")]
            except ValueError:
                raise ValueError(
                    f"TRACE_GUIDANCE_LAYERS={g!r}: expected deeper-half, all or e.g. 2,3"
                ) from None
        # Site names are checked here so a typo stops the trainer at start-up, naming it.
        if self.quant_sites not in ("default", "all"):
            try:
                QuantConfig(sites=site_names(self.quant_sites), format=self.quant_format)
            except ValueError as e:
                raise ValueError(f"TRACE_QUANT_SITES={self.quant_sites!r}: {e}") from None
        if self.guidance_sites != "default":
            try:
                GuidanceConfig(sites=tuple(site_names(self.guidance_sites)))
            except ValueError as e:
                raise ValueError(f"TRACE_GUIDANCE_SITES={self.guidance_sites!r}: {e}") from None
        return self


def site_names(csv: str) -> list[str]:
    """Comma-separated names as a list (blanks dropped)."""
    return [x.strip() for x in csv.split(",") if x.strip()]
