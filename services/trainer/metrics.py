"""The trainer's per-step metrics: one JSON line per step in metrics.jsonl and the same
numbers as Prometheus series ``trace_trainer_<name>``.

Documented series (all gauges unless noted; every one is set on every step where it applies):

- ``trace_trainer_step``, ``trace_trainer_policy_version``
- ``trace_trainer_reward_mean``
- ``trace_trainer_logp_abs_diff_mean``, ``..._max``, ``trace_trainer_k3_kl``,
  ``trace_trainer_exp_mean_abs_dlogp``, ``trace_trainer_routing_mismatch`` (trace mode)
- ``trace_trainer_d_act{layer}``, ``trace_trainer_code_flip_rate`` (full guidance records)
- ``trace_trainer_staleness_mean``, ``trace_trainer_staleness_max``
- ``trace_trainer_samples_total``, ``trace_trainer_samples_dropped_stale_total``,
  ``trace_trainer_samples_dropped_records_total`` (records missing/corrupt in quant-cache),
  ``trace_trainer_samples_regenerated_total``, ``trace_trainer_samples_unguided_total``
  (records lost: generated again / trained without records, the recipe's stores.lost_records),
  ``trace_trainer_redispatched_units_total``, ``trace_trainer_records_refused_total{reason}``
  (records that failed their HMAC tag, reason "tag", or CRC-32, "checksum") (counters)
- ``trace_trainer_rollout_tokens_per_second{replica_id}``
- ``trace_trainer_weight_push_seconds``, ``trace_trainer_weight_pull_seconds{replica_id}``,
  ``trace_trainer_weight_push_bytes``, ``trace_trainer_weight_push_full_bytes`` (a delta push
  sends the first, a full one both the same; metrics.jsonl also has
  ``weight_changed_fraction`` by dtype for a delta)
  (``replica_id``: the label every TRACE series naming a replica uses, as weight-sync's)
- ``trace_trainer_run_info{run_id}`` (1; the dashboard's run selector)
- ``trace_trainer_record_bytes_per_token``
- ``trace_trainer_step_phase_seconds{phase=rollout|records|train|push}``,
  ``trace_trainer_step_seconds`` (histogram)
- ``trace_trainer_loss``, ``trace_trainer_clip_frac``, ``trace_trainer_tis_mean``
- ``trace_trainer_run_failed`` (1 once the run failed: alert TraceTrainerRunFailed)
- ``trace_trainer_reward_failures_total{reason=error|timeout}`` (reward calls that raised or
  ran past reward.timeout_s; each scored 0), ``trace_trainer_completions_truncated_total``,
  ``trace_trainer_prompts_skipped_total{reason=too_long|malformed}`` (counters)
- ``trace_trainer_eval_reward_mean``, ``trace_trainer_eval_pass_at_1``,
  ``trace_trainer_eval_pass_at_k``, ``trace_trainer_eval_step`` (the last held-out evaluation)

metrics.jsonl also holds one line per held-out evaluation, ``{"event": "eval", ...}``
(`EVENT_KEY`); step lines have no "event" key.
"""

from __future__ import annotations

import json
import math
import pathlib
import threading
from typing import Any

from trace_common.service import Metrics

SCALAR_SERIES = {
    "reward_mean": "mean reward of the step's samples",
    "logp_abs_diff_mean": "mean |logp_train - logp_rollout| per completion token",
    "logp_abs_diff_max": "max |logp_train - logp_rollout| over the step's tokens",
    "k3_kl": "k3 estimate of KL(rollout || trainer)",
    "exp_mean_abs_dlogp": "exp(mean |dlogp|)",
    "routing_mismatch": "fraction of tokens whose own top-k differs from the rollout's",
    "code_flip_rate": "fraction of guided-site elements quantized differently than the rollout",
    "staleness_mean": "mean version gap of the samples trained",
    "staleness_max": "max version gap of the samples trained",
    "record_bytes_per_token": "record bytes written to quant-cache per token",
    "loss": "policy loss",
    "clip_frac": "fraction of tokens with the clipped ratio branch active",
    "tis_mean": "mean truncated importance weight",
    "weight_push_seconds": "seconds to quantize + push the last version whose push finished",
    "weight_push_bytes": "bytes the last finished push sent (a delta's payloads, or the version)",
    "weight_push_full_bytes": "bytes of the last pushed version in full",
}
PHASES = ("rollout", "records", "train", "push")
EVENT_KEY = "event"  # metrics.jsonl lines that are not a step's carry this key
EVAL_SERIES = {
    "eval_reward_mean": "mean reward of the last held-out evaluation",
    "eval_pass_at_1": "fraction of held-out completions that pass (reward >= pass_threshold)",
    "eval_pass_at_k": "fraction of held-out prompts with a passing completion among k",
    "step": "step of the last held-out evaluation",
}


REFUSAL_REASONS = ("tag", "replay", "checksum")  # services.trainer.remote.refusal_reason


