"""RL objective pieces (GRPO, clipped ratio with truncated IS, staleness) and the trainer core."""

from __future__ import annotations

from trace_common.rl.objective import (
    DEFAULT_CLIP_EPS,
    DEFAULT_MAX_STALENESS,
    DEFAULT_TIS_CAP,
    PolicyLossOutput,
    StalenessResult,
    clipped_policy_loss,
    filter_stale,
    grpo_advantages,
)

__all__ = [
    "DEFAULT_CLIP_EPS",
    "DEFAULT_MAX_STALENESS",
    "DEFAULT_TIS_CAP",
    "PolicyLossOutput",
    "StalenessResult",
    "clipped_policy_loss",
    "filter_stale",
    "grpo_advantages",
]
