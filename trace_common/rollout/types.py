"""What a rollout engine takes and returns, independent of transport and of the RL loop."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length"]
FINISH_STOP: FinishReason = "stop"  # sampled EOS or a stop token (included in the output)
FINISH_LENGTH: FinishReason = "length"  # reached max_new_tokens
MAX_STOP_TOKENS = 64  # stop token ids one request may name


@dataclass(kw_only=True, slots=True, frozen=True)
class SamplingConfig:
    """Sampling parameters of one generate call (the same for every sequence of the call)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 disables nucleus sampling
    top_k: int = 0  # 0 disables top-k
    max_new_tokens: int = 8
    seed: int = 0  # base seed; each sequence derives its own from it and its index
    stop_token_ids: tuple[int, ...] = ()  # besides the policy's EOS

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        stops = tuple(int(t) for t in self.stop_token_ids)
        if len(stops) > MAX_STOP_TOKENS:
            raise ValueError(f"{len(stops)} stop_token_ids > max {MAX_STOP_TOKENS}")
        bad = [t for t in stops if t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be >= 0, got {bad[:5]}")
        object.__setattr__(self, "stop_token_ids", stops)


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
