"""Rewards: named functions of (dataset row, completion text) -> float, run in a pool of
worker processes beside the trainer (`RewardPool`). Built in: exact_match, math, code; a
custom reward is `module:function`."""

from __future__ import annotations

from trace_common.rewards.pool import RewardOutcome, RewardPool, RewardPoolConfig
from trace_common.rewards.registry import (
    BUILTIN_REWARDS,
    Reward,
    RewardError,
    import_reward,
    load_reward,
)

__all__ = [
    "BUILTIN_REWARDS",
    "Reward",
    "RewardError",
    "RewardOutcome",
    "RewardPool",
    "RewardPoolConfig",
    "import_reward",
    "load_reward",
]