class TrainerMetrics:
    """Writes each step's metrics to metrics.jsonl and Prometheus."""

    def __init__(self, metrics: Metrics, jsonl: pathlib.Path | None, run_id: str = "") -> None:
        self.jsonl = jsonl
        if jsonl is not None:
            jsonl.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.step = metrics.gauge("step", "RL steps completed")
        self.version = metrics.gauge("policy_version", "latest published policy version")
        self.scalars = {k: metrics.gauge(k, doc) for k, doc in SCALAR_SERIES.items()}
        self.d_act = metrics.gauge("d_act", "max D_act at guided sites, by layer", ("layer",))
        self.samples = metrics.counter("samples", "samples received from rollout")
        self.dropped = metrics.counter("samples_dropped_stale", "samples dropped as too stale")
        self.dropped_records = metrics.counter(
            "samples_dropped_records", "samples dropped: records missing or corrupt in quant-cache"
        )
        self.refused = metrics.counter(
            "records_refused",
            "records quant-cache returned that failed their HMAC tag or CRC-32",
            ("reason",),
        )
        for reason in REFUSAL_REASONS:  # exported at 0 from the start
            self.refused.labels(reason)
        self.regenerated = metrics.counter(
            "samples_regenerated", "samples generated again: their records were lost"
        )
        self.unguided = metrics.counter(
            "samples_unguided", "samples trained without records: their records were lost"
        )
        self.redispatched = metrics.counter("redispatched_units", "work units re-dispatched")
        self.tps = metrics.gauge(
            "rollout_tokens_per_second", "rollout tokens/s by replica", ("replica_id",)
        )
        self.pull = metrics.gauge(
            "weight_pull_seconds", "last weight pull seconds by replica", ("replica_id",)
        )
        self.phase = metrics.gauge(
            "step_phase_seconds", "seconds of the last step by phase", ("phase",)
        )
        self.step_seconds = metrics.histogram("step_seconds", "RL step wall time")
        self.reward_failures = metrics.counter(
            "reward_failures", "reward calls that raised or timed out (scored 0)", ("reason",)
        )
        self.truncated = metrics.counter(
            "completions_truncated", "completions cut off at max_new_tokens (no EOS)"
        )
        self.skipped = metrics.counter(
            "prompts_skipped", "dataset rows skipped: prompt too long or malformed", ("reason",)
        )
        self.eval = {
            k: metrics.gauge(f"eval_{k}" if k == "step" else k, doc)
            for k, doc in EVAL_SERIES.items()
        }
        self.failed = metrics.gauge("run_failed", "1 once the run failed (state failed)")
        self.failed.set(0)
        if run_id:
            info = metrics.gauge(
                "run_info", "1, labelled with the run this trainer runs", ("run_id",)
            )
            info.labels(run_id).set(1)

    def truncate_after(self, step: int) -> int:
        """Drop the metrics.jsonl rows of steps after `step` (a resume from the checkpoint of
        `step` runs them again: without this each would have two rows). Atomic (a temp file
        renamed over it); a torn last line is dropped too. Returns the rows dropped."""
        if self.jsonl is None or not self.jsonl.exists():
            return 0
        with self._lock:
            lines = self.jsonl.read_text().splitlines()
            keep = []
            for line in lines:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a write the killed trainer did not finish
                    continue
                if isinstance(row, dict) and row.get("step", 0) <= step:
                    keep.append(line)
            if len(keep) == len(lines):
                return 0
            tmp = self.jsonl.with_name(self.jsonl.name + ".tmp")
            tmp.write_text("".join(x + "\n" for x in keep))
            tmp.replace(self.jsonl)
            return len(lines) - len(keep)

    def record(self, m: dict[str, Any]) -> None:
        with self._lock:
            self.step.set(m["step"])
            self.version.set(m["policy_version"])
            for k, g in self.scalars.items():
                v = m.get(k)
                if isinstance(v, int | float) and math.isfinite(v):
                    g.set(v)
            for layer, v in (m.get("d_act_per_layer") or {}).items():
                self.d_act.labels(str(layer)).set(v)
            self.samples.inc(m.get("samples", 0))
            self.dropped.inc(m.get("samples_dropped_stale", 0))
            self.dropped_records.inc(m.get("samples_dropped_records", 0))
            for reason, n in (m.get("records_refused") or {}).items():
                self.refused.labels(reason).inc(n)
            self.regenerated.inc(m.get("samples_regenerated", 0))
            self.unguided.inc(m.get("samples_unguided", 0))
            self.redispatched.inc(m.get("redispatched_units", 0))
            self.reward_failures.labels("error").inc(m.get("reward_errors", 0))
            self.reward_failures.labels("timeout").inc(m.get("reward_timeouts", 0))
            self.truncated.inc(m.get("completions_truncated", 0))
            self.skipped.labels("too_long").inc(m.get("prompts_skipped_too_long", 0))
            self.skipped.labels("malformed").inc(m.get("prompts_skipped_malformed", 0))
            for r, v in (m.get("rollout_tokens_per_s_per_replica") or {}).items():
                self.tps.labels(r).set(v)
            for r, v in (m.get("weight_pull_seconds_per_replica") or {}).items():
                self.pull.labels(r).set(v)
            for p in PHASES:
                self.phase.labels(p).set(m[f"time_{p}_s"])
            self.step_seconds.observe(m["step_time_s"])
            self._append(m)

    def record_eval(self, e: dict[str, Any]) -> None:
        """A held-out evaluation: its gauges, and an "eval" line in metrics.jsonl."""
        with self._lock:
            for k, g in self.eval.items():
                g.set(e[k])
            self.reward_failures.labels("error").inc(e.get("eval_reward_errors", 0))
            self.reward_failures.labels("timeout").inc(e.get("eval_reward_timeouts", 0))
            self._append({**e, EVENT_KEY: "eval"})

    def _append(self, row: dict[str, Any]) -> None:
        if self.jsonl is not None:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps(row, sort_keys=True) + "\n")
