"""trace.rollout.v1 messages <-> the rollout types, used by the rollout service and by its
clients (the trainer), so each conversion is written once."""

from __future__ import annotations

from trace_common.protos_gen.trace.rollout.v1 import rollout_pb2
from trace_common.rollout.engine import Completion
from trace_common.rollout.types import FinishReason, SamplingConfig

FINISH_TO_PROTO: dict[str, int] = {
    "stop": rollout_pb2.FINISH_REASON_STOP,
    "length": rollout_pb2.FINISH_REASON_LENGTH,
}
FINISH_FROM_PROTO: dict[int, FinishReason] = {
    rollout_pb2.FINISH_REASON_STOP: "stop",
    rollout_pb2.FINISH_REASON_LENGTH: "length",
}


def sampling_to_proto(sp: SamplingConfig) -> rollout_pb2.SamplingParams:
    return rollout_pb2.SamplingParams(
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        max_new_tokens=sp.max_new_tokens,
        stop_token_ids=list(sp.stop_token_ids),
        seed=sp.seed,
    )


def sampling_from_proto(p: rollout_pb2.SamplingParams) -> SamplingConfig:
    """Proto -> typed config. An unset top_p (0) means 1. A bad value raises ValueError
    naming it (the service answers INVALID_ARGUMENT)."""
    return SamplingConfig(
        temperature=p.temperature,
        top_p=p.top_p if p.top_p else 1.0,
        top_k=p.top_k,
        max_new_tokens=p.max_new_tokens,
        seed=p.seed,
        stop_token_ids=tuple(p.stop_token_ids),
    )


def completion_to_proto(c: Completion) -> rollout_pb2.Completion:
    s = c.sample
    return rollout_pb2.Completion(
        sample_id=c.sample_id,
        prompt_index=s.prompt_index,
        group_index=s.group_index,
        token_ids=s.completion_tokens,
        logprobs=s.logprobs,
        policy_version=c.policy_version,
        finish_reason=FINISH_TO_PROTO[s.finish_reason],
        record_bytes=c.record_bytes,
        record_generation=c.record_generation,
    )


def finish_from_proto(value: int) -> FinishReason:
    """A completion's finish reason; ValueError for one the proto does not define."""
    try:
        return FINISH_FROM_PROTO[value]
    except KeyError:
        raise ValueError(f"finish_reason={value} is not STOP or LENGTH") from None
