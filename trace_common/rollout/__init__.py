"""The rollout side of TRACE: the engine interface and its engines, the version holder, and
the conversion between the rollout proto and these types.

Engines (`make_engine_factory` picks one from `EngineSettings`; `select.ENGINES` lists them):
  native  the policy's PyTorch model (`trace_common.rollout.native`): any device, any shape;
          the reference
  cuda    the CUDA-graph decode engine (`trace_common.rollout.cuda`): continuous batching of
          fixed-size decode steps, FP4 or BF16, records captured inside the step
  vllm    vLLM with TRACE's FP4 numerics (`trace_common.rollout.vllm_engine`)

Importing this package needs neither a GPU nor Triton.
"""

from __future__ import annotations

from trace_common.rollout.engine import (
    Completion,
    EngineFactory,
    EngineHolder,
    PutRecord,
    ReplicaBehind,
    RolloutEngine,
    RolloutRequest,
    run_request,
)
from trace_common.rollout.types import (
    FINISH_LENGTH,
    FINISH_STOP,
    FinishReason,
    GeneratedSample,
    SamplingConfig,
)

__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "Completion",
    "EngineFactory",
    "EngineHolder",
    "FinishReason",
    "GeneratedSample",
    "PutRecord",
    "ReplicaBehind",
    "RolloutEngine",
    "RolloutRequest",
    "SamplingConfig",
    "run_request",
]
