"""Qwen3-MoE-architecture causal LM in plain PyTorch.

RMSNorm, rotary embeddings, GQA attention with per-head q/k RMSNorm, a top-k softmax router,
routed SwiGLU experts (weights stacked per layer: [E, out, in]) and an optional Qwen2-MoE style
shared expert. Module and parameter names follow Hugging Face's `Qwen3MoeForCausalLM` so state
dicts map one to one (routed experts are stacked here, per-expert tensors in HF files).

The model itself never decides how a site is quantized or how tokens are routed: every
quantizable activation goes through `hooks.act(layer, site, x)`, every routing decision through
`hooks.route(layer, probs)` and every expert weight through `hooks.weight_mode`. The rollout
path (`generate.py`) and the training path (`train_forward.py`) differ only in the hooks they
pass (`runtime.py`), which is what makes "identical by construction" checkable.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from trace_common.fp4.fake import straight_through
from trace_common.model.config import (
    ASITE_DOWN_IN,
    GSITE_K,
    GSITE_MOE_IN,
    GSITE_V,
    ModelConfig,
    QuantConfig,
)
from trace_common.model.kv_cache import KVCache

WeightMode = Literal["master", "quantized", "ste"]


class Hooks(Protocol):
    """What the forward pass asks its caller (see runtime.py for the implementations)."""

    weight_mode: WeightMode

    def act(self, layer: int, site: str, x: torch.Tensor) -> torch.Tensor:
        """Quantize (or not) activation rows x [N, W] at (layer, site); returns [N, W]."""
        ...

    def route(self, layer: int, probs: torch.Tensor, top_k: int) -> torch.Tensor:
        """Pick experts from router probs [N, E] (fp32); returns ids [N, top_k] int64."""
        ...


class PlainHooks:
    """High precision everywhere, master weights, the model's own routing."""

    weight_mode: WeightMode = "master"

    def act(self, layer: int, site: str, x: torch.Tensor) -> torch.Tensor:
        return x

    def route(self, layer: int, probs: torch.Tensor, top_k: int) -> torch.Tensor:
        return torch.topk(probs, top_k, dim=-1).indices


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, head_dim] for integer positions [B, T] (HF's half-rotation layout)."""
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float) / head_dim)
    )
    freqs = positions[..., None].float() * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; cos/sin [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,  # [B, T, S] bool, True = may attend
        hooks: Hooks,
        cache: KVCache | None,
    ) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, cfg.num_heads, cfg.head_dim))
        k = self.k_norm(self.k_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim))
        v = self.v_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # K and V are quantized per token row exactly as they enter the cache.
        k = hooks.act(self.layer, GSITE_K, k.reshape(b * t, cfg.kv_width)).view(k.shape)
        v = hooks.act(self.layer, GSITE_V, v.reshape(b * t, cfg.kv_width)).view(v.shape)
        if cache is not None:
            k, v = cache.append(self.layer, k, v)  # [B, S, n_kv, D]
        rep = cfg.num_heads // cfg.num_kv_heads
        qh = q.transpose(1, 2)  # [B, H, T, D]
        kh = k.transpose(1, 2).repeat_interleave(rep, dim=1)  # [B, H, S, D]
        vh = v.transpose(1, 2).repeat_interleave(rep, dim=1)
        scores = torch.matmul(qh, kh.transpose(2, 3)) * cfg.head_dim**-0.5  # [B, H, T, S]
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, vh).transpose(1, 2).reshape(b, t, -1)  # [B, T, H*D]
        return self.o_proj(out)


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP (shared expert, or the MLP of `mlp_only_layers`)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


