"""Quantization sites beyond the paper's (attention, shared expert, router, dense MLP, LM head,
embedding): each changes the forward exactly as a hand-built fake-quant reference does, both
paths read bit-identical weights, export -> load reproduces logits without re-quantizing,
guidance at the new sites keeps trace mode exact, and bad configs are clear errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import trace_common.fp4.mxfp4
import trace_common.fp4.nvfp4
from trace_common.fp4.fake import fake_quantize
from trace_common.fp4.nvfp4 import scale_2_from_amax
from trace_common.model import (
    GuidanceConfig,
    MoECausalLM,
    QuantConfig,
    SampleRecords,
    SamplingConfig,
    export_quantized_state_dict,
    forward_logprobs,
    generate,
    get_config,
    load_quantized_state_dict,
    quantize_policy,
)
from trace_common.model.config import DEFAULT_QUANT_SITES, GUIDED_SITES, QUANT_SITES
from trace_common.model.discrepancy import activation_discrepancy, rollout_reference
from trace_common.model.model import FP4Weights
from trace_common.model.runtime import RolloutHooks

# Shared expert on every MoE layer and a dense layer 0: every site exists in this model.
CFG = get_config("debug-shared").replace(mlp_only_layers=(0,), intermediate_size=64)
ALL_SITES = QuantConfig.every_site(CFG).sites
NEW_SITES = sorted(QUANT_SITES - DEFAULT_QUANT_SITES)
PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 2, 11], [6], [3, 3, 12, 40, 2, 17, 21]]


@pytest.fixture(scope="module")
def master_state() -> dict[str, torch.Tensor]:
    return MoECausalLM(CFG).init_weights(seed=3, std=0.1).state_dict()


def policy(state: dict[str, torch.Tensor], sites: frozenset[str], fmt: str = "nvfp4"):
    model = MoECausalLM(CFG).eval()
    model.load_state_dict(state)
    return quantize_policy(model, QuantConfig(sites=sites, format=fmt))


def prefill_logits(model: MoECausalLM) -> torch.Tensor:
    """The rollout path's forward over a right-padded batch (no cache): logits [B, T, V]."""
    ids = torch.tensor([[5, 9, 2, 7, 1, 4], [3, 3, 12, 40, 2, 17]])
    pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    valid = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        return model(ids, pos, valid, RolloutHooks(model.quant))


def _layers(model: MoECausalLM, kind: str) -> list:
    return [
        layer.mlp
        for layer in model.model.layers
        if (kind == "moe") == hasattr(layer.mlp, "experts")
    ]


def weight_groups(model: MoECausalLM, site: str) -> list[list[torch.nn.Module]]:
    """The modules whose weights `site` quantizes, grouped as one fused GEMM reads them."""
    if site == "attn_weights":
        attn = [layer.self_attn for layer in model.model.layers]
        return [g for a in attn for g in ([a.q_proj, a.k_proj, a.v_proj], [a.o_proj])]
    if site in ("shared_expert_weights", "dense_mlp_weights"):
        mlps = (
            [m.shared_expert for m in _layers(model, "moe")]
            if "shared" in site
            else (_layers(model, "dense"))
        )
        return [g for m in mlps for g in ([m.gate_proj, m.up_proj], [m.down_proj])]
    if site == "router_weights":
        return [[m.gate] for m in _layers(model, "moe")]
    if site == "lm_head_weights":
        return [[model.lm_head]]
    assert site == "embed_weights", site
    return [[model.model.embed_tokens]]


def act_inputs(model: MoECausalLM, site: str) -> list[torch.nn.Module]:
    """Modules whose first positional input `site` quantizes (reference pre-hooks go there)."""
    if site == "attn_acts":
        return [
            m for layer in model.model.layers for m in (layer.self_attn, layer.self_attn.o_proj)
        ]
    if site == "shared_expert_acts":
        return [
            x for m in _layers(model, "moe") for x in (m.shared_expert, m.shared_expert.down_proj)
        ]
    if site == "dense_mlp_acts":
        return [x for m in _layers(model, "dense") for x in (m, m.down_proj)]
    if site == "router_acts":
        return [m.gate for m in _layers(model, "moe")]
    assert site == "lm_head_acts", site
    return [model.lm_head]


def reference(state, site: str, fmt: str) -> torch.Tensor:
    """Hand-built: a high-precision model whose site weights are replaced by their fake
    quantization (one NVFP4 scale_2 per fused group) or whose site inputs are fake-quantized
    per token by forward pre-hooks."""
    model = policy(state, frozenset(), fmt)
    if site.endswith("_weights"):
        with torch.no_grad():
            for group in weight_groups(model, site):
                kw: dict = {}
                if fmt == "nvfp4":
                    amax = torch.stack([m.weight.abs().amax() for m in group]).amax()
                    kw = {
                        "scale_granularity": "tensor",
                        "per_tensor_scale": scale_2_from_amax(amax),
                    }
                for m in group:
                    m.weight.copy_(fake_quantize(m.weight, fmt, **kw))
    else:

        def quantize_first(_mod, args):
            return (fake_quantize(args[0], fmt, scale_granularity="row"), *args[1:])

        for m in act_inputs(model, site):
            m.register_forward_pre_hook(quantize_first)
    return prefill_logits(model)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("site", NEW_SITES)
