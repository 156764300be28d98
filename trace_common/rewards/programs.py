"""The `code` reward: a completion's Python run against its row's tests in the sandbox
(`trace_common.rewards.sandbox`).

The row holds ``tests`` (a list of Python snippets, each an independent test such as
``"assert add(1, 2) == 3"``, or a JSON string of that list) and, HumanEval style, optionally
``prompt`` (a signature and docstring) and ``entry_point`` (the function's name). The code is
the completion's last fenced block (```python ... ```) if it has one, else all of it; when it
does not define ``entry_point`` itself, it continues the prompt, which is put before it.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from trace_common.rewards.sandbox import SandboxLimits, run_tests

FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
    """The last fenced code block of `completion`, or all of it when it has none."""
    blocks = FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def defines(code: str, name: str) -> bool:
    """Whether `code` parses and defines a top-level function or class `name`."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and node.name == name
        for node in tree.body
    )


def row_tests(row: Mapping[str, Any]) -> list[str]:
    if "tests" not in row:
        raise KeyError(f"the row has no field 'tests'; fields found: {sorted(row)}")
    tests = row["tests"]
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            tests = [tests]  # one test as a plain string
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError(f"field 'tests' must be a non-empty list of strings, got {tests!r:.200}")
    return tests


def program(row: Mapping[str, Any], completion: str) -> str:
    """The code to run: the completion's, after the row's prompt when it continues it."""
    code = extract_code(completion)
    entry = row.get("entry_point")
    if isinstance(entry, str) and entry and not defines(code, entry):
        code = str(row.get("prompt", "")) + code
    return code


def code_reward(
    row: Mapping[str, Any], completion: str, *, mode: Literal["fraction", "all"] = "fraction",
    timeout_s: float = 10.0, memory_mb: int = 512,
) -> float:  # fmt: skip
    """The fraction of the row's tests the completion passes (``mode="fraction"``), or 1.0
    only when it passes all of them (``"all"``)."""
    if mode not in ("fraction", "all"):
        raise ValueError(f"code reward mode={mode!r}: expected 'fraction' or 'all'")
    tests = row_tests(row)
    limits = SandboxLimits(timeout_s=timeout_s, memory_bytes=int(memory_mb) * 2**20)
    result = run_tests(program(row, completion), tests, limits)
    if mode == "all":
        return float(result.passed == result.total)
    return result.passed / result.total


code_reward.fields = ("tests",)  # type: ignore[attr-defined]
