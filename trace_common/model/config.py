"""Typed configuration of the MoE policy: architecture, quantized sites and guidance.

One `ModelConfig` describes a Qwen3-MoE-architecture causal LM (optionally with a Qwen2-MoE
style shared expert). `QuantConfig` says which sites run FP4 and in which format, and
`GuidanceConfig` says at which layers and sites the rollout records guidance for the trainer.
Quantization is configuration: the model code asks these objects, it never hard-codes a site.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

# Quantizable sites (QuantConfig.sites).
SITE_EXPERT_WEIGHTS = "expert_weights"  # routed-expert gate/up/down weights (W4)
SITE_EXPERT_ACTS = "expert_acts"  # routed-expert GEMM inputs: hidden state in, down_proj in (A4)
SITE_KV = "kv"  # attention K and V as stored in the KV cache
QUANT_SITES = frozenset({SITE_EXPERT_WEIGHTS, SITE_EXPERT_ACTS, SITE_KV})
DEFAULT_QUANT_SITES = QUANT_SITES

# Activation sites at which the rollout can record guidance (GuidanceConfig.sites).
GSITE_MOE_IN = "moe_in"  # normalized hidden state entering the routed experts  [T, hidden]
GSITE_K = "k"  # post-RoPE keys as appended to the KV cache  [T, n_kv*head_dim]
GSITE_V = "v"  # values as appended to the KV cache  [T, n_kv*head_dim]
GUIDED_SITES = (GSITE_MOE_IN, GSITE_K, GSITE_V)
# The SwiGLU output entering each routed expert's down_proj is quantized (RTN, per row) on both
# paths but never guided: the paper's size arithmetic points at one hidden-state site per layer.
ASITE_DOWN_IN = "down_in"
DEFAULT_GUIDED_SITES = (GSITE_MOE_IN, GSITE_K, GSITE_V)
# Which QuantConfig site must be on for a guidance site to exist.
GSITE_REQUIRES = {
    GSITE_MOE_IN: SITE_EXPERT_ACTS,
    GSITE_K: SITE_KV,
    GSITE_V: SITE_KV,
}

FP4_FORMATS = ("nvfp4", "mxfp4")
GUIDANCE_MODES = ("compact", "full")


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig:
    """Architecture of a Qwen3-MoE causal LM (field names follow HF's `Qwen3MoeConfig`)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int  # experts per token (HF: num_experts_per_tok)
    moe_intermediate_size: int  # width of one routed expert
    intermediate_size: int = 0  # width of the dense MLP of `mlp_only_layers` (0: none used)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE style shared expert (0: none)
    norm_topk_prob: bool = True  # renormalize the top-k router probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer l is MoE iff (l+1) % step == 0 and l not in mlp_only
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} outside [0, {self.num_layers})")
        if any(not self.is_moe_layer(i) for i in range(self.num_layers)) and (
            self.intermediate_size <= 0
        ):
            raise ValueError(
                "dense layers present (mlp_only_layers/decoder_sparse_step) but "
                f"intermediate_size={self.intermediate_size}"
            )

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        d = dict(d)
        d["mlp_only_layers"] = tuple(d.get("mlp_only_layers", ()))
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict of a Qwen3-MoE model.

        A `shared_expert_intermediate_size` key (Qwen2-MoE style shared expert) is honoured.
        """
        model_type = hf.get("model_type")
        if model_type != "qwen3_moe":
            raise ValueError(f"unsupported model_type {model_type!r} (expected 'qwen3_moe')")
        if hf.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported (use_sliding_window=true)")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r} (only 'default')")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        num_experts = hf.get("num_experts", hf.get("num_local_experts"))
        if num_experts is None:
            raise ValueError("config.json has neither num_experts nor num_local_experts")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} (only 'silu')")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            num_experts=num_experts,
            top_k=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            intermediate_size=hf.get("intermediate_size", 0),
            shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0),
            norm_topk_prob=hf.get("norm_topk_prob", False),
            decoder_sparse_step=hf.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=hf.get("max_position_embeddings", 40960),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", False),
        )

    def diff(self, other: ModelConfig) -> dict[str, tuple[Any, Any]]:
        """Fields that differ: {name: (self value, other value)}."""
        out = {}
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                out[f.name] = (a, b)
        return out


# Named shapes. "debug" is the tiny CPU flavor used by tests; the others are real models
# (values from their HF config.json) for sizing and for the GPU engine.
_DEBUG = ModelConfig(
    vocab_size=64,
    hidden_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    num_experts=8,
    top_k=2,
    moe_intermediate_size=32,
    max_position_embeddings=512,
    rope_theta=10000.0,
)

NAMED_CONFIGS: dict[str, ModelConfig] = {
    "debug": _DEBUG,
    "debug-shared": dataclasses.replace(_DEBUG, shared_expert_intermediate_size=64),
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        num_experts=128,
        top_k=8,
        moe_intermediate_size=768,
        intermediate_size=6144,
        max_position_embeddings=40960,
    ),
    "qwen3-235b-a22b": ModelConfig(
        vocab_size=151936,
        hidden_size=4096,
        num_layers=94,
        num_heads=64,
        num_kv_heads=4,
        head_dim=128,
        num_experts=128,
        top_k=8,
        moe_intermediate_size=1536,
        intermediate_size=12288,
        max_position_embeddings=40960,
    ),
}


def get_config(name: str) -> ModelConfig:
    """A named shape; unknown name -> ValueError listing the known ones."""
    try:
        return NAMED_CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known: {sorted(NAMED_CONFIGS)}") from None


@dataclass(kw_only=True, slots=True, frozen=True)
class QuantConfig:
    """Which sites run FP4 and how. Everything not listed stays high precision.

    Weights are quantized once per policy version with a per-tensor second-level scale
    (ModelOpt layout); activations and KV use a per-token (per-row) second-level scale.
    """

    sites: frozenset[str] = field(default_factory=lambda: DEFAULT_QUANT_SITES)
    format: Literal["nvfp4", "mxfp4"] = "nvfp4"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sites", frozenset(self.sites))
        unknown = sorted(set(self.sites) - QUANT_SITES)
        if unknown:
            raise ValueError(
                f"unknown quantization site(s) {unknown}; known: {sorted(QUANT_SITES)}"
            )
        if self.format not in FP4_FORMATS:
            raise ValueError(f"unknown FP4 format {self.format!r}; known: {list(FP4_FORMATS)}")

    @classmethod
    def none(cls) -> QuantConfig:
        """Everything in high precision."""
        return cls(sites=frozenset())

    def has(self, site: str) -> bool:
        return site in self.sites

    def to_dict(self) -> dict[str, Any]:
        return {"sites": sorted(self.sites), "format": self.format}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuantConfig:
        return cls(sites=frozenset(d["sites"]), format=d["format"])


@dataclass(kw_only=True, slots=True, frozen=True)
class GuidanceConfig:
    """Where the rollout records guidance: layers x sites, in compact or full mode.

    layers=None means the deeper half (layers num_layers//2 .. num_layers-1), the paper's default.
    """

    layers: tuple[int, ...] | None = None
    sites: tuple[str, ...] = DEFAULT_GUIDED_SITES
    mode: Literal["compact", "full"] = "compact"

    def __post_init__(self) -> None:
        unknown = [s for s in self.sites if s not in GUIDED_SITES]
        if unknown:
            raise ValueError(f"unknown guidance site(s) {unknown}; known: {list(GUIDED_SITES)}")
        if self.mode not in GUIDANCE_MODES:
            raise ValueError(f"unknown guidance mode {self.mode!r}; known: {list(GUIDANCE_MODES)}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(sorted(set(self.layers))))
        object.__setattr__(self, "sites", tuple(dict.fromkeys(self.sites)))

    @classmethod
    def deepest(
        cls,
        fraction: float,
        num_layers: int,
        *,
        sites: Iterable[str] = DEFAULT_GUIDED_SITES,
        mode: Literal["compact", "full"] = "compact",
    ) -> GuidanceConfig:
        """The deepest ceil(fraction * num_layers) layers (at least one)."""
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        n = max(1, math.ceil(round(fraction * num_layers, 6)))
        return cls(layers=tuple(range(num_layers - n, num_layers)), sites=tuple(sites), mode=mode)

    def resolve_layers(self, cfg: ModelConfig) -> tuple[int, ...]:
        layers = self.layers
        if layers is None:
            layers = tuple(range(cfg.num_layers // 2, cfg.num_layers))
        bad = [i for i in layers if not 0 <= i < cfg.num_layers]
        if bad:
            raise ValueError(f"guided layer(s) {bad} outside [0, {cfg.num_layers})")
        return layers

    def resolve(self, cfg: ModelConfig, quant: QuantConfig) -> tuple[tuple[int, str], ...]:
        """All guided (layer, site) pairs, checked against the model and quantized sites."""
        for s in self.sites:
            if not quant.has(GSITE_REQUIRES[s]):
                raise ValueError(
                    f"guidance site {s!r} needs quantization site {GSITE_REQUIRES[s]!r}, "
                    f"which is off (QuantConfig.sites={sorted(quant.sites)})"
                )
        pairs = []
        for layer in self.resolve_layers(cfg):
            for s in self.sites:
                if s == GSITE_MOE_IN and not cfg.is_moe_layer(layer):
                    continue  # dense layers have no routed experts
                pairs.append((layer, s))
        return tuple(pairs)
