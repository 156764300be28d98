"""The training-mode names are declared once (trace_common.rl.types); every table keyed by
mode must name exactly those modes."""

from __future__ import annotations

from typing import get_args

import pytest

from trace_common.rl.types import TRAIN_MODES, TrainMode


def test_train_modes_are_the_literal_type() -> None:
    assert TRAIN_MODES == get_args(TrainMode) == ("bf16", "fp4", "rtn", "trace")


def test_every_mode_is_one_spec_the_learner_understands() -> None:
    from trace_common.model.runtime import QAT_MODES
    from trace_common.rl.policy import LearnerConfig
    from trace_common.rl.types import MODES

    assert tuple(MODES) == TRAIN_MODES and all(m.name == k for k, m in MODES.items())
    assert {m.qat for m in MODES.values()} <= set(QAT_MODES)
    for name, spec in MODES.items():
        assert LearnerConfig(mode=name).spec is spec
        assert not spec.guided or spec.fp4_policy, "records come from an FP4 rollout"
    with pytest.raises(ValueError, match="unknown training mode 'int8'"):
        LearnerConfig(mode="int8")


def test_the_run_config_accepts_exactly_the_modes() -> None:
    import typing

    from trace_common.config import RunConfig

    assert get_args(typing.get_type_hints(RunConfig)["mode"]) == TRAIN_MODES
