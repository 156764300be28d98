"""Quantized policy weights: quantize once, export, load without re-quantizing.

The trainer owns high-precision master weights. `quantize_policy` quantizes every routed-expert
weight once (NVFP4: per-tensor fp32 second-level scale, gate and up of one expert sharing it as
vLLM's fused w13 expects; MXFP4: E8M0 block scales) and keeps both the codes and their
dequantized value. Both paths multiply with that dequantized value, so weights are identical
by construction. `export_quantized_state_dict` produces what the trainer pushes to weight-sync
(ModelOpt layout, HF names: `...experts.{e}.gate_proj.weight` uint8 [out, in/2],
`.weight_scale` e4m3 [out, in/16], `.weight_scale_2` fp32) and `load_quantized_state_dict`
rebuilds a policy from it, reusing the codes as they are.
"""

from __future__ import annotations

import json

import torch

from trace_common.fp4 import get_format
from trace_common.fp4.mxfp4 import MXFP4Tensor
from trace_common.fp4.nvfp4 import NVFP4Tensor, scale_2_from_amax
from trace_common.model.config import SITE_EXPERT_WEIGHTS, ModelConfig, QuantConfig
from trace_common.model.hf import load_native_state_dict
from trace_common.model.model import EXPERT_PROJS, Experts, MoECausalLM

POLICY_FORMAT_VERSION = "1"
_META_VERSION = "trace_policy_format_version"
_META_MODEL = "trace_model_config"
_META_QUANT = "trace_quant_config"


def set_quant_config(model: MoECausalLM, quant: QuantConfig) -> None:
    model.quant = quant  # type: ignore[attr-defined]


def quant_config_of(model: MoECausalLM) -> QuantConfig:
    """The model's QuantConfig (all high precision if it was never quantized)."""
    return model.quant


@torch.no_grad()
def quantize_policy(model: MoECausalLM, quant: QuantConfig) -> MoECausalLM:
    """Attach `quant` to the model and quantize its expert weights (if that site is on) once.

    Call again after every optimizer step that should produce a new policy version.
    """
    set_quant_config(model, quant)
    fmt = get_format(quant.format)
    for _, block in model.moe_blocks():
        ex: Experts = block.experts
        ex.quantized.clear()
        for name in EXPERT_PROJS:
            ex.set_dequant(name, None)
        if not quant.has(SITE_EXPERT_WEIGHTS):
            continue
        for name in EXPERT_PROJS:
            ex.quantized[name] = []
        for e in range(ex.num_experts):
            shared = None
            if fmt.name == "nvfp4":
                # gate and up of one expert share scale_2 (vLLM fuses them into one w13 GEMM).
                amax = torch.maximum(ex.gate_proj[e].abs().amax(), ex.up_proj[e].abs().amax())
                shared = scale_2_from_amax(amax.float())
            for name in EXPERT_PROJS:
                w = getattr(ex, name)[e].detach()
                if fmt.name == "nvfp4":
                    pts = shared if name != "down_proj" else None
                    q = fmt.quantize(w, scale_granularity="tensor", per_tensor_scale=pts)
                else:
                    q = fmt.quantize(w)
                ex.quantized[name].append(q)
        _refresh_dequant(ex, fmt.name)
    return model


def _refresh_dequant(ex: Experts, fmt_name: str) -> None:
    fmt = get_format(fmt_name)
    for name, qs in ex.quantized.items():
        master = getattr(ex, name)
        deq = torch.stack([fmt.dequantize(q, dtype=torch.float32) for q in qs])
        ex.set_dequant(name, deq.to(device=master.device, dtype=master.dtype))


