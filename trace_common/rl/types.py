"""Data that flows through one RL step, independent of transport (in-process or gRPC)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trace_common.rollout.types import FinishReason

# The training modes (docs/design.md, "Training modes"): the type, and MODES below.
TrainMode = Literal["bf16", "fp4", "rtn", "trace"]


@dataclass(frozen=True, slots=True)
class ModeSpec:
    """What a training mode does. The learner and the trainer ask this, never the mode's
    name: a new mode is one entry of MODES (and its name in TrainMode)."""

    name: str
    summary: str
    fp4_policy: bool  # the rollout serves the FP4 policy (else high precision on both sides)
    qat: Literal["none", "rtn", "trace"]  # the trainer's forward (model.runtime's QatMode):
    # none = the high-precision weights, rtn = fake-quantized to nearest with its own scales,
    # trace = rounded toward the rollout's records
    guided: bool  # the records steer training: every sample needs them (or is trained unguided)
    replays_routing: bool  # the trainer replays the rollout's expert choices (routing_replay)

    def wants_records(self, measure: bool) -> bool:
        """Whether the learner reads records: to steer (guided), or only to measure the
        rollout/trainer mismatch of an FP4 policy (`measure`)."""
        return self.guided or (measure and self.fp4_policy)


_SPECS = (
    ModeSpec(name="bf16", summary="high-precision rollout and trainer (no quantization)",
             fp4_policy=False, qat="none", guided=False, replays_routing=False),
    ModeSpec(name="fp4", summary="FP4 rollout, high-precision trainer without QAT",
             fp4_policy=True, qat="none", guided=False, replays_routing=False),
    ModeSpec(name="rtn", summary="FP4 rollout, vanilla QAT (the trainer rounds to nearest "
             "with its own scales)", fp4_policy=True, qat="rtn", guided=False,
             replays_routing=False),
    ModeSpec(name="trace", summary="FP4 rollout with records, rollout-guided QAT with "
             "routing replay", fp4_policy=True, qat="trace", guided=True,
             replays_routing=True),
)  # fmt: skip
MODES: dict[str, ModeSpec] = {m.name: m for m in _SPECS}
TRAIN_MODES: tuple[str, ...] = tuple(MODES)


def mode_spec(mode: str) -> ModeSpec:
    """The spec of `mode`; ValueError naming it and the modes for an unknown one."""
    try:
        return MODES[mode]
    except KeyError:
        raise ValueError(f"unknown training mode {mode!r}; expected one of {TRAIN_MODES}") from None


@dataclass(kw_only=True, slots=True)
class WorkUnit:
    """A chunk of prompts sent to one replica in one generate call.

    ``attempt`` grows each time the unit is re-dispatched after a failure, and is part of every
    sample id, so records of an abandoned attempt can never be mistaken for the accepted ones.
    """

    unit_id: int
    prompt_ids: list[int]  # stream positions of the prompts
    prompt_tokens: list[tuple[int, ...]]  # token ids of each prompt (BOS first)
    attempt: int = 0

    def sample_id_prefix(self, step: int) -> str:
        return f"s{step}-u{self.unit_id}-a{self.attempt}"


@dataclass(kw_only=True, slots=True)
class RolloutSample:
    """One completion as returned by a rollout replica."""

    sample_id: str
    prompt_id: int  # stream position of its prompt
    group_index: int  # index within the prompt's group
    prompt_tokens: tuple[int, ...]
    completion_tokens: list[int]
    logprobs: list[float]  # rollout log-prob of each completion token
    policy_version: int
    finish_reason: FinishReason
    record_bytes: int = 0
    # The stored record's write generation (empty: the store does not report one); the
    # trainer reads the record expecting it, so a replayed older write is refused.
    record_generation: bytes = b""
    replica_id: str = ""


@dataclass(kw_only=True, slots=True)
class TrainSample:
    """A scored sample ready for the train step."""

    rollout: RolloutSample
    reward: float
    advantage: float
    records: bytes | None = None  # this sample's SampleRecords blob (trace mode)
    # Its records were lost and the run trains such samples anyway (lost_records=unguided):
    # trace mode trains it with round-to-nearest QAT and the model's own routing.
    unguided: bool = False
    staleness: int = 0  # trainer version - the version that generated the sample


@dataclass(kw_only=True, slots=True)
class DispatchStats:
    """What one dispatch round cost, per replica."""

    tokens_per_replica: dict[str, int] = field(default_factory=dict)
    seconds_per_replica: dict[str, float] = field(default_factory=dict)
    redispatched_units: int = 0
    failed_replicas: list[str] = field(default_factory=list)

    def tokens_per_second(self) -> dict[str, float]:
        return {
            r: self.tokens_per_replica[r] / max(self.seconds_per_replica.get(r, 0.0), 1e-9)
            for r in self.tokens_per_replica
        }
