"""Verifiable tasks with an exact-match reward that a tiny MoE can learn on a CPU.

A task turns a random generator into a :class:`Problem` (prompt text and the one correct
answer). The reward is exact match of the completion (text before EOS) with the answer; a
completion that never emitted EOS was cut off at the length limit and scores 0.

Prompt formats (characters of :data:`~trace_common.tasks.tokenizer.DEFAULT_ALPHABET`):

- addition ``"57+68="`` -> ``"125"``
- sort     ``"S3142="`` -> ``"1234"``
- reverse  ``"R3142="`` -> ``"2413"``
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from trace_common.tasks.tokenizer import Tokenizer

REWARD_CORRECT = 1.0
REWARD_WRONG = 0.0


@dataclass(frozen=True, slots=True)
class Problem:
    """One prompt and what scoring it needs.

    `answer` is the text a perfect completion reads (the synthetic tasks' unique answer; a
    dataset's warm-start target, or "" when it has none). `row` holds the fields a reward
    reads (`trace_common.rewards`): a dataset row, or ``{"answer": answer}`` for the synthetic
    tasks."""

    prompt: str
    answer: str
    row: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.row:
            object.__setattr__(self, "row", {"answer": self.answer})


class Task(Protocol):
    """A problem generator with an exact-match verifier."""

    name: str

    def sample(self, rng: random.Random) -> Problem: ...

    @property
    def max_answer_chars(self) -> int: ...


@dataclass(frozen=True, slots=True)
class AdditionTask:
    """``a+b=`` with ``a`` and ``b`` of ``1..digits`` digits; answer is the decimal sum."""

    digits: int = 2
    name: ClassVar[str] = "addition"

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ValueError(f"addition digits must be >= 1, got {self.digits}")

    def sample(self, rng: random.Random) -> Problem:
        hi = 10**self.digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b))

    @property
    def max_answer_chars(self) -> int:
        return self.digits + 1


@dataclass(frozen=True, slots=True)
class SortTask:
    """``S<digits>=``: answer is the digits in ascending order."""

    length: int = 4
    name: ClassVar[str] = "sort"

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"sort length must be >= 1, got {self.length}")

    def sample(self, rng: random.Random) -> Problem:
        s = "".join(rng.choice("0123456789") for _ in range(self.length))
        return Problem(prompt=f"S{s}=", answer="".join(sorted(s)))

    @property
    def max_answer_chars(self) -> int:
        return self.length


@dataclass(frozen=True, slots=True)
class ReverseTask:
    """``R<digits>=``: answer is the digits reversed."""

    length: int = 4
    name: ClassVar[str] = "reverse"

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"reverse length must be >= 1, got {self.length}")

    def sample(self, rng: random.Random) -> Problem:
        s = "".join(rng.choice("0123456789") for _ in range(self.length))
        return Problem(prompt=f"R{s}=", answer=s[::-1])

    @property
    def max_answer_chars(self) -> int:
        return self.length


@dataclass(frozen=True, slots=True)
class MixedTask:
    """Each problem drawn uniformly from the given tasks."""

    tasks: tuple[Task, ...]
    name: ClassVar[str] = "mixed"

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("mixed task needs at least one task")

    def sample(self, rng: random.Random) -> Problem:
        return rng.choice(self.tasks).sample(rng)

    @property
    def max_answer_chars(self) -> int:
        return max(t.max_answer_chars for t in self.tasks)


TASK_NAMES = ("addition", "sort", "reverse", "mixed")


def make_task(name: str, difficulty: int) -> Task:
    """Build a task by name; ``difficulty`` is digits (addition) or sequence length."""
    if name == "addition":
        return AdditionTask(digits=difficulty)
    if name == "sort":
        return SortTask(length=difficulty)
    if name == "reverse":
        return ReverseTask(length=difficulty)
    if name == "mixed":
        return MixedTask(
            tasks=(AdditionTask(difficulty), SortTask(difficulty + 1), ReverseTask(difficulty + 1))
        )
    raise ValueError(f"unknown task {name!r}; expected one of {TASK_NAMES}")


def completion_text(completion_ids: Sequence[int], tokenizer: Tokenizer) -> str | None:
    """Text of a completion up to its first EOS, or ``None`` when it has no EOS (truncated)."""
    ids = [int(i) for i in completion_ids]
    if tokenizer.eos_id not in ids:
        return None
    return tokenizer.decode(ids[: ids.index(tokenizer.eos_id)])


def exact_match_reward(completion_ids: Sequence[int], answer: str, tokenizer: Tokenizer) -> float:
    """1.0 when the text before the first EOS equals ``answer`` exactly, else 0.0."""
    text = completion_text(completion_ids, tokenizer)
    return REWARD_CORRECT if text is not None and text == answer else REWARD_WRONG
