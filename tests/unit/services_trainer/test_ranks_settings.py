"""The trainer under torchrun refuses, before joining the process group, what a sharded
learner cannot do."""

from __future__ import annotations

import pytest

from services.trainer.build import build_learner
from services.trainer.config import TrainerSettings
from trace_common.model import GuidanceConfig, MoECausalLM, QuantConfig, get_config

REQUIRED = {"weight_sync_address": "127.0.0.1:1", "quant_cache_address": "127.0.0.1:2"}


def test_unguided_lost_records_are_refused_under_torchrun(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    s = TrainerSettings(**REQUIRED, auth_token="t", run={"stores.lost_records": "unguided"})
    with pytest.raises(
        ValueError, match="lost_records = 'unguided' is not supported under torchrun"
    ):
        build_learner(
            s, MoECausalLM(get_config("debug")), quant=QuantConfig(), guidance=GuidanceConfig(),
            eos_id=2, pad_id=0, records=None,  # type: ignore[arg-type]
        )  # fmt: skip
