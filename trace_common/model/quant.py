"""Quantized policy weights: quantize once, export, load without re-quantizing.

The trainer owns high-precision master weights. `quantize_policy` quantizes the weights of
every configured weight site once (NVFP4: per-tensor fp32 second-level scale; weights that one
fused GEMM reads share it, as ModelOpt exports them and vLLM's fused w13/qkv expect: gate and
up of one expert, q/k/v, a SwiGLU's gate and up; MXFP4: E8M0 block scales) and keeps both the
codes and their dequantized value. Both paths multiply with that dequantized value, so weights
are identical by construction. `export_quantized_state_dict` produces what the trainer pushes
to weight-sync (ModelOpt layout, HF names: `<module>.weight` uint8 [out, in/2],
`.weight_scale` e4m3 [out, in/16], `.weight_scale_2` fp32; routed experts per expert,
`...experts.{e}.gate_proj.weight`) with unconfigured sites in high precision, and
`load_quantized_state_dict` rebuilds a policy from it, reusing the codes as they are.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import torch

from trace_common.fp4 import FP4Format, QTensor, get_format, nvfp4
from trace_common.fp4.mxfp4 import MXFP4Tensor
from trace_common.fp4.nvfp4 import NVFP4Tensor, scale_2_from_amax
from trace_common.model.config import ModelConfig, QuantConfig
from trace_common.model.hf import load_native_state_dict
from trace_common.model.model import EXPERT_PROJS, Embedding, FP4Weights, Linear, MoECausalLM

POLICY_FORMAT_VERSION = "1"
_META_VERSION = "trace_policy_format_version"
_META_MODEL = "trace_model_config"
_META_QUANT = "trace_quant_config"
_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2")
# Gate and up of one expert are read by one fused w13 GEMM (shared scale_2); down alone.
_EXPERT_GROUPS = (("gate_proj", "up_proj"), ("down_proj",))

FP4Module = Linear | Embedding


def set_quant_config(model: MoECausalLM, quant: QuantConfig) -> None:
    model.quant = quant  # type: ignore[attr-defined]


def quant_config_of(model: MoECausalLM) -> QuantConfig:
    """The model's QuantConfig (all high precision if it was never quantized)."""
    return model.quant


def fp4_modules(model: MoECausalLM) -> Iterator[tuple[str, FP4Module]]:
    """(HF name, module) of every projection/embedding with a weight site, once per tensor:
    a tied LM head is left out (the embedding holds its weight and codes)."""
    tied = model.cfg.tie_word_embeddings
    for name, mod in model.named_modules():
        if isinstance(mod, (Linear, Embedding)) and not (tied and mod is model.lm_head):
            yield name, mod


def _fused_groups(model: MoECausalLM) -> list[list[FP4Module]]:
    """The projections/embedding grouped by the GEMM that reads them (`FUSED_LINEARS`)."""
    groups, grouped = [], set()
    for mod in model.modules():
        for names in getattr(mod, "FUSED_LINEARS", ()):
            group = [getattr(mod, n) for n in names]
            groups.append(group)
            grouped.update(map(id, group))
    groups += [[m] for _, m in fp4_modules(model) if id(m) not in grouped]
    return groups


def _quantize_group(fmt: FP4Format, weights: list[torch.Tensor]) -> list[QTensor]:
    """Quantize the weights one fused GEMM reads; NVFP4: one shared per-tensor scale_2."""
    if fmt.name != "nvfp4":
        return [fmt.quantize(w) for w in weights]
    amax = torch.stack([w.abs().amax() for w in weights]).amax()
    scale_2 = scale_2_from_amax(amax.float())
    return [fmt.quantize(w, scale_granularity="tensor", per_tensor_scale=scale_2) for w in weights]


def _quantize_experts(fmt: FP4Format, stacked: list[torch.Tensor]) -> list[list[QTensor]]:
    """Per weight name, the per-expert QTensors of one expert group's stacked weights
    [E, out, in]: each expert's group quantized as `_quantize_group` does. NVFP4 takes every
    expert at once (one scale_2 per expert, from the amax over the group's weights of that
    expert); other formats go expert by expert."""
    if fmt.name != "nvfp4":
        num_experts = stacked[0].shape[0]
        per_expert = [_quantize_group(fmt, [w[e] for w in stacked]) for e in range(num_experts)]
        return [list(qs) for qs in zip(*per_expert, strict=True)]
    amax = torch.stack([w.abs().amax(dim=tuple(range(1, w.dim()))) for w in stacked]).amax(0)
    scale_2 = scale_2_from_amax(amax.float())  # [E]
    return [nvfp4.quantize_stack(w, scale_2) for w in stacked]


