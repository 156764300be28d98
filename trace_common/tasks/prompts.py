"""A seeded, resumable stream of prompts.

Problem ``i`` of a stream depends only on ``(seed, i)``, so a trainer that checkpoints the
cursor and restarts continues with exactly the prompts it would have seen.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trace_common.tasks.tasks import Problem, Task
from trace_common.tasks.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Prompt:
    """A problem with its stream position (``prompt_id``) and its token ids (BOS first)."""

    prompt_id: int
    problem: Problem
    token_ids: tuple[int, ...]


class PromptStream:
    """Deterministic prompts: ``next_batch(n)`` returns the next ``n`` prompts of the stream."""

    def __init__(self, task: Task, tokenizer: Tokenizer, seed: int = 0) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.seed = seed
        self.cursor = 0

    def problem(self, index: int) -> Problem:
        """Problem at position ``index``: seeded by a string, so stable across processes."""
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        return self.task.sample(random.Random(f"trace-prompts:{self.seed}:{index}"))

    def encode(self, prompt_id: int, problem: Problem) -> Prompt:
        ids = tuple(self.tokenizer.prompt_ids(problem.prompt))
        return Prompt(prompt_id=prompt_id, problem=problem, token_ids=ids)

    def with_seed(self, seed: int) -> PromptStream:
        """The same task and tokenizer, another stream (e.g. a warm start's own problems)."""
        return PromptStream(self.task, self.tokenizer, seed=seed)

    def next_batch(self, n: int) -> list[Prompt]:
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        out = [self.encode(i, self.problem(i)) for i in range(self.cursor, self.cursor + n)]
        self.cursor += n
        return out

    @property
    def skipped(self) -> dict[str, int]:
        """Prompts skipped so far, by reason (a generated task skips none)."""
        return {"too_long": 0, "malformed": 0}

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "cursor": self.cursor}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(
                f"prompt stream seed mismatch: checkpoint has {state['seed']}, stream has {self.seed}"
            )
        self.cursor = int(state["cursor"])
