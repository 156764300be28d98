"""Load a Hugging Face `Qwen3MoeForCausalLM` checkpoint directory (config.json + safetensors).

HF files store one tensor per expert (`...mlp.experts.{e}.gate_proj.weight`, the layout of the
released Qwen3-MoE checkpoints); transformers >= 5 can also hold them fused
(`...mlp.experts.gate_up_proj` [E, 2I, H]). Both are accepted and stacked into our
[E, out, in] parameters. Anything missing, unexpected or mis-shaped is an error naming the key.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from trace_common.model.config import ModelConfig
from trace_common.model.model import EXPERT_PROJS, MoECausalLM

_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+_proj)\.weight$")
_FUSED_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def read_hf_config(path: str | Path) -> ModelConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {str(path)!r}")
    return ModelConfig.from_hf(json.loads(cfg_file.read_text()))


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(path)!r}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def hf_to_native(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename/stack HF tensors into our state-dict layout (experts stacked [E, out, in])."""
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for key, t in tensors.items():
        if m := _EXPERT_KEY.match(key):
            prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
            per_expert.setdefault((prefix, proj), {})[e] = t
        elif m := _FUSED_KEY.match(key):
            prefix, name = m.group(1), m.group(2)
            if name == "gate_up_proj":
                gate, up = t.chunk(2, dim=1)  # [E, 2I, H] -> 2 x [E, I, H]
                out[f"{prefix}.gate_proj"], out[f"{prefix}.up_proj"] = gate, up
            else:
                out[f"{prefix}.down_proj"] = t
        else:
            out[key] = t
    for (prefix, proj), by_e in per_expert.items():
        if proj not in EXPERT_PROJS:
            raise ValueError(f"unexpected expert tensor {prefix}.<e>.{proj}.weight")
        missing = sorted(set(range(cfg.num_experts)) - set(by_e))
        extra = sorted(set(by_e) - set(range(cfg.num_experts)))
        if missing or extra:
            raise ValueError(
                f"{prefix}.*.{proj}: experts missing {missing} / unexpected {extra} "
                f"for num_experts={cfg.num_experts}"
            )
        out[f"{prefix}.{proj}"] = torch.stack([by_e[e] for e in range(cfg.num_experts)])
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def load_native_state_dict(
    model: MoECausalLM, sd: dict[str, torch.Tensor], *, source: str = "state dict"
) -> None:
    """Strict load with messages that name the offending keys and shapes."""
    own = model.state_dict()
    if model.cfg.tie_word_embeddings:
        own.pop("lm_head.weight", None)
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"{source} does not match the model: missing {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{'...' if len(unexpected) > 8 else ''}"
        )
    for key, t in sd.items():
        if tuple(t.shape) != tuple(own[key].shape):
            raise ValueError(
                f"{source}: tensor {key!r} has shape {tuple(t.shape)}, "
                f"model expects {tuple(own[key].shape)}"
            )
    with torch.no_grad():
        for key, t in sd.items():
            own[key].copy_(t.to(own[key].dtype))


def load_hf_checkpoint(
    path: str | Path,
    *,
    expected: ModelConfig | None = None,
    dtype: torch.dtype = torch.float32,
) -> MoECausalLM:
    """Build our model from an HF checkpoint dir; `expected` (if given) must match config.json."""
    cfg = read_hf_config(path)
    if expected is not None and (diff := expected.diff(cfg)):
        detail = ", ".join(
            f"{k}: expected {a!r}, checkpoint has {b!r}" for k, (a, b) in diff.items()
        )
        raise ValueError(f"checkpoint {str(path)!r} config does not match: {detail}")
    model = MoECausalLM(cfg).to(dtype)
    load_native_state_dict(model, hf_to_native(read_safetensors_dir(path), cfg), source=str(path))
    return model
