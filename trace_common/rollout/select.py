"""Choosing and building a replica's rollout engine from its settings.

`TRACE_ROLLOUT_ENGINE`:
  auto    the CUDA engine on a CUDA device when it serves the policy, else the PyTorch engine
          (the reason is logged once)
  native  the PyTorch engine on the configured device
  cuda    the CUDA engine; a policy it cannot serve is an error naming why
  vllm    vLLM with TRACE's FP4 numerics (`trace_common.rollout.vllm_engine`); later versions
          load into the running engine
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Literal

import torch

from trace_common.kernels.settings import KernelSettings
from trace_common.rollout.engine import EngineFactory, RolloutEngine

log = logging.getLogger(__name__)

ENGINE_CHOICES = ("auto", "native", "cuda", "vllm")
EngineChoice = Literal["auto", "native", "cuda", "vllm"]
NATIVE_DTYPES = ("auto", "float32", "bfloat16")


@dataclass(kw_only=True, slots=True, frozen=True)
class EngineSettings:
    """What a replica's engine is built from."""

    engine: EngineChoice = "auto"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    max_batch: int = 64  # CUDA engine: sequences decoded together (one graph of this batch)
    max_context: int = 4096  # CUDA engine: prompt + completion tokens one sequence may hold
    native_dtype: str = "auto"  # PyTorch engine: non-FP4 compute dtype (auto: bf16 on CUDA)
    kernels: KernelSettings | None = None  # CUDA engine: kernel launch shapes (None: built-in)

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_CHOICES:
            raise ValueError(f"rollout engine {self.engine!r}; expected one of {ENGINE_CHOICES}")
        if self.engine == "cuda" and self.device.type != "cuda":
            raise ValueError(f"TRACE_ROLLOUT_ENGINE=cuda needs a CUDA device, got {self.device}")
        if self.native_dtype not in NATIVE_DTYPES:
            raise ValueError(f"native dtype {self.native_dtype!r}; expected one of {NATIVE_DTYPES}")
        from trace_common.kernels.moe import MAX_FUSED_ROUTE_TOKENS

        if not 1 <= self.max_batch <= MAX_FUSED_ROUTE_TOKENS:
            raise ValueError(f"max_batch={self.max_batch}: the CUDA engine decodes 1.."
                             f"{MAX_FUSED_ROUTE_TOKENS} sequences per step")  # fmt: skip
        if self.max_context < 2:
            raise ValueError(f"max_context={self.max_context} must be >= 2")

    def dtype(self) -> torch.dtype:
        if self.native_dtype == "auto":
            return torch.bfloat16 if self.device.type == "cuda" else torch.float32
        return getattr(torch, self.native_dtype)


class EngineSelector:
    """The replica's `EngineFactory`: builds the chosen engine for the first version, then
    loads later versions into the CUDA or vLLM engine in place, or builds a new PyTorch engine."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.engine: RolloutEngine | None = None
        self.name = "native" if settings.engine == "native" else settings.engine
        self.fallback_reason: str | None = None
        self._lock = threading.Lock()

    def __call__(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                 version: int) -> RolloutEngine:  # fmt: skip
        with self._lock:
            from trace_common.rollout.cuda import CudaEngine
            from trace_common.rollout.vllm_engine import VllmEngine  # imports vllm lazily

            if isinstance(self.engine, (CudaEngine, VllmEngine)):
                return self.engine.load_version(tensors, metadata, version)
            engine = self._build(tensors, metadata, version)
            self.engine, self.name = engine, engine.name
            return engine

    def _build(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
               version: int) -> RolloutEngine:  # fmt: skip
        s = self.settings
        if s.engine == "vllm":
            from trace_common.rollout.vllm_engine import VllmEngine

            return VllmEngine(tensors, metadata, version)
        if s.engine == "cuda" or (s.engine == "auto" and s.device.type == "cuda"):
            reason = self._cuda_reason(metadata)
            if reason is None:
                from trace_common.rollout.cuda import CudaEngine

                try:
                    return CudaEngine(tensors, metadata, version, device=s.device,
                                      max_batch=s.max_batch, max_context=s.max_context,
                                      kernels=s.kernels)  # fmt: skip
                except (ValueError, ImportError, RuntimeError) as exc:
                    if s.engine == "cuda":
                        raise
                    reason = f"{type(exc).__name__}: {exc}"
            elif s.engine == "cuda":
                raise ValueError(f"TRACE_ROLLOUT_ENGINE=cuda: {reason}")
            if reason != self.fallback_reason:
                log.warning("the CUDA engine does not serve this policy; using the PyTorch "
                            "engine on %s: %s", s.device, reason)  # fmt: skip
            self.fallback_reason = reason
        from trace_common.rollout.native import NativeEngine

        return NativeEngine.from_weights(tensors, metadata, version, dtype=s.dtype(),
                                         device=s.device)  # fmt: skip

    @staticmethod
    def _cuda_reason(metadata: dict[str, str]) -> str | None:
        from trace_common.model.quant import policy_configs
        from trace_common.rollout.cuda import unsupported_reason
        from trace_common.rollout.meta import PolicyMeta

        try:
            import triton  # noqa: F401
        except ImportError:
            return "Triton is not installed"
        cfg, quant = policy_configs(metadata)
        return unsupported_reason(cfg, quant, PolicyMeta.parse(metadata).guidance)


def make_engine_factory(settings: EngineSettings) -> EngineSelector:
    """The factory a replica hands its weight follower (`EngineFactory`)."""
    return EngineSelector(settings)


__all__ = ["ENGINE_CHOICES", "EngineFactory", "EngineSelector", "EngineSettings",
           "make_engine_factory"]  # fmt: skip
