"""The policy on CUDA: decode vs full forward, and exact trace reproduction (skipped on CPU)."""

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

PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 2, 11], [6]]


# The debug model's guidable sites when every site is FP4 (all of them are guided).
ALL_DEBUG_GUIDED = ("moe_in", "k", "v", "attn_in", "o_in", "router_in")


@pytest.mark.gpu
@pytest.mark.parametrize("all_sites", [False, True], ids=["paper-sites", "all-sites"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_trace_reproduces_rollout_exactly(dtype: torch.dtype, all_sites: bool) -> None:
    cfg = get_config("debug")
    model = MoECausalLM(cfg).init_weights(seed=0, std=0.1)
    quant = QuantConfig.every_site(cfg) if all_sites else QuantConfig()
    quantize_policy(model, quant)  # codes made on CPU, moved with the model
    model = model.to("cuda", dtype).eval()
    sites = ALL_DEBUG_GUIDED if all_sites else ("moe_in", "k", "v")
    out = generate(
        model,
        PROMPTS,
        SamplingConfig(max_new_tokens=8, seed=1),
        guidance=GuidanceConfig(layers=tuple(range(cfg.num_layers)), sites=sites, mode="full"),
    )
    seqs = [p + t for p, t in zip(out.prompts, out.tokens, strict=True)]
    values, codes = rollout_reference(out.records, dtype)
    res = forward_logprobs(
        model,
        seqs,
        qat_mode="trace",
        routing_replay=True,
        records=[r.select(mode="compact") for r in out.records],
        collect=True,
    )
    disc = activation_discrepancy(res.site_values, res.site_codes, values, codes)
    assert len(disc) == len(sites) * cfg.num_layers
    for key, d in disc.items():
        assert d.d_act == 0.0 and d.flip_rate == 0.0, f"{key}: {d}"


@pytest.mark.gpu
def test_cuda_high_precision_decode_matches_full_forward() -> None:
    model = MoECausalLM(get_config("debug")).init_weights(seed=0, std=0.1).to("cuda").eval()
    out = generate(model, PROMPTS, SamplingConfig(max_new_tokens=8, temperature=0))
    seqs = [p + t for p, t in zip(out.prompts, out.tokens, strict=True)]
    res = forward_logprobs(model, seqs)
    train = torch.cat(
        [
            res.logprobs[i, len(p) - 1 : len(s) - 1]
            for i, (s, p) in enumerate(zip(seqs, out.prompts, strict=True))
        ]
    ).cpu()
    got = torch.tensor([lp for row in out.logprobs for lp in row])
    # cuBLAS picks different kernels for decode and full-sequence shapes: not bit-exact.
    assert (train - got).abs().max() < 1e-4