def test_each_site_changes_the_forward_exactly_like_fake_quant(master_state, site, fmt) -> None:
    hp = prefill_logits(policy(master_state, frozenset(), fmt))
    got = prefill_logits(policy(master_state, frozenset({site}), fmt))
    assert not torch.equal(got, hp), f"{site} did not change the forward"
    assert torch.equal(got, reference(master_state, site, fmt)), site


def test_rollout_and_training_read_bit_identical_weights(master_state, monkeypatch) -> None:
    """Every weight read on the rollout path (prefill and every decode step) equals the one
    the training path reads, at every configured weight site, and is not the master."""
    model = policy(master_state, ALL_SITES)
    seen: dict[str, list[tuple[str, torch.Tensor]]] = {}
    original: Callable = FP4Weights.effective_weight

    def spy(self, name, mode):
        w = original(self, name, mode)
        seen.setdefault(self.weight_site, []).append((f"{id(self)}.{name}", w.detach().clone()))
        return w

    monkeypatch.setattr(FP4Weights, "effective_weight", spy)
    out = generate(model, PROMPTS, SamplingConfig(max_new_tokens=5, seed=1, temperature=0.0))
    assert out.num_forward_steps == 5  # prefill + 4 decode steps
    rollout, seen = seen, {}
    seqs = [p + t for p, t in zip(out.prompts, out.tokens, strict=True)]
    forward_logprobs(model, seqs, qat_mode="rtn")
    train = seen
    weight_sites = {s for s in ALL_SITES if s.endswith("_weights")}
    assert set(rollout) == set(train) == weight_sites
    for site in weight_sites:
        train_w = dict(train[site])
        # Every module of the site read once per forward: prefill + decode steps on the rollout.
        assert len(rollout[site]) == out.num_forward_steps * len(train_w), site
        for key, w in rollout[site]:
            assert torch.equal(w, train_w[key]), f"{site} {key}"
    master = model.model.layers[1].self_attn.q_proj.weight
    assert not torch.equal(model.model.layers[1].self_attn.q_proj.dequant["weight"], master)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_export_load_round_trip_is_bit_exact_without_requantizing(master_state, fmt, monkeypatch):
    model = policy(master_state, ALL_SITES, fmt)
    tensors, meta = export_quantized_state_dict(model)
    q = "model.layers.1.self_attn.q_proj"
    assert tensors[f"{q}.weight"].dtype == torch.uint8
    assert tensors[f"{q}.weight"].shape == (CFG.num_heads * CFG.head_dim, CFG.hidden_size // 2)
    for key in ("lm_head", "model.embed_tokens", "model.layers.2.mlp.gate",
                "model.layers.2.mlp.shared_expert.down_proj", "model.layers.0.mlp.up_proj"):  # fmt: skip
        assert tensors[f"{key}.weight"].dtype == torch.uint8, key
    if fmt == "nvfp4":
        assert tensors[f"{q}.weight_scale"].dtype == torch.float8_e4m3fn
        # q/k/v share one second-level scale (one fused qkv GEMM), o has its own.
        s2 = [tensors[f"model.layers.1.self_attn.{p}_proj.weight_scale_2"] for p in "qkvo"]
        assert torch.equal(s2[0], s2[1]) and torch.equal(s2[0], s2[2])
        assert not torch.equal(s2[0], s2[3])
    else:
        assert tensors[f"{q}.weight_scale"].dtype == torch.uint8  # E8M0
        assert f"{q}.weight_scale_2" not in tensors
    # Never quantized: norms and the shared expert's 1-wide gate.
    assert tensors["model.layers.1.input_layernorm.weight"].dtype == torch.float32
    assert tensors["model.layers.1.mlp.shared_expert_gate.weight"].dtype == torch.float32

    def refuse(*a, **k):
        raise AssertionError("loading a quantized policy must not quantize")

    with monkeypatch.context() as m:
        m.setattr(trace_common.fp4.nvfp4, "quantize", refuse)
        m.setattr(trace_common.fp4.mxfp4, "quantize", refuse)
        engine = load_quantized_state_dict(tensors, meta)
    assert torch.equal(prefill_logits(engine), prefill_logits(model))
    sp = SamplingConfig(max_new_tokens=6, seed=4)
    x, y = generate(model, PROMPTS, sp), generate(engine, PROMPTS, sp)
    assert x.tokens == y.tokens and x.logprobs == y.logprobs


def test_only_configured_sites_are_packed(master_state) -> None:
    tensors, _ = export_quantized_state_dict(policy(master_state, frozenset({"router_weights"})))
    packed = {k.removesuffix(".weight") for k, v in tensors.items() if v.dtype == torch.uint8}
    assert packed == {f"model.layers.{i}.mlp.gate" for i in CFG.moe_layers}


def test_tied_embeddings_share_one_set_of_codes() -> None:
    cfg = get_config("debug").replace(tie_word_embeddings=True)
    model = MoECausalLM(cfg).init_weights(seed=2, std=0.1).eval()
    with pytest.raises(ValueError, match="'lm_head_weights' and 'embed_weights' must be"):
        quantize_policy(model, QuantConfig(sites=frozenset({"lm_head_weights"})))
    quantize_policy(model, QuantConfig(sites=frozenset({"lm_head_weights", "embed_weights"})))
    embed = model.model.embed_tokens
    assert model.lm_head.quantized["weight"] is embed.quantized["weight"]
    assert model.lm_head.dequant["weight"] is embed.dequant["weight"]
    tensors, meta = export_quantized_state_dict(model)
    assert "lm_head.weight" not in tensors
    assert tensors["model.embed_tokens.weight"].dtype == torch.uint8
    engine = load_quantized_state_dict(tensors, meta)
    assert torch.equal(engine.lm_head.dequant["weight"], model.lm_head.dequant["weight"])
    assert torch.equal(prefill_logits(engine), prefill_logits(model))


@pytest.mark.parametrize("mode", ["full", "compact"])
def test_trace_all_layers_all_sites_reproduces_rollout_exactly(master_state, mode) -> None:
    """Every site FP4, every guidable site of every layer guided, routing replayed, records
    through bytes, another batch order: D_act = 0 and no flipped code at every guided site."""
    model = policy(master_state, ALL_SITES)
    layers = tuple(range(CFG.num_layers))
    guidance = GuidanceConfig(layers=layers, sites=GUIDED_SITES, mode="full")
    out = generate(model, PROMPTS, SamplingConfig(max_new_tokens=8, seed=5), guidance=guidance)
    expected = {(la, s) for la in layers for s in GUIDED_SITES if CFG.has_act_site(la, s)}
    assert set(out.records[0].guidance) == expected
    order = [3, 1, 0, 2]
    seqs = [out.prompts[i] + out.tokens[i] for i in order]
    records = [SampleRecords.from_bytes(out.records[i].select(mode=mode).to_bytes()) for i in order]
    res = forward_logprobs(
        model, seqs, qat_mode="trace", records=records, routing_replay=True, collect=True
    )
    values, codes = rollout_reference([out.records[i] for i in order])
    disc = activation_discrepancy(res.site_values, res.site_codes, values, codes)
    assert set(disc) == expected
    for key, d in disc.items():
        assert d.d_act == 0.0 and d.flip_rate == 0.0, f"{key}: {d}"


def test_every_site_is_what_the_model_has() -> None:
    assert ALL_SITES == QUANT_SITES  # CFG has a shared expert and a dense layer
    debug = QuantConfig.every_site(get_config("debug"), "mxfp4")
    assert debug.format == "mxfp4"
    assert QUANT_SITES - debug.sites == {
        "shared_expert_weights",
        "shared_expert_acts",
        "dense_mlp_weights",
        "dense_mlp_acts",
    }


def test_site_config_errors_name_the_values() -> None:
    with pytest.raises(ValueError, match=r"unknown quantization site\(s\) \['attn_out'\]"):
        QuantConfig(sites=frozenset({"attn_out"}))
    with pytest.raises(ValueError, match="'norm_weights' is not supported: RMSNorm gains"):
        QuantConfig(sites=frozenset({"norm_weights"}))
    with pytest.raises(ValueError, match="'embed_acts' is not supported: the embedding is a"):
        QuantConfig(sites=frozenset({"embed_acts", "kv"}))
    debug = get_config("debug")
    with pytest.raises(ValueError, match="'shared_expert_acts' is configured but the model has"):
        QuantConfig(sites=frozenset({"shared_expert_acts"})).check_model(debug)
    with pytest.raises(ValueError, match="'dense_mlp_weights' is configured but the model has"):
        quantize_policy(MoECausalLM(debug), QuantConfig(sites=frozenset({"dense_mlp_weights"})))
    odd = debug.replace(moe_intermediate_size=48)  # 3 NVFP4 blocks, 1.5 MXFP4 blocks
    QuantConfig(format="nvfp4").check_model(odd)
    with pytest.raises(
        ValueError,
        match=r"'expert_acts': width\(s\) \{'down_in': 48\} not a multiple of the "
        r"mxfp4 block size 32",
    ):
        QuantConfig(format="mxfp4").check_model(odd)
    wide_o = debug.replace(num_heads=2, head_dim=40)  # o_proj input 80 (q/k/v input 64)
    with pytest.raises(ValueError, match=r"'attn_weights': width\(s\) \{'o_in': 80\}"):
        QuantConfig(sites=frozenset({"attn_weights"}), format="mxfp4").check_model(wide_o)
    with pytest.raises(ValueError, match=r"\['down_in'\] cannot be guided"):
        GuidanceConfig(sites=("moe_in", "down_in"))
    with pytest.raises(
        ValueError, match="guidance site 'o_in' needs quantization site 'attn_acts'"
    ):
        GuidanceConfig(sites=("o_in",)).resolve(debug, QuantConfig())
