"""`trace-rl train` on the shipped datasets through the real services (Redis, quant-cache,
weight-sync, the trainer and a rollout replica as processes): the math set with its warm
start and held-out evaluations, and the code set scored in the sandbox."""

from __future__ import annotations

import json
import pathlib

import pytest
from typer.testing import CliRunner

from trace_common.cli import app

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[2]


def short_recipe(tmp_path: pathlib.Path, base: str, extra: str) -> pathlib.Path:
    """The shipped recipe `base` with its data paths absolute and a small run on top."""
    text = (ROOT / "recipes" / base).read_text().replace('"data/', f'"{ROOT}/data/')
    path = tmp_path / base
    path.write_text(text + extra)
    return path


def train(tmp_path: pathlib.Path, recipe: pathlib.Path) -> tuple[pathlib.Path, list[dict]]:
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["train", "--config", str(recipe), "--out", str(out), "--steps", "3",
              "--replicas", "1"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output + repr(result.exception)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return out, lines


def test_train_on_the_math_set_evaluates_held_out_prompts_on_the_replicas(
    tmp_path: pathlib.Path,
) -> None:
    recipe = short_recipe(tmp_path, "math-cpu.toml", "")
    text = recipe.read_text()
    text = text.replace("prompts_per_step = 16", "prompts_per_step = 4")
    text = text.replace("group_size = 8", "group_size = 2")
    text = text.replace("every = 10", "every = 2").replace("prompts = 128", "prompts = 8")
    text = text.replace("samples = 4  # pass@4", "samples = 2")
    text = text.replace("warmstart_max_steps = 400", "warmstart_max_steps = 4")
    recipe.write_text(text)
    out, lines = train(tmp_path, recipe)
    steps = [r for r in lines if "event" not in r]
    evals = [r for r in lines if r.get("event") == "eval"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [e["step"] for e in evals] == [0, 2, 3]  # start, every 2, the end
    for e in evals:
        assert e["eval_prompts"] == 8 and e["eval_samples_per_prompt"] == 2
        assert 0.0 <= e["eval_pass_at_1"] <= e["eval_pass_at_k"] <= 1.0
        assert e["eval_reward_errors"] == 0 and e["eval_reward_timeouts"] == 0
    for r in steps:
        assert r["samples"] == 8 and r["reward_errors"] == 0 and r["reward_timeouts"] == 0
        assert r["prompts_skipped_too_long"] == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["warm_start"]["steps"] == 4
    assert [e["step"] for e in summary["evals"]] == [0, 2, 3]
    assert summary["eval_reward_final"] == evals[-1]["eval_reward_mean"]
    for name in ("reward.png", "overview.png", "summary.md", "warmstart.safetensors"):
        assert (out / name).stat().st_size > 0, name
    assert "held-out evaluation on the replicas" in (out / "summary.md").read_text()
    played = (out / "run.toml").read_text()
    assert f'"{ROOT}/data/math-word/train.jsonl"' in played and 'name = "math"' in played


def test_train_on_the_code_set_scores_completions_in_the_sandbox(tmp_path: pathlib.Path) -> None:
    recipe = short_recipe(tmp_path, "code-cpu.toml", "")
    text = recipe.read_text()
    text = text.replace("prompts_per_step = 8", "prompts_per_step = 4")
    text = text.replace("every = 10", "every = 0")
    recipe.write_text(text)
    out, lines = train(tmp_path, recipe)
    steps = [r for r in lines if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        # Every completion was scored: by the sandbox, or at once when it hit the length limit.
        assert r["reward_errors"] == 0 and r["reward_timeouts"] == 0, r
        assert 0.0 <= r["reward_mean"] <= 1.0
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert "reward worker failed" not in trainer_log
    assert not (out / "warmstart.safetensors").exists()  # no warm start unless asked
