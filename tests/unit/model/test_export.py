"""The HF exports: the NVFP4 directory (ModelOpt's format, as vLLM's modelopt_fp4 loads it)
reads back bit-exactly and equals ModelOpt's own tensors; the BF16 directory is a plain
Qwen3-MoE checkpoint transformers runs with the project's logits."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from trace_common.model import (
    ModelConfig,
    MoECausalLM,
    QuantConfig,
    export_quantized_state_dict,
    get_config,
    quantize_policy,
)
from trace_common.model.config import (
    SITE_ATTN_ACTS,
    SITE_ATTN_WEIGHTS,
    SITE_EXPERT_ACTS,
    SITE_EXPERT_WEIGHTS,
    SITE_KV,
    SITE_ROUTER_WEIGHTS,
)
from trace_common.model.export import (
    calibrate_act_amax,
    hf_config_dict,
    load_nvfp4_checkpoint,
    save_hf_checkpoint,
    save_nvfp4_checkpoint,
)
from trace_common.model.quant import _EXPERT_GROUPS
from trace_common.model.runtime import RolloutHooks

ATTN_TOO = QuantConfig(
    sites=frozenset(
        {SITE_EXPERT_WEIGHTS, SITE_EXPERT_ACTS, SITE_KV, SITE_ATTN_WEIGHTS, SITE_ATTN_ACTS}
    )
)
# A dense layer (mlp_only_layers) so the export's dense-MLP path is exercised too.
CFG = get_config("debug").replace(num_layers=3, mlp_only_layers=(1,), intermediate_size=64)


def policy(quant: QuantConfig = ATTN_TOO, cfg: ModelConfig = CFG) -> MoECausalLM:
    return quantize_policy(MoECausalLM(cfg).init_weights(3, std=0.1), quant)


def calib_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, CFG.vocab_size, (2, 10), generator=g) for _ in range(2)]


def fp4_logits(model: MoECausalLM, ids: torch.Tensor) -> torch.Tensor:
    b, t = ids.shape
    hooks = RolloutHooks(model.quant)
    with torch.no_grad():
        return model(ids, torch.arange(t).expand(b, t), torch.ones(b, t, dtype=torch.bool), hooks)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory):
    model = policy()
    amax = calibrate_act_amax(model, calib_batches())
    path = tmp_path_factory.mktemp("export") / "fp4"
    save_nvfp4_checkpoint(model, path, amax, dtype=torch.float32)
    return model, amax, path


def test_fp4_export_loads_back_bit_exactly(exported) -> None:
    model, _, path = exported
    loaded, _ = load_nvfp4_checkpoint(path)
    want, want_meta = export_quantized_state_dict(model)
    got, got_meta = export_quantized_state_dict(loaded)
    assert got_meta == want_meta and sorted(got) == sorted(want)
    bad = [k for k in want if not same_bits(got[k], want[k])]
    assert not bad, f"tensors differ after the round trip: {bad[:5]}"
    ids = calib_batches()[0]
    assert torch.equal(fp4_logits(loaded, ids), fp4_logits(model, ids))


def test_bf16_fp4_export_keeps_codes_and_rounds_the_rest(tmp_path: Path) -> None:
    model = policy()
    amax = calibrate_act_amax(model, calib_batches())
    save_nvfp4_checkpoint(model, tmp_path / "fp4", amax)  # bf16 high-precision tensors
    stored = load_file(tmp_path / "fp4" / "model.safetensors")
    want, _ = export_quantized_state_dict(model)
    for key, t in want.items():
        if t.dtype == torch.float32 and not key.endswith("weight_scale_2"):
            assert same_bits(stored[key], t.to(torch.bfloat16)), key
        else:
            assert same_bits(stored[key], t), f"{key}: FP4 codes/scales must be stored as is"
    loaded, _ = load_nvfp4_checkpoint(tmp_path / "fp4")
    got, _ = export_quantized_state_dict(loaded)
    assert all(same_bits(got[k], want[k]) for k in want if k.endswith("weight_scale_2"))


def test_vllm_modelopt_tensor_layout(exported) -> None:
    """What vLLM's modelopt_fp4 loader reads: per GEMM uint8 codes [out, in/2], e4m3 block
    scales [out, in/16], fp32 scalar weight_scale_2 and input_scale; k/v scales per layer;
    one shared weight_scale_2 and input_scale per fused GEMM (qkv, an expert's w13)."""
    _, amax, path = exported
    t = load_file(path / "model.safetensors")
    h, inter = CFG.hidden_size, CFG.moe_intermediate_size
    for layer in (0, 2):  # MoE layers
        for e in range(CFG.num_experts):
            base = f"model.layers.{layer}.mlp.experts.{e}"
            assert t[f"{base}.gate_proj.weight"].dtype == torch.uint8
            assert t[f"{base}.gate_proj.weight"].shape == (inter, h // 2)
            assert t[f"{base}.down_proj.weight_scale"].shape == (h, inter // 16)
            assert t[f"{base}.down_proj.weight_scale"].dtype == torch.float8_e4m3fn
            for key in ("weight_scale_2", "input_scale"):
                g, u = t[f"{base}.gate_proj.{key}"], t[f"{base}.up_proj.{key}"]
                assert g.dtype == torch.float32 and g.shape == () and same_bits(g, u), key
            want = torch.tensor(amax[(layer, "moe_in")]) / (6.0 * 448.0)
            assert same_bits(t[f"{base}.gate_proj.input_scale"], want)
        assert f"model.layers.{layer}.mlp.gate.weight" in t  # router: high precision
    for layer in range(CFG.num_layers):
        attn = f"model.layers.{layer}.self_attn"
        for p in ("q_proj", "k_proj", "v_proj"):
            assert same_bits(t[f"{attn}.{p}.input_scale"], t[f"{attn}.q_proj.input_scale"])
            assert same_bits(t[f"{attn}.{p}.weight_scale_2"], t[f"{attn}.q_proj.weight_scale_2"])
        assert t[f"{attn}.o_proj.input_scale"].shape == ()
        k_scale = torch.tensor(amax[(layer, "k")]) / 448.0
        assert same_bits(t[f"{attn}.k_proj.k_scale"], k_scale)
        assert t[f"{attn}.v_proj.v_scale"].shape == ()
    assert t["model.layers.1.mlp.gate_proj.weight"].dtype == torch.float32  # dense: off here


def test_config_files(exported) -> None:
    _, _, path = exported
    hq = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "NVFP4" and hq["group_size"] == 16
    assert hq["kv_cache_quant_algo"] == "NVFP4"
    assert "lm_head" in hq["exclude_modules"] and "model.layers.0.mlp.gate" in hq["exclude_modules"]
    assert "model.layers.1.mlp*" in hq["exclude_modules"]  # the dense layer's MLP
    assert not any("self_attn" in m for m in hq["exclude_modules"])  # attention is FP4
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4"
    assert qc["ignore"] == hq["exclude_modules"]
    assert ModelConfig.from_hf(cfg) == CFG


def test_hf_config_round_trips() -> None:
    for cfg in (CFG, get_config("debug"), get_config("qwen3-30b-a3b")):
        assert ModelConfig.from_hf(hf_config_dict(cfg)) == cfg


def test_export_into_a_non_empty_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    model = policy()
    with pytest.raises(FileExistsError, match="not empty"):
        save_hf_checkpoint(model, tmp_path)
    with pytest.raises(FileExistsError, match="not empty"):
        save_nvfp4_checkpoint(model, tmp_path, calibrate_act_amax(model, calib_batches()))
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize(
    ("quant", "cfg", "match"),
    [
        (QuantConfig(format="mxfp4"), CFG, "NVFP4 only"),
        (
            QuantConfig(
                sites=frozenset({SITE_EXPERT_WEIGHTS, SITE_EXPERT_ACTS, SITE_ROUTER_WEIGHTS})
            ),
            CFG,
            r"\['router_weights'\] cannot be exported",
        ),
        (QuantConfig(sites=frozenset({SITE_EXPERT_WEIGHTS})), CFG, "W4A4"),
        (QuantConfig(sites=frozenset({SITE_KV})), CFG, "no weight site is FP4"),
        (QuantConfig(), get_config("debug-shared"), "no shared expert"),
    ],
)
def test_policies_vllm_cannot_express_are_refused(
    quant: QuantConfig, cfg: ModelConfig, match: str, tmp_path: Path
) -> None:
    model = policy(quant, cfg)
    with pytest.raises(ValueError, match=match):
        save_nvfp4_checkpoint(model, tmp_path / "out", {})
    assert not (tmp_path / "out").exists()


def test_missing_calibration_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no calibration amax for activation site \(0, "):
        save_nvfp4_checkpoint(policy(), tmp_path / "out", {})


def test_bf16_export_loads_in_transformers_with_the_projects_logits(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    model = policy(QuantConfig.none()).eval()
    save_hf_checkpoint(model, tmp_path / "bf16")
    ref = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    # The project's model with the same (bf16-rounded) weights, in fp32 like transformers'.
    rounded = MoECausalLM(CFG)
    rounded.load_state_dict(
        {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    )
    ids = calib_batches()[0]
    b, t = ids.shape
    with torch.no_grad():
        want = rounded(ids, torch.arange(t).expand(b, t), torch.ones(b, t, dtype=torch.bool))
        got = ref.eval()(ids).logits
    assert want.abs().max() > 0.1, "test model too close to zero to be a meaningful comparison"
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


# --- ModelOpt, the reference -------------------------------------------------------------------
# The NVFP4 export equals what NVIDIA ModelOpt computes from the same master weights and the same
# calibration amaxes, bit for bit, as far as ModelOpt runs on a CPU: its NVFP4QTensor
# quantization of every exported GEMM (fused GEMMs sharing one weight_scale_2, as ModelOpt's
# export unifies them), the activation scale of its NVFP4 input quantizer, and its KV-cache
# scale post-processing. ModelOpt's end-to-end `export_hf_checkpoint` (calibration hooks on a
# transformers model) is not run here.


def modelopt() -> SimpleNamespace:
    """ModelOpt's pieces, or a skip naming the extra that provides them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # modelopt warns about the installed transformers
        qtensor = pytest.importorskip(
            "modelopt.torch.quantization.qtensor",
            reason="nvidia-modelopt (the [modelopt] extra) is the reference",
        )
        from modelopt.torch.export.quant_utils import postprocess_state_dict
        from modelopt.torch.quantization.config import QuantizerAttributeConfig
        from modelopt.torch.quantization.nn import TensorQuantizer
    return SimpleNamespace(
        NVFP4QTensor=qtensor.NVFP4QTensor,
        postprocess_state_dict=postprocess_state_dict,
        QuantizerAttributeConfig=QuantizerAttributeConfig,
        TensorQuantizer=TensorQuantizer,
    )


GROUP = 16


def modelopt_fused(weights: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """ModelOpt's NVFP4 of the weights one fused GEMM reads: one weight_scale_2 from their
    joint amax, then (codes, block scales, weight_scale_2) per weight."""
    scale_2 = modelopt().NVFP4QTensor.get_weights_scaling_factor_2(
        torch.cat([w.reshape(-1) for w in weights])
    )
    out = []
    for w in weights:
        q, scale, s2 = modelopt().NVFP4QTensor.quantize(w, GROUP, weights_scaling_factor_2=scale_2)
        out.append((q._quantized_data, scale, s2))
    return out


def modelopt_input_scale(amax: float) -> torch.Tensor:
    quantizer = modelopt().TensorQuantizer(
        modelopt().QuantizerAttributeConfig(
            num_bits=(2, 1), block_sizes={-1: GROUP, "type": "dynamic", "scale_bits": (4, 3)}
        )
    )
    quantizer.amax = torch.tensor(amax)
    return modelopt().NVFP4QTensor.get_activation_scaling_factor(quantizer).squeeze()


@pytest.fixture(scope="module")
def modelopt_dirs(tmp_path_factory: pytest.TempPathFactory):
    model = policy()
    amax = calibrate_act_amax(model, calib_batches())
    root = tmp_path_factory.mktemp("modelopt")
    save_hf_checkpoint(model, root / "master", dtype=torch.float32)
    save_nvfp4_checkpoint(model, root / "fp4", amax)
    return amax, load_file(root / "master" / "model.safetensors"), root / "fp4"


def fused_groups() -> list[list[str]]:
    groups = []
    for layer in range(CFG.num_layers):
        attn = f"model.layers.{layer}.self_attn"
        groups += [[f"{attn}.{p}" for p in ("q_proj", "k_proj", "v_proj")], [f"{attn}.o_proj"]]
        if CFG.is_moe_layer(layer):
            for e in range(CFG.num_experts):
                base = f"model.layers.{layer}.mlp.experts.{e}"
                groups += [[f"{base}.{n}" for n in names] for names in _EXPERT_GROUPS]
    return groups


def test_weights_equal_modelopt(modelopt_dirs: tuple[dict, dict, Path]) -> None:
    _, master, fp4_dir = modelopt_dirs
    ours = load_file(fp4_dir / "model.safetensors")
    for group in fused_groups():
        ref = modelopt_fused([master[f"{m}.weight"] for m in group])
        for m, (codes, scale, scale_2) in zip(group, ref, strict=True):
            assert torch.equal(ours[f"{m}.weight"], codes), f"{m}: packed codes"
            assert same_bits(ours[f"{m}.weight_scale"], scale), f"{m}: e4m3 block scales"
            assert same_bits(ours[f"{m}.weight_scale_2"], scale_2.float()), f"{m}: scale_2"


def test_static_scales_equal_modelopt(modelopt_dirs: tuple[dict, dict, Path]) -> None:
    amax, _, fp4_dir = modelopt_dirs
    ours = load_file(fp4_dir / "model.safetensors")
    for layer in range(CFG.num_layers):
        attn = f"model.layers.{layer}.self_attn"
        want = modelopt_input_scale(amax[(layer, "attn_in")])
        assert same_bits(ours[f"{attn}.q_proj.input_scale"], want), f"{attn} input_scale"
        kv = modelopt().postprocess_state_dict(
            {
                f"{attn}.k_bmm_quantizer._amax": torch.tensor(amax[(layer, "k")]),
                f"{attn}.v_bmm_quantizer._amax": torch.tensor(amax[(layer, "v")]),
            },
            448,  # ModelOpt's kv_cache_max_bound for FP8 and NVFP4 KV caches
            "NVFP4",
        )
        assert sorted(kv) == [f"{attn}.k_proj.k_scale", f"{attn}.v_proj.v_scale"]
        for key, value in kv.items():
            assert same_bits(ours[key], value.float()), key
        if CFG.is_moe_layer(layer):
            base = f"model.layers.{layer}.mlp.experts.0"
            want = modelopt_input_scale(amax[(layer, "down_in")])
            assert same_bits(ours[f"{base}.down_proj.input_scale"], want)
