"""Write the policy as Hugging Face checkpoint directories other tools load (docs/export.md).

Two exports:
  `save_hf_checkpoint`     the master weights as a plain `Qwen3MoeForCausalLM` checkpoint
                           (config.json + model.safetensors, BF16 by default): transformers,
                           vLLM or ModelOpt's own PTQ load it as any released Qwen3-MoE.
  `save_nvfp4_checkpoint`  the FP4 policy in NVIDIA ModelOpt's NVFP4 checkpoint format, which
                           vLLM serves with `quantization="modelopt_fp4"`: the codes and scales
                           of `export_quantized_state_dict` (already bit-identical to
                           ModelOpt's) under ModelOpt's names, plus the static scales ModelOpt
                           writes and vLLM's loader reads (`input_scale`, `k_scale`, `v_scale`),
                           `hf_quant_config.json` and a `quantization_config` in config.json.

ModelOpt's static scales come from calibration: `input_scale = amax / (6 * 448)` over the
calibration activations of a GEMM's input, `k_scale`/`v_scale = amax / 448` over K and V.
TRACE quantizes activations and K/V with a dynamic per-token second-level scale instead
(`amax(row) / (6 * 448)`, computed for every token); `calibrate_act_amax` runs the FP4 policy
with the rollout's numerics and takes the largest per-token amax each site saw, so a static
scale is the largest per-token scale of the calibration data. `load_nvfp4_checkpoint` reads the
directory back into the project bit-exactly (codes and scales as stored).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from trace_common.fp4.constants import F8E4M3_MAX
from trace_common.fp4.nvfp4 import scale_2_from_amax
from trace_common.model.config import (
    ASITE_DOWN_IN,
    GSITE_K,
    GSITE_MOE_IN,
    GSITE_V,
    SITE_ATTN_ACTS,
    SITE_ATTN_WEIGHTS,
    SITE_DENSE_MLP_ACTS,
    SITE_DENSE_MLP_WEIGHTS,
    SITE_EXPERT_ACTS,
    SITE_EXPERT_WEIGHTS,
    SITE_KV,
    ModelConfig,
    QuantConfig,
)
from trace_common.model.hf import read_hf_config
from trace_common.model.model import EXPERT_PROJS, Linear, MoECausalLM
from trace_common.model.quant import (
    export_quantized_state_dict,
    fp4_modules,
    load_quantized_state_dict,
    quant_config_of,
)
from trace_common.model.runtime import RolloutHooks

CONFIG_FILE = "config.json"
QUANT_CONFIG_FILE = "hf_quant_config.json"  # ModelOpt's; vLLM detects ModelOpt by it
WEIGHTS_FILE = "model.safetensors"
NVFP4_QUANT_ALGO = "NVFP4"  # ModelOpt's name for W4A4 NVFP4 (vLLM: modelopt_fp4)
NVFP4_GROUP_SIZE = 16  # elements per e4m3 block scale (the NVFP4 block)
KV_CACHE_NVFP4 = "NVFP4"  # ModelOpt's kv_cache_quant_algo for an FP4 KV cache
STATIC_SCALE_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")
_PACKED_SUFFIXES = (".weight_scale", ".weight_scale_2")
_HP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_EXPERT_STACK = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\w+_proj)$")

# W4A4 pairs ModelOpt's NVFP4 expresses: a weight site is exported only with its input site.
_W4A4_PAIRS = {
    SITE_EXPERT_WEIGHTS: SITE_EXPERT_ACTS,
    SITE_ATTN_WEIGHTS: SITE_ATTN_ACTS,
    SITE_DENSE_MLP_WEIGHTS: SITE_DENSE_MLP_ACTS,
}
_EXPRESSIBLE = frozenset(_W4A4_PAIRS) | frozenset(_W4A4_PAIRS.values()) | {SITE_KV}
_WHY_NOT = (
    "vLLM's Qwen3-MoE keeps its router, embedding and LM head out of the modelopt_fp4 "
    "quantized layers, has no shared expert, and its NVFP4 is W4A4 (a weight site needs its "
    "activation site and the reverse)"
)


def hf_config_dict(cfg: ModelConfig, *, dtype: torch.dtype = torch.bfloat16) -> dict:
    """config.json of a `Qwen3MoeForCausalLM` with this architecture (read back by
    `ModelConfig.from_hf` to the same config)."""
    if cfg.shared_expert_intermediate_size:
        raise ValueError(
            f"shared_expert_intermediate_size={cfg.shared_expert_intermediate_size}: "
            "Qwen3MoeForCausalLM has no shared expert, so this policy has no HF architecture "
            "to export as"
        )
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
        "rms_norm_eps": cfg.rms_norm_eps,
        # Both spellings: transformers >= 5 reads rope_parameters, older releases rope_theta.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def native_to_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> HF names: stacked experts [E, out, in] become per-expert tensors
    (`...experts.{e}.gate_proj.weight`); a tied LM head is left to the embedding."""
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        if m := _EXPERT_STACK.match(key):
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.{m.group(2)}.weight"] = t[e]
        elif not (key == "lm_head.weight" and cfg.tie_word_embeddings):
            out[key] = t
    return out


