"""The learner's export with bf16 high-precision weights (what a CUDA trainer pushes by
default): only the fp32 weights change dtype, rounded as a bf16 engine rounds them; the FP4
codes, block scales and per-tensor scales are the same bytes as the fp32 export's."""

from __future__ import annotations

import pytest
import torch
from test_learner_device import learner

from trace_common.rollout.native import NativeEngine
from trace_common.rollout.types import SamplingConfig


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_bf16_export_rounds_only_the_high_precision_weights() -> None:
    lrn = learner()
    full, meta = lrn.export_weights()
    lrn.export_hp_dtype = torch.bfloat16
    half, meta_half = lrn.export_weights()
    assert meta_half == meta and half.keys() == full.keys()
    hp = [k for k, t in full.items() if t.dtype == torch.float32 and k.endswith(".weight")]
    assert hp and any(full[k].dtype == torch.uint8 for k in full)
    for k, t in full.items():
        if k in hp:
            assert half[k].dtype == torch.bfloat16 and torch.equal(half[k], t.to(torch.bfloat16))
        else:
            assert half[k].dtype == t.dtype and torch.equal(raw(half[k]), raw(t)), k
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts.values())  # noqa: E731
    assert size(half) < size(full)


def test_a_bf16_engine_serves_both_exports_alike() -> None:
    """A bf16 engine rounds fp32 weights to bf16 itself: both exports give it the same
    weights, so the same greedy tokens and log-probs."""
    lrn = learner()
    full, meta = lrn.export_weights()
    lrn.export_hp_dtype = torch.bfloat16
    half, _ = lrn.export_weights()
    sp = SamplingConfig(temperature=0.0, max_new_tokens=6)
    out = [
        NativeEngine.from_weights(t, meta, dtype=torch.bfloat16).generate(
            [[5, 6, 7], [9, 3]], 1, sp, with_records=False
        )
        for t in (full, half)
    ]
    assert [(s.completion_tokens, s.logprobs) for s in out[0]] == [
        (s.completion_tokens, s.logprobs) for s in out[1]
    ]


@pytest.mark.parametrize(
    ("setting", "device", "dtype"),
    [
        ("auto", "cpu", None),
        ("auto", "cuda", torch.bfloat16),
        ("float32", "cuda", None),
        ("bfloat16", "cpu", torch.bfloat16),
    ],
)
def test_the_trainer_setting_picks_the_export_dtype(setting, device, dtype) -> None:
    from types import SimpleNamespace

    from services.trainer.build import export_hp_dtype

    got = export_hp_dtype(SimpleNamespace(export_hp_dtype=setting), torch.device(device))
    assert got is dtype
