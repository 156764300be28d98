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

from trace_common.fp4 import get_format

# Quantizable sites (QuantConfig.sites). A weight site quantizes its weights once per policy
# version (per-tensor second-level scale, ModelOpt layout); an activation site fake-quantizes the
# input rows of its GEMMs per token (per-row second-level scale), like the routed experts' inputs.
SITE_EXPERT_WEIGHTS = "expert_weights"  # routed-expert gate/up/down weights (W4)
SITE_EXPERT_ACTS = "expert_acts"  # routed-expert GEMM inputs: hidden state in, down_proj in (A4)
SITE_KV = "kv"  # attention K and V as stored in the KV cache
SITE_ATTN_WEIGHTS = "attn_weights"  # q/k/v/o projection weights
SITE_ATTN_ACTS = "attn_acts"  # q/k/v input (normed hidden state) and o_proj input
SITE_SHARED_EXPERT_WEIGHTS = "shared_expert_weights"  # shared expert gate/up/down (not its gate)
SITE_SHARED_EXPERT_ACTS = "shared_expert_acts"  # shared expert gate/up input and down_proj input
SITE_ROUTER_WEIGHTS = "router_weights"  # router (mlp.gate) weight [E, hidden]
SITE_ROUTER_ACTS = "router_acts"  # router input (normed hidden state)
SITE_DENSE_MLP_WEIGHTS = "dense_mlp_weights"  # SwiGLU MLP of dense (mlp_only) layers
SITE_DENSE_MLP_ACTS = "dense_mlp_acts"  # its gate/up input and down_proj input
SITE_LM_HEAD_WEIGHTS = "lm_head_weights"  # LM head weight [vocab, hidden]
SITE_LM_HEAD_ACTS = "lm_head_acts"  # LM head input (final normed hidden state)
SITE_EMBED_WEIGHTS = "embed_weights"  # embedding table [vocab, hidden], blocks along hidden
QUANT_SITES = frozenset(
    {
        SITE_EXPERT_WEIGHTS,
        SITE_EXPERT_ACTS,
        SITE_KV,
        SITE_ATTN_WEIGHTS,
        SITE_ATTN_ACTS,
        SITE_SHARED_EXPERT_WEIGHTS,
        SITE_SHARED_EXPERT_ACTS,
        SITE_ROUTER_WEIGHTS,
        SITE_ROUTER_ACTS,
        SITE_DENSE_MLP_WEIGHTS,
        SITE_DENSE_MLP_ACTS,
        SITE_LM_HEAD_WEIGHTS,
        SITE_LM_HEAD_ACTS,
        SITE_EMBED_WEIGHTS,
    }
)
# The paper's setting: routed experts W4A4 and an FP4 KV cache; everything else high precision.
DEFAULT_QUANT_SITES = frozenset({SITE_EXPERT_WEIGHTS, SITE_EXPERT_ACTS, SITE_KV})
# Names a user might reasonably ask for that TRACE refuses, with the reason.
REFUSED_QUANT_SITES = {
    "norm_weights": "RMSNorm gains are 1-D vectors multiplied elementwise (no GEMM reads them), "
    "so FP4 would save a few KiB and only add error; no FP4 system (ModelOpt, vLLM) quantizes "
    "them. Norms always stay high precision.",
    "embed_acts": "the embedding is a table lookup by token id: it has no activation input to "
    "quantize (use 'embed_weights' for the table).",
}