def export_quantized_state_dict(
    model: MoECausalLM,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of the quantized policy, for weight-sync / safetensors.

    Routed-expert weights as packed FP4 codes + scales (HF per-expert names, ModelOpt layout),
    everything else high precision under its HF name. Metadata (all str, safetensors-ready)
    carries the model and quant configs and the format version, never guessed from names.
    """
    quant = quant_config_of(model)
    tensors: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        if ".mlp.experts." in key:
            continue
        if key == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        tensors[key] = t.detach().clone()
    for layer, block in model.moe_blocks():
        ex = block.experts
        prefix = f"model.layers.{layer}.mlp.experts"
        for name in EXPERT_PROJS:
            for e in range(ex.num_experts):
                base = f"{prefix}.{e}.{name}"
                if name in ex.quantized:
                    q = ex.quantized[name][e]
                    tensors[f"{base}.weight"] = q.qdata.clone()  # uint8 [out, in/2]
                    tensors[f"{base}.weight_scale"] = q.scale.clone()  # [out, in/block]
                    if isinstance(q, NVFP4Tensor):
                        tensors[f"{base}.weight_scale_2"] = q.per_tensor_scale.clone()
                else:
                    tensors[f"{base}.weight"] = getattr(ex, name)[e].detach().clone()
    metadata = {
        _META_VERSION: POLICY_FORMAT_VERSION,
        _META_MODEL: json.dumps(model.cfg.to_dict()),
        _META_QUANT: json.dumps(quant.to_dict()),
    }
    return tensors, metadata


def load_quantized_state_dict(
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    *,
    dtype: torch.dtype = torch.float32,
) -> MoECausalLM:
    """Rebuild a policy from `export_quantized_state_dict` output. Codes are used as stored:
    the expert master weights become their dequantized value, nothing is re-quantized."""
    version = metadata.get(_META_VERSION)
    if version != POLICY_FORMAT_VERSION:
        raise ValueError(
            f"policy format version {version!r} is not supported (expected {POLICY_FORMAT_VERSION!r})"
        )
    cfg = ModelConfig.from_dict(json.loads(metadata[_META_MODEL]))
    quant = QuantConfig.from_dict(json.loads(metadata[_META_QUANT]))
    model = MoECausalLM(cfg).to(dtype)
    set_quant_config(model, quant)
    fmt = get_format(quant.format)
    native = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    quantized_w = quant.has(SITE_EXPERT_WEIGHTS)
    for layer, block in model.moe_blocks():
        ex = block.experts
        prefix = f"model.layers.{layer}.mlp.experts"
        for name in EXPERT_PROJS:
            master = getattr(ex, name)
            out_dim, in_dim = master.shape[1:]
            qs, ws = [], []
            for e in range(cfg.num_experts):
                base = f"{prefix}.{e}.{name}"
                w = _take(tensors, f"{base}.weight")
                if not quantized_w:
                    ws.append(w)
                    continue
                _expect(w, f"{base}.weight", (out_dim, in_dim // 2), torch.uint8)
                scale = _take(tensors, f"{base}.weight_scale")
                shape = torch.Size((out_dim, in_dim))
                if fmt.name == "nvfp4":
                    _expect(
                        scale,
                        f"{base}.weight_scale",
                        (out_dim, in_dim // fmt.block_size),
                        torch.float8_e4m3fn,
                    )
                    s2 = _take(tensors, f"{base}.weight_scale_2").float()
                    _expect(s2, f"{base}.weight_scale_2", (), torch.float32)
                    q = NVFP4Tensor(
                        qdata=w,
                        scale=scale,
                        per_tensor_scale=s2,
                        shape=shape,
                        dtype=dtype,
                        scale_granularity="tensor",
                    )
                else:
                    _expect(
                        scale,
                        f"{base}.weight_scale",
                        (out_dim, in_dim // fmt.block_size),
                        torch.uint8,
                    )
                    q = MXFP4Tensor(qdata=w, scale=scale, shape=shape, dtype=dtype)
                qs.append(q)
                ws.append(fmt.dequantize(q, dtype=torch.float32))
            native[f"{prefix}.{name}"] = torch.stack(ws)
            if quantized_w:
                ex.quantized[name] = qs
        if quantized_w:
            _refresh_dequant(ex, fmt.name)
    leftover = sorted(set(tensors) - _consumed(tensors, cfg, model))
    if leftover:
        raise ValueError(f"quantized state dict has unexpected tensors {leftover[:8]}")
    load_native_state_dict(model, native, source="quantized state dict")
    return model


def _take(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in tensors:
        raise ValueError(f"quantized state dict is missing tensor {key!r}")
    return tensors[key]


def _expect(t: torch.Tensor, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(
            f"tensor {key!r} is {t.dtype} {tuple(t.shape)}, expected {dtype} {tuple(shape)}"
        )


def _consumed(
    tensors: dict[str, torch.Tensor],
    cfg: ModelConfig,
    model: MoECausalLM,
) -> set[str]:
    used = {k for k in tensors if ".mlp.experts." not in k}
    for layer, _ in model.moe_blocks():
        for name in EXPERT_PROJS:
            for e in range(cfg.num_experts):
                base = f"model.layers.{layer}.mlp.experts.{e}.{name}"
                used.update({f"{base}.weight", f"{base}.weight_scale", f"{base}.weight_scale_2"})
    return used
