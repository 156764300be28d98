"""The answer rewards: exact match, and math equivalence through math-verify."""

from __future__ import annotations

import pytest

from trace_common.rewards import load_reward
from trace_common.rewards.answers import final_reference

GSM = {"answer": "Ann has 7 apples and buys 5 more: 7 + 5 = 12.\n#### 12"}


def test_exact_match_is_exact_unless_asked_to_strip() -> None:
    reward = load_reward("exact_match")
    assert reward({"answer": "1234"}, "1234") == 1.0
    assert reward({"answer": "1234"}, "1234 ") == 0.0
    assert load_reward("exact_match", {"strip": True})({"answer": "1234"}, " 1234\n") == 1.0
    assert reward.fields == ("answer",)


@pytest.mark.parametrize(
    ("completion", "value"),
    [
        ("7 + 5 = 12.\n#### 12", 1.0),  # GSM8K's own format
        ("The answer is \\boxed{12}.", 1.0),
        ("First 7, then 5 more, so 12", 1.0),  # the last number
        ("#### 12.0", 1.0),  # equal as numbers
        ("7 + 5 = 12, so #### 13", 0.0),  # the final answer, not a number of the working
        ("The answer is \\boxed{13}.", 0.0),
        ("I do not know", 0.0),
        ("", 0.0),
    ],
)
def test_math_checks_the_final_answer_for_equivalence(completion: str, value: float) -> None:
    assert load_reward("math")(GSM, completion) == value


def test_math_equivalence_is_mathematical_not_textual() -> None:
    reward = load_reward("math")
    assert reward({"answer": "0.5"}, "\\boxed{\\frac{1}{2}}") == 1.0
    assert reward({"answer": "1/2"}, "it is 0.5") == 1.0
    assert reward({"answer": "\\frac{3}{4}"}, "\\boxed{0.75}") == 1.0
    assert reward({"answer": "0.5"}, "\\boxed{0.6}") == 0.0


def test_a_gsm8k_reference_is_reduced_to_its_final_answer() -> None:
    assert final_reference(GSM["answer"]) == "12"
    assert final_reference("42") == "42"
    assert final_reference("a #### 1 #### 2") == "2"


def test_a_row_without_the_answer_field_names_the_fields_found() -> None:
    with pytest.raises(KeyError, match=r"no field 'answer'; fields found: \['question'\]"):
        load_reward("math")({"question": "q"}, "12")
