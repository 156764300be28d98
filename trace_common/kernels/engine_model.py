"""The decode engine's model side: the Qwen3-MoE shape it runs (`EngineShape`), its weights
(`EngineWeights`: random for the benchmark, or a policy's via `from_model`; routed experts
BF16 or packed NVFP4) and the memory sizing of a batch (`kv_bytes_per_sequence`,
`largest_batch`). The step itself is `engine.DecodeEngine`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from trace_common.kernels import attention as attn
from trace_common.kernels import fp4_gemm_impl, moe, moe_layout
from trace_common.model.config import ModelConfig, get_config

if TYPE_CHECKING:
    from trace_common.model.model import MoECausalLM

WEIGHT_STD = 0.02


@dataclass(kw_only=True, slots=True, frozen=True)
class EngineShape:
    """The model shape the engine runs: a policy's `ModelConfig` (the one declaration of a
    model's shape) read under the engine's short names. Built by `from_model_config`, which
    refuses what the engine's step does not compute; `named` for benchmarks and tests
    (default: Qwen3-30B-A3B)."""

    model: ModelConfig

    def __post_init__(self) -> None:
        cfg = self.model
        dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
        refused = {
            "mlp_only_layers / decoder_sparse_step (dense MLP layers)": dense,
            "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
            "attention_bias": cfg.attention_bias,
            "norm_topk_prob=False": not cfg.norm_topk_prob,
        }
        bad = {name: value for name, value in refused.items() if value}
        if bad:
            raise ValueError(
                f"the decode engine runs routed-expert layers only; this config has {bad}"
            )
        if cfg.num_experts & (cfg.num_experts - 1):
            raise ValueError(f"num_experts={cfg.num_experts} must be a power of two")

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> EngineShape:
        """The engine shape of a policy's config. What the engine's step does not compute is
        refused, naming the field: dense MLP layers, a shared expert, attention biases, top-k
        weights left unnormalized (its routing kernels renormalize them)."""
        return cls(model=cfg)

    @classmethod
    def named(cls, name: str = "qwen3-30b-a3b", **overrides: Any) -> EngineShape:
        """A named shape (`trace_common.model.config.NAMED_CONFIGS`) with `ModelConfig`
        fields replaced, e.g. `EngineShape.named(num_layers=3, hidden_size=512)`."""
        return cls.from_model_config(dataclasses.replace(get_config(name), **overrides))

    # The engine's names for the ModelConfig fields it reads.
    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    @property
    def hidden(self) -> int:
        return self.model.hidden_size

    @property
    def q_heads(self) -> int:
        return self.model.num_heads

    @property
    def kv_heads(self) -> int:
        return self.model.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.model.head_dim

    @property
    def num_experts(self) -> int:
        return self.model.num_experts

    @property
    def top_k(self) -> int:
        return self.model.top_k

    @property
    def moe_inter(self) -> int:
        return self.model.moe_intermediate_size

    @property
    def vocab(self) -> int:
        return self.model.vocab_size

    @property
    def eps(self) -> float:
        return self.model.rms_norm_eps

    @property
    def rope_theta(self) -> float:
        return self.model.rope_theta


@dataclass(slots=True)
class LayerWeights:
    ln1: torch.Tensor  # [H]
    ln2: torch.Tensor  # [H]
    w_qkv: torch.Tensor  # [(HQ + 2 HKV) D, H]
    w_o: torch.Tensor  # [H, HQ D]
    norm_qk: torch.Tensor  # [2, D]
    router: torch.Tensor  # [E, H]
    gate_up: moe_layout.ExpertWeights  # [E, 2I, H]
    down: moe_layout.ExpertWeights  # [E, H, I]


@dataclass(slots=True)
class EngineWeights:
    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H]
    layers: list[LayerWeights] = field(default_factory=list)

    @classmethod
    def random(cls, shape: EngineShape, device: str, seed: int = 0) -> EngineWeights:
        """Random BF16 weights (normal, std 0.02; norms 1)."""
        g = torch.Generator(device=device).manual_seed(seed)

        def rnd(*size: int) -> torch.Tensor:
            t = torch.empty(*size, dtype=torch.bfloat16, device=device)
            return t.normal_(0.0, WEIGHT_STD, generator=g)

        def ones(*size: int) -> torch.Tensor:
            return torch.ones(*size, dtype=torch.bfloat16, device=device)

        s = shape
        d, h, e, i = s.head_dim, s.hidden, s.num_experts, s.moe_inter
        w = cls(rnd(s.vocab, h), rnd(s.vocab, h), ones(h))
        for _ in range(s.num_layers):
            w.layers.append(
                LayerWeights(
                    ones(h),
                    ones(h),
                    rnd((s.q_heads + 2 * s.kv_heads) * d, h),
                    rnd(h, s.q_heads * d),
                    ones(2, d),
                    rnd(e, h),
                    moe_layout.ExpertWeights(n=2 * i, k=h, bf16=rnd(e, 2 * i, h)),
                    moe_layout.ExpertWeights(n=h, k=i, bf16=rnd(e, h, i)),
                )
            )
        return w

    @classmethod
    def from_model(cls, model: MoECausalLM, device: str) -> EngineWeights:
        """A policy's weights in the engine's layout, BF16 on `device`: q/k/v stacked into one
        projection, the q and k norm weights into one [2, D], each layer's gate and up experts
        into one [E, 2I, H] (gate rows first, as the gated GEMM reads them). These are the
        master weights; `quantize_experts_` makes the FP4 engine's from them. The shape is
        `EngineShape.from_model_config(model.cfg)` (called here, so unsupported configs are
        refused)."""
        EngineShape.from_model_config(model.cfg)

        def bf(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device=device, dtype=torch.bfloat16).contiguous()

        bb = model.model
        w = cls(bf(bb.embed_tokens.weight), bf(model.lm_head.weight), bf(bb.norm.weight))
        for layer in bb.layers:
            at, mlp = layer.self_attn, layer.mlp
            ex = mlp.experts
            _, i, h = ex.gate_proj.shape
            w.layers.append(
                LayerWeights(
                    bf(layer.input_layernorm.weight),
                    bf(layer.post_attention_layernorm.weight),
                    bf(torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])),
                    bf(at.o_proj.weight),
                    bf(torch.stack([at.q_norm.weight, at.k_norm.weight])),
                    bf(mlp.gate.weight),
                    moe_layout.ExpertWeights(
                        n=2 * i, k=h, bf16=bf(torch.cat([ex.gate_proj, ex.up_proj], dim=1))
                    ),
                    moe_layout.ExpertWeights(n=h, k=i, bf16=bf(ex.down_proj)),
                )
            )
        return w

    def quantize_experts_(self, gemm: str | None = None) -> None:
        """Replace every BF16 expert weight by its NVFP4 quantization (GPU quantizer), layer
        by layer, freeing the BF16 copy as it goes; for the CUDA expert GEMM (`gemm`, default
        `fp4_gemm_impl()`) the codes are held in its packed layout only."""
        cuda = fp4_gemm_impl(gemm) == "cuda"
        for lw in self.layers:
            if not lw.gate_up.is_fp4:
                assert lw.gate_up.bf16 is not None and lw.down.bf16 is not None
                lw.gate_up = moe.quantize_weights(lw.gate_up.bf16, shared_halves=True)
                lw.down = moe.quantize_weights(lw.down.bf16, shared_halves=False)
                if cuda:
                    lw.gate_up.pack_for_cuda_()
                    lw.down.pack_for_cuda_()

    def nbytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in (self.embed, self.lm_head, self.final_norm))
        for lw in self.layers:
            n += sum(t.numel() * t.element_size() for t in
                     (lw.ln1, lw.ln2, lw.w_qkv, lw.w_o, lw.norm_qk, lw.router))  # fmt: skip
            n += lw.gate_up.nbytes() + lw.down.nbytes()
        return n


def kv_bytes_per_sequence(shape: EngineShape, *, fp4: bool, tokens: int) -> int:
    """KV-cache bytes of one sequence of `tokens` over all layers."""
    per = attn.KVCacheGPU.bytes_per_token(fp4=fp4, kv_heads=shape.kv_heads,
                                          head_dim=shape.head_dim)  # fmt: skip
    return shape.num_layers * tokens * per


def largest_batch(budget_bytes: int, weight_bytes: int, per_seq_bytes: int) -> int:
    """Largest batch whose KV cache fits the budget next to the weights."""
    return max(0, math.floor((budget_bytes - weight_bytes) / per_seq_bytes))


__all__ = [
    "WEIGHT_STD",
    "EngineShape",
    "EngineWeights",
    "LayerWeights",
    "kv_bytes_per_sequence",
    "largest_batch",
]
