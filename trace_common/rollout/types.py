"""What a rollout engine takes and returns, independent of transport and of the RL loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trace_common.model.generate import MAX_STOP_TOKENS, SamplingConfig

FinishReason = Literal["stop", "length"]
FINISH_STOP: FinishReason = "stop"  # sampled EOS or a stop token (included in the output)
FINISH_LENGTH: FinishReason = "length"  # reached max_new_tokens


@dataclass(kw_only=True, slots=True)
class GeneratedSample:
    """One completion as an engine produced it."""

    prompt_index: int  # index into the prompts of the generate call
    group_index: int
    completion_tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    records: bytes | None = None  # serialized SampleRecords (when asked)
    policy_version: int = -1  # the version that generated it; -1: the caller's snapshot


__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "MAX_STOP_TOKENS",
    "FinishReason",
    "GeneratedSample",
    "SamplingConfig",
]
