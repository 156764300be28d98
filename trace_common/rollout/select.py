"""Choosing and building a replica's rollout engine from its settings.

`ENGINES` is the one table of the values `TRACE_ROLLOUT_ENGINE` takes: each entry says what it
runs and how it is built. A new engine is its module plus one entry here; the settings
(`services/rollout/config.py`) and the demo (`trace_common/launch/demo.py`) check their
choice against it (`check_engine`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trace_common.kernels.settings import KernelSettings
from trace_common.rollout.engine import EngineFactory, RolloutEngine

log = logging.getLogger(__name__)

NATIVE_DTYPES = ("auto", "float32", "bfloat16")


@dataclass(kw_only=True, slots=True, frozen=True)
class EngineSettings:
    """What a replica's engine is built from."""

    engine: str = "auto"  # a name in ENGINES
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    max_batch: int = 64  # CUDA engine: sequences decoded together (one graph of this batch)
    max_context: int = 4096  # CUDA engine: prompt + completion tokens one sequence may hold
    native_dtype: str = "auto"  # PyTorch engine: non-FP4 compute dtype (auto: bf16 on CUDA)
    kernels: KernelSettings | None = None  # CUDA engine: kernel launch shapes (None: built-in)

    def __post_init__(self) -> None:
        check_engine(self.engine)
        if ENGINES[self.engine].needs_cuda and self.device.type != "cuda":
            raise ValueError(
                f"TRACE_ROLLOUT_ENGINE={self.engine} needs a CUDA device, got {self.device}"
            )
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
    loads later versions into it where its entry `reloads`, or builds a new one per version."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.engine: RolloutEngine | None = None
        self.name = settings.engine
        self.fallback_reason: str | None = None
        self._lock = threading.Lock()

    def __call__(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                 version: int) -> RolloutEngine:  # fmt: skip
        with self._lock:
            if self.engine is not None and ENGINES[self.engine.name].reloads:
                return self.engine.load_version(tensors, metadata, version)  # type: ignore[attr-defined]
            engine = ENGINES[self.settings.engine].build(self, tensors, metadata, version)
            self.engine, self.name = engine, engine.name
            return engine

    def fall_back(self, reason: str) -> None:
        """Log, once per distinct reason, why `auto` builds the PyTorch engine on CUDA."""
        if reason != self.fallback_reason:
            log.warning("the CUDA engine does not serve this policy; using the PyTorch "
                        "engine on %s: %s", self.settings.device, reason)  # fmt: skip
        self.fallback_reason = reason


Weights = dict[str, torch.Tensor]
Builder = Callable[[EngineSelector, Weights, dict[str, str], int], RolloutEngine]


@dataclass(frozen=True, slots=True)
class EngineEntry:
    """One value of TRACE_ROLLOUT_ENGINE.

    name:       the value, and the `name` of the engines it builds (but `auto`)
    summary:    what it runs (the settings' description)
    build:      (selector, weights, metadata, version) -> the engine for the first version
    reloads:    later versions load into the built engine (`load_version`) instead of a new
                engine being built for each
    needs_cuda: settings naming it on a device other than CUDA are refused
    """

    name: str
    summary: str
    build: Builder
    reloads: bool = False
    needs_cuda: bool = False


def _build_native(sel: EngineSelector, tensors: Weights, metadata: dict[str, str],
                  version: int) -> RolloutEngine:  # fmt: skip
    from trace_common.rollout.native import NativeEngine

    s = sel.settings
    return NativeEngine.from_weights(tensors, metadata, version, dtype=s.dtype(),
                                     device=s.device)  # fmt: skip


def _build_cuda(sel: EngineSelector, tensors: Weights, metadata: dict[str, str],
                version: int) -> RolloutEngine:  # fmt: skip
    """The CUDA engine; ValueError naming why where it does not serve the policy."""
    reason = _cuda_reason(metadata)
    if reason is not None:
        raise ValueError(f"TRACE_ROLLOUT_ENGINE=cuda: {reason}")
    return _cuda_engine(sel, tensors, metadata, version)


def _build_auto(sel: EngineSelector, tensors: Weights, metadata: dict[str, str],
                version: int) -> RolloutEngine:  # fmt: skip
    """The CUDA engine on a CUDA device where it serves the policy, else the PyTorch one."""
    if sel.settings.device.type == "cuda":
        reason = _cuda_reason(metadata)
        if reason is None:
            try:
                return _cuda_engine(sel, tensors, metadata, version)
            except (ValueError, ImportError, RuntimeError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
        sel.fall_back(reason)
    return _build_native(sel, tensors, metadata, version)


def _cuda_engine(sel: EngineSelector, tensors: Weights, metadata: dict[str, str],
                 version: int) -> RolloutEngine:  # fmt: skip
    from trace_common.rollout.cuda import CudaEngine

    s = sel.settings
    return CudaEngine(tensors, metadata, version, device=s.device, max_batch=s.max_batch,
                      max_context=s.max_context, kernels=s.kernels)  # fmt: skip


def _build_vllm(sel: EngineSelector, tensors: Weights, metadata: dict[str, str],
                version: int) -> RolloutEngine:  # fmt: skip
    from trace_common.rollout.vllm_engine import VllmEngine  # imports vllm lazily

    return VllmEngine(tensors, metadata, version)


def _cuda_reason(metadata: dict[str, str]) -> str | None:
    """Why the CUDA engine cannot serve this policy, or None where it can."""
    from trace_common.model.quant import policy_configs
    from trace_common.rollout.cuda import unsupported_reason
    from trace_common.rollout.meta import PolicyMeta

    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    cfg, quant = policy_configs(metadata)
    return unsupported_reason(cfg, quant, PolicyMeta.parse(metadata).guidance)


ENGINES: dict[str, EngineEntry] = {
    e.name: e
    for e in (
        EngineEntry("auto", "the CUDA engine on a CUDA device when it serves the policy, else "
                    "the PyTorch engine (the reason is logged once)", _build_auto),
        EngineEntry("native", "the PyTorch engine on the configured device", _build_native),
        EngineEntry("cuda", "the CUDA engine; a policy it cannot serve is an error naming why",
                    _build_cuda, reloads=True, needs_cuda=True),
        EngineEntry("vllm", "vLLM with TRACE's FP4 numerics and records "
                    "(`trace_common.rollout.vllm_engine`; needs vllm, docs/export.md)",
                    _build_vllm, reloads=True),
    )
}  # fmt: skip


def check_engine(name: str) -> str:
    """`name` if it is an entry of ENGINES, else ValueError naming it and the entries."""
    if name not in ENGINES:
        raise ValueError(f"rollout engine {name!r}; expected one of {tuple(ENGINES)}")
    return name


def engines_help() -> str:
    """The choices and what each runs, for a setting's description."""
    return "; ".join(f"{e.name}: {e.summary}" for e in ENGINES.values())


def make_engine_factory(settings: EngineSettings) -> EngineSelector:
    """The factory a replica hands its weight follower (`EngineFactory`)."""
    return EngineSelector(settings)


__all__ = ["ENGINES", "EngineEntry", "EngineFactory", "EngineSelector", "EngineSettings",
           "check_engine", "engines_help", "make_engine_factory"]  # fmt: skip
