"""Engine selection from the replica's settings, on a machine without CUDA."""

from __future__ import annotations

import pytest
import torch

from trace_common.device import resolve_device
from trace_common.model import GuidanceConfig, MoECausalLM, QuantConfig, get_config
from trace_common.model.quant import policy_configs
from trace_common.rl.policy import LearnerConfig, ModelLearner
from trace_common.rollout.cuda import unsupported_reason
from trace_common.rollout.native import NativeEngine
from trace_common.rollout.select import EngineSettings, make_engine_factory
from trace_common.rollout.types import SamplingConfig


def exported(mode: str = "trace"):
    model = MoECausalLM(get_config("debug")).init_weights(seed=1)
    learner = ModelLearner(model, LearnerConfig(mode=mode), quant=QuantConfig(),
                           guidance=GuidanceConfig(), eos_id=2, pad_id=0)  # fmt: skip
    return learner.export_weights()


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="TRACE_DEVICE='gpu'"):
        resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:0")


def test_auto_on_cpu_builds_the_pytorch_engine_and_rebuilds_per_version() -> None:
    factory = make_engine_factory(EngineSettings(engine="auto", device=torch.device("cpu")))
    tensors, meta = exported()
    e0 = factory(tensors, meta, 0)
    e1 = factory(tensors, meta, 1)
    assert isinstance(e0, NativeEngine) and isinstance(e1, NativeEngine) and e0 is not e1
    assert factory.name == "native" and next(e0.model.parameters()).dtype == torch.float32
    out = e0.generate([[1, 5, 6]], 2, SamplingConfig(max_new_tokens=3), with_records=True)
    assert len(out) == 2 and all(s.records for s in out)


def test_cuda_engine_needs_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        EngineSettings(engine="cuda", device=torch.device("cpu"))
    with pytest.raises(ValueError, match="max_batch=0"):
        EngineSettings(max_batch=0)


def test_unsupported_reasons_name_what_the_cuda_engine_refuses() -> None:
    _, meta = exported()
    cfg, quant = policy_configs(meta)
    assert "groups of 64" in unsupported_reason(cfg, quant, GuidanceConfig())  # debug: 32 wide
    cfg = get_config("mid-1b")
    assert unsupported_reason(cfg, quant, GuidanceConfig()) is None
    assert "mode 'full'" in unsupported_reason(cfg, quant, GuidanceConfig(mode="full"))
    every = QuantConfig.every_site(cfg)
    assert "FP4 nvfp4 at sites" in unsupported_reason(cfg, every, None)
    assert "sites ['attn_in']" in unsupported_reason(cfg, quant, GuidanceConfig(sites=("attn_in",)))
    assert "mxfp4" in unsupported_reason(cfg, QuantConfig(format="mxfp4"), None)
    shared = get_config("debug-shared")
    assert "shared_expert" in unsupported_reason(shared, QuantConfig.none(), None)
    assert unsupported_reason(cfg, QuantConfig.none(), None) is None
    assert "needs FP4" in unsupported_reason(cfg, QuantConfig.none(), GuidanceConfig())


class _ReloadingEngine:
    name = "fake"

    def __init__(self) -> None:
        self.versions: list[int] = []

    def load_version(self, tensors, metadata, version: int) -> _ReloadingEngine:
        self.versions.append(version)
        return self


def test_a_table_entry_is_all_a_new_engine_needs(monkeypatch) -> None:
    """An entry in ENGINES is a choice the replica's settings, the demo and the selector all
    take: built for the first version, reloaded in place where the entry says so."""
    from services.rollout.config import RolloutSettings
    from trace_common.launch.demo import DemoConfig
    from trace_common.rollout import select

    monkeypatch.setitem(select.ENGINES, "fake", select.EngineEntry(
        "fake", "a test engine", lambda sel, t, m, v: _ReloadingEngine(), reloads=True))  # fmt: skip
    required = {"weight_sync_address": "127.0.0.1:1", "quant_cache_address": "127.0.0.1:2",
                "auth_token": "t"}  # fmt: skip
    assert RolloutSettings(**required, rollout_engine="fake").rollout_engine == "fake"
    assert DemoConfig.load(rollout_engine="fake").rollout_engine == "fake"
    factory = make_engine_factory(EngineSettings(engine="fake"))
    first = factory({}, {}, 0)
    assert factory({}, {}, 1) is first and first.versions == [1] and factory.name == "fake"
    with pytest.raises(ValueError, match="rollout engine 'tensorrt'; expected one of"):
        RolloutSettings(**required, rollout_engine="tensorrt")


def test_built_engines_are_named_by_their_entries() -> None:
    from trace_common.rollout.cuda import CudaEngine
    from trace_common.rollout.select import ENGINES

    assert list(ENGINES) == ["auto", "native", "cuda", "vllm"]
    assert not ENGINES[NativeEngine.name].reloads and ENGINES[CudaEngine.name].reloads
    assert ENGINES["cuda"].needs_cuda and ENGINES["vllm"].reloads
