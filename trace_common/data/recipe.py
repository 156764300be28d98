"""What a run trains on, built from its recipe: the prompt stream (a synthetic task or the
user's dataset), the held-out prompts and the reward, with the start-up checks that refuse a
recipe whose dataset, tokenizer, model or reward do not fit together (a ConfigError naming the
recipe key and its value)."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import Any

from trace_common.config import ConfigError, RunConfig
from trace_common.data.prompts import DatasetPrompts, PromptFormat, SkipRow, first_prompts
from trace_common.data.sources import DatasetError, RowSource, open_source
from trace_common.rewards.pool import RewardPoolConfig
from trace_common.rewards.registry import RewardError, load_reward
from trace_common.tasks import Prompt, PromptStream, Tokenizer, make_task

EVAL_SEED_OFFSET = 7_777_777  # a synthetic task's held-out prompts: a stream of their own
PROBE_ROWS = 16  # rows rendered at start-up to catch a format that does not fit


def resolve_run_paths(run: RunConfig, root: pathlib.Path | None = None) -> RunConfig:
    """The run with its relative file paths (dataset splits, a tokenizer or model directory)
    made absolute against `root` (default: the working directory). A named tokenizer ("char")
    or model shape stays a name."""
    root = (root or pathlib.Path.cwd()).resolve()

    def absolute(p: pathlib.Path) -> pathlib.Path:
        return p if p.is_absolute() else root / p

    def dir_or_name(value: str) -> str:
        candidate = absolute(pathlib.Path(value))
        return str(candidate) if candidate.is_dir() else value

    run = dataclasses.replace(run)
    d = run.dataset
    run.dataset = dataclasses.replace(
        d, train=absolute(d.train) if d.train is not None else None,
        eval=absolute(d.eval) if d.eval is not None else None,
    )  # fmt: skip
    if not run.task.tokenizer.startswith("char"):
        run.task = dataclasses.replace(run.task, tokenizer=dir_or_name(run.task.tokenizer))
    run.model = dataclasses.replace(
        run.model, name=dir_or_name(run.model.name),
        init_weights=absolute(run.model.init_weights) if run.model.init_weights else None,
    )  # fmt: skip
    return run


def is_dataset(run: RunConfig) -> bool:
    return run.task.name == "dataset"


def prompt_format(run: RunConfig) -> PromptFormat:
    d = run.dataset
    return PromptFormat(
        prompt_column=d.prompt, template=d.template, system=d.system, chat=d.chat,
        target_column=d.target, columns=dict(d.columns), max_prompt_tokens=d.max_prompt_tokens,
    )  # fmt: skip


def open_split(run: RunConfig, split: str) -> RowSource:
    """The dataset's "train" or "eval" split; ConfigError naming the key when it cannot be
    opened."""
    d = run.dataset
    path, name = (d.train, d.train_split) if split == "train" else (d.eval, d.eval_split)
    key = f"dataset.{split}"
    if path is None:
        raise ConfigError(f"{key} is not set")
    try:
        return open_source(path, name)
    except (DatasetError, ImportError) as e:
        raise ConfigError(f"{key} = {str(path)!r}: {e}") from None


def train_prompts(run: RunConfig, tokenizer: Tokenizer) -> PromptStream | DatasetPrompts:
    """The run's prompt stream, seeded by the run's seed."""
    if not is_dataset(run):
        return PromptStream(make_task(run.task.name, run.task.difficulty), tokenizer, seed=run.seed)
    try:
        return DatasetPrompts(
            open_split(run, "train"), prompt_format(run), tokenizer, seed=run.seed,
            shuffle=run.dataset.shuffle,
        )  # fmt: skip
    except DatasetError as e:
        raise ConfigError(f"dataset.train = {str(run.dataset.train)!r}: {e}") from None


def eval_prompts(run: RunConfig, tokenizer: Tokenizer, n: int | None = None) -> list[Prompt]:
    """The held-out prompts (`eval.prompts` of them unless `n`): the dataset's eval split in
    file order, or a synthetic task's own held-out stream. The same at every evaluation."""
    n = run.eval.prompts if n is None else n
    if not is_dataset(run):
        task = make_task(run.task.name, run.task.difficulty)
        return PromptStream(task, tokenizer, seed=run.seed + EVAL_SEED_OFFSET).next_batch(n)
    try:
        stream = DatasetPrompts(open_split(run, "eval"), prompt_format(run), tokenizer)
    except DatasetError as e:
        raise ConfigError(f"dataset.eval = {str(run.dataset.eval)!r}: {e}") from None
    prompts = first_prompts(stream, n)
    if not prompts:
        raise ConfigError(
            f"dataset.eval = {str(run.dataset.eval)!r}: no row gives a prompt within "
            f"dataset.max_prompt_tokens = {run.dataset.max_prompt_tokens}"
        )
    return prompts