class Experts(nn.Module):
    """Routed experts, weights stacked: gate/up [E, I, H], down [E, H, I].

    `quantized[name]` holds, once `trace_common.model.quant.quantize_policy` ran (or a
    quantized state dict was loaded), the FP4 codes of each weight, and the non-persistent
    buffer `<name>_dequant` their dequantized value [E, out, in], which is what both paths
    multiply with (a buffer so that `.to(device/dtype)` moves it with the model).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = e
        self.gate_proj = nn.Parameter(torch.empty(e, i, h))
        self.up_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.quantized: dict[str, list[object]] = {}  # name -> per-expert FP4 tensors
        for name in EXPERT_PROJS:
            self.register_buffer(f"{name}_dequant", None, persistent=False)

    @property
    def dequant(self) -> dict[str, torch.Tensor]:
        """{name: [E, out, in] dequantized codes} for the quantized weights."""
        out = {}
        for name in EXPERT_PROJS:
            t = getattr(self, f"{name}_dequant")
            if t is not None:
                out[name] = t
        return out

    def set_dequant(self, name: str, value: torch.Tensor | None) -> None:
        setattr(self, f"{name}_dequant", value)

    def weight(self, name: str, mode: WeightMode) -> torch.Tensor:
        master = getattr(self, name)
        if mode == "master":
            return master
        deq = getattr(self, f"{name}_dequant")
        if deq is None:
            raise RuntimeError(
                f"expert weight {name!r} has no FP4 codes: call quantize_policy(model, quant) "
                "or load a quantized state dict before a quantized forward"
            )
        deq = deq.to(master.dtype)
        if mode == "quantized":
            return deq
        # Straight-through: forward exactly the codes' value, gradient to the master weight.
        return straight_through(master, deq)

    def forward(
        self,
        x: torch.Tensor,  # [N, H] (already through the moe_in site)
        ids: torch.Tensor,  # [N, k]
        weights: torch.Tensor,  # [N, k]
        hooks: Hooks,
        layer: int,
    ) -> torch.Tensor:
        wg = self.weight("gate_proj", hooks.weight_mode)
        wu = self.weight("up_proj", hooks.weight_mode)
        wd = self.weight("down_proj", hooks.weight_mode)
        n, k = ids.shape
        # Each (token, slot) output lands in its own row; the k slots are then summed in fp32
        # in slot order, so a token's result does not depend on which other tokens are batched.
        slots = x.new_zeros(n * k, x.shape[1], dtype=torch.float32)  # [N*k, H]
        flat_ids = ids.reshape(-1)  # [N*k], row r = token r // k, slot r % k
        for e in torch.unique(flat_ids).tolist():
            rows = torch.nonzero(flat_ids == e).flatten()  # (token, slot) rows routed to e
            xe = x[rows // k]  # [n_e, H]
            he = F.silu(xe @ wg[e].T) * (xe @ wu[e].T)  # [n_e, I]
            he = hooks.act(layer, ASITE_DOWN_IN, he)
            ye = he @ wd[e].T  # [n_e, H]
            slots = slots.index_copy(0, rows, ye.float())
        w = weights.reshape(n * k, 1).float()
        return (slots * w).view(n, k, -1).sum(dim=1).to(x.dtype)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # router
        self.experts = Experts(cfg)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor, hooks: Hooks) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(b * t, h)  # [N, H]
        probs = torch.softmax(self.gate(flat), dim=-1, dtype=torch.float32)  # [N, E]
        ids = hooks.route(self.layer, probs, self.cfg.top_k)  # [N, k]
        weights = probs.gather(1, ids)  # [N, k] differentiable w.r.t. the router
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        x_q = hooks.act(self.layer, GSITE_MOE_IN, flat)
        out = self.experts(x_q, ids, weights.to(x.dtype), hooks, self.layer)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat) * torch.sigmoid(self.shared_expert_gate(flat))
        return out.view(b, t, h)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp: nn.Module = (
            SparseMoE(cfg, layer)
            if cfg.is_moe_layer(layer)
            else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, hooks: Hooks, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, hooks, cache)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, SparseMoE):
            return x + self.mlp(h, hooks)
        return x + self.mlp(h)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def attention_mask(
    query_cols: torch.Tensor,  # [T] column of each query in the key axis
    key_valid: torch.Tensor,  # [B, S] bool
) -> torch.Tensor:
    """[B, T, S] bool: causal by column, padding keys masked.

    A query always sees its own column, so padding rows never get an all-masked softmax (their
    outputs are garbage but finite, and nothing reads them).
    """
    cols = torch.arange(key_valid.shape[1], device=key_valid.device)
    causal = cols[None, :] <= query_cols[:, None]  # [T, S]
    own = cols[None, :] == query_cols[:, None]
    return causal[None] & (key_valid[:, None, :] | own[None])


class MoECausalLM(nn.Module):
    """The policy. `forward` is the one forward pass both paths run."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.quant = QuantConfig.none()  # set by quant.quantize_policy / a quantized load
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, seed: int = 0, std: float = 0.02) -> MoECausalLM:
        """Random init like HF's (normal(0, std) matrices, unit norms); returns self."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        return self

    def moe_blocks(self) -> list[tuple[int, SparseMoE]]:
        return [
            (i, layer.mlp)
            for i, layer in enumerate(self.model.layers)
            if isinstance(layer.mlp, SparseMoE)
        ]

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T] RoPE positions
        key_valid: torch.Tensor,  # [B, S] keys that exist (S = cache length after append, or T)
        hooks: Hooks | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V]. Without a cache the queries are columns 0..T-1 of the keys."""
        hooks = hooks or PlainHooks()
        t = input_ids.shape[1]
        start = cache.length if cache is not None else 0
        query_cols = torch.arange(start, start + t, device=input_ids.device)
        mask = attention_mask(query_cols, key_valid)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask, hooks, cache)
        if cache is not None:
            cache.advance(t)
        return self.lm_head(self.model.norm(x))