@torch.no_grad()
def quantize_policy(
    model: MoECausalLM, quant: QuantConfig, *, only: Callable[[str], bool] | None = None
) -> MoECausalLM:
    """Attach `quant` to the model and quantize the weights of its weight sites once.

    Call again after every optimizer step that should produce a new policy version.
    ValueError (QuantConfig.check_model) if the config does not fit the architecture.
    `only(module_name)` limits the work to the modules it accepts (a sharded trainer
    quantizes one decoder layer at a time, while that layer's parameters are gathered).
    """
    quant.check_model(model.cfg)
    set_quant_config(model, quant)
    fmt = get_format(quant.format)
    module_names = {id(m): n for n, m in model.named_modules()}
    for layer, block in model.moe_blocks():
        if only is not None and not only(f"model.layers.{layer}.mlp.experts"):
            continue
        ex = block.experts
        ex.clear_quantized()
        if not quant.has(ex.weight_site):
            continue
        for names in _EXPERT_GROUPS:
            per_name = _quantize_experts(fmt, [getattr(ex, n).detach() for n in names])
            for n, qs in zip(names, per_name, strict=True):
                ex.quantized[n] = qs
        ex.refresh_dequant()
    if only is None or only("lm_head"):
        model.lm_head.clear_quantized()
    for group in _fused_groups(model):
        if only is not None and not only(module_names[id(group[0])]):
            continue
        for mod in group:
            mod.clear_quantized()
        if quant.has(group[0].weight_site):
            qs = _quantize_group(fmt, [m.weight.detach() for m in group])
            for mod, q in zip(group, qs, strict=True):
                mod.quantized["weight"] = q
                mod.refresh_dequant()
    _share_tied_codes(model)
    return model


def _share_tied_codes(model: MoECausalLM) -> None:
    """A tied LM head reads the embedding's codes (one tensor, quantized once)."""
    if model.cfg.tie_word_embeddings:
        embed = model.model.embed_tokens
        model.lm_head.quantized.update(embed.quantized)
        model.lm_head.set_dequant("weight", embed.dequant.get("weight"))


def _put_qtensor(tensors: dict[str, torch.Tensor], base: str, q: QTensor) -> None:
    """ModelOpt layout under `base` (e.g. "model.layers.0.self_attn.q_proj")."""
    tensors[f"{base}.weight"] = q.qdata.clone()  # uint8 [out, in/2]
    tensors[f"{base}.weight_scale"] = q.scale.clone()  # [out, in/block]
    if isinstance(q, NVFP4Tensor):
        tensors[f"{base}.weight_scale_2"] = q.per_tensor_scale.clone()  # fp32 0-d


