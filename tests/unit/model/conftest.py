"""Shared fixtures: the tiny debug MoE (hidden 64, head_dim 32, 4 layers, 8 experts top-2)."""

from __future__ import annotations

import pytest
import torch

from trace_common.model import MoECausalLM, QuantConfig, get_config, quantize_policy

# Random init scale: larger than HF's 0.02 so activations span several FP4 block scales and
# routing is not a near-tie everywhere.
INIT_STD = 0.1


@pytest.fixture(scope="module")
def debug_model() -> MoECausalLM:
    """FP4 policy (default sites: expert W4A4 + KV, nvfp4), weights quantized once."""
    model = MoECausalLM(get_config("debug")).init_weights(seed=0, std=INIT_STD).eval()
    return quantize_policy(model, QuantConfig())


@pytest.fixture(scope="module")
def hp_model() -> MoECausalLM:
    """The same weights, nothing quantized."""
    return MoECausalLM(get_config("debug")).init_weights(seed=0, std=INIT_STD).eval()


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """The debug model's ops are tiny: intra-op threads only add contention (10x slower on a
    busy 2-core machine). Restored afterwards so other test folders are unaffected."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
