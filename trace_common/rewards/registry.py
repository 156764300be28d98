"""Rewards by name: a reward is a function ``(row, completion, **options) -> float``.

`row` is the prompt's dataset row (every column, plus the fields the recipe's
``dataset.columns`` maps); `completion` is the completion's text before EOS. Options come from
the recipe's ``[reward.options]`` table as keyword arguments.

Built in: ``exact_match``, ``math``, ``code``. Any other name is ``module:function``, imported
where the reward runs (the module must be importable there: on ``PYTHONPATH`` or installed).
A reward may declare the row fields it reads as a ``fields`` attribute (a tuple of names);
the trainer checks them against the dataset's columns at start-up.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Built-in reward name -> "module:function".
BUILTIN_REWARDS: dict[str, str] = {
    "exact_match": "trace_common.rewards.answers:exact_match",
    "math": "trace_common.rewards.answers:math_equivalent",
    "code": "trace_common.rewards.programs:code_reward",
}

RewardFn = Callable[..., float]


class RewardError(ValueError):
    """A reward that cannot be loaded or called as configured (names it)."""


def import_reward(name: str) -> RewardFn:
    """The function a reward name stands for: a built-in name or ``module:function``."""
    target = BUILTIN_REWARDS.get(name, name)
    if ":" not in target:
        raise RewardError(
            f"unknown reward {name!r}; known: {sorted(BUILTIN_REWARDS)}, or a custom reward "
            "as 'module:function'"
        )
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises on import
        raise RewardError(
            f"reward {name!r}: importing module {module_name!r} failed: {type(e).__name__}: {e}"
        ) from e
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise RewardError(f"reward {name!r}: module {module_name!r} has no function {attr!r}")
    return fn


@dataclass(frozen=True, slots=True)
class Reward:
    """A reward function bound to its options."""

    name: str
    fn: RewardFn
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def fields(self) -> tuple[str, ...]:
        """The row fields the reward declares it reads (none declared: ())."""
        return tuple(getattr(self.fn, "fields", ()))

    def __call__(self, row: Mapping[str, Any], completion: str) -> float:
        value = self.fn(row, completion, **self.options)
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise TypeError(f"reward {self.name!r} returned {value!r}; expected a finite float")
        return float(value)


def load_reward(name: str, options: Mapping[str, Any] | None = None) -> Reward:
    """The named reward with `options` checked against its signature (an unknown option is a
    RewardError naming it and the ones it takes)."""
    fn = import_reward(name)
    options = dict(options or {})
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: nothing to check
        return Reward(name=name, fn=fn, options=options)
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) < 2 and not varargs:
        raise RewardError(
            f"reward {name!r}: a reward takes (row, completion, **options), got {fn.__name__}{sig}"
        )
    try:
        sig.bind({}, "", **options)
    except TypeError as e:
        takes = [p.name for p in params[2:] if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        raise RewardError(
            f"reward {name!r}: options {sorted(options)} do not fit {fn.__name__}{sig} ({e}); "
            f"it takes {takes}"
        ) from None
    return Reward(name=name, fn=fn, options=options)
