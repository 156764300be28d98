"""The training-mode names are declared once (trace_common.rl.types); every table keyed by
mode must name exactly those modes."""

from __future__ import annotations

from typing import get_args

from trace_common.rl.types import TRAIN_MODES, TrainMode


def test_train_modes_are_the_literal_type() -> None:
    assert TRAIN_MODES == get_args(TrainMode) == ("bf16", "fp4", "rtn", "trace")


def test_the_learner_maps_every_mode_to_a_qat_mode() -> None:
    from trace_common.model.runtime import QAT_MODES
    from trace_common.rl.policy import QAT_OF_MODE

    assert tuple(QAT_OF_MODE) == TRAIN_MODES
    assert set(QAT_OF_MODE.values()) <= set(QAT_MODES)


def test_the_run_config_accepts_exactly_the_modes() -> None:
    import typing

    from trace_common.config import RunConfig

    assert get_args(typing.get_type_hints(RunConfig)["mode"]) == TRAIN_MODES
