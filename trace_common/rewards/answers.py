"""Rewards that compare a completion's answer with the row's reference answer.

- `exact_match`: the completion text equals the reference (the synthetic digit tasks).
- `math`: the completion's final answer (the last ``\\boxed{}``, a GSM8K-style ``#### N``, or
  the last number) is mathematically equivalent to the reference, as the `math-verify` library
  parses and compares them (``1/2`` = ``0.5`` = ``\\frac{1}{2}``). A GSM8K reference (a worked
  solution ending in ``#### N``) is reduced to what follows its last ``####``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GSM8K_DELIMITER = "####"  # GSM8K's worked answers end in "#### <number>"


def _reference(row: Mapping[str, Any], field: str) -> str:
    if field not in row:
        raise KeyError(f"the row has no field {field!r}; fields found: {sorted(row)}")
    value = row[field]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise TypeError(f"field {field!r} must be a string or a number, got {type(value).__name__}")
    return value


def exact_match(row: Mapping[str, Any], completion: str, *, strip: bool = False) -> float:
    """1.0 when `completion` equals the row's `answer` (both stripped of surrounding
    whitespace with `strip`), else 0.0."""
    answer = _reference(row, "answer")
    if strip:
        return float(completion.strip() == answer.strip())
    return float(completion == answer)


exact_match.fields = ("answer",)  # type: ignore[attr-defined]


def final_reference(answer: str, delimiter: str = GSM8K_DELIMITER) -> str:
    """The reference's final answer: what follows its last `delimiter`, else all of it."""
    if delimiter and delimiter in answer:
        return answer.rsplit(delimiter, 1)[1].strip()
    return answer.strip()


def math_equivalent(
    row: Mapping[str, Any], completion: str, *, delimiter: str = GSM8K_DELIMITER,
    timeout_s: int = 5,
) -> float:  # fmt: skip
    """1.0 when the completion's final answer equals the row's `answer` mathematically."""
    try:
        from math_verify import parse, verify
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the math reward needs math-verify: pip install 'trace-rl[data]'") from e
    gold_text = final_reference(_reference(row, "answer"), delimiter)
    gold = parse(f"${gold_text}$", parsing_timeout=timeout_s)
    if not gold:
        raise ValueError(f"math reward: the reference answer {gold_text!r} does not parse")
    if delimiter and delimiter in completion:
        # "... #### 12": the answer is what follows the last delimiter, not the last number of
        # the working before it.
        completion = completion.rsplit(delimiter, 1)[1]
    answer = parse(completion, parsing_timeout=timeout_s)
    if not answer:
        return 0.0
    return float(verify(gold, answer, timeout_seconds=timeout_s))


math_equivalent.fields = ("answer",)  # type: ignore[attr-defined]
