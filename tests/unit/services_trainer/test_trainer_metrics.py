"""metrics.jsonl on resume: the rows of steps after the checkpoint go (they run again), so a
resume from a checkpoint several steps back leaves one row per step."""

from __future__ import annotations

import json
import pathlib

from services.trainer.metrics import TrainerMetrics
from trace_common.rl.plots import read_metrics
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
