"""Dispatch prompt groups across the live rollout replicas.

Prompts are cut into work units; each idle live replica takes the next unit, so a faster
replica takes more (load balancing by pull). A unit is accepted only when a replica returns
*all* of its completions, validated; if the replica fails (connection lost, crash, bad
answer) the whole unit goes back to the queue with ``attempt + 1`` (its sample ids change with
the attempt), so no sample is lost and none is counted twice. A replica that is behind the
minimum policy version gets the unit back in the queue and is retried shortly.

The transport is behind :class:`Replica`: an in-process engine in tests and the demo's
unit tests, a gRPC client in the trainer service.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

from trace_common.rl.types import DispatchStats, RolloutSample, WorkUnit
from trace_common.rollout.engine import ReplicaBehind
from trace_common.rollout.types import SamplingConfig
from trace_common.tasks.prompts import Prompt

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2  # how often the dispatcher re-reads the replica directory while waiting


class ReplicaUnavailable(Exception):
    """The replica failed this call (gone, crashed, answered nonsense); re-dispatch its unit."""


@dataclass(frozen=True, slots=True)
class GenerateCall:
    """Everything a replica needs for one work unit."""

    run_id: str
    step: int
    unit: WorkUnit
    group_size: int
    sampling: SamplingConfig
    min_policy_version: int
    write_records: bool
    sample_id_prefix: str = ""  # "" -> derived from step, unit and attempt

    def prefix(self) -> str:
        return self.sample_id_prefix or self.unit.sample_id_prefix(self.step)


def unit_seed(base_seed: int, step: int, unit_id: int, attempt: int) -> int:
    """Sampling seed of one generate call: differs per step, unit and attempt (uint64)."""
    return (base_seed * 1_000_003 + step * 10_007 + unit_id * 101 + attempt) % (1 << 63)


class Replica(Protocol):
    """A rollout replica as the dispatcher sees it."""

    @property
    def replica_id(self) -> str: ...

    def generate(self, call: GenerateCall) -> list[RolloutSample]: ...


class ReplicaDirectory(Protocol):
    """Which replicas are alive now (weight-sync's registry, or a fixed list)."""

    def replicas(self) -> Sequence[Replica]: ...


class StaticDirectory:
    """A fixed list of replicas (in-process runs and tests)."""

    def __init__(self, replicas: Sequence[Replica]) -> None:
        self._replicas = list(replicas)

    def replicas(self) -> Sequence[Replica]:
        return list(self._replicas)


@dataclass(kw_only=True, slots=True)
class DispatchConfig:
    """How prompts are spread over replicas."""

    prompts_per_unit: int = 4  # prompts per generate call; smaller = finer load balancing
    wait_for_replicas_s: float = 60.0  # give up when no replica is usable for this long
    retry_failed_after_s: float = 2.0  # a failed replica rests this long, doubling per failure
    max_retry_after_s: float = 60.0  # cap of that doubling
    max_attempts: int = 20  # a unit failing this many times aborts the step
    abandon_grace_s: float = 1.0  # in-flight work of a replica no longer listed is re-queued

    def __post_init__(self) -> None:
        if self.prompts_per_unit < 1:
            raise ValueError(f"prompts_per_unit must be >= 1, got {self.prompts_per_unit}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")


def validate_unit_result(call: GenerateCall, samples: Sequence[RolloutSample]) -> None:
    """Raise :class:`ReplicaUnavailable` unless ``samples`` is exactly the unit's groups."""
    unit = call.unit
    expected = {(pid, j) for pid in unit.prompt_ids for j in range(call.group_size)}
    got = [(s.prompt_id, s.group_index) for s in samples]
    if len(got) != len(set(got)) or set(got) != expected:
        raise ReplicaUnavailable(
            f"unit {unit.unit_id} attempt {unit.attempt}: expected {len(expected)} completions "
            f"(prompts {unit.prompt_ids} x {call.group_size}), got {sorted(got)}"
        )
    prefix = call.prefix()
    for s in samples:
        if not s.sample_id.startswith(prefix + "-"):
            raise ReplicaUnavailable(f"sample id {s.sample_id!r} does not carry prefix {prefix!r}")
        if s.policy_version < call.min_policy_version:
            raise ReplicaUnavailable(
                f"sample {s.sample_id} has version {s.policy_version} < minimum "
                f"{call.min_policy_version}"
            )
        if len(s.logprobs) != len(s.completion_tokens):
            raise ReplicaUnavailable(
                f"sample {s.sample_id}: {len(s.logprobs)} logprobs for "
                f"{len(s.completion_tokens)} tokens"
            )


class Dispatcher:
    """Runs one step's prompts on the live replicas; returns every completion exactly once."""

    def __init__(
        self,
        directory: ReplicaDirectory,
        config: DispatchConfig | None = None,
        *,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.directory = directory
        self.config = config or DispatchConfig()
        self._on_event = on_event or (lambda _e: None)
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="dispatch")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def make_units(self, prompts: Sequence[Prompt], first_unit_id: int = 0) -> list[WorkUnit]:
        n = self.config.prompts_per_unit
        return [
            WorkUnit(
                unit_id=first_unit_id + i // n,
                prompt_ids=[p.prompt_id for p in prompts[i : i + n]],
                prompt_tokens=[p.token_ids for p in prompts[i : i + n]],
            )
            for i in range(0, len(prompts), n)
        ]

    def run(
        self,
        prompts: Sequence[Prompt],
        *,
        run_id: str,
        step: int,
        group_size: int,
        sampling: SamplingConfig,
        min_policy_version: int,
        write_records: bool,
        first_unit_id: int = 0,
        on_unit: Callable[[list[RolloutSample]], None] | None = None,
    ) -> tuple[list[RolloutSample], DispatchStats]:
        """Every completion of ``prompts`` exactly once. Units are numbered from
        ``first_unit_id``: a second round in the same step (regenerating groups whose records
        were lost) starts past the first round's units, so its sample ids and seeds differ.
        ``on_unit`` is called with each unit's samples once they are accepted (each exactly
        once), so the caller can start scoring them while the rest are generated."""
        cfg = self.config
        pending = collections.deque(self.make_units(prompts, first_unit_id))
        done: dict[int, list[RolloutSample]] = {}
        inflight: dict[Future[list[RolloutSample]], tuple[str, GenerateCall, float]] = {}
        failed_at: dict[str, float] = {}  # replica -> when it may be used again
        failures: dict[str, int] = {}  # consecutive failures per replica
        stats = DispatchStats()
        n_units = len(pending)
        idle_since = time.monotonic()

        def call_for(unit: WorkUnit) -> GenerateCall:
            return GenerateCall(
                run_id=run_id,
                step=step,
                unit=unit,
                group_size=group_size,
                sampling=dataclasses.replace(
                    sampling, seed=unit_seed(sampling.seed, step, unit.unit_id, unit.attempt)
                ),
                min_policy_version=min_policy_version,
                write_records=write_records,
            )

        def fail(rid: str, unit: WorkUnit, reason: object) -> None:
            """Replica ``rid`` lost ``unit``: rest the replica, queue the unit's next attempt."""
            log.warning("replica %s failed unit %d: %s", rid, unit.unit_id, reason)
            self._on_event(f"failed unit={unit.unit_id} attempt={unit.attempt} replica={rid}")
            failures[rid] = failures.get(rid, 0) + 1
            rest = cfg.retry_failed_after_s * 2 ** (failures[rid] - 1)
            failed_at[rid] = time.monotonic() + min(rest, cfg.max_retry_after_s)
            if rid not in stats.failed_replicas:
                stats.failed_replicas.append(rid)
            stats.redispatched_units += 1
            retry = dataclasses.replace(unit, attempt=unit.attempt + 1)  # new sample ids
            if retry.attempt >= cfg.max_attempts:
                raise RuntimeError(
                    f"work unit {unit.unit_id} failed {retry.attempt} times; last: {reason}"
                )
            pending.appendleft(retry)

        while len(done) < n_units:
            now = time.monotonic()
            listed = list(self.directory.replicas())
            live = {r.replica_id for r in listed}
            # A replica the directory no longer lists (heartbeats stopped: hung or gone) loses
            # its in-flight unit; whatever it answers later is ignored.
            for fut, (rid, call, t0) in list(inflight.items()):
                if rid not in live and now - t0 > cfg.abandon_grace_s:
                    del inflight[fut]
                    fail(rid, call.unit, "replica no longer listed as alive")
            busy = {rid for rid, _, _ in inflight.values()}
            usable = [
                r
                for r in listed
                if r.replica_id not in busy and now >= failed_at.get(r.replica_id, -1e18)
            ]
            for replica in usable:
                if not pending:
                    break
                unit = pending.popleft()
                call = call_for(unit)
                self._on_event(
                    f"dispatch unit={unit.unit_id} attempt={unit.attempt} to={replica.replica_id}"
                )
                fut = self._pool.submit(replica.generate, call)
                inflight[fut] = (replica.replica_id, call, time.monotonic())
            if not inflight:
                if now - idle_since > cfg.wait_for_replicas_s:
                    raise RuntimeError(
                        f"no usable rollout replica for {cfg.wait_for_replicas_s:.0f}s with "
                        f"{len(pending)} work unit(s) left (failed: {sorted(failures)})"
                    )
                time.sleep(POLL_SECONDS)
                continue
            idle_since = time.monotonic()
            finished, _ = wait(list(inflight), timeout=POLL_SECONDS, return_when=FIRST_COMPLETED)
            for fut in finished:
                rid, call, t0 = inflight.pop(fut)
                unit = call.unit
                try:
                    samples = fut.result()
                    validate_unit_result(call, samples)
                except ReplicaBehind as exc:
                    log.info("replica %s behind: %s", rid, exc)
                    self._on_event(f"behind unit={unit.unit_id} replica={rid}")
                    failed_at[rid] = time.monotonic() + POLL_SECONDS
                    pending.appendleft(unit)  # nothing was generated: same attempt
                    continue
                except Exception as exc:  # any failure of the replica: re-dispatch the unit
                    fail(rid, unit, exc)
                    continue
                failures.pop(rid, None)
                for s in samples:
                    s.replica_id = s.replica_id or rid
                done[unit.unit_id] = samples
                self._on_event(f"done unit={unit.unit_id} replica={rid}")
                if on_unit is not None:
                    on_unit(samples)
                stats.tokens_per_replica[rid] = stats.tokens_per_replica.get(rid, 0) + sum(
                    len(s.completion_tokens) for s in samples
                )
                stats.seconds_per_replica[rid] = stats.seconds_per_replica.get(rid, 0.0) + (
                    time.monotonic() - t0
                )
        out = [s for uid in sorted(done) for s in done[uid]]
        out.sort(key=lambda s: (s.prompt_id, s.group_index))
        return out, stats
