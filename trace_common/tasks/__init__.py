"""Verifiable RL tasks: problems, exact-match rewards, tokenizers and a seeded prompt stream."""

from __future__ import annotations

from trace_common.tasks.prompts import Prompt, PromptStream
from trace_common.tasks.tasks import (
    TASK_NAMES,
    AdditionTask,
    MixedTask,
    Problem,
    ReverseTask,
    SortTask,
    Task,
    completion_text,
    exact_match_reward,
    make_task,
)
from trace_common.tasks.tokenizer import (
    CharTokenizer,
    HFTokenizerAdapter,
    Tokenizer,
    load_tokenizer,
)

__all__ = [
    "TASK_NAMES",
    "AdditionTask",
    "CharTokenizer",
    "HFTokenizerAdapter",
    "MixedTask",
    "Problem",
    "Prompt",
    "PromptStream",
    "ReverseTask",
    "SortTask",
    "Task",
    "Tokenizer",
    "completion_text",
    "exact_match_reward",
    "load_tokenizer",
    "make_task",
]
