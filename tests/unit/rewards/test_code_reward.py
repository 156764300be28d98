"""The `code` reward: the completion's code (a fenced block, or a body continuing the
prompt) against the row's tests in the sandbox."""

from __future__ import annotations

import json

import pytest

from trace_common.rewards import load_reward
from trace_common.rewards.programs import extract_code, program

ROW = {
    "prompt": 'def add(a, b):\n    """Return a plus b."""\n',
    "entry_point": "add",
    "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"],
}


def test_a_body_that_continues_the_prompt_passes() -> None:
    assert load_reward("code")(ROW, "    return a + b\n") == 1.0


def test_a_fenced_function_is_run_as_it_is() -> None:
    text = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert extract_code(text) == "def add(a, b):\n    return a + b\n"
    assert program(ROW, text) == "def add(a, b):\n    return a + b\n"  # defines add itself
    assert load_reward("code")(ROW, text) == 1.0


def test_fraction_or_all_or_nothing() -> None:
    half = "    return 3\n"  # passes only add(1, 2) == 3
    assert load_reward("code")(ROW, half) == pytest.approx(1 / 3)
    assert load_reward("code", {"mode": "all"})(ROW, half) == 0.0
    assert load_reward("code", {"mode": "all"})(ROW, "    return b + a\n") == 1.0


def test_tests_may_be_a_json_string() -> None:
    row = {**ROW, "tests": json.dumps(ROW["tests"])}
    assert load_reward("code")(row, "    return a + b\n") == 1.0


def test_garbage_and_hostile_completions_score_zero() -> None:
    reward = load_reward("code", {"timeout_s": 1.0})
    for text in ("not python at all", "    while True: pass\n", "    import os; os.fork()\n"):
        assert reward(ROW, text) == 0.0, text


def test_a_row_without_tests_names_the_fields_found() -> None:
    with pytest.raises(
        KeyError, match=r"no field 'tests'; fields found: \['entry_point', 'prompt'\]"
    ):
        load_reward("code")({"prompt": "x", "entry_point": "f"}, "pass")
    assert load_reward("code").fields == ("tests",)


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="mode='most'"):
        load_reward("code", {"mode": "most"})(ROW, "    return a + b\n")
