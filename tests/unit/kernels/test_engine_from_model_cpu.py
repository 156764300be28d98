"""The decode engine's shape and weights taken from a policy (`trace_common.model`): every
engine tensor is the policy tensor it stands for, in the layout the engine's kernels read."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from trace_common.kernels.engine import EngineShape, EngineWeights
from trace_common.model.config import ModelConfig
from trace_common.model.model import MoECausalLM

CFG = ModelConfig(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=32,
                  rms_norm_eps=1e-5, rope_theta=10_000.0)  # fmt: skip


def _bf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.bfloat16)


def test_shape_from_config():
    s = EngineShape.from_model_config(CFG)
    assert (s.num_layers, s.hidden, s.q_heads, s.kv_heads, s.head_dim) == (2, 64, 4, 2, 16)
    assert (s.num_experts, s.top_k, s.moe_inter, s.vocab) == (8, 2, 32, 96)
    assert (s.eps, s.rope_theta) == (1e-5, 10_000.0)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"mlp_only_layers": (1,), "intermediate_size": 48}, "dense MLP layers"),
        ({"decoder_sparse_step": 2, "intermediate_size": 48}, "dense MLP layers"),
        ({"shared_expert_intermediate_size": 48}, "shared_expert_intermediate_size"),
        ({"attention_bias": True}, "attention_bias"),
        ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ],
)
def test_unsupported_configs_are_refused_by_name(change, field):
    cfg = dataclasses.replace(CFG, **change)
    with pytest.raises(ValueError, match=field):
        EngineShape.from_model_config(cfg)
    with pytest.raises(ValueError, match=field):
        EngineWeights.from_model(MoECausalLM(cfg), "cpu")


def test_non_power_of_two_experts_refused():
    with pytest.raises(ValueError, match="num_experts=6"):
        EngineShape.from_model_config(dataclasses.replace(CFG, num_experts=6))


def test_weights_are_the_policys_in_the_engine_layout():
    model = MoECausalLM(CFG).init_weights(seed=3)
    w = EngineWeights.from_model(model, "cpu")
    bb, d, i = model.model, CFG.head_dim, CFG.moe_intermediate_size
    assert torch.equal(w.embed, _bf(bb.embed_tokens.weight))
    assert torch.equal(w.lm_head, _bf(model.lm_head.weight))
    assert torch.equal(w.final_norm, _bf(bb.norm.weight))
    assert len(w.layers) == CFG.num_layers
    for lw, layer in zip(w.layers, bb.layers, strict=True):
        at, mlp = layer.self_attn, layer.mlp
        assert torch.equal(lw.ln1, _bf(layer.input_layernorm.weight))
        assert torch.equal(lw.ln2, _bf(layer.post_attention_layernorm.weight))
        nq, nk = CFG.num_heads * d, CFG.num_kv_heads * d
        assert lw.w_qkv.shape == (nq + 2 * nk, CFG.hidden_size)
        assert torch.equal(lw.w_qkv[:nq], _bf(at.q_proj.weight))
        assert torch.equal(lw.w_qkv[nq : nq + nk], _bf(at.k_proj.weight))
        assert torch.equal(lw.w_qkv[nq + nk :], _bf(at.v_proj.weight))
        assert torch.equal(lw.w_o, _bf(at.o_proj.weight))
        assert torch.equal(lw.norm_qk[0], _bf(at.q_norm.weight))
        assert torch.equal(lw.norm_qk[1], _bf(at.k_norm.weight))
        assert torch.equal(lw.router, _bf(mlp.gate.weight))
        gu, dn = lw.gate_up, lw.down
        assert (gu.n, gu.k, dn.n, dn.k) == (2 * i, CFG.hidden_size, CFG.hidden_size, i)
        assert gu.bf16 is not None and dn.bf16 is not None and not gu.is_fp4
        assert torch.equal(gu.bf16[:, :i], _bf(mlp.experts.gate_proj))
        assert torch.equal(gu.bf16[:, i:], _bf(mlp.experts.up_proj))
        assert torch.equal(dn.bf16, _bf(mlp.experts.down_proj))
        assert all(t.is_contiguous() for t in (lw.w_qkv, lw.norm_qk, gu.bf16, dn.bf16))


def test_gated_layout_computes_the_policys_experts():
    """silu(first half) * second half of the stacked gate_up, then down, per routed pair: the
    gated GEMM's reading (tests/unit/gpu: act_ref) gives the policy's expert output."""
    model = MoECausalLM(CFG).init_weights(seed=4).to(torch.bfloat16)
    w = EngineWeights.from_model(model, "cpu")
    ex, lw = model.model.layers[0].mlp.experts, w.layers[0]
    torch.manual_seed(0)
    x = torch.randn(5, CFG.hidden_size).to(torch.bfloat16)
    ids = torch.randint(0, CFG.num_experts, (5, CFG.top_k))
    rw = torch.full((5, CFG.top_k), 1.0 / CFG.top_k, dtype=torch.bfloat16)

    class NoQuant:
        def weight_mode(self, site):
            return "master"

        def act(self, layer, site, t):
            return t

    with torch.no_grad():
        want = ex(x, ids, rw, NoQuant(), 0).float()
    i = CFG.moe_intermediate_size
    assert lw.gate_up.bf16 is not None and lw.down.bf16 is not None
    got = torch.zeros_like(want)
    for t in range(5):
        for j in range(CFG.top_k):
            g = lw.gate_up.bf16[ids[t, j]].float() @ x[t].float()
            h = (F.silu(g[:i]) * g[i:]).to(torch.bfloat16).float()
            got[t] += rw[t, j].float() * (lw.down.bf16[ids[t, j]].float() @ h)
    # bf16 rounding differs (the policy multiplies in bf16): 0.4% here; gate and up swapped: 16%
    rel = float((got - want).norm() / want.norm())
    assert rel < 0.02, f"relative error {rel:.3f}"
