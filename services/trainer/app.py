"""The trainer service's job: build the run from settings, restore or initialize, publish,
then step until done, writing metrics and checkpoints; pause/resume between steps."""

from __future__ import annotations

import logging
import pathlib
import threading
import time
from typing import Any

import torch

from services.trainer.build import build_learner, build_model
from services.trainer.config import TrainerSettings
from services.trainer.metrics import TrainerMetrics
from services.trainer.remote import (
    QuantCacheRecords,
    WeightSyncDirectory,
    WeightSyncPublisher,
    broadcast_source,
)
from trace_common.clients import QuantCacheClient, WeightSyncClient
from trace_common.config import ConfigError, RunConfig
from trace_common.data.recipe import (
    check_inputs,
    eval_prompts,
    is_dataset,
    resolve_run_paths,
    reward_config,
    train_prompts,
)
from trace_common.model import QuantConfig
from trace_common.rewards import RewardPool
from trace_common.rl.audit import RecordAudit, state_digest
from trace_common.rl.checkpoint import (
    Checkpoint,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from trace_common.rl.core import RewardScorer, TrainerConfig, TrainerCore
from trace_common.rl.dispatch import Dispatcher
from trace_common.rl.distributed import LeaderLearner
from trace_common.rl.policy import ModelLearner
from trace_common.service import Backoff, Metrics
from trace_common.tasks import load_tokenizer

log = logging.getLogger(__name__)

STATES = ("starting", "running", "paused", "finished", "failed")


def export_checkpoint(run: RunConfig, path: pathlib.Path, quant: QuantConfig) -> None:
    """`trace-rl export` of a checkpoint just written, into `<path>/export` (calibrated on the
    run's own prompts and targets)."""
    from trace_common.export_job import CALIB_SEED, ExportConfig, run_export

    sequences = None
    if is_dataset(run):
        tok = load_tokenizer(run.task.tokenizer)
        prompts = train_prompts(run, tok).with_seed(CALIB_SEED).next_batch(64)
        sequences = [[*p.token_ids, *tok.encode(p.problem.answer), tok.eos_id] for p in prompts]
    run_export(
        ExportConfig(
            out=path / "export", model=run.model.name, checkpoint=path,
            tokenizer=run.task.tokenizer, quant=quant, task=run.task.name,
            difficulty=run.task.difficulty, sequences=sequences,
        )
    )  # fmt: skip


class TrainerApp:
    """Owns the core loop and its state; the gRPC servicer and HTTP status read it."""

    def __init__(self, settings: TrainerSettings, metrics: Metrics) -> None:
        self.settings = s = settings
        self.run_config = run = resolve_run_paths(s.run, s.data_root)
        torch.set_num_threads(s.torch_threads)
        torch.manual_seed(run.seed)
        token = s.token()
        try:
            self.tokenizer = tok = load_tokenizer(run.task.tokenizer)
        except (ValueError, OSError) as e:
            raise ConfigError(f"task.tokenizer = {run.task.tokenizer!r}: {e}") from None
        model = build_model(run, tok.vocab_size)
        # The dataset, the reward and the model fit together, or start-up stops naming the key.
        self.inputs = check_inputs(run, tok, model.cfg.max_position_embeddings)
        prompts = train_prompts(run, tok)
        self.eval_prompts = eval_prompts(run, tok) if run.eval.every else []
        self.rewards = RewardPool(reward_config(run))
        quant = run.quant.build(model.cfg)
        guidance = run.guidance.build(model.cfg.num_layers)
        guidance.resolve(model.cfg, quant)  # a guided site whose FP4 site is off stops start-up
        if run.checkpoint.export:
            from trace_common.model.export import check_nvfp4_exportable

            check_nvfp4_exportable(quant, model.cfg)  # an inexpressible policy stops start-up
        self.quant = quant
        self.weight_sync = WeightSyncClient(s.weight_sync_address, token, deltas=s.weight_deltas)
        self.quant_cache = QuantCacheClient(
            s.quant_cache_address, token, data_path=s.quant_cache_data_path
        )
        self.directory = WeightSyncDirectory(
            self.weight_sync, token, generate_timeout=s.generate_timeout_seconds
        )
        backoff = Backoff(budget_s=run.stores.retry_seconds)
        self.publisher = WeightSyncPublisher(
            self.weight_sync, backoff, cuda_ipc=s.cuda_ipc, source=broadcast_source(s)
        )
        self.records = records = QuantCacheRecords(
            self.quant_cache,
            RecordAudit(s.record_audit_file) if s.record_audit_file else None,
            backoff,
        )
        # One process, or rank 0 of N under torchrun (services/trainer/build.py).
        self.learner = build_learner(
            s, model, quant=quant, guidance=guidance, eos_id=tok.eos_id, pad_id=tok.pad_id,
            records=records,
        )  # fmt: skip
        if isinstance(self.learner, ModelLearner):  # offers share the export's GPU buffer
            on_cuda = self.learner.device.type == "cuda"
            source = self.publisher.source
            self.learner.export_on_device = on_cuda and (
                self.publisher.cuda_ipc or (source is not None and source.backend == "nccl")
            )
        if run.checkpoint.export and isinstance(self.learner, LeaderLearner):
            raise ValueError(
                "checkpoint.export needs an unsharded trainer: sharded (torchrun) "
                "checkpoints are DCP shards, which the export does not read yet"
            )
        self.core = TrainerCore(
            TrainerConfig(
                run_id=run.run_id, steps=run.steps, prompts_per_step=run.prompts_per_step,
                group_size=run.group_size, mode=run.mode, max_staleness=run.max_staleness,
                sampling=run.sampling, measure_records=run.guidance.measure_records,
                lost_records=run.stores.lost_records,
                regenerate_attempts=run.stores.regenerate_attempts,
                overlap_push=run.overlap_push,
            ),
            prompts=prompts,
            dispatcher=Dispatcher(self.directory, run.dispatch),
            scorer=RewardScorer(self.rewards, tok, truncated=run.reward.truncated),
            records=records,
            learner=self.learner,
            publisher=self.publisher,
        )  # fmt: skip
        self.metrics = TrainerMetrics(metrics, s.metrics_file, run.run_id)
        self.state = "starting"
        self.detail = ""
        self.last_metrics: dict[str, Any] = {}
        self.last_eval: dict[str, Any] = {}
        self.resumed_from: str | None = None
        self.republished = 0  # versions pushed again after weight-sync lost them
        self.samples_seen = 0  # received from rollout in this process (for the dropped limit)
        self.samples_dropped = 0  # of those, dropped untrained
        self.weights_digest = ""  # sha256 of the master weights at start / last checkpoint
        self._resume = threading.Event()
        if not s.start_paused:
            self._resume.set()
        self._stop = threading.Event()
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- control

    def pause(self, reason: str) -> None:
        with self._lock:
            if self.state in ("finished", "failed"):
                raise RuntimeError(f"trainer is {self.state}")
            self._resume.clear()
            self.detail = f"pause requested: {reason}" if reason else "pause requested"
            if self.state == "running":
                self.state = "paused"

    def resume(self) -> None:
        with self._lock:
            if self.state in ("finished", "failed"):
                raise RuntimeError(f"trainer is {self.state}")
            self._resume.set()
            if self.state == "paused":
                self.state = "running"
            self.detail = ""

    def stop(self) -> None:
        self._stop.set()
        self._resume.set()

    def status(self) -> dict[str, Any]:
        return {
            "run_id": self.run_config.run_id,
            "state": self.state,
            "step": self.core.step_index,
            "total_steps": self.run_config.steps,
            "policy_version": self.core.version,  # the latest exported (maybe being pushed)
            "policy_version_pushed": self.core.pushed_version,  # the latest in weight-sync
            "rollout_replicas": len(self.directory.replicas()),
            "mode": self.run_config.mode,
            "device": str(self.learner.device),
            "world_size": self.learner.world_size,
            "detail": self.detail,
            "resumed_from": self.resumed_from,
            "versions_republished": self.republished,
            "weights_digest": self.weights_digest,
            "last_metrics": self.last_metrics,
            "last_eval": self.last_eval,
            "inputs": self.inputs,
            "prompts_skipped": dict(self.core.prompts.skipped),
        }

    # ----------------------------------------------------------------- run

    def start(self) -> None:
        threading.Thread(target=self._run_safely, name="trainer-loop", daemon=True).start()

    def _run_safely(self) -> None:
        try:
            self.run()
        except Exception as exc:
            log.exception("trainer failed")
            self.state = "failed"
            self.detail = f"{type(exc).__name__}: {exc}"
            self.metrics.failed.set(1)

    def run(self) -> None:
        try:
            self._run_steps()
        finally:
            try:
                self.core.close()  # the last version's push finishes (or fails the run)
            finally:
                self.rewards.close()

    def _evaluate_if_due(self, *, start: bool = False) -> None:
        """Held-out evaluation at the start of a fresh run, every eval.every steps and after
        the last step (recorded in metrics.jsonl as an "eval" event)."""
        every, step = self.run_config.eval.every, self.core.step_index
        if not every:
            return
        due = (start and step == 0) or (
            not start and (step % every == 0 or step == self.run_config.steps)
        )
        if not due:
            return
        e = self.core.evaluate(
            self.eval_prompts, samples=self.run_config.eval.samples,
            pass_threshold=self.run_config.eval.pass_threshold,
        )  # fmt: skip
        e["wall_time"] = time.time()
        self.metrics.record_eval(e)
        self.last_eval = e
        log.info(
            "evaluation done",
            extra={k: e[k] for k in ("step", "eval_reward_mean", "eval_pass_at_k", "eval_seconds")},
        )

    def _run_steps(self) -> None:
        s, run = self.settings, self.run_config
        self._restore_or_publish()
        self._evaluate_if_due(start=True)
        self.state = "running" if self._resume.is_set() else "paused"
        while self.core.step_index < run.steps and not self._stop.is_set():
            if not self._resume.is_set():
                self.state = "paused"
                self._resume.wait()
                if self._stop.is_set():
                    break
                self.state = "running"
            self._republish_if_lost()
            m = self.core.step()
            m["weight_pull_seconds_per_replica"] = self.directory.pull_seconds()
            pulls = list(m["weight_pull_seconds_per_replica"].values())
            m["weight_pull_seconds"] = sum(pulls) / len(pulls) if pulls else 0.0
            m.update(getattr(self.publisher, "last_push", {}))  # bytes sent and changed, if known
            m["records_refused"] = self.records.take_refused()
            m["wall_time"] = time.time()
            self.metrics.record(m)
            self.last_metrics = m
            self._check_dropped(m)
            self._evaluate_if_due()
            log.info(
                "step done",
                extra={k: m[k] for k in ("step", "policy_version", "reward_mean", "step_time_s")},
            )
            if s.checkpoint_dir is not None and (
                self.core.step_index % run.checkpoint.every == 0
                or self.core.step_index == run.steps
            ):
                self.checkpoint()
        self.core.wait_pushed()  # "finished" means the last version is in weight-sync
        if self.core.step_index >= run.steps:
            self.state = "finished"
        if isinstance(self.learner, LeaderLearner):
            self.learner.stop()  # the other ranks' follow() returns

    def _check_dropped(self, m: dict[str, Any]) -> None:
        """Fail the run (loudly: state failed, /healthz 503, the alert) once more than
        max_dropped_fraction of the samples received so far went untrained."""
        self.samples_seen += m["samples"]
        self.samples_dropped += m["samples_dropped_records"] + m["samples_dropped_stale"]
        limit = self.run_config.stores.max_dropped_fraction
        if self.samples_seen and self.samples_dropped / self.samples_seen > limit:
            raise RuntimeError(
                f"{self.samples_dropped} of {self.samples_seen} samples dropped untrained "
                f"({self.samples_dropped / self.samples_seen:.0%}) after step {m['step']}, over "
                f"stores.max_dropped_fraction={limit:g}: records lost (quant-cache too small or "
                "failing?) or replicas too stale"
            )

    def _republish_if_lost(self) -> None:
        """weight-sync keeps versions in memory: after a restart it holds none (or older
        ones). Push the current weights again under the current version, so replicas that
        restart or join can load them (replicas re-register on their own)."""
        latest = self.publisher.latest_version()
        if latest < self.core.pushed_version:  # the version in flight, if any, is not there yet
            log.warning(
                "weight-sync lost the current version (restarted?): publishing it again",
                extra={"version": self.core.version, "weight_sync_latest": latest},
            )
            self.core.republish()
            self.republished += 1

    def checkpoint(self) -> None:
        assert self.settings.checkpoint_dir is not None
        self.core.wait_pushed()  # a resume finds the checkpoint's version in weight-sync
        if isinstance(self.learner, LeaderLearner):  # every rank writes its own shards
            self.learner.save(
                self.settings.checkpoint_dir, step=self.core.step_index,
                version=self.core.version, prompt_state=self.core.prompts.state_dict(),
                extra={"run_id": self.run_config.run_id, "mode": self.run_config.mode},
            )  # fmt: skip
            return
        model_state, optim_state = self.learner.state()
        self.weights_digest = state_digest(model_state)
        path = save_checkpoint(
            self.settings.checkpoint_dir,
            Checkpoint(
                step=self.core.step_index,
                version=self.core.version,
                model=model_state,
                optimizer=optim_state,
                prompt_state=self.core.prompts.state_dict(),
                extra={
                    "run_id": self.run_config.run_id,
                    "mode": self.run_config.mode,
                    "weights_digest": self.weights_digest,
                },
            ),
        )
        if self.run_config.checkpoint.export:
            export_checkpoint(self.run_config, path, self.quant)

    def _restore_or_publish(self) -> None:
        """Resume from the latest checkpoint (same step, same weights) or publish version 0."""
        s = self.settings
        resume = s.checkpoint_dir and s.resume
        path = latest_checkpoint(s.checkpoint_dir) if resume else None
        latest = self.publisher.latest_version()
        if path is None:
            if not isinstance(self.learner, LeaderLearner):  # sharded: no gathered digest
                self.weights_digest = state_digest(self.learner.state()[0])
            self.core.version = latest  # next publish is latest + 1 (0 on a fresh weight-sync)
            self.core.publish()
            return
        if isinstance(self.learner, LeaderLearner):
            state = self.learner.load(path)  # at any world size; restores each rank's RNG
            self.core.prompts.load_state_dict(state["prompt_state"])
            self.core.step_index = state["step"]
            self._continue_version(path, latest, state["version"])
            return
        ckpt = load_checkpoint(path)
        self.learner.load_state(ckpt.model, ckpt.optimizer)
        self.core.prompts.load_state_dict(ckpt.prompt_state)
        self.core.step_index = ckpt.step
        if ckpt.rng is not None:
            restore_rng(ckpt.rng)
        self.weights_digest = state_digest(self.learner.state()[0])
        self._continue_version(path, latest, ckpt.version)

    def _continue_version(self, path: pathlib.Path, latest: int, version: int) -> None:
        """After a resume: keep the checkpoint's version if weight-sync holds it, else push.
        Rows of the steps after the checkpoint leave metrics.jsonl: they run again."""
        self.resumed_from = str(path)
        dropped = self.metrics.truncate_after(self.core.step_index)
        if dropped:
            log.info("metrics rows after the checkpoint removed", extra={"rows": dropped})
        if latest == version:
            self.core.version = version  # replicas already hold exactly these weights
            self.core.pushed_version = version
            self.core.version_floor = version
        else:
            # weight-sync holds other weights (pushed after the checkpoint, or lost): push the
            # checkpoint's weights as a version newer than anything it has.
            self.core.version = max(latest, version - 1)
            self.core.publish()
        log.info(
            "resumed",
            extra={"path": str(path), "step": self.core.step_index, "version": self.core.version},
        )
