"""The rollout engine interface, the replica's version holder, and the one function that runs
a generate request on an engine and stores each completion's records.

An engine is bound to one policy version at a time. The PyTorch engine is rebuilt per version
and swapped in the holder; the CUDA engine keeps its buffers and CUDA graph and loads a new
version into them in place (see `trace_common.rollout.cuda`). Either way a request runs on
one version from start to end: the holder snapshot (PyTorch engine) or the engine's own
admission barrier (CUDA engine) guarantees it, and every completion reports its version.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from trace_common.rollout.types import GeneratedSample, SamplingConfig

log = logging.getLogger(__name__)


class ReplicaBehind(Exception):
    """The replica holds a policy older than the request's minimum version."""


class RolloutEngine(Protocol):
    """Generates groups of completions with the weights it holds. An engine that can stop
    early also takes `cancelled`, a callable that turns true when the caller has gone."""

    name: str

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        group_size: int,
        sampling: SamplingConfig,
        *,
        with_records: bool,
    ) -> list[GeneratedSample]: ...


# (pushed tensors, string metadata, version) -> the engine serving that version
EngineFactory = Callable[[dict[str, torch.Tensor], dict[str, str], int], RolloutEngine]


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


# (run_id, version, sample_id, blob) -> the record's write generation (b"" if the store has none)
PutRecord = Callable[[str, int, str, bytes], bytes | None]


@dataclass(kw_only=True, slots=True, frozen=True)
class RolloutRequest:
    """One generate request: prompts x group_size completions."""

    run_id: str
    prompts: list[tuple[int, ...]]
    group_size: int
    sampling: SamplingConfig
    sample_id_prefix: str
    min_policy_version: int = 0
    write_records: bool = False


@dataclass(kw_only=True, slots=True)
class Completion:
    """A generated sample with its id, version, and its stored record's size and write
    generation."""

    sample_id: str
    sample: GeneratedSample
    policy_version: int
    record_bytes: int
    record_generation: bytes = b""


class RecordRefused(RuntimeError):
    """The record store refused a record for good (full at its memory bound, or the record
    over its size limit). `run_request` returns the completion without it (record_bytes 0):
    the trainer finds the record missing and its lost-records setting takes over (regenerate,
    train unguided, or drop and count), instead of the whole request failing and being
    retried against a store that stays full."""


def run_request(
    engine: RolloutEngine,
    version: int,
    request: RolloutRequest,
    put_record: PutRecord | None,
    replica_id: str,
    *,
    cancelled: Callable[[], bool] | None = None,
) -> list[Completion]:
    """Run `request` on `engine` (held at `version`) and store each completion's records
    before returning it. Sample ids are ``<prefix>-<prompt_index>-<group_index>``.
    `cancelled` reaches engines that can stop early (`cancellable = True`)."""
    if version < request.min_policy_version:
        raise ReplicaBehind(
            f"replica {replica_id} holds version {version} < minimum {request.min_policy_version}"
        )
    if request.write_records and put_record is None:
        raise RuntimeError("records requested but this replica has no record store")
    extra = {} if cancelled is None or not getattr(engine, "cancellable", False) else {
        "cancelled": cancelled}  # fmt: skip
    gen = engine.generate(request.prompts, request.group_size, request.sampling,
                          with_records=request.write_records, **extra)  # fmt: skip
    out = []
    for g in gen:
        sid = f"{request.sample_id_prefix}-{g.prompt_index}-{g.group_index}"
        got = g.policy_version if g.policy_version >= 0 else version
        nbytes, generation = 0, b""
        if request.write_records:
            if g.records is None:
                raise RuntimeError(f"engine {engine.name} produced no records for {sid}")
            assert put_record is not None
            try:
                generation = put_record(request.run_id, got, sid, g.records) or b""
                nbytes = len(g.records)
            except RecordRefused as exc:
                log.warning("record of %s not stored: %s", sid, exc)
        out.append(Completion(sample_id=sid, sample=g, policy_version=got, record_bytes=nbytes,
                              record_generation=generation))  # fmt: skip
    return out


__all__ = [
    "Completion",
    "EngineFactory",
    "EngineHolder",
    "PutRecord",
    "RecordRefused",
    "ReplicaBehind",
    "RolloutEngine",
    "RolloutRequest",
    "run_request",
]
