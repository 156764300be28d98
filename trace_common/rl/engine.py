"""The rollout engine interface, the atomic version holder, and the one function that turns
an engine's output into samples + stored records (used by the rollout service and by the
in-process replica alike).

An engine object is bound to one policy version's weights. Swapping versions means replacing
the engine reference in :class:`EngineHolder`; a request takes one ``(engine, version)``
snapshot at its start and uses it to the end, so no sample is produced by a mix of versions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from trace_common.rl.dispatch import GenerateCall, ReplicaBehind
from trace_common.rl.types import FinishReason, RolloutSample, SamplingConfig


@dataclass(kw_only=True, slots=True)
class GeneratedSample:
    """One completion as an engine produced it."""

    prompt_index: int  # index into the prompts of the generate call
    group_index: int
    completion_tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    records: bytes | None = None  # serialized guidance + routing records (when asked)


class RolloutEngine(Protocol):
    """Generates groups of completions with one fixed set of weights."""

    name: str

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        group_size: int,
        sampling: SamplingConfig,
        *,
        with_records: bool,
    ) -> list[GeneratedSample]: ...


class EngineHolder:
    """The current ``(engine, version)`` of a replica; swapped atomically between requests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engine: RolloutEngine | None = None
        self._version = -1

    def swap(self, engine: RolloutEngine, version: int) -> None:
        if version <= self._version:
            raise ValueError(f"version {version} is not newer than the held {self._version}")
        with self._lock:
            self._engine, self._version = engine, version

    def snapshot(self) -> tuple[RolloutEngine | None, int]:
        with self._lock:
            return self._engine, self._version

    @property
    def version(self) -> int:
        return self._version


PutRecord = Callable[[str, int, str, bytes], None]  # (run_id, version, sample_id, blob)


def generate_unit(
    engine: RolloutEngine,
    version: int,
    call: GenerateCall,
    put_record: PutRecord | None,
    replica_id: str,
) -> list[RolloutSample]:
    """Run one work unit on ``engine`` (held at ``version``) and store each sample's records.

    Sample ids are ``<prefix>-<prompt_index>-<j>`` with the unit's prefix, as the rollout
    proto specifies.
    """
    if version < call.min_policy_version:
        raise ReplicaBehind(
            f"replica {replica_id} holds version {version} < minimum {call.min_policy_version}"
        )
    unit = call.unit
    prefix = call.prefix()
    gen = engine.generate(
        unit.prompt_tokens, call.group_size, call.sampling, with_records=call.write_records
    )
    out = []
    for g in gen:
        sid = f"{prefix}-{g.prompt_index}-{g.group_index}"
        nbytes = 0
        if call.write_records:
            if g.records is None:
                raise RuntimeError(f"engine {engine.name} produced no records for {sid}")
            if put_record is None:
                raise RuntimeError("records requested but this replica has no record store")
            put_record(call.run_id, version, sid, g.records)
            nbytes = len(g.records)
        out.append(
            RolloutSample(
                sample_id=sid,
                prompt_id=unit.prompt_ids[g.prompt_index],
                group_index=g.group_index,
                prompt_tokens=tuple(unit.prompt_tokens[g.prompt_index]),
                completion_tokens=list(g.completion_tokens),
                logprobs=list(g.logprobs),
                policy_version=version,
                finish_reason=g.finish_reason,
                record_bytes=nbytes,
                replica_id=replica_id,
            )
        )
    return out


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
