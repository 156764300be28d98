"""The trainer's step loop, independent of transport: prompts -> rollout -> score -> records
-> train -> quantize + push.

Overlapped push (`TrainerConfig.overlap_push`, with max_staleness >= 1): the step quantizes
and exports the new version (the weights are copied out, so training may go on), then pushes
it on a background thread while the next step rolls out and trains; that step's rollout
samples the versions the staleness bound allows, as it would while replicas pull. Pushes run
one at a time in version order: the next publish, a checkpoint and the end of the run wait for
the one in flight, and a push that failed for good fails the step that finds it.

Every component is an interface so the loop can run in-process (tests, fakes that record the
order of events) or against the real services (the trainer service wires gRPC clients in).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from trace_common.rewards.pool import RewardOutcome, RewardPool
from trace_common.rl.dispatch import Dispatcher
from trace_common.rl.objective import (
    DEFAULT_MAX_STALENESS,
    filter_stale,
    grpo_advantages,
)
from trace_common.rl.types import DispatchStats, RolloutSample, TrainSample, mode_spec
from trace_common.rollout.types import SamplingConfig
from trace_common.tasks.prompts import Prompt, PromptStream
from trace_common.tasks.tasks import completion_text
from trace_common.tasks.tokenizer import Tokenizer

if TYPE_CHECKING:
    from trace_common.data.prompts import DatasetPrompts
from trace_common.tasks.tasks import Problem

log = logging.getLogger(__name__)


class RecordStore(Protocol):
    """Where the rollout's per-sample record blobs are read back (quant-cache)."""

    def fetch(
        self,
        run_id: str,
        policy_version: int,
        sample_ids: Sequence[str],
        *,
        generations: Mapping[str, bytes] | None = None,
    ) -> dict[str, bytes]:
        """Blobs of the requested samples that exist and verify; missing or corrupt ones are
        left out (the caller drops their groups). `generations`: the write generation each
        record must carry (`expected_generations`), where the rollout reported one."""
        ...


def expected_generations(samples: Sequence[TrainSample]) -> dict[str, bytes]:
    """The write generation each sample's record was stored under, as its rollout reported."""
    return {
        ts.rollout.sample_id: ts.rollout.record_generation
        for ts in samples
        if ts.rollout.record_generation
    }


class WeightPublisher(Protocol):
    """Where a new policy version goes (weight-sync)."""

    def publish(
        self, version: int, tensors: Mapping[str, torch.Tensor], metadata: dict[str, Any]
    ) -> None: ...


class Learner(Protocol):
    """Master weights + optimizer: one RL update, and the quantized export of the policy."""

    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]: ...

    def export_weights(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]: ...


class Scorer(Protocol):
    """Scores a completion of a problem; `submit` returns at once and the reward runs
    elsewhere (`trace_common.rewards.RewardPool`), so a step scores each work unit's samples
    while the rest are still being generated."""

    def submit(self, sample: RolloutSample, problem: Problem) -> Future[RewardOutcome]: ...


class FunctionScorer:
    """A plain function ``(sample, problem) -> float`` as a Scorer, run in the caller's thread
    (tests, benches); an exception scores 0 with status "error"."""

    def __init__(self, fn: Callable[[RolloutSample, Problem], float]) -> None:
        self.fn = fn

    def submit(self, sample: RolloutSample, problem: Problem) -> Future[RewardOutcome]:
        fut: Future[RewardOutcome] = Future()
        try:
            fut.set_result(RewardOutcome(float(self.fn(sample, problem))))
        except Exception as e:
            fut.set_result(RewardOutcome(0.0, "error", f"{type(e).__name__}: {e}"))
        return fut


