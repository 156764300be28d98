"""Architecture options: Qwen2-MoE style shared expert, dense (mlp_only) layers."""

from __future__ import annotations

import pytest
import torch

from trace_common.model import (
    GuidanceConfig,
    MoECausalLM,
    QuantConfig,
    SamplingConfig,
    forward_logprobs,
    generate,
    get_config,
    quantize_policy,
)
from trace_common.model.discrepancy import activation_discrepancy, rollout_reference

VARIANTS = {
    "shared-expert": get_config("debug-shared"),
    "dense-layer-0": get_config("debug").replace(mlp_only_layers=(0,), intermediate_size=96),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_decode_matches_and_trace_is_exact(name: str) -> None:
    cfg = VARIANTS[name]
    model = MoECausalLM(cfg).init_weights(seed=5, std=0.1).eval()
    quantize_policy(model, QuantConfig())
    prompts = [[4, 8, 15], [16, 23, 42, 7, 9]]
    out = generate(
        model,
        prompts,
        SamplingConfig(max_new_tokens=6, seed=3),
        guidance=GuidanceConfig(layers=tuple(range(cfg.num_layers)), mode="full"),
    )
    rec = out.records[0]
    assert rec.moe_layers == cfg.moe_layers
    assert rec.routing.shape[1] == len(cfg.moe_layers)
    expected_keys = {(la, s) for la in range(cfg.num_layers) for s in ("k", "v")}
    expected_keys |= {(la, "moe_in") for la in cfg.moe_layers}
    assert set(rec.guidance) == expected_keys
    seqs = [p + t for p, t in zip(out.prompts, out.tokens, strict=True)]
    res = forward_logprobs(
        model, seqs, qat_mode="trace", records=out.records, routing_replay=True, collect=True
    )
    values, codes = rollout_reference(out.records)
    disc = activation_discrepancy(res.site_values, res.site_codes, values, codes)
    assert set(disc) == expected_keys
    assert all(d.d_act == 0.0 for d in disc.values())
    got = torch.tensor([lp for row in out.logprobs for lp in row])
    train = torch.cat(
        [
            res.logprobs[i, len(p) - 1 : len(s) - 1]
            for i, (s, p) in enumerate(zip(seqs, out.prompts, strict=True))
        ]
    )
    assert (train - got).abs().max() < 1e-4
