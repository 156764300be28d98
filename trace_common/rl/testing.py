"""Train samples from a real rollout engine, for tests and benchmarks of the learner: the
policy's own completions, log-probs and records, with rewards and advantages given."""

from __future__ import annotations

from collections.abc import Sequence

from trace_common.rl.types import RolloutSample, TrainSample
from trace_common.rollout.engine import RolloutEngine
from trace_common.rollout.types import SamplingConfig


def engine_train_samples(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    group_size: int,
    sampling: SamplingConfig,
    *,
    advantages: Sequence[float],
    rewards: Sequence[float] = (0.0,),
) -> list[TrainSample]:
    """`group_size` completions per prompt (with records) as TrainSamples `s0`, `s1`, ...;
    sample i gets advantages[i % len] and rewards[i % len], policy version 0."""
    out = engine.generate(prompts, group_size, sampling, with_records=True)
    samples = []
    for i, g in enumerate(out):
        rollout = RolloutSample(
            sample_id=f"s{i}", prompt_id=g.prompt_index, group_index=g.group_index,
            prompt_tokens=tuple(prompts[g.prompt_index]),
            completion_tokens=list(g.completion_tokens), logprobs=list(g.logprobs),
            policy_version=0, finish_reason=g.finish_reason,
        )  # fmt: skip
        samples.append(TrainSample(
            rollout=rollout, reward=rewards[i % len(rewards)],
            advantage=advantages[i % len(advantages)], records=g.records,
        ))  # fmt: skip
    return samples