class RewardScorer:
    """The run's reward on a pool of workers: a completion's text (before EOS) and its
    prompt's row go to `pool`; a completion cut off without EOS scores 0 at once with status
    "truncated" (`truncated="zero"`) or is scored like the others (`"score"`)."""

    def __init__(self, pool: RewardPool, tokenizer: Tokenizer, *, truncated: str = "zero") -> None:
        if truncated not in ("zero", "score"):
            raise ValueError(f"truncated={truncated!r}: expected 'zero' or 'score'")
        self.pool = pool
        self.tokenizer = tokenizer
        self.truncated = truncated

    def submit(self, sample: RolloutSample, problem: Problem) -> Future[RewardOutcome]:
        text = completion_text(sample.completion_tokens, self.tokenizer)
        if text is None:
            if self.truncated == "zero":
                fut: Future[RewardOutcome] = Future()
                fut.set_result(RewardOutcome(0.0, "truncated"))
                return fut
            text = self.tokenizer.decode(sample.completion_tokens)
        return self.pool.submit(problem.row, text)


def as_scorer(scorer: Scorer | Callable[[RolloutSample, Problem], float]) -> Scorer:
    return scorer if hasattr(scorer, "submit") else FunctionScorer(scorer)  # type: ignore[arg-type]


@dataclass(kw_only=True, slots=True)
class ScoreTally:
    """What became of one step's reward calls (the statuses of RewardOutcome)."""

    errors: int = 0
    timeouts: int = 0
    truncated: int = 0

    def add(self, outcome: RewardOutcome) -> None:
        if outcome.status == "error":
            self.errors += 1
        elif outcome.status == "timeout":
            self.timeouts += 1
        elif outcome.status == "truncated":
            self.truncated += 1


# Held-out evaluation's work units are numbered from here, so their sample ids never meet a
# training unit's of the same step.
EVAL_FIRST_UNIT = 1_000_000

# What happens to a group whose records are lost for good (a Redis restart, eviction at the
# memory bound, a refused record), in the setting TrainerConfig.lost_records:
#   regenerate  its prompt is generated again in the same step, up to regenerate_attempts
#               times, and the new group is trained guided; still lost after that: dropped
#   unguided    trained without records: round-to-nearest QAT, no routing replay (rtn)
#   drop        dropped untrained
LOST_RECORDS = ("regenerate", "unguided", "drop")


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """One RL run's loop parameters."""

    run_id: str = "run"
    steps: int = 10
    prompts_per_step: int = 8
    group_size: int = 4  # completions per prompt (GRPO group)
    mode: str = "trace"  # bf16 | fp4 | rtn | trace
    max_staleness: int = DEFAULT_MAX_STALENESS  # samples older than this many versions are dropped
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    measure_records: bool = False  # rollouts write records in every mode (for D_act metrics)
    lost_records: str = "regenerate"  # groups whose records are lost: LOST_RECORDS
    regenerate_attempts: int = 2  # regenerate: rounds per step before a lost group is dropped
    overlap_push: bool = False  # push in the background during the next step (max_staleness >= 1)

    def __post_init__(self) -> None:
        mode_spec(self.mode)  # ValueError for an unknown mode
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 for GRPO, got {self.group_size}")
        if self.prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.lost_records not in LOST_RECORDS:
            raise ValueError(
                f"unknown lost_records {self.lost_records!r}; expected one of {LOST_RECORDS}"
            )
        if self.regenerate_attempts < 1:
            raise ValueError(f"regenerate_attempts must be >= 1, got {self.regenerate_attempts}")

    @property
    def pushes_in_background(self) -> bool:
        """With max_staleness 0 the next step needs the new version on the replicas before
        it can roll out, so there is nothing to overlap: the push runs in the step."""
        return self.overlap_push and self.max_staleness >= 1

    @property
    def writes_records(self) -> bool:
        """A guided mode consumes guidance and routing records; other modes only measure."""
        return mode_spec(self.mode).guided or self.measure_records


