"""The RL loop's side of the rollout engine: a work unit run on an engine as `RolloutSample`s
(`generate_unit`), and the in-process replica the dispatcher drives in tests and benchmarks.
The engine interface itself lives in `trace_common.rollout`."""

from __future__ import annotations

from trace_common.rl.dispatch import GenerateCall
from trace_common.rl.types import RolloutSample
from trace_common.rollout.engine import (
    EngineHolder,
    PutRecord,
    ReplicaBehind,
    RolloutEngine,
    RolloutRequest,
    run_request,
)


def generate_unit(
    engine: RolloutEngine,
    version: int,
    call: GenerateCall,
    put_record: PutRecord | None,
    replica_id: str,
) -> list[RolloutSample]:
    """Run one work unit on ``engine`` (held at ``version``) and store each sample's records."""
    unit = call.unit
    request = RolloutRequest(
        run_id=call.run_id,
        prompts=[tuple(p) for p in unit.prompt_tokens],
        group_size=call.group_size,
        sampling=call.sampling,
        sample_id_prefix=call.prefix(),
        min_policy_version=call.min_policy_version,
        write_records=call.write_records,
    )
    return [
        RolloutSample(
            sample_id=c.sample_id,
            prompt_id=unit.prompt_ids[c.sample.prompt_index],
            group_index=c.sample.group_index,
            prompt_tokens=tuple(unit.prompt_tokens[c.sample.prompt_index]),
            completion_tokens=list(c.sample.completion_tokens),
            logprobs=list(c.sample.logprobs),
            policy_version=c.policy_version,
            finish_reason=c.sample.finish_reason,
            record_bytes=c.record_bytes,
            record_generation=c.record_generation,
            replica_id=replica_id,
        )
        for c in run_request(engine, version, request, put_record, replica_id)
    ]


class LocalReplica:
    """An in-process replica: an engine holder plus a record sink (the dispatcher's Replica)."""

    def __init__(self, replica_id: str, holder: EngineHolder, put_record: PutRecord | None) -> None:
        self._replica_id = replica_id
        self.holder = holder
        self.put_record = put_record

    @property
    def replica_id(self) -> str:
        return self._replica_id

    def generate(self, call: GenerateCall) -> list[RolloutSample]:
        engine, version = self.holder.snapshot()
        if engine is None:
            raise ReplicaBehind(f"replica {self._replica_id} has no weights yet")
        return generate_unit(engine, version, call, self.put_record, self._replica_id)
