"""TRACE_ROLLOUT_ENGINE=vllm (trace_common/rollout/vllm_engine.py). The engine tests need vllm
(`make test-vllm`) and are skipped with the reason without it; the selection tests run anywhere.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from trace_common.model import (
    MoECausalLM,
    QuantConfig,
    export_quantized_state_dict,
    get_config,
    quantize_policy,
)
from trace_common.rollout.meta import PolicyMeta
from trace_common.rollout.native import NativeEngine
from trace_common.rollout.select import EngineSettings, make_engine_factory
from trace_common.rollout.types import SamplingConfig

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (make test-vllm)")
PROMPTS = [[1, 5, 9, 12, 3], [2, 7, 7, 30, 41, 8, 1], [3, 60, 22], [4, 4, 17]]


def pushed(quant: QuantConfig) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A policy version as weight-sync hands it to a replica."""
    m = MoECausalLM(get_config("debug").replace(vocab_size=64)).init_weights(0, std=0.1)
    tensors, meta = export_quantized_state_dict(quantize_policy(m, quant))
    meta.update(PolicyMeta(eos_id=2, pad_id=0, guidance=None).to_metadata())
    return tensors, meta


@pytest.mark.skipif(HAS_VLLM, reason="checks the message shown when vllm is missing")
def test_selecting_vllm_without_vllm_names_the_install() -> None:
    factory = make_engine_factory(EngineSettings(engine="vllm"))
    with pytest.raises(ImportError, match="make test-vllm"):
        factory(*pushed(QuantConfig.none()), 1)


@needs_vllm
@pytest.mark.slow
def test_vllm_engine_matches_the_native_engine_where_margins_allow() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    tensors, meta = pushed(QuantConfig.none())
    engine = make_engine_factory(EngineSettings(engine="vllm"))(tensors, meta, 7)
    assert engine.name == "vllm"
    sp = SamplingConfig(temperature=0, max_new_tokens=6)
    got = engine.generate(PROMPTS, 2, sp, with_records=False)
    want = NativeEngine.from_weights(tensors, meta).generate(PROMPTS, 2, sp, with_records=False)
    assert [(s.prompt_index, s.group_index) for s in got] == [
        (s.prompt_index, s.group_index) for s in want
    ]
    assert all(s.policy_version == 7 and s.records is None for s in got)
    # vLLM runs bf16, the native engine fp32: compare up to the first token they disagree on
    # (this random policy's margins are ~0.01 nats in places), and the first token always.
    for g, w in zip(got, want, strict=True):
        assert (
            g.completion_tokens[0] == w.completion_tokens[0]
            or abs(g.logprobs[0] - w.logprobs[0]) < 0.05
        )
        n = next(
            (
                i
                for i, (a, b) in enumerate(
                    zip(g.completion_tokens, w.completion_tokens, strict=True)
                )
                if a != b
            ),
            len(g.completion_tokens),
        )
        gaps = [abs(a - b) for a, b in zip(g.logprobs[:n], w.logprobs[:n], strict=True)]
        assert max(gaps, default=0.0) < 0.05, f"|dlogp| {gaps} on the agreeing prefix"
    sampled = engine.generate(PROMPTS, 3, SamplingConfig(temperature=1.0, max_new_tokens=4),
                              with_records=False)  # fmt: skip
    assert len(sampled) == 12 and all(
        len(s.logprobs) == len(s.completion_tokens) and all(lp <= 0 for lp in s.logprobs)
        for s in sampled
    )
    with pytest.raises(ValueError, match="does not capture guidance or routing records"):
        engine.generate(PROMPTS, 1, sp, with_records=True)


@needs_vllm
def test_vllm_engine_refuses_fp4_policies() -> None:
    from trace_common.rollout.vllm_engine import VllmEngine

    with pytest.raises(ValueError, match=r"FP4 sites .*expert_weights"):
        VllmEngine(*pushed(QuantConfig()), 1)