# Activation sites the model reports to `hooks.act(layer, site, x)`, x = rows [N, width].
GSITE_MOE_IN = "moe_in"  # normalized hidden state entering the routed experts  [T, hidden]
GSITE_K = "k"  # post-RoPE keys as appended to the KV cache  [T, n_kv*head_dim]
GSITE_V = "v"  # values as appended to the KV cache  [T, n_kv*head_dim]
GSITE_ATTN_IN = "attn_in"  # q/k/v input  [T, hidden]
GSITE_O_IN = "o_in"  # o_proj input (attention output)  [T, n_heads*head_dim]
GSITE_ROUTER_IN = "router_in"  # router input  [T, hidden]
GSITE_SHARED_IN = "shared_in"  # shared expert gate/up input  [T, hidden]
GSITE_SHARED_DOWN_IN = "shared_down_in"  # shared expert down_proj input  [T, shared inter]
GSITE_DENSE_IN = "dense_in"  # dense MLP gate/up input  [T, hidden]
GSITE_DENSE_DOWN_IN = "dense_down_in"  # dense MLP down_proj input  [T, intermediate]
# Activation sites at which the rollout can record guidance (GuidanceConfig.sites): every
# per-token input of a decoder layer's GEMMs. Not guidable: the routed experts' down_proj
# input (ASITE_DOWN_IN: rows are (token, expert) pairs, not tokens; the paper's size arithmetic
# points at one hidden-state site per layer) and the LM head input (ASITE_LM_HEAD_IN: not in a
# decoder layer; only the logits follow it).
GUIDED_SITES = (
    GSITE_MOE_IN,
    GSITE_K,
    GSITE_V,
    GSITE_ATTN_IN,
    GSITE_O_IN,
    GSITE_ROUTER_IN,
    GSITE_SHARED_IN,
    GSITE_SHARED_DOWN_IN,
    GSITE_DENSE_IN,
    GSITE_DENSE_DOWN_IN,
)
ASITE_DOWN_IN = "down_in"  # routed-expert down_proj input  [n_e, moe inter] per expert
ASITE_LM_HEAD_IN = "lm_head_in"  # LM head input  [T, hidden], reported as layer num_layers
DEFAULT_GUIDED_SITES = (GSITE_MOE_IN, GSITE_K, GSITE_V)
# Which QuantConfig site governs each activation site (and must be on to guide it).
ACT_SITE_TO_QUANT_SITE = {
    GSITE_MOE_IN: SITE_EXPERT_ACTS,
    ASITE_DOWN_IN: SITE_EXPERT_ACTS,
    GSITE_K: SITE_KV,
    GSITE_V: SITE_KV,
    GSITE_ATTN_IN: SITE_ATTN_ACTS,
    GSITE_O_IN: SITE_ATTN_ACTS,
    GSITE_ROUTER_IN: SITE_ROUTER_ACTS,
    GSITE_SHARED_IN: SITE_SHARED_EXPERT_ACTS,
    GSITE_SHARED_DOWN_IN: SITE_SHARED_EXPERT_ACTS,
    GSITE_DENSE_IN: SITE_DENSE_MLP_ACTS,
    GSITE_DENSE_DOWN_IN: SITE_DENSE_MLP_ACTS,
    ASITE_LM_HEAD_IN: SITE_LM_HEAD_ACTS,
}
# Weight site -> the activation site of the same GEMMs (same layers, same reduction widths).
WEIGHT_SITE_TO_ACT_SITE = {
    SITE_EXPERT_WEIGHTS: SITE_EXPERT_ACTS,
    SITE_ATTN_WEIGHTS: SITE_ATTN_ACTS,
    SITE_SHARED_EXPERT_WEIGHTS: SITE_SHARED_EXPERT_ACTS,
    SITE_ROUTER_WEIGHTS: SITE_ROUTER_ACTS,
    SITE_DENSE_MLP_WEIGHTS: SITE_DENSE_MLP_ACTS,
    SITE_LM_HEAD_WEIGHTS: SITE_LM_HEAD_ACTS,
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

    def act_width(self, site: str) -> int:
        """Row width of activation site `site` (see ACT_SITE_TO_QUANT_SITE)."""
        h = self.hidden_size
        widths = {
            GSITE_MOE_IN: h,
            GSITE_K: self.kv_width,
            GSITE_V: self.kv_width,
            GSITE_ATTN_IN: h,
            GSITE_O_IN: self.num_heads * self.head_dim,
            GSITE_ROUTER_IN: h,
            GSITE_SHARED_IN: h,
            GSITE_SHARED_DOWN_IN: self.shared_expert_intermediate_size,
            GSITE_DENSE_IN: h,
            GSITE_DENSE_DOWN_IN: self.intermediate_size,
            ASITE_DOWN_IN: self.moe_intermediate_size,
            ASITE_LM_HEAD_IN: h,
        }
        if site not in widths:
            raise ValueError(f"unknown activation site {site!r}; known: {sorted(widths)}")
        return widths[site]

    def has_act_site(self, layer: int, site: str) -> bool:
        """Whether layer `layer` runs activation site `site` (the LM head is layer num_layers)."""
        if site == ASITE_LM_HEAD_IN:
            return layer == self.num_layers
        if not 0 <= layer < self.num_layers:
            return False
        if site in (GSITE_MOE_IN, GSITE_ROUTER_IN, ASITE_DOWN_IN):
            return self.is_moe_layer(layer)
        if site in (GSITE_SHARED_IN, GSITE_SHARED_DOWN_IN):
            return self.is_moe_layer(layer) and self.shared_expert_intermediate_size > 0
        if site in (GSITE_DENSE_IN, GSITE_DENSE_DOWN_IN):
            return not self.is_moe_layer(layer)
        self.act_width(site)  # unknown site -> ValueError
        return True

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
    # The smallest shape the CUDA rollout engine serves (head_dim 128, 8 q heads per kv head,
    # expert widths in groups of 64): GPU tests of the whole system.
    "gpu-small": ModelConfig(
        vocab_size=64,
        hidden_size=512,
        num_layers=4,
        num_heads=16,
        num_kv_heads=2,
        head_dim=128,
        num_experts=32,
        top_k=8,
        moe_intermediate_size=256,
        max_position_embeddings=1024,
        rope_theta=1_000_000.0,
    ),
    # The mid-size GPU shape: about 1B parameters (0.18B active per token) with Qwen3-MoE's
    # layout; one H200 holds its trainer and two rollout replicas. The vocabulary is the
    # task tokenizer's (callers replace vocab_size).
    "mid-1b": ModelConfig(
        vocab_size=64,
        hidden_size=1024,
        num_layers=12,
        num_heads=16,
        num_kv_heads=4,
        head_dim=128,
        num_experts=64,
        top_k=8,
        moe_intermediate_size=384,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
    ),
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

    sites: any of QUANT_SITES (default: the paper's expert_weights + expert_acts + kv):
      expert_weights / expert_acts     routed experts' weights / GEMM inputs (W4A4)
      kv                               K and V as stored in the KV cache
      attn_weights / attn_acts         q/k/v/o projections / their inputs (q/k/v read one
                                       quantized input, as one fused qkv GEMM would)
      shared_expert_weights / _acts    Qwen2-MoE shared expert gate/up/down (its 1-wide
                                       sigmoid gate `shared_expert_gate` stays high precision)
      router_weights / router_acts     the router (`mlp.gate`)
      dense_mlp_weights / _acts        the SwiGLU MLP of dense (`mlp_only_layers`) layers
      lm_head_weights / lm_head_acts   the LM head
      embed_weights                    the embedding table (rows blocked along hidden)
    Refused with the reason (REFUSED_QUANT_SITES): norm_weights, embed_acts.

    Weights are quantized once per policy version with a per-tensor second-level scale
    (ModelOpt layout; weights one fused GEMM reads share it: q/k/v, gate/up); activations and
    KV use a per-token (per-row) second-level scale. `check_model` cross-checks a config
    against an architecture (quantize_policy and loading call it).
    """

    sites: frozenset[str] = field(default_factory=lambda: DEFAULT_QUANT_SITES)
    format: Literal["nvfp4", "mxfp4"] = "nvfp4"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sites", frozenset(self.sites))
        refused = sorted(set(self.sites) & set(REFUSED_QUANT_SITES))
        if refused:
            raise ValueError(
                f"quantization site {refused[0]!r} is not supported: "
                f"{REFUSED_QUANT_SITES[refused[0]]}"
            )
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

    @classmethod
    def every_site(cls, cfg: ModelConfig, fmt: Literal["nvfp4", "mxfp4"] = "nvfp4") -> QuantConfig:
        """Every quantization site `cfg` has, FP4 (e.g. no shared_expert_* without one)."""
        return cls(sites=frozenset(s for s in QUANT_SITES if _site_widths(cfg, s)), format=fmt)

    def has(self, site: str) -> bool:
        return site in self.sites

    def check_model(self, cfg: ModelConfig) -> None:
        """ValueError unless every configured site exists in `cfg`, every width it quantizes
        is a whole number of FP4 blocks, and tied embeddings are quantized on both ends."""
        block = get_format(self.format).block_size
        for site in sorted(self.sites):
            widths = _site_widths(cfg, site)
            if not widths:
                raise ValueError(
                    f"quantization site {site!r} is configured but the model has no such "
                    f"GEMMs (moe_layers={list(cfg.moe_layers)}, shared_expert_intermediate_"
                    f"size={cfg.shared_expert_intermediate_size}, mlp_only_layers="
                    f"{list(cfg.mlp_only_layers)})"
                )
            bad = {name: w for name, w in widths.items() if w % block}
            if bad:
                raise ValueError(
                    f"quantization site {site!r}: width(s) {bad} not a multiple of the "
                    f"{self.format} block size {block}"
                )
        lm, emb = self.has(SITE_LM_HEAD_WEIGHTS), self.has(SITE_EMBED_WEIGHTS)
        if cfg.tie_word_embeddings and lm != emb:
            raise ValueError(
                "tie_word_embeddings=True: the LM head and the embedding share one tensor, so "
                f"'{SITE_LM_HEAD_WEIGHTS}' and '{SITE_EMBED_WEIGHTS}' must be configured "
                f"together (got {SITE_LM_HEAD_WEIGHTS}={lm}, {SITE_EMBED_WEIGHTS}={emb})"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"sites": sorted(self.sites), "format": self.format}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuantConfig:
        return cls(sites=frozenset(d["sites"]), format=d["format"])


def _site_widths(cfg: ModelConfig, site: str) -> dict[str, int]:
    """{activation site (or tensor): width quantized} of a quant site present in `cfg`."""
    if site == SITE_EMBED_WEIGHTS:
        return {"embed_tokens": cfg.hidden_size}
    acts = WEIGHT_SITE_TO_ACT_SITE.get(site, site)
    return {
        a: cfg.act_width(a)
        for a, q in ACT_SITE_TO_QUANT_SITE.items()
        if q == acts and any(cfg.has_act_site(i, a) for i in range(cfg.num_layers + 1))
    }


@dataclass(kw_only=True, slots=True, frozen=True)
class GuidanceConfig:
    """Where the rollout records guidance: layers x sites, in compact or full mode.

    layers=None means the deeper half (layers num_layers//2 .. num_layers-1), the paper's default.
    """

    layers: tuple[int, ...] | None = None
    sites: tuple[str, ...] = DEFAULT_GUIDED_SITES
    mode: Literal["compact", "full"] = "compact"

    def __post_init__(self) -> None:
        unguidable = [s for s in self.sites if s in (ASITE_DOWN_IN, ASITE_LM_HEAD_IN)]
        if unguidable:
            raise ValueError(
                f"activation site(s) {unguidable} cannot be guided: routed-expert down_in rows "
                "are (token, expert) pairs, not tokens, and the LM head input is outside the "
                f"decoder layers; guidable: {list(GUIDED_SITES)}"
            )
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
            if not quant.has(ACT_SITE_TO_QUANT_SITE[s]):
                raise ValueError(
                    f"guidance site {s!r} needs quantization site {ACT_SITE_TO_QUANT_SITE[s]!r}, "
                    f"which is off (QuantConfig.sites={sorted(quant.sites)})"
                )
        pairs = []
        for layer in self.resolve_layers(cfg):
            for s in self.sites:
                if cfg.has_act_site(layer, s):  # e.g. dense layers have no moe_in
                    pairs.append((layer, s))
        return tuple(pairs)
