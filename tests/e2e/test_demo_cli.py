"""`trace-rl demo` itself, shortened: warm start, the local cluster, RL steps, run directory."""

from __future__ import annotations

import json
import pathlib

import pytest
from typer.testing import CliRunner

from trace_common.cli import app

pytestmark = pytest.mark.timeout(240)


def test_demo_writes_a_complete_run_directory(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        ["demo", "--out", str(out), "--steps", "3", "--replicas", "1", "--prompts-per-step", "4",
         "--group-size", "2", "--warmstart-target", "0.05"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output + repr(result.exception)
    for name in ("metrics.jsonl", "reward.png", "discrepancy.png", "overview.png",
                 "summary.json", "summary.md", "warmstart.safetensors", "config.json"):  # fmt: skip
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["mode"] == "trace"
    assert pathlib.Path(summary["final_checkpoint"]).name == "step-000003"
    assert 0.0 <= summary["eval_reward_final"] <= 1.0
    assert (out / "logs" / "trainer.log").is_file() and (out / "logs" / "rollout-0.log").is_file()
    assert "done in" in result.output


def test_demo_rejects_an_unknown_mode(tmp_path: pathlib.Path) -> None:
    result = CliRunner().invoke(app, ["demo", "--out", str(tmp_path), "--mode", "fp8"])
    assert result.exit_code != 0 and "unknown mode 'fp8'" in result.output
