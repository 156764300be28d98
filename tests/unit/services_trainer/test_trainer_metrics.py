"""metrics.jsonl on resume: the rows of steps after the checkpoint go (they run again), so a
resume from a checkpoint several steps back leaves one row per step."""

from __future__ import annotations

import json
import pathlib

from services.trainer.metrics import TrainerMetrics
from trace_common.launch.plots import read_metrics
from trace_common.service import Metrics


def _row(step: int) -> dict:
    return {"step": step, "policy_version": step, "time_rollout_s": 0.0, "time_records_s": 0.0,
            "time_train_s": 0.0, "time_push_s": 0.0, "step_time_s": 0.1}  # fmt: skip


def test_resume_from_an_older_checkpoint_leaves_one_row_per_step(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "metrics.jsonl"
    first = TrainerMetrics(Metrics("trainer"), path)
    for step in range(1, 6):  # checkpoints at 2 and 4, killed after step 5's row
        first.record(_row(step))
    with open(path, "a") as f:
        f.write('{"step": 6, "polic')  # killed while writing step 6's row
    resumed = TrainerMetrics(Metrics("trainer"), path)
    assert resumed.truncate_after(4) == 2  # step 5 and the torn line
    for step in range(5, 8):
        resumed.record(_row(step))
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5, 6, 7]
    assert not path.with_name("metrics.jsonl.tmp").exists()


def test_truncate_keeps_a_file_with_nothing_after_the_step(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(_row(s)) + "\n" for s in (1, 2)))
    before = path.stat().st_mtime_ns
    m = TrainerMetrics(Metrics("trainer"), path)
    assert m.truncate_after(2) == 0 and path.stat().st_mtime_ns == before
    assert TrainerMetrics(Metrics("trainer"), tmp_path / "none.jsonl").truncate_after(0) == 0
    assert TrainerMetrics(Metrics("trainer"), None).truncate_after(0) == 0


def test_reward_failures_skips_and_evaluations_reach_prometheus_and_the_jsonl(
    tmp_path: pathlib.Path,
) -> None:
    from prometheus_client import generate_latest

    from trace_common.launch.plots import read_evals

    path = tmp_path / "metrics.jsonl"
    metrics = Metrics("trainer")
    m = TrainerMetrics(metrics, path)
    m.record({**_row(1), "reward_errors": 2, "reward_timeouts": 1, "completions_truncated": 3,
              "prompts_skipped_too_long": 4, "prompts_skipped_malformed": 1})  # fmt: skip
    m.record({**_row(2), "reward_errors": 1})
    m.record_eval({"step": 2, "policy_version": 2, "eval_reward_mean": 0.25,
                   "eval_pass_at_1": 0.25, "eval_pass_at_k": 0.5, "eval_reward_timeouts": 2})  # fmt: skip
    text = generate_latest(metrics.registry).decode()
    for line in (
        'trace_trainer_reward_failures_total{reason="error"} 3.0',
        'trace_trainer_reward_failures_total{reason="timeout"} 3.0',
        "trace_trainer_completions_truncated_total 3.0",
        'trace_trainer_prompts_skipped_total{reason="too_long"} 4.0',
        "trace_trainer_eval_reward_mean 0.25",
        "trace_trainer_eval_pass_at_k 0.5",
        "trace_trainer_eval_step 2.0",
    ):
        assert line in text, line
    assert [r["step"] for r in read_metrics(path)] == [1, 2]  # eval lines are not steps
    (e,) = read_evals(path)
    assert (e["event"], e["eval_pass_at_k"]) == ("eval", 0.5)
