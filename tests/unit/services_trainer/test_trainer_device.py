"""The trainer's device (TRACE_DEVICE) and the run's objective.compute_dtype and
objective.activation_checkpointing reach the learner; a device the machine lacks stops
start-up."""

from __future__ import annotations

import pydantic
import pytest
import torch

from services.trainer.app import TrainerApp
from services.trainer.config import TrainerSettings
from trace_common.service import Metrics

REQUIRED = dict(weight_sync_address="127.0.0.1:1", quant_cache_address="127.0.0.1:2")


def _settings(**kw: object) -> TrainerSettings:
    return TrainerSettings(**REQUIRED, auth_token="t", **kw)  # type: ignore[arg-type]


def test_defaults_are_auto() -> None:
    s = _settings()
    o = s.run.objective
    assert (s.device, o.compute_dtype, o.activation_checkpointing) == ("auto", "auto", False)


def test_settings_reach_the_learner() -> None:
    app = TrainerApp(
        _settings(
            device="cpu",
            run={"objective.compute_dtype": "bfloat16", "objective.activation_checkpointing": True},
        ),
        Metrics("trainer"),
    )
    lrn = app.learner
    assert lrn.device == torch.device("cpu") and lrn.autocast_dtype is torch.bfloat16
    assert lrn.model.activation_checkpointing
    assert {p.device.type for p in lrn.model.parameters()} == {"cpu"}
    assert app.status()["device"] == "cpu"


@pytest.mark.parametrize("value", ["nvidia0", "cuda:x", "CUDA", ""])
def test_malformed_device_is_rejected(value: str) -> None:
    with pytest.raises(pydantic.ValidationError, match="device"):
        _settings(device=value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_cuda_without_cuda_stops_start_up() -> None:
    with pytest.raises(ValueError, match="TRACE_DEVICE='cuda' but CUDA is not available"):
        TrainerApp(_settings(device="cuda"), Metrics("trainer"))
