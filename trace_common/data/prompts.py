"""The prompt stream over a dataset split: deterministic, resumable, never the whole file in
memory.

Position ``p`` of the stream is row ``perm_e[p % N]`` of the split, where ``e = p // N`` is
the epoch and ``perm_e`` a permutation seeded by ``(seed, e)`` (the identity without
shuffling). So the prompts depend only on ``(seed, position)``: a trainer that checkpoints
the cursor and restarts continues with exactly the prompts it would have seen, like the
synthetic tasks' :class:`~trace_common.tasks.PromptStream`.

A row becomes a prompt by :class:`PromptFormat`:

- its prompt column holds plain text or a list of chat messages (``{"role", "content"}``);
- plain text may go through a template string (``"Question: {question}\\nAnswer:"``, any column
  by name, ``{prompt}`` for the prompt column);
- with a Hugging Face tokenizer that has a chat template, messages (and, with ``chat = "auto"``
  or ``"always"``, plain prompts as one user message) go through that template;
- a prompt longer than ``max_prompt_tokens`` is skipped and counted, never truncated; a row
  that cannot be read or rendered is skipped and counted too, its reason logged with its file
  and line.

Reward fields: ``columns`` maps a field a reward reads to the dataset column holding it
(``{answer = "solution"}``); every other column reaches the reward under its own name.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from trace_common.data.sources import DatasetError, RowSource
from trace_common.tasks.prompts import Prompt
from trace_common.tasks.tasks import Problem
from trace_common.tasks.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CHAT_MODES = ("auto", "always", "never")
# A stream that skips this many rows in a row (and at least a whole split's worth when the
# split is smaller) stops: every prompt is too long or malformed, the recipe does not fit.
MAX_CONSECUTIVE_SKIPS = 1000


@dataclass(kw_only=True, slots=True, frozen=True)
class PromptFormat:
    """How a row becomes a prompt (and what of it a reward and a warm start read)."""

    prompt_column: str = "prompt"  # plain text, or a list of {"role", "content"} messages
    template: str = ""  # plain prompts: a format string over the row's columns; "" = as is
    system: str = ""  # chat prompts: a system message put first ("" = none)
    chat: Literal["auto", "always", "never"] = "auto"  # plain prompts through the chat template
    target_column: str = ""  # the text a supervised warm start fits ("" = none)
    columns: Mapping[str, str] = field(default_factory=dict)  # reward field -> dataset column
    max_prompt_tokens: int = 512

    def __post_init__(self) -> None:
        if self.chat not in CHAT_MODES:
            raise ValueError(f"chat={self.chat!r}: expected one of {CHAT_MODES}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")

    def needed_columns(self) -> list[str]:
        """The dataset columns this format reads (the reward's fields come on top)."""
        cols = [self.prompt_column, *self.columns.values()]
        if self.target_column:
            cols.append(self.target_column)
        return list(dict.fromkeys(cols))


class SkipRow(Exception):
    """A row that gives no prompt: `reason` is "too_long" or "malformed"."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def check_columns(source: RowSource, needed: Sequence[str], what: str) -> None:
    """DatasetError naming the first missing column and the columns found."""
    for col in needed:
        if col not in source.columns:
            raise DatasetError(
                f"dataset {source.path}: no column {col!r} ({what}); columns found: "
                f"{list(source.columns)}"
            )


def render_prompt(row: Mapping[str, Any], fmt: PromptFormat, tokenizer: Tokenizer) -> str:
    """The prompt text of `row` (after the template and the chat template). Raises ValueError
    naming the field when the row does not fit the format."""
    value = row.get(fmt.prompt_column)
    chat_template = getattr(tokenizer, "has_chat_template", False)
    if isinstance(value, str):
        text = fmt.template.format_map({**row, "prompt": value}) if fmt.template else value
        if fmt.chat == "always" and not chat_template:
            raise ValueError("chat = 'always' needs a tokenizer with a chat template")
        if fmt.chat == "never" or not chat_template:
            return text
        messages = [{"role": "user", "content": text}]
    elif isinstance(value, list) and value:
        if not chat_template:
            raise ValueError(
                f"field {fmt.prompt_column!r} holds chat messages, but the tokenizer has no chat "
                "template (use a Hugging Face tokenizer directory that has one)"
            )
        for m in value:
            if not (isinstance(m, Mapping) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):  # fmt: skip
                raise ValueError(
                    f"field {fmt.prompt_column!r}: a chat message must be "
                    f'{{"role": str, "content": str}}, got {m!r}'
                )
        messages = [{"role": m["role"], "content": m["content"]} for m in value]
    else:
        raise ValueError(
            f"field {fmt.prompt_column!r} must be a string or a non-empty list of chat "
            f"messages, got {type(value).__name__}"
        )
    if fmt.system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": fmt.system}, *messages]
    return tokenizer.render_chat(messages)  # type: ignore[attr-defined]


def reward_row(row: Mapping[str, Any], fmt: PromptFormat) -> dict[str, Any]:
    """What a reward sees of `row`: every column, and each mapped field under its name."""
    out = dict(row)
    for name, col in fmt.columns.items():
        out[name] = row[col]
    return out


class DatasetPrompts:
    """Deterministic prompts of one split: ``next_batch(n)`` returns the next ``n`` prompts
    that fit (the ones that do not are skipped and counted in :attr:`skipped`)."""

    def __init__(
        self,
        source: RowSource,
        fmt: PromptFormat,
        tokenizer: Tokenizer,
        *,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        self.source = source
        self.fmt = fmt
        self.tokenizer = tokenizer
        self.seed = seed
        self.shuffle = shuffle
        self.cursor = 0
        self.skipped = {"too_long": 0, "malformed": 0}
        self._epoch = -1
        self._perm: np.ndarray | None = None
        check_columns(source, fmt.needed_columns(), "named by the recipe's dataset keys")

    def with_seed(self, seed: int) -> DatasetPrompts:
        """The same split and format, another order (e.g. a warm start's own stream)."""
        return DatasetPrompts(self.source, self.fmt, self.tokenizer, seed=seed,
                              shuffle=self.shuffle)  # fmt: skip

    def row_index(self, position: int) -> int:
        """The split's row at stream position `position`."""
        if position < 0:
            raise ValueError(f"prompt index must be >= 0, got {position}")
        n = len(self.source)
        epoch, offset = divmod(position, n)
        if not self.shuffle:
            return offset
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            self._epoch = epoch
        assert self._perm is not None
        return int(self._perm[offset])

    def problem(self, position: int) -> Problem:
        """The problem at `position`; SkipRow when its row gives no prompt."""
        index = self.row_index(position)
        where = self.source.where(index)
        try:
            row = self.source.row(index)
            missing = [c for c in self.fmt.needed_columns() if c not in row]
            if missing:
                raise ValueError(f"no field {missing[0]!r}; fields found: {sorted(row)}")
            text = render_prompt(row, self.fmt, self.tokenizer)
            target = row[self.fmt.target_column] if self.fmt.target_column else ""
            if not isinstance(target, str):
                raise ValueError(
                    f"field {self.fmt.target_column!r} (the warm start's target) must be a "
                    f"string, got {type(target).__name__}"
                )
        except (DatasetError, ValueError, KeyError, IndexError) as e:
            raise SkipRow("malformed", f"{where}: {e}") from None
        return Problem(prompt=text, answer=target, row=reward_row(row, self.fmt))

    def encode(self, prompt_id: int, problem: Problem) -> Prompt:
        """The prompt's token ids; SkipRow when it is longer than the limit (or has a
        character the tokenizer cannot encode)."""
        try:
            ids = tuple(self.tokenizer.prompt_ids(problem.prompt))
        except ValueError as e:
            raise SkipRow("malformed", f"{self.where(prompt_id)}: {e}") from None
        if len(ids) > self.fmt.max_prompt_tokens:
            raise SkipRow(
                "too_long",
                f"{self.where(prompt_id)}: {len(ids)} prompt tokens > max_prompt_tokens="
                f"{self.fmt.max_prompt_tokens}",
            )
        return Prompt(prompt_id=prompt_id, problem=problem, token_ids=ids)

    def where(self, position: int) -> str:
        return self.source.where(self.row_index(position))

    def next_batch(self, n: int) -> list[Prompt]:
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        out: list[Prompt] = []
        run_of_skips = 0
        limit = max(MAX_CONSECUTIVE_SKIPS, len(self.source))
        while len(out) < n:
            position = self.cursor
            self.cursor += 1
            try:
                out.append(self.encode(position, self.problem(position)))
                run_of_skips = 0
            except SkipRow as skip:
                self.skipped[skip.reason] += 1
                run_of_skips += 1
                log.warning("prompt skipped (%s): %s", skip.reason, skip)
                if run_of_skips >= limit:
                    raise DatasetError(
                        f"{run_of_skips} rows in a row gave no prompt (last: {skip}); check "
                        "dataset.max_prompt_tokens and the dataset's columns"
                    ) from None
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "cursor": self.cursor, "rows": len(self.source),
                "skipped": dict(self.skipped)}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(
                f"prompt stream seed mismatch: checkpoint has {state['seed']}, stream has {self.seed}"
            )
        rows = state.get("rows")
        if rows is not None and int(rows) != len(self.source):
            raise ValueError(
                f"dataset {self.source.path} has {len(self.source)} rows, but the checkpoint's "
                f"stream was over {rows}: resuming would not continue its prompt order"
            )
        self.cursor = int(state["cursor"])
        self.skipped = {**self.skipped, **dict(state.get("skipped") or {})}


def first_prompts(stream: DatasetPrompts, n: int) -> list[Prompt]:
    """The first `n` prompts of an unshuffled copy of `stream` (the held-out set: the same
    prompts at every evaluation); fewer when the split has fewer that fit."""
    copy = DatasetPrompts(stream.source, stream.fmt, stream.tokenizer, seed=0, shuffle=False)
    out: list[Prompt] = []
    for position in range(len(copy.source)):
        if len(out) == n:
            break
        try:
            out.append(copy.encode(position, copy.problem(position)))
        except SkipRow as skip:
            log.warning("held-out prompt skipped (%s): %s", skip.reason, skip)
    return out