class TrainerCore:
    """Owns the step counter and policy version; runs one RL step per :meth:`step` call."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        prompts: PromptStream | DatasetPrompts,
        dispatcher: Dispatcher,
        scorer: Scorer | Callable[[RolloutSample, Problem], float],
        records: RecordStore,
        learner: Learner,
        publisher: WeightPublisher,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.prompts = prompts
        self.dispatcher = dispatcher
        self.scorer = as_scorer(scorer)
        self.records = records
        self.learner = learner
        self.publisher = publisher
        self.step_index = 0  # steps completed
        self.version = -1  # latest published policy version
        # Oldest version this run may sample from: versions before it belong to another run
        # (or another start of this one) that shared weight-sync; set at the first publish.
        self.version_floor: int | None = None
        self._on_event = on_event or (lambda _e: None)
        self.pushed_version = -1  # latest version whose push has finished
        self.last_push_seconds = 0.0  # export + push of the latest finished push
        self._push: Future[None] | None = None  # the background push in flight
        self._pusher: ThreadPoolExecutor | None = None

    def publish(self, *, background: bool = False) -> float:
        """Quantize the master weights and push them as the next version (on a background
        thread with `background`: see the module docstring); returns the seconds this call
        took: the export and, in the background case, the wait for the previous push."""
        t0 = time.perf_counter()
        self.wait_pushed()
        tensors, metadata = self._export()
        version = self.version + 1
        exported = time.perf_counter() - t0
        if background:
            if self._pusher is None:
                self._pusher = ThreadPoolExecutor(1, thread_name_prefix="weight-push")
            self._push = self._pusher.submit(self._push_now, version, tensors, metadata, exported)
        else:
            self._push_now(version, tensors, metadata, exported)
        self.version = version
        if self.version_floor is None:
            self.version_floor = version
        return time.perf_counter() - t0

    def _export(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The quantized policy and its metadata, stamped with the step and mode."""
        tensors, metadata = self.learner.export_weights()
        return tensors, {**metadata, "step": self.step_index, "mode": self.config.mode}

    def _push_now(self, version: int, tensors: Mapping[str, torch.Tensor],
                  metadata: dict[str, Any], exported: float) -> None:  # fmt: skip
        t0 = time.perf_counter()
        self.publisher.publish(version, tensors, metadata)
        self.pushed_version = version
        self.last_push_seconds = exported + time.perf_counter() - t0
        self._on_event(f"push version={version}")

    def wait_pushed(self) -> None:
        """Wait for the background push in flight, if any (raising what made it fail)."""
        push, self._push = self._push, None
        if push is not None:
            push.result()

    def _check_push(self) -> None:
        """Raise now if the background push has already failed."""
        if self._push is not None and self._push.done():
            self.wait_pushed()

    def close(self) -> None:
        """Finish the push in flight and stop the push thread."""
        try:
            self.wait_pushed()
        finally:
            if self._pusher is not None:
                self._pusher.shutdown(wait=True)
                self._pusher = None

    def republish(self) -> float:
        """Push the current version again, the same weights under the same number (a
        weight-sync that restarted lost it; replicas that hold it need not pull it again)."""
        if self.version < 0:
            raise RuntimeError("no policy version published yet: call publish() first")
        self.wait_pushed()
        t0 = time.perf_counter()
        tensors, metadata = self._export()
        self.publisher.publish(self.version, tensors, metadata)
        self._on_event(f"republish version={self.version}")
        return time.perf_counter() - t0

    def _dispatch(
        self, prompts: Sequence[Prompt], *, write_records: bool, first_unit_id: int = 0,
        on_unit: Callable[[list[RolloutSample]], None] | None = None,
    ) -> tuple[list[RolloutSample], DispatchStats]:  # fmt: skip
        """Generate `prompts` for this step on the replicas (no sample older than
        max_staleness versions, nor than the version floor); `on_unit` gets each work unit's
        samples as they are accepted."""
        cfg = self.config
        return self.dispatcher.run(
            prompts,
            run_id=cfg.run_id,
            step=self.step_index,
            group_size=cfg.group_size,
            sampling=cfg.sampling,
            min_policy_version=max(self.version_floor or 0, self.version - cfg.max_staleness),
            write_records=write_records,
            first_unit_id=first_unit_id,
            on_unit=on_unit,
        )

    def _scoring(
        self, by_id: Mapping[int, Prompt]
    ) -> tuple[dict[str, Future[RewardOutcome]], Callable[[list[RolloutSample]], None]]:
        """Scores submitted as units arrive: the futures by sample id, and the callback."""
        futures: dict[str, Future[RewardOutcome]] = {}

        def on_unit(samples: list[RolloutSample]) -> None:
            for s in samples:
                futures[s.sample_id] = self.scorer.submit(s, by_id[s.prompt_id].problem)

        return futures, on_unit

    def evaluate(self, prompts: Sequence[Prompt], *, samples: int,
                 pass_threshold: float) -> dict[str, Any]:  # fmt: skip
        """Held-out evaluation of the latest version on the replicas: `samples` completions of
        each prompt (no records), scored by the run's reward. Returns mean reward, pass@1 and
        pass@k (k = `samples`: the fraction of prompts with a passing completion, reward >=
        `pass_threshold`)."""
        if self.version < 0:
            raise RuntimeError("no policy version published yet: call publish() first")
        self.wait_pushed()  # evaluate the version just exported, not the one before
        t0 = time.perf_counter()
        by_id = {p.prompt_id: p for p in prompts}
        futures, on_unit = self._scoring(by_id)
        out, _ = self.dispatcher.run(
            prompts, run_id=self.config.run_id, step=self.step_index, group_size=samples,
            sampling=self.config.sampling, min_policy_version=self.version,
            write_records=False, first_unit_id=EVAL_FIRST_UNIT, on_unit=on_unit,
        )  # fmt: skip
        tally = ScoreTally()
        per_prompt: dict[int, list[float]] = {}
        for s in out:
            outcome = futures[s.sample_id].result()
            tally.add(outcome)
            per_prompt.setdefault(s.prompt_id, []).append(outcome.value)
        rewards = [v for vs in per_prompt.values() for v in vs]
        passed = [[v >= pass_threshold for v in vs] for vs in per_prompt.values()]
        self._on_event(f"eval prompts={len(prompts)} samples={samples}")
        return {
            "event": "eval",
            "step": self.step_index,
            "policy_version": self.version,
            "eval_prompts": len(per_prompt),
            "eval_samples_per_prompt": samples,
            "eval_reward_mean": sum(rewards) / max(len(rewards), 1),
            "eval_pass_at_1": sum(sum(p) for p in passed) / max(len(rewards), 1),
            "eval_pass_at_k": sum(any(p) for p in passed) / max(len(passed), 1),
            "eval_reward_errors": tally.errors,
            "eval_reward_timeouts": tally.timeouts,
            "eval_completions_truncated": tally.truncated,
            "eval_completion_len_mean": sum(len(s.completion_tokens) for s in out)
            / max(len(out), 1),
            "eval_seconds": time.perf_counter() - t0,
        }

    def step(self) -> dict[str, Any]:
        """One RL step; returns its metrics (also what metrics.jsonl gets)."""
        cfg = self.config
        if self.version < 0:
            raise RuntimeError("no policy version published yet: call publish() first")
        self._check_push()
        t_start = time.perf_counter()
        skipped_before = dict(self.prompts.skipped)
        batch = self.prompts.next_batch(cfg.prompts_per_step)
        skipped = {k: v - skipped_before.get(k, 0) for k, v in self.prompts.skipped.items()}
        by_id = {p.prompt_id: p for p in batch}
        self._on_event(f"prompts step={self.step_index} n={len(batch)}")

        futures, on_unit = self._scoring(by_id)
        samples, dstats = self._dispatch(batch, write_records=cfg.writes_records, on_unit=on_unit)
        self._on_event(f"rollout samples={len(samples)}")
        t_rollout = time.perf_counter()

        tally = ScoreTally()
        kept_groups, dropped, staleness = self._filter_groups(samples)
        train_samples = self._score(kept_groups, by_id, tally, futures)
        self._on_event(f"score groups={len(kept_groups)}")
        t_score = time.perf_counter()

        lost = LostRecords()
        if cfg.writes_records and train_samples:
            train_samples, lost_groups = self._attach_records(train_samples)
            self._on_event("records")
            if lost_groups:
                recovered, lost = self._recover(lost_groups, by_id, tally, first_unit_id=len(batch))
                train_samples += recovered
                staleness += [ts.staleness for ts in recovered]
        t_records = time.perf_counter()

        train_metrics = self.learner.train_step(train_samples) if train_samples else {}
        self._on_event("train")
        t_train = time.perf_counter()

        self.step_index += 1
        self.publish(background=cfg.pushes_in_background)
        t_end = time.perf_counter()

        all_rewards = [ts.reward for ts in train_samples]
        n_tokens = sum(len(s.prompt_tokens) + len(s.completion_tokens) for s in samples)
        n_completion = sum(len(s.completion_tokens) for s in samples)
        tps = dstats.tokens_per_second()
        metrics: dict[str, Any] = {
            "step": self.step_index,
            "policy_version": self.version,
            "reward_mean": sum(all_rewards) / len(all_rewards) if all_rewards else float("nan"),
            "samples": len(samples),
            "samples_trained": len(train_samples),
            "samples_dropped_stale": dropped,
            "samples_dropped_records": lost.dropped,
            "samples_regenerated": lost.regenerated,
            "samples_unguided": lost.unguided,
            "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "staleness_max": max(staleness) if staleness else 0,
            "completion_tokens": n_completion,
            "completion_len_mean": n_completion / max(len(samples), 1),
            "rollout_tokens_per_s": n_completion / max(t_rollout - t_start, 1e-9),
            "rollout_tokens_per_s_per_replica": tps,
            "redispatched_units": dstats.redispatched_units + lost.redispatched_units,
            "reward_errors": tally.errors,
            "reward_timeouts": tally.timeouts,
            "completions_truncated": tally.truncated,
            "prompts_skipped_too_long": skipped.get("too_long", 0),
            "prompts_skipped_malformed": skipped.get("malformed", 0),
            "time_score_wait_s": t_score - t_rollout,
            "failed_replicas": list(dstats.failed_replicas),
            "record_bytes_per_token": sum(s.record_bytes for s in samples) / max(n_tokens, 1),
            "weight_push_seconds": self.last_push_seconds,
            "weight_push_in_background": cfg.pushes_in_background,
            "time_rollout_s": t_rollout - t_start,
            "time_records_s": t_records - t_rollout,
            "time_train_s": t_train - t_records,
            "time_push_s": t_end - t_train,
            "step_time_s": t_end - t_start,
        }
        metrics.update(train_metrics)
        return metrics

    def _filter_groups(
        self, samples: Sequence[RolloutSample]
    ) -> tuple[list[list[RolloutSample]], int, list[int]]:
        """Group by prompt; drop whole groups whose version is too old (groups are generated by
        one replica call, so they share a version)."""
        groups: dict[int, list[RolloutSample]] = {}
        for s in samples:
            groups.setdefault(s.prompt_id, []).append(s)
        ordered = [sorted(g, key=lambda s: s.group_index) for _, g in sorted(groups.items())]
        versions = [min(s.policy_version for s in g) for g in ordered]
        res = filter_stale(versions, self.version, self.config.max_staleness)
        kept = [ordered[i] for i in res.keep]
        dropped = sum(len(ordered[i]) for i in range(len(ordered)) if i not in set(res.keep))
        staleness = [st for st, i in zip(res.staleness, res.keep, strict=True) for _ in ordered[i]]
        return kept, dropped, staleness

    def _score(
        self,
        groups: Sequence[Sequence[RolloutSample]],
        by_id: Mapping[int, Prompt],
        tally: ScoreTally,
        futures: Mapping[str, Future[RewardOutcome]] | None = None,
    ) -> list[TrainSample]:
        """Rewards (the scores submitted as units arrived, or submitted now) and GRPO
        advantages of whole groups; failed reward calls score 0 and are counted in `tally`."""
        if not groups:
            return []
        futures = futures or {}
        pending = [
            [futures.get(s.sample_id) or self.scorer.submit(s, by_id[s.prompt_id].problem)
             for s in g]
            for g in groups
        ]  # fmt: skip
        outcomes = [[f.result() for f in g] for g in pending]
        for g in outcomes:
            for o in g:
                tally.add(o)
        rewards = torch.tensor([[o.value for o in g] for g in outcomes])  # [G, n]
        adv = grpo_advantages(rewards)  # [G, n]
        return [
            TrainSample(
                rollout=s,
                reward=float(rewards[gi, j]),
                advantage=float(adv[gi, j]),
                staleness=self.version - s.policy_version,
            )
            for gi, g in enumerate(groups)
            for j, s in enumerate(g)
        ]

    def _attach_records(
        self, samples: Sequence[TrainSample]
    ) -> tuple[list[TrainSample], list[list[TrainSample]]]:
        """Attach each sample's record blob. A group with any record missing or corrupt (TTL,
        eviction at the memory bound, a Redis restart, a bad tag) is set apart whole, since its
        advantages were normalized together. Returns (kept samples, the groups set apart).

        A sharded learner's ranks pull the records of the samples each trains themselves
        (`pulls_records`): they pull them now (`check_records`) and keep them for the train
        step, and the samples here stay without blobs."""
        if getattr(self.learner, "pulls_records", False):
            lacking = self.learner.check_records(samples)  # type: ignore[attr-defined]
            return self._split_lost(samples, lacking)
        by_version: dict[int, list[TrainSample]] = {}
        for ts in samples:
            by_version.setdefault(ts.rollout.policy_version, []).append(ts)
        lacking: set[int] = set()  # prompt ids of groups with a record missing
        for version, group in sorted(by_version.items()):
            blobs = self.records.fetch(
                self.config.run_id,
                version,
                [ts.rollout.sample_id for ts in group],
                generations=expected_generations(group),
            )
            for ts in group:
                blob = blobs.get(ts.rollout.sample_id)
                if blob is None:
                    log.warning("no usable record for sample %s (version %d): group lost",
                                ts.rollout.sample_id, version)  # fmt: skip
                    lacking.add(ts.rollout.prompt_id)
                ts.records = blob
        return self._split_lost(samples, lacking)

    @staticmethod
    def _split_lost(
        samples: Sequence[TrainSample], lacking: set[int]
    ) -> tuple[list[TrainSample], list[list[TrainSample]]]:
        """(the samples of groups not in `lacking`, the groups in it by prompt id)."""
        kept = [ts for ts in samples if ts.rollout.prompt_id not in lacking]
        lost: dict[int, list[TrainSample]] = {}
        for ts in samples:
            if ts.rollout.prompt_id in lacking:
                lost.setdefault(ts.rollout.prompt_id, []).append(ts)
        return kept, [lost[pid] for pid in sorted(lost)]

    def _recover(
        self,
        groups: list[list[TrainSample]],
        by_id: Mapping[int, Prompt],
        tally: ScoreTally,
        *,
        first_unit_id: int,
    ) -> tuple[list[TrainSample], LostRecords]:
        """What ``config.lost_records`` says to do with groups whose records are lost: the
        samples to train in their place, and the counts."""
        cfg = self.config
        n_lost = sum(len(g) for g in groups)
        if cfg.lost_records == "drop":
            return [], LostRecords(dropped=n_lost)
        if cfg.lost_records == "unguided":
            out = []
            for g in groups:
                for ts in g:
                    ts.records, ts.unguided = None, True
                    out.append(ts)
            self._on_event(f"unguided samples={n_lost}")
            return out, LostRecords(unguided=n_lost)
        stats, out = LostRecords(), []
        for _ in range(cfg.regenerate_attempts):
            if not groups:
                break
            prompts = [by_id[g[0].rollout.prompt_id] for g in groups]
            stats.regenerated += sum(len(g) for g in groups)
            self._on_event(f"regenerate groups={len(groups)}")
            samples, dstats = self._dispatch(
                prompts, write_records=True, first_unit_id=first_unit_id
            )
            first_unit_id += len(prompts)  # >= the units this round used: fresh sample ids
            stats.redispatched_units += dstats.redispatched_units
            kept_groups, stale, _ = self._filter_groups(samples)
            stats.dropped += stale  # the replicas lag the floor: rare, counted as dropped
            got, groups = self._attach_records(self._score(kept_groups, by_id, tally))
            out += got
        stats.dropped += sum(len(g) for g in groups)
        return out, stats


@dataclass(kw_only=True, slots=True)
class LostRecords:
    """One step's samples whose records were lost, by what became of them."""

    regenerated: int = 0  # generated again (each round counts the samples it replaced)
    unguided: int = 0  # trained without records
    dropped: int = 0  # not trained
    redispatched_units: int = 0  # units of the regeneration rounds sent to another replica