def _empty_dir(path: str | Path) -> Path:
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"export directory {str(path)!r} exists and is not empty")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _save(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    from safetensors.torch import save_file

    # safetensors refuses shared or non-contiguous storage: plain contiguous CPU copies.
    plain = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
    save_file(plain, str(path / WEIGHTS_FILE), metadata={"format": "pt", **metadata})


def save_hf_checkpoint(
    model: MoECausalLM, path: str | Path, *, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """The master weights as a plain HF checkpoint directory (must be empty or absent)."""
    config = hf_config_dict(model.cfg, dtype=dtype)
    out = _empty_dir(path)
    tensors = {k: v.to(dtype) for k, v in native_to_hf(model.state_dict(), model.cfg).items()}
    _save(out, tensors, {})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


class _CalibrationHooks(RolloutHooks):
    """The rollout's hooks that also keep, per (layer, site), the largest |x| seen."""

    def __init__(self, quant: QuantConfig) -> None:
        super().__init__(quant)
        self.amax: dict[tuple[int, str], float] = {}

    def act(self, layer: int, site: str, x: torch.Tensor) -> torch.Tensor:
        if x.numel():
            a = float(x.detach().abs().amax())
            self.amax[(layer, site)] = max(a, self.amax.get((layer, site), 0.0))
        return super().act(layer, site, x)


@torch.no_grad()
def calibrate_act_amax(
    model: MoECausalLM, batches: Iterable[torch.Tensor]
) -> dict[tuple[int, str], float]:
    """{(layer, site): max |activation|} of every activation site, over token batches [B, T]
    run through the FP4 policy with the rollout's numerics (sites after an FP4 site see
    FP4-quantized inputs, as they do in vLLM). Routed experts' down_proj inputs are pooled
    over the layer's experts."""
    hooks = _CalibrationHooks(quant_config_of(model))
    model.eval()
    for ids in batches:
        b, t = ids.shape
        positions = torch.arange(t).expand(b, t)
        model(ids, positions, torch.ones(b, t, dtype=torch.bool), hooks)
    if not hooks.amax:
        raise ValueError("calibration got no tokens (empty batches)")
    return hooks.amax


def check_nvfp4_exportable(quant: QuantConfig, cfg: ModelConfig) -> None:
    """ValueError unless ModelOpt's NVFP4 format (as vLLM loads it) expresses a policy of
    architecture `cfg` quantized per `quant`."""
    if quant.format != "nvfp4":
        raise ValueError(
            f"the policy is {quant.format}: ModelOpt's NVFP4 checkpoint holds NVFP4 only "
            "(e4m3 block scales of 16); re-quantize with format='nvfp4'"
        )
    unsupported = sorted(quant.sites - _EXPRESSIBLE)
    if unsupported:
        raise ValueError(f"quantization site(s) {unsupported} cannot be exported: {_WHY_NOT}")
    for w, a in _W4A4_PAIRS.items():
        if quant.has(w) != quant.has(a):
            raise ValueError(
                f"'{w}'={quant.has(w)} but '{a}'={quant.has(a)}: ModelOpt's NVFP4 (vLLM's "
                "modelopt_fp4) is W4A4, so these must be on or off together"
            )
    if not any(quant.has(w) for w in _W4A4_PAIRS):
        raise ValueError(
            f"no weight site is FP4 (sites={sorted(quant.sites)}): nothing for an NVFP4 "
            "checkpoint to hold; use save_hf_checkpoint"
        )
    hf_config_dict(cfg)  # ValueError for a shared expert


def _input_scale(amax: Mapping[tuple[int, str], float], key: tuple[int, str]) -> torch.Tensor:
    if key not in amax:
        raise ValueError(f"no calibration amax for activation site {key} (layer, site)")
    return scale_2_from_amax(torch.tensor(amax[key], dtype=torch.float32))  # amax / (6 * 448)


def static_scales(
    model: MoECausalLM, amax: Mapping[tuple[int, str], float]
) -> dict[str, torch.Tensor]:
    """ModelOpt's static scales (fp32 0-d) of the quantized GEMMs and of K/V, from amaxes."""
    quant = quant_config_of(model)
    out: dict[str, torch.Tensor] = {}
    for name, mod in fp4_modules(model):
        if isinstance(mod, Linear) and "weight" in mod.quantized:
            out[f"{name}.input_scale"] = _input_scale(amax, (mod.layer, mod.act_site))
    if quant.has(SITE_EXPERT_WEIGHTS):
        for layer, block in model.moe_blocks():
            for e in range(block.experts.num_experts):
                for proj in EXPERT_PROJS:
                    site = ASITE_DOWN_IN if proj == "down_proj" else GSITE_MOE_IN
                    base = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                    out[f"{base}.input_scale"] = _input_scale(amax, (layer, site))
    if quant.has(SITE_KV):
        e4m3_max = torch.tensor(F8E4M3_MAX, dtype=torch.float32)
        for layer in range(model.cfg.num_layers):
            attn = f"model.layers.{layer}.self_attn"
            for proj, site in (("k_proj.k_scale", GSITE_K), ("v_proj.v_scale", GSITE_V)):
                if (layer, site) not in amax:
                    raise ValueError(f"no calibration amax for activation site {(layer, site)}")
                a = torch.tensor(amax[(layer, site)], dtype=torch.float32)
                out[f"{attn}.{proj}"] = a / e4m3_max  # ModelOpt: amax / 448 for FP8 and NVFP4
    return out


def _exclude_modules(model: MoECausalLM) -> list[str]:
    """ModelOpt-style wildcard patterns of the GEMMs left in high precision."""
    quant, cfg = quant_config_of(model), model.cfg
    out = ["lm_head"]
    for layer in range(cfg.num_layers):
        prefix = f"model.layers.{layer}"
        if not quant.has(SITE_ATTN_WEIGHTS):
            out.append(f"{prefix}.self_attn*")
        if cfg.is_moe_layer(layer):
            out.append(f"{prefix}.mlp.gate")  # the router
            if not quant.has(SITE_EXPERT_WEIGHTS):
                out.append(f"{prefix}.mlp.experts*")
        elif not quant.has(SITE_DENSE_MLP_WEIGHTS):
            out.append(f"{prefix}.mlp*")
    return sorted(out)


def hf_quant_config(model: MoECausalLM) -> dict:
    """hf_quant_config.json: ModelOpt's `{"producer", "quantization"}` layout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        producer_version = version("trace-rl")
    except PackageNotFoundError:
        producer_version = "unknown"
    quant = quant_config_of(model)
    return {
        "producer": {"name": "trace-rl", "version": producer_version},
        "quantization": {
            "quant_algo": NVFP4_QUANT_ALGO,
            "kv_cache_quant_algo": KV_CACHE_NVFP4 if quant.has(SITE_KV) else None,
            "group_size": NVFP4_GROUP_SIZE,
            "exclude_modules": _exclude_modules(model),
        },
    }


def quantization_config(hf_quant: Mapping) -> dict:
    """The `quantization_config` of config.json, in the compressed-tensors-like shape ModelOpt
    writes there (`quant_method: modelopt`, `ignore`, `config_groups`)."""
    q = hf_quant["quantization"]
    group = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": q["group_size"]}
    out: dict = {
        "config_groups": {
            "group_0": {
                "input_activations": dict(group),
                "weights": dict(group),
                "targets": ["Linear"],
            }
        },
        "ignore": list(q["exclude_modules"]),
        "quant_algo": q["quant_algo"],
        "producer": dict(hf_quant["producer"]),
        "quant_method": "modelopt",
    }
    if q["kv_cache_quant_algo"]:
        out["kv_cache_scheme"] = q["kv_cache_quant_algo"]
    return out


def save_nvfp4_checkpoint(
    model: MoECausalLM,
    path: str | Path,
    act_amax: Mapping[tuple[int, str], float],
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """The quantized policy as a ModelOpt NVFP4 checkpoint directory (must be empty or absent).

    `act_amax` ({(layer, site): max |x|}, e.g. from `calibrate_act_amax`) gives the static
    `input_scale`/`k_scale`/`v_scale`. FP4 codes, e4m3 block scales and fp32 `weight_scale_2`
    are written as quantized; high-precision tensors (norms, router, embedding, LM head,
    unquantized GEMMs) in `dtype`. The TRACE model and quant configs ride in the safetensors
    metadata, so `load_nvfp4_checkpoint` never infers the format from names.
    """
    check_nvfp4_exportable(quant_config_of(model), model.cfg)
    tensors, metadata = export_quantized_state_dict(model)
    for key, t in tensors.items():
        if not key.endswith(_PACKED_SUFFIXES) and t.dtype in _HP_DTYPES:
            tensors[key] = t.to(dtype)
    tensors.update(static_scales(model, act_amax))
    hf_quant = hf_quant_config(model)
    config = {
        **hf_config_dict(model.cfg, dtype=dtype),
        "quantization_config": quantization_config(hf_quant),
    }
    out = _empty_dir(path)
    _save(out, tensors, metadata)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    (out / QUANT_CONFIG_FILE).write_text(json.dumps(hf_quant, indent=2) + "\n")
    return out


def load_nvfp4_checkpoint(
    path: str | Path, *, dtype: torch.dtype = torch.float32
) -> tuple[MoECausalLM, dict[str, torch.Tensor]]:
    """(policy, static scales) from a `save_nvfp4_checkpoint` directory: codes and scales as
    stored (nothing re-quantized); config.json and hf_quant_config.json must agree with the
    TRACE configs recorded in the weights file."""
    from safetensors import safe_open

    path = Path(path)
    hf_cfg = read_hf_config(path)
    quant_file = path / QUANT_CONFIG_FILE
    if not quant_file.is_file():
        raise FileNotFoundError(f"no {QUANT_CONFIG_FILE} in {str(path)!r}: not an NVFP4 export")
    q = json.loads(quant_file.read_text()).get("quantization", {})
    if q.get("quant_algo") != NVFP4_QUANT_ALGO or q.get("group_size") != NVFP4_GROUP_SIZE:
        raise ValueError(
            f"{quant_file}: quant_algo={q.get('quant_algo')!r} group_size={q.get('group_size')!r}"
            f", expected {NVFP4_QUANT_ALGO!r} {NVFP4_GROUP_SIZE}"
        )
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        metadata = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iter)
    metadata.pop("format", None)
    scales = {k: tensors.pop(k) for k in list(tensors) if k.endswith(STATIC_SCALE_SUFFIXES)}
    model = load_quantized_state_dict(tensors, metadata, dtype=dtype)
    if diff := model.cfg.diff(hf_cfg):
        raise ValueError(f"{path}: config.json disagrees with the weights' metadata: {diff}")
    kv = KV_CACHE_NVFP4 if quant_config_of(model).has(SITE_KV) else None
    if q.get("kv_cache_quant_algo") != kv:
        raise ValueError(
            f"{quant_file}: kv_cache_quant_algo={q.get('kv_cache_quant_algo')!r} but the "
            f"policy's KV site says {kv!r}"
        )
    return model, scales