def export_quantized_state_dict(
    model: MoECausalLM, *, only: Callable[[str], bool] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of the quantized policy, for weight-sync / safetensors.

    Weights of configured weight sites as packed FP4 codes + scales (ModelOpt layout; routed
    experts under HF per-expert names), everything else high precision under its HF name.
    Metadata (all str, safetensors-ready) carries the model and quant configs and the format
    version: what is packed is read from there, never guessed from names or dtypes.
    `only(module_name)` exports just the modules it accepts, read from the parameters as
    they are registered now (a sharded trainer's gathered layer), not from `state_dict()`.
    """
    quant = quant_config_of(model)
    tensors: dict[str, torch.Tensor] = {}
    items = model.state_dict().items() if only is None else model.named_parameters()
    for key, t in items:
        if only is not None and not only(key.rpartition(".")[0]):
            continue
        if ".mlp.experts." in key:
            continue
        if key == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        tensors[key] = t.detach().clone()
    for name, mod in fp4_modules(model):
        if "weight" in mod.quantized and (only is None or only(name)):
            _put_qtensor(tensors, name, mod.quantized["weight"])
    for layer, block in model.moe_blocks():
        ex = block.experts
        prefix = f"model.layers.{layer}.mlp.experts"
        if only is not None and not only(prefix):
            continue
        for name in EXPERT_PROJS:
            for e in range(ex.num_experts):
                base = f"{prefix}.{e}.{name}"
                if name in ex.quantized:
                    _put_qtensor(tensors, base, ex.quantized[name][e])
                else:
                    tensors[f"{base}.weight"] = getattr(ex, name)[e].detach().clone()
    return tensors, policy_metadata(model.cfg, quant)


def policy_metadata(cfg: ModelConfig, quant: QuantConfig) -> dict[str, str]:
    """The metadata a pushed policy carries: format version, model and quant configs."""
    return {
        _META_VERSION: POLICY_FORMAT_VERSION,
        _META_MODEL: json.dumps(cfg.to_dict()),
        _META_QUANT: json.dumps(quant.to_dict()),
    }


def policy_configs(metadata: dict[str, str]) -> tuple[ModelConfig, QuantConfig]:
    """The (model, quant) configs of `policy_metadata`; ValueError naming what is missing or
    an unsupported format version."""
    version = metadata.get(_META_VERSION)
    if version != POLICY_FORMAT_VERSION:
        raise ValueError(
            f"policy format version {version!r} is not supported (expected {POLICY_FORMAT_VERSION!r})"
        )
    for key in (_META_MODEL, _META_QUANT):
        if key not in metadata:
            raise ValueError(f"policy metadata lacks {key!r}; got keys {sorted(metadata)}")
    cfg = ModelConfig.from_dict(json.loads(metadata[_META_MODEL]))
    return cfg, QuantConfig.from_dict(json.loads(metadata[_META_QUANT]))


def load_quantized_state_dict(
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    *,
    dtype: torch.dtype = torch.float32,
) -> MoECausalLM:
    """Rebuild a policy from `export_quantized_state_dict` output. Codes are used as stored:
    master weights of quantized sites become their dequantized value, nothing is re-quantized."""
    cfg, quant = policy_configs(metadata)
    quant.check_model(cfg)
    model = MoECausalLM(cfg).to(dtype)
    set_quant_config(model, quant)
    fmt = get_format(quant.format)
    native = {
        k: v
        for k, v in tensors.items()
        if ".mlp.experts." not in k and not k.endswith(_SCALE_SUFFIXES)
    }
    consumed = set(native)
    loaded: list[FP4Weights] = []
    for name, mod in fp4_modules(model):
        if quant.has(mod.weight_site):
            q = _take_qtensor(tensors, name, tuple(mod.weight.shape), fmt, dtype, consumed)
            native[f"{name}.weight"] = q.dequantize(torch.float32)
            mod.quantized["weight"] = q
            loaded.append(mod)
    for layer, block in model.moe_blocks():
        ex = block.experts
        prefix = f"model.layers.{layer}.mlp.experts"
        for name in EXPERT_PROJS:
            shape = tuple(getattr(ex, name).shape[1:])
            qs, ws = [], []
            for e in range(cfg.num_experts):
                base = f"{prefix}.{e}.{name}"
                if quant.has(ex.weight_site):
                    qs.append(_take_qtensor(tensors, base, shape, fmt, dtype, consumed))
                    ws.append(qs[-1].dequantize(torch.float32))
                else:
                    ws.append(_take(tensors, f"{base}.weight"))
                    consumed.add(f"{base}.weight")
            native[f"{prefix}.{name}"] = torch.stack(ws)
            if qs:
                ex.quantized[name] = qs
        loaded.append(ex)
    leftover = sorted(set(tensors) - consumed)
    if leftover:
        raise ValueError(f"quantized state dict has unexpected tensors {leftover[:8]}")
    load_native_state_dict(model, native, source="quantized state dict")
    for mod in loaded:
        mod.refresh_dequant()
    _share_tied_codes(model)
    return model


def _take_qtensor(
    tensors: dict[str, torch.Tensor],
    base: str,
    shape: tuple[int, int],
    fmt: FP4Format,
    dtype: torch.dtype,
    consumed: set[str],
) -> QTensor:
    """The FP4 weight [out, in] stored under `base` in ModelOpt layout, checked, as stored."""
    out_dim, in_dim = shape
    w = _take(tensors, f"{base}.weight")
    _expect(w, f"{base}.weight", (out_dim, in_dim // 2), torch.uint8)
    scale = _take(tensors, f"{base}.weight_scale")
    scale_dtype = torch.float8_e4m3fn if fmt.name == "nvfp4" else torch.uint8  # e4m3 / e8m0
    _expect(scale, f"{base}.weight_scale", (out_dim, in_dim // fmt.block_size), scale_dtype)
    consumed.update({f"{base}.weight", f"{base}.weight_scale"})
    if fmt.name != "nvfp4":
        return MXFP4Tensor(qdata=w, scale=scale, shape=torch.Size(shape), dtype=dtype)
    s2 = _take(tensors, f"{base}.weight_scale_2").float()
    _expect(s2, f"{base}.weight_scale_2", (), torch.float32)
    consumed.add(f"{base}.weight_scale_2")
    return NVFP4Tensor(
        qdata=w,
        scale=scale,
        per_tensor_scale=s2,
        shape=torch.Size(shape),
        dtype=dtype,
        scale_granularity="tensor",
    )


def _take(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in tensors:
        raise ValueError(f"quantized state dict is missing tensor {key!r}")
    return tensors[key]


def _expect(t: torch.Tensor, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(
            f"tensor {key!r} is {t.dtype} {tuple(t.shape)}, expected {dtype} {tuple(shape)}"
        )
