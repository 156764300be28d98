"""The CUDA engine's reader of a pushed version (trace_common.rollout.cuda.PolicyWeights):
each projection of all experts stacked whole, bit for bit what stacking expert by expert
gives, and a weight_scale_2 that differs between gate and up is refused naming the expert.
The reader runs on any device; the engine itself is tested on the GPU (tests/unit/gpu)."""

from __future__ import annotations

import pytest
import torch

from trace_common.model import get_config
from trace_common.model.quant import QuantConfig
from trace_common.rollout.cuda import PolicyWeights

E, N, K = 4, 8, 32


def pushed(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {}
    for e in range(E):
        s2 = torch.rand((), generator=g) + 0.5
        for proj in ("gate_proj", "up_proj", "down_proj"):
            base = f"x.{e}.{proj}"
            t[base + ".weight"] = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
            t[base + ".weight_scale"] = (
                torch.randint(0, 127, (N, K // 16), generator=g, dtype=torch.uint8)
                .view(torch.float8_e4m3fn)
            )  # fmt: skip
            t[base + ".weight_scale_2"] = s2.clone()
    return t


def reader() -> PolicyWeights:
    cfg = get_config("debug").replace(num_experts=E)
    return PolicyWeights(cfg, QuantConfig(), torch.device("cpu"))


def test_experts_are_stacked_per_projection_bit_for_bit() -> None:
    t = pushed(0)
    w = reader()._fp4_experts(t, "x.", ("gate_proj", "up_proj"), 3)
    for e in range(E):
        gate, up = (t[f"x.{e}.{p}.weight"] for p in ("gate_proj", "up_proj"))
        assert torch.equal(w.codes[e], torch.cat([gate, up]))
        scales = [t[f"x.{e}.{p}.weight_scale"].view(torch.uint8) for p in ("gate_proj", "up_proj")]
        assert torch.equal(w.scales[e], torch.cat(scales))
        assert w.scale_2[e] == t[f"x.{e}.gate_proj.weight_scale_2"]
    assert (w.n, w.k) == (2 * N, K) and w.scale_2.dtype == torch.float32
    down = reader()._fp4_experts(t, "x.", ("down_proj",), 3)
    assert down.codes.shape == (E, N, K // 2) and down.scales.shape == (E, N, K // 16)


def test_gate_and_up_with_different_scale_2_are_refused_naming_the_expert() -> None:
    t = pushed(1)
    t["x.2.up_proj.weight_scale_2"] = t["x.2.up_proj.weight_scale_2"] * 2
    with pytest.raises(ValueError, match=r"layer 5 expert 2: .*different weight_scale_2"):
        reader()._fp4_experts(t, "x.", ("gate_proj", "up_proj"), 5)


def test_a_missing_expert_tensor_is_named() -> None:
    t = pushed(2)
    del t["x.1.up_proj.weight_scale"]
    with pytest.raises(ValueError, match=r"lacks tensor 'x.1.up_proj.weight_scale'"):
        reader()._fp4_experts(t, "x.", ("gate_proj", "up_proj"), 0)
