"""Quantized policy weights: ModelOpt layout export, load without re-quantizing, identical
weights on both paths, QAT gradients."""

from __future__ import annotations

import pytest
import torch

import trace_common.fp4.mxfp4
import trace_common.fp4.nvfp4
from trace_common.model import (
    GuidanceConfig,
    MoECausalLM,
    QuantConfig,
    SamplingConfig,
    export_quantized_state_dict,
    forward_logprobs,
    generate,
    get_config,
    load_quantized_state_dict,
    quantize_policy,
)
from trace_common.model.config import DEFAULT_QUANT_SITES
from trace_common.model.model import FP4Weights

PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8]]


def test_export_uses_modelopt_layout(debug_model: MoECausalLM) -> None:
    cfg = debug_model.cfg
    tensors, meta = export_quantized_state_dict(debug_model)
    base = "model.layers.2.mlp.experts.5"
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    assert tensors[f"{base}.gate_proj.weight"].dtype == torch.uint8
    assert tensors[f"{base}.gate_proj.weight"].shape == (i, h // 2)
    assert tensors[f"{base}.gate_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert tensors[f"{base}.gate_proj.weight_scale"].shape == (i, h // 16)
    assert tensors[f"{base}.down_proj.weight"].shape == (h, i // 2)
    assert tensors[f"{base}.down_proj.weight_scale_2"].shape == ()
    # gate and up share the second-level scale (vLLM fuses them into w13).
    assert torch.equal(
        tensors[f"{base}.gate_proj.weight_scale_2"], tensors[f"{base}.up_proj.weight_scale_2"]
    )
    # Everything else stays high precision.
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    assert "model.layers.0.mlp.experts.gate_proj" not in tensors
    assert all(isinstance(v, str) for v in meta.values())


# Every site the debug model has (it has no shared expert and no dense layer).
DEBUG_SITES = QuantConfig.every_site(get_config("debug")).sites


@pytest.mark.parametrize("sites", [DEFAULT_QUANT_SITES, DEBUG_SITES], ids=["default", "all"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_load_reuses_codes_and_reproduces_rollout(fmt, sites, hp_model, monkeypatch) -> None:
    policy = MoECausalLM(hp_model.cfg).eval()
    policy.load_state_dict(hp_model.state_dict())
    quantize_policy(policy, QuantConfig(sites=sites, format=fmt))
    tensors, meta = export_quantized_state_dict(policy)

    def refuse(*a, **k):
        raise AssertionError("loading a quantized policy must not quantize")

    with monkeypatch.context() as m:
        m.setattr(trace_common.fp4.nvfp4, "quantize", refuse)
        m.setattr(trace_common.fp4.mxfp4, "quantize", refuse)
        engine = load_quantized_state_dict(tensors, meta)
    quantized = [(n, m) for n, m in policy.named_modules() if isinstance(m, FP4Weights)]
    assert sum(bool(m.dequant) for _, m in quantized) == (
        26 if sites == DEBUG_SITES else 4
    )  # layers x (q,k,v,o,gate,experts) + 2
    loaded = dict(engine.named_modules())
    for name, mod in quantized:
        assert mod.dequant.keys() == loaded[name].dequant.keys(), name
        for w, deq in mod.dequant.items():
            assert torch.equal(deq, loaded[name].dequant[w]), f"{name}.{w}"
    sp = SamplingConfig(max_new_tokens=6, seed=4)
    g = GuidanceConfig(mode="full")
    x, y = generate(policy, PROMPTS, sp, guidance=g), generate(engine, PROMPTS, sp, guidance=g)
    assert x.tokens == y.tokens and x.logprobs == y.logprobs
    assert [r.to_bytes() for r in x.records] == [r.to_bytes() for r in y.records]
    # The quantized weights differ from the master weights (so the check above has teeth).
    assert not torch.equal(
        policy.moe_blocks()[0][1].experts.dequant["gate_proj"],
        policy.moe_blocks()[0][1].experts.gate_proj.detach(),
    )


def test_bad_quantized_state_dicts_are_clear_errors(debug_model) -> None:
    tensors, meta = export_quantized_state_dict(debug_model)
    with pytest.raises(ValueError, match="policy format version '0' is not supported"):
        load_quantized_state_dict(tensors, {**meta, "trace_policy_format_version": "0"})
    key = "model.layers.1.mlp.experts.3.up_proj.weight_scale"
    with pytest.raises(ValueError, match=f"missing tensor '{key}'"):
        load_quantized_state_dict({k: v for k, v in tensors.items() if k != key}, meta)
    bad = dict(tensors)
    bad[key] = bad[key].float()
    with pytest.raises(ValueError, match=f"'{key}' is torch.float32"):
        load_quantized_state_dict(bad, meta)


def test_qat_gradients_reach_master_weights_and_router(debug_model) -> None:
    model = MoECausalLM(debug_model.cfg)
    model.load_state_dict(debug_model.state_dict())
    quantize_policy(model, QuantConfig())
    out = generate(
        model, PROMPTS, SamplingConfig(max_new_tokens=4, seed=0), guidance=GuidanceConfig()
    )
    seqs = [p + t for p, t in zip(out.prompts, out.tokens, strict=True)]
    for mode in ("rtn", "trace"):
        model.zero_grad()
        res = forward_logprobs(model, seqs, qat_mode=mode, records=out.records, routing_replay=True)
        res.logprobs.sum().backward()
        block = model.moe_blocks()[-1][1]
        assert block.experts.gate_proj.grad.abs().sum() > 0, mode
        assert block.gate.weight.grad.abs().sum() > 0, mode  # router, through replayed probs
        assert model.model.layers[0].self_attn.k_proj.weight.grad.abs().sum() > 0, mode


def test_unquantized_forward_needs_no_codes() -> None:
    model = MoECausalLM(get_config("debug")).init_weights(seed=1)
    quantize_policy(model, QuantConfig(sites=frozenset({"expert_acts"})))
    assert model.moe_blocks()[0][1].experts.dequant == {}
    out = generate(model, PROMPTS, SamplingConfig(max_new_tokens=3))
    assert all(len(t) == 3 for t in out.tokens)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_experts_quantized_at_once_equal_expert_by_expert(fmt, hp_model) -> None:
    """quantize_policy quantizes a layer's experts in one batch; every expert's codes, block
    scales and scale_2 (shared by its gate and up) equal quantizing that expert alone, and the
    dequantized weights the forward uses are those codes' values."""
    policy = MoECausalLM(hp_model.cfg)
    policy.load_state_dict(hp_model.state_dict())
    with torch.no_grad():  # one all-zero expert (scale_2 1.0) and one of large magnitude
        ex = next(iter(policy.moe_blocks()))[1].experts
        ex.gate_proj[1].zero_()
        ex.up_proj[1].zero_()
        ex.down_proj[2].mul_(1e3)
    quantize_policy(policy, QuantConfig(format=fmt))
    f = trace_common.fp4.get_format(fmt)
    for _, block in policy.moe_blocks():
        ex = block.experts
        for e in range(ex.num_experts):
            for names in (("gate_proj", "up_proj"), ("down_proj",)):
                ws = [getattr(ex, n)[e].detach() for n in names]
                if fmt == "nvfp4":
                    s2 = trace_common.fp4.nvfp4.scale_2_from_amax(
                        torch.stack([w.abs().amax() for w in ws]).amax()
                    )
                    refs = [f.quantize(w, per_tensor_scale=s2) for w in ws]
                else:
                    refs = [f.quantize(w) for w in ws]
                for n, ref in zip(names, refs, strict=True):
                    q = ex.quantized[n][e]
                    assert torch.equal(q.qdata, ref.qdata), (n, e)
                    assert torch.equal(q.scale.view(torch.uint8), ref.scale.view(torch.uint8))
                    if fmt == "nvfp4":
                        assert torch.equal(q.per_tensor_scale, ref.per_tensor_scale), (n, e)
                    assert torch.equal(ex.dequant[n][e], ref.dequantize(torch.float32)), (n, e)