def reward_config(run: RunConfig) -> RewardPoolConfig:
    r = run.reward
    return RewardPoolConfig(name=r.name, options=dict(r.options), workers=r.workers,
                            timeout_s=r.timeout_s)  # fmt: skip


def check_reward(run: RunConfig, columns: Sequence[str] | None) -> None:
    """The reward loads with its options, and the fields it declares are columns of the
    dataset (after dataset.columns) or, for a synthetic task, its answer."""
    try:
        reward = load_reward(run.reward.name, run.reward.options)
    except RewardError as e:
        raise ConfigError(f"reward.name = {run.reward.name!r}: {e}") from None
    available = set(columns) | set(run.dataset.columns) if columns is not None else {"answer"}
    for name in reward.fields:
        if name not in available:
            where = (
                f"dataset.train has no column {name!r} (map one with dataset.columns = "
                f'{{{name} = "<column>"}}); columns found: {sorted(columns)}'
                if columns is not None
                else f"a synthetic task gives only 'answer' (task.name = {run.task.name!r})"
            )
            raise ConfigError(f"reward.name = {run.reward.name!r} reads field {name!r}: {where}")


def check_inputs(run: RunConfig, tokenizer: Tokenizer, max_positions: int | None) -> dict[str, Any]:
    """Start-up checks of a run's data and reward against its tokenizer and model; returns
    what they found (rows per split). Raises ConfigError naming the key that does not fit."""
    found: dict[str, Any] = {}
    if not is_dataset(run):
        check_reward(run, None)
        return found
    train = open_split(run, "train")
    found["train_rows"] = len(train)
    fmt = prompt_format(run)
    for col in fmt.needed_columns():
        if col not in train.columns:
            key = "dataset.prompt" if col == fmt.prompt_column else (
                "dataset.target" if col == fmt.target_column else "dataset.columns"
            )  # fmt: skip
            raise ConfigError(
                f"{key}: dataset.train = {str(run.dataset.train)!r} has no column {col!r}; "
                f"columns found: {list(train.columns)}"
            )
    check_reward(run, train.columns)
    if run.dataset.eval is not None:
        found["eval_rows"] = len(open_split(run, "eval"))
    stream = DatasetPrompts(train, fmt, tokenizer, seed=run.seed, shuffle=False)
    reasons: list[str] = []
    for position in range(min(PROBE_ROWS, len(train))):
        try:
            stream.encode(position, stream.problem(position))
        except SkipRow as skip:
            reasons.append(str(skip))
    if len(reasons) == min(PROBE_ROWS, len(train)):
        raise ConfigError(
            f"dataset.train = {str(run.dataset.train)!r}: none of the first {len(reasons)} rows "
            f"gives a prompt (first: {reasons[0]})"
        )
    if max_positions is not None:
        longest = run.dataset.max_prompt_tokens + run.sampling.max_new_tokens
        if longest > max_positions:
            raise ConfigError(
                f"dataset.max_prompt_tokens = {run.dataset.max_prompt_tokens} plus "
                f"sampling.max_new_tokens = {run.sampling.max_new_tokens} is {longest} positions; "
                f"the model has {max_positions}"
            )
    return found
