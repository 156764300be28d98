"""The trainer refuses, at start-up, a recipe whose dataset, reward, tokenizer or model do
not fit together, naming the recipe key and its value."""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import pytest

from services.trainer.app import TrainerApp
from services.trainer.config import TrainerSettings
from trace_common.config import ConfigError, load_run_config
from trace_common.service import Metrics

REQUIRED = dict(weight_sync_address="127.0.0.1:1", quant_cache_address="127.0.0.1:2")
ALPHABET = "char:0123456789+=?# abcdefghijklmnopqrstuvwxyzAHW"


@pytest.fixture
def train_file(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "train.jsonl"
    rows = [{"question": f"What is {i}+{i}?", "solution": f"#### {2 * i}"} for i in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def start(train: pathlib.Path, **run: Any) -> TrainerApp:
    base = {
        "steps": 1, "task.name": "dataset", "task.tokenizer": ALPHABET,
        "dataset.train": str(train), "dataset.prompt": "question",
        "dataset.columns": {"answer": "solution"}, "dataset.max_prompt_tokens": 64,
        "reward.name": "math", "sampling.max_new_tokens": 16,
    }  # fmt: skip
    app = TrainerApp(TrainerSettings(**REQUIRED, auth_token="t", run={**base, **run}),
                     Metrics("trainer"))  # fmt: skip
    app.rewards.close()
    return app


def test_a_recipe_that_fits_starts(train_file: pathlib.Path) -> None:
    app = start(train_file)
    assert app.inputs == {"train_rows": 20}
    (p,) = app.core.prompts.next_batch(1)
    assert p.problem.row["answer"].startswith("#### ")


@pytest.mark.parametrize(
    ("run", "named"),
    [
        (
            {"dataset.train": "/no/such/train.jsonl"},
            "dataset.train = '/no/such/train.jsonl': dataset /no/such/train.jsonl: no such file",
        ),
        (
            {"dataset.prompt": "prompt"},
            "dataset.prompt: dataset.train = .* has no column 'prompt'; columns found: "
            r"\['question', 'solution'\]",
        ),
        (
            {"dataset.columns": {}},
            "reward.name = 'math' reads field 'answer': dataset.train has no column 'answer'",
        ),
        (
            {"reward.name": "f1"},
            r"reward.name = 'f1': unknown reward 'f1'; known: \['code', 'exact_match', 'math'\]",
        ),
        (
            {"reward.name": "my_rewards_nowhere:score"},
            "reward.name = 'my_rewards_nowhere:score': .*No module named 'my_rewards_nowhere'",
        ),
        (
            {"reward.options": {"tolerance": 0.1}},
            r"reward.name = 'math': .*options \['tolerance'\] do not fit",
        ),
        (
            {"dataset.max_prompt_tokens": 500},
            "dataset.max_prompt_tokens = 500 plus sampling.max_new_tokens = 16 is 516 positions; "
            "the model has 512",
        ),
        (
            {"task.tokenizer": "char:0123456789"},
            "none of the first 16 rows gives a prompt .*character 'W' is not in the tokenizer",
        ),
    ],
)
def test_a_recipe_that_does_not_fit_is_refused_naming_the_key(
    train_file: pathlib.Path, run: dict, named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        start(train_file, **run)


@pytest.mark.parametrize(
    ("run", "named"),
    [
        (
            {"task.name": "dataset", "sampling.max_new_tokens": 8},
            'task.name = "dataset" needs dataset.train',
        ),
        (
            {"task.name": "dataset", "dataset.train": "t.jsonl"},
            "sampling.max_new_tokens must be set for a dataset task",
        ),
        (
            {
                "task.name": "dataset",
                "dataset.train": "t.jsonl",
                "sampling.max_new_tokens": 8,
                "eval.every": 5,
            },
            "eval.every = 5 needs dataset.eval",
        ),
        (
            {"reward.truncated": "half"},
            r"reward.truncated = 'half': expected one of \['zero', 'score'\]",
        ),
        ({"reward.workers": 0}, r"reward.workers must be in \[1, 256\], got 0"),
        ({"dataset.chat": "sometimes"}, "dataset.chat = 'sometimes'"),
        ({"eval.samples": 0}, "eval.prompts and eval.samples must be >= 1"),
    ],
)
def test_bad_dataset_reward_and_eval_keys_are_refused_by_the_tree(run: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load_run_config(overrides=run)


def test_a_reward_that_needs_a_dataset_field_is_refused_on_a_synthetic_task() -> None:
    named = "reward.name = 'code' reads field 'tests': a synthetic task gives only 'answer'"
    with pytest.raises(ConfigError, match=re.escape(named)):
        TrainerApp(
            TrainerSettings(**REQUIRED, auth_token="t", run={"reward.name": "code"}),
            Metrics("trainer"),
        )
