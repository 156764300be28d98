"""rollout settings (environment `TRACE_*`, optional YAML via `TRACE_CONFIG_FILE`)."""

from __future__ import annotations

import os
import pathlib
import socket
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from trace_common.device import DEVICE_HELP, DEVICE_RE
from trace_common.kernels.settings import KernelSettings
from trace_common.rollout.select import check_engine, engines_help
from trace_common.service.config import ENV_PREFIX, StoreClientSettings


class RolloutSettings(StoreClientSettings):
    grpc_port: int = Field(50053, ge=0, le=65535)
    http_port: int = Field(8053, ge=0, le=65535)
    weight_sync_data_path: Literal["auto", "direct", "grpc"] = Field(
        "auto",
        description="policy pulls over weight-sync's bulk data plane (direct: ticket over gRPC, "
        "bytes over TCP/TLS) or its PullVersion stream (grpc); auto = direct when offered and "
        "reachable",
    )
    weight_deltas: bool = Field(
        True,
        description="keep the version last pulled (one host copy of the policy) and pull the "
        "next one as a delta against it: only the changed codes, scales and values travel",
    )
    cuda_ipc: bool = Field(
        True,
        description="on a CUDA replica, load a version the trainer offers over CUDA IPC on "
        "this node GPU to GPU (else, or when that fails, pull it over the network)",
    )
    broadcast: Literal["auto", "off", "nccl", "gloo"] = Field(
        "auto",
        description="join the trainer's broadcasts of new versions (weight-sync forms the "
        "groups): nccl GPU to GPU (a CUDA replica), gloo into host memory; auto: nccl on a "
        "CUDA replica, off on the CPU. A replica on the trainer's node loads over CUDA IPC",
    )
    replica_id: str = Field(
        default_factory=lambda: f"rollout-{socket.gethostname()}-{os.getpid()}",
        description="this replica's id in weight-sync's registry",
    )
    advertise_host: str = Field(
        "127.0.0.1", description="host other services use to reach this replica's gRPC port"
    )
    heartbeat_interval_seconds: float = Field(1.0, gt=0)
    rollout_engine: str = Field("auto", description=engines_help())
    device: str = Field("auto", pattern=DEVICE_RE.pattern, description=DEVICE_HELP)
    rollout_max_batch: int = Field(
        64, ge=1, le=256, description="CUDA engine: sequences decoded together per step"
    )
    rollout_max_context: int = Field(
        4096, ge=2, description="CUDA engine: prompt + completion tokens per sequence"
    )
    kernel_small_launch: dict[str, int] = Field(
        default_factory=dict,
        description="CUDA engine: small-batch kernel launch shapes, JSON such as "
        '{"qkv": 8, "RING_STAGES": 3} (keys: trace_common/kernels/settings.py); empty: built-in',
    )
    kernel_expert_gemm_configs: pathlib.Path | None = Field(
        None,
        description="CUDA engine: JSON file of FP4 expert GEMM launch configurations "
        "(bench/experiments/rollout_gpu_kernels.py --cuda-sweep writes them); unset: built-in",
    )
    kernel_attn_config: tuple[str, int, int, int] | None = Field(
        None,
        description='CUDA engine: FP4 attention launch configuration, JSON such as ["ring", 4, '
        "4, 4] (warps per CTA, CTAs per SM, ring stages); unset: built-in",
    )
    torch_threads: int = Field(1, ge=1, description="intra-op CPU threads of the PyTorch engine")
    engine_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="PyTorch engine's dtype for non-FP4 parts (auto: bf16 on CUDA, else fp32)",
    )
    record_audit_file: pathlib.Path | None = Field(
        None, description="append a sha256 line per record blob written (tests, debugging)"
    )

    @field_validator("rollout_engine")
    @classmethod
    def _check_engine(cls, value: str) -> str:
        return check_engine(value)

    @model_validator(mode="after")
    def _check_kernels(self) -> RolloutSettings:
        """A bad launch shape or a missing file stops start-up, naming its variable
        (`kernel_<field>` is `KernelSettings.<field>`)."""
        for field, value in self._kernel_fields().items():
            try:
                KernelSettings(**{field: value})
            except ValueError as exc:
                raise ValueError(f"{ENV_PREFIX}KERNEL_{field.upper()}: {exc}") from None
        return self

    def _kernel_fields(self) -> dict[str, Any]:
        return {
            "small_launch": dict(self.kernel_small_launch),
            "expert_gemm_configs": self.kernel_expert_gemm_configs,
            "attn_config": self.kernel_attn_config,
        }

    def kernels(self) -> KernelSettings:
        """The CUDA engine's launch settings."""
        return KernelSettings(**self._kernel_fields())
