"""Small fakes for orchestration tests: they record the order of events."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from trace_common.rl.dispatch import GenerateCall, ReplicaBehind, ReplicaUnavailable
from trace_common.rl.types import RolloutSample, TrainSample


class EventLog:
    def __init__(self) -> None:
        self.events: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, event: str) -> None:
        with self._lock:
            self.events.append(event)

    def kinds(self) -> list[str]:
        return [e.split()[0] for e in self.events]


class FakeReplica:
    """Answers a unit with completions that spell the answer for even group indices (reward 1)
    and a wrong answer for odd ones; writes a record blob per sample into ``store``."""

    def __init__(
        self,
        replica_id: str,
        *,
        version: int = 0,
        store: dict | None = None,
        fail_on_calls: Sequence[int] = (),
        behind_on_calls: Sequence[int] = (),
        answers: Mapping[int, list[int]] | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.version = version
        self.store = store if store is not None else {}
        self.fail_on_calls = set(fail_on_calls)
        self.behind_on_calls = set(behind_on_calls)
        self.answers = answers or {}
        self.calls = 0

    def generate(self, call: GenerateCall) -> list[RolloutSample]:
        self.calls += 1
        if self.calls in self.fail_on_calls:
            raise ReplicaUnavailable(f"{self.replica_id} crashed")
        if self.calls in self.behind_on_calls:
            raise ReplicaBehind(f"{self.replica_id} at version -1")
        out = []
        prefix = call.unit.sample_id_prefix(call.step)
        for pi, pid in enumerate(call.unit.prompt_ids):
            for j in range(call.group_size):
                right = self.answers.get(pid, [4, 2])
                toks = [*right, 2] if j % 2 == 0 else [5, 2]
                sid = f"{prefix}-{pi}-{j}"
                if call.write_records:
                    self.store[(call.run_id, self.version, sid)] = f"rec:{sid}".encode()
                out.append(
                    RolloutSample(
                        sample_id=sid,
                        prompt_id=pid,
                        group_index=j,
                        prompt_tokens=call.unit.prompt_tokens[pi],
                        completion_tokens=toks,
                        logprobs=[-0.5] * len(toks),
                        policy_version=self.version,
                        finish_reason="stop",
                        record_bytes=len(f"rec:{sid}") if call.write_records else 0,
                    )
                )
        return out


class FakeRecordStore:
    def __init__(self, store: dict, log: EventLog) -> None:
        self.store = store
        self.log = log

    def fetch(
        self,
        run_id: str,
        policy_version: int,
        sample_ids: Sequence[str],
        *,
        generations: Mapping[str, bytes] | None = None,
    ) -> dict[str, bytes]:
        self.log(f"fetch version={policy_version} n={len(sample_ids)}")
        return {s: self.store[(run_id, policy_version, s)] for s in sample_ids}


class FakeLearner:
    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.seen: list[list[TrainSample]] = []
        self.w = torch.zeros(2)

    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        self.log(f"learner.train n={len(samples)}")
        self.seen.append(list(samples))
        self.w += 1
        return {"loss": 0.25}

    def export_weights(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        self.log("learner.export")
        return {"w": self.w.clone()}, {"format": "fake"}


class FakePublisher:
    def __init__(self, log: EventLog, replicas: Sequence[FakeReplica] = ()) -> None:
        self.log = log
        self.replicas = list(replicas)
        self.pushed: list[tuple[int, dict]] = []

    def publish(
        self, version: int, tensors: Mapping[str, torch.Tensor], metadata: dict[str, Any]
    ) -> None:
        self.log(f"publish version={version}")
        self.pushed.append((version, dict(metadata)))
        for r in self.replicas:
            r.version = version
