"""Qwen3-MoE-architecture causal LM in plain PyTorch.

RMSNorm, rotary embeddings, GQA attention with per-head q/k RMSNorm, a top-k softmax router,
routed SwiGLU experts (weights stacked per layer: [E, out, in]) and an optional Qwen2-MoE style
shared expert. Module and parameter names follow Hugging Face's `Qwen3MoeForCausalLM` so state
dicts map one to one (routed experts are stacked here, per-expert tensors in HF files).

The model itself never decides how a site is quantized or how tokens are routed: every
quantizable activation goes through `hooks.act(layer, site, x)`, every routing decision through
`hooks.route(layer, probs)` and every quantizable weight through `FP4Weights.effective_weight`
with the mode `hooks.weight_mode(site)` picks. Every projection (attention, shared expert,
router, dense MLP, LM head) is a `Linear`, the one place that applies both to a GEMM. The
rollout path (`generate.py`) and the training path (`train_forward.py`) differ only in the
hooks they pass (`runtime.py`), which is what makes "identical by construction" checkable.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trace_common.fp4 import nvfp4
from trace_common.fp4.fake import straight_through
from trace_common.fp4.nvfp4 import NVFP4Tensor
from trace_common.model.config import (
    ASITE_DOWN_IN,
    ASITE_LM_HEAD_IN,
    GSITE_ATTN_IN,
    GSITE_DENSE_DOWN_IN,
    GSITE_DENSE_IN,
    GSITE_K,
    GSITE_MOE_IN,
    GSITE_O_IN,
    GSITE_ROUTER_IN,
    GSITE_SHARED_DOWN_IN,
    GSITE_SHARED_IN,
    GSITE_V,
    SITE_ATTN_WEIGHTS,
    SITE_DENSE_MLP_WEIGHTS,
    SITE_EMBED_WEIGHTS,
    SITE_EXPERT_WEIGHTS,
    SITE_LM_HEAD_WEIGHTS,
    SITE_ROUTER_WEIGHTS,
    SITE_SHARED_EXPERT_WEIGHTS,
    ModelConfig,
    QuantConfig,
)
from trace_common.model.kv_cache import KVCache

WeightMode = Literal["master", "quantized", "ste"]


class Hooks(Protocol):
    """What the forward pass asks its caller (see runtime.py for the implementations)."""

    def weight_mode(self, site: str) -> WeightMode:
        """How to read the weights of quantization site `site` (e.g. "attn_weights")."""
        ...

    def act(self, layer: int, site: str, x: torch.Tensor) -> torch.Tensor:
        """Quantize (or not) activation rows x [N, W] at (layer, site); returns [N, W]."""
        ...

    def route(self, layer: int, probs: torch.Tensor, top_k: int) -> torch.Tensor:
        """Pick experts from router probs [N, E] (fp32); returns ids [N, top_k] int64."""
        ...


class PlainHooks:
    """High precision everywhere, master weights, the model's own routing."""

    def weight_mode(self, site: str) -> WeightMode:
        return "master"

    def act(self, layer: int, site: str, x: torch.Tensor) -> torch.Tensor:
        return x

    def route(self, layer: int, probs: torch.Tensor, top_k: int) -> torch.Tensor:
        return torch.topk(probs, top_k, dim=-1).indices


class FP4Weights:
    """Mixin for a module whose weights form one quantization site (`weight_site`).

    `quantized[name]` holds, once `trace_common.model.quant.quantize_policy` ran (or a
    quantized state dict was loaded), the FP4 codes of weight `name` (one QTensor, or a list
    of per-expert ones for stacked expert weights), and the non-persistent buffer
    `<name>_dequant` their dequantized value, which is what both paths multiply with (a buffer
    so that `.to(device/dtype)` moves it with the model). Quantized once per policy version.
    """

    weight_site: str
    fp4_weight_names: tuple[str, ...]
    quantized: dict[str, Any]

    def _init_fp4(self, site: str, names: tuple[str, ...]) -> None:
        self.weight_site = site
        self.fp4_weight_names = names
        self.quantized = {}
        for name in names:
            self.register_buffer(f"{name}_dequant", None, persistent=False)  # type: ignore[attr-defined]

    @property
    def dequant(self) -> dict[str, torch.Tensor]:
        """{name: dequantized codes, shaped like the weight} for the quantized weights."""
        out = {}
        for name in self.fp4_weight_names:
            t = getattr(self, f"{name}_dequant")
            if t is not None:
                out[name] = t
        return out

    def set_dequant(self, name: str, value: torch.Tensor | None) -> None:
        setattr(self, f"{name}_dequant", value)

    def clear_quantized(self) -> None:
        self.quantized.clear()
        for name in self.fp4_weight_names:
            self.set_dequant(name, None)

    def refresh_dequant(self) -> None:
        """Recompute `<name>_dequant` from `quantized[name]` (in the master weight's dtype)."""
        for name, qs in self.quantized.items():
            master = getattr(self, name)
            if isinstance(qs, list) and all(isinstance(q, NVFP4Tensor) for q in qs):
                deq = nvfp4.stack(qs).dequantize(torch.float32)  # one batched dequantize
            elif isinstance(qs, list):
                deq = torch.stack([q.dequantize(torch.float32) for q in qs])
            else:
                deq = qs.dequantize(torch.float32)
            self.set_dequant(name, deq.to(device=master.device, dtype=master.dtype))

    def effective_weight(self, name: str, mode: WeightMode) -> torch.Tensor:
        """The weight a forward multiplies with: master, FP4 codes' value, or that value with
        the gradient straight through to the master weight ("ste")."""
        master = getattr(self, name)
        if mode == "master":
            return master
        deq = getattr(self, f"{name}_dequant")
        if deq is None:
            raise RuntimeError(
                f"{self.weight_site} weight {name!r} has no FP4 codes: call "
                "quantize_policy(model, quant) or load a quantized state dict before a "
                "quantized forward"
            )
        deq = deq.to(master.dtype)
        if mode == "quantized":
            return deq
        # Straight-through: forward exactly the codes' value, gradient to the master weight.
        return straight_through(master, deq)


class Linear(FP4Weights, nn.Linear):
    """The one place a projection's configured quantization is applied: its input rows go
    through activation site `act_site` of `layer`, its weight is read per `weight_site`.

    Projections that read one input (q/k/v; gate/up) call `quantize_input` once and
    `project` each, as one fused GEMM would.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        layer: int,
        weight_site: str,
        act_site: str,
        bias: bool = False,
    ) -> None:
        nn.Linear.__init__(self, in_features, out_features, bias=bias)
        self.layer, self.act_site = layer, act_site
        self._init_fp4(weight_site, ("weight",))

    def quantize_input(self, x: torch.Tensor, hooks: Hooks) -> torch.Tensor:
        """x [..., in] -> the same through the activation site (one row per token)."""
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        return hooks.act(self.layer, self.act_site, rows).view(x.shape)

    def project(self, x_q: torch.Tensor, hooks: Hooks) -> torch.Tensor:
        """x_q [..., in] (already through the activation site) -> [..., out]."""
        w = self.effective_weight("weight", hooks.weight_mode(self.weight_site))
        return F.linear(x_q, w, self.bias)

    def forward(self, x: torch.Tensor, hooks: Hooks) -> torch.Tensor:  # type: ignore[override]
        return self.project(self.quantize_input(x, hooks), hooks)


class Embedding(FP4Weights, nn.Embedding):
    """Token embedding whose table may be FP4 (`embed_weights`; blocks along hidden)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        nn.Embedding.__init__(self, num_embeddings, embedding_dim)
        self._init_fp4(SITE_EMBED_WEIGHTS, ("weight",))

    def forward(self, ids: torch.Tensor, hooks: Hooks) -> torch.Tensor:  # type: ignore[override]
        return F.embedding(
            ids, self.effective_weight("weight", hooks.weight_mode(self.weight_site))
        )


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
    # Projections one fused GEMM reads: they share one input and one weight second-level scale.
    FUSED_LINEARS = (("q_proj", "k_proj", "v_proj"),)

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        h, d = cfg.hidden_size, cfg.head_dim
        kw = {"layer": layer, "weight_site": SITE_ATTN_WEIGHTS, "bias": cfg.attention_bias}
        self.q_proj = Linear(h, cfg.num_heads * d, act_site=GSITE_ATTN_IN, **kw)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, act_site=GSITE_ATTN_IN, **kw)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, act_site=GSITE_ATTN_IN, **kw)
        self.o_proj = Linear(cfg.num_heads * d, h, act_site=GSITE_O_IN, **kw)
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
        x_q = self.q_proj.quantize_input(x, hooks)  # [B, T, hidden], shared by q/k/v
        q = self.q_norm(self.q_proj.project(x_q, hooks).view(b, t, cfg.num_heads, cfg.head_dim))
        k = self.k_norm(self.k_proj.project(x_q, hooks).view(b, t, cfg.num_kv_heads, cfg.head_dim))
        v = self.v_proj.project(x_q, hooks).view(b, t, cfg.num_kv_heads, cfg.head_dim)
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
        return self.o_proj(out, hooks)


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP (shared expert, or the MLP of `mlp_only_layers`)."""

    FUSED_LINEARS = (("gate_proj", "up_proj"),)  # one w13 GEMM: shared input and scale_2

    def __init__(
        self, hidden: int, inter: int, *, layer: int, weight_site: str, act_sites: tuple[str, str]
    ) -> None:
        super().__init__()
        kw = {"layer": layer, "weight_site": weight_site}
        self.gate_proj = Linear(hidden, inter, act_site=act_sites[0], **kw)
        self.up_proj = Linear(hidden, inter, act_site=act_sites[0], **kw)
        self.down_proj = Linear(inter, hidden, act_site=act_sites[1], **kw)

    def forward(self, x: torch.Tensor, hooks: Hooks) -> torch.Tensor:
        x_q = self.gate_proj.quantize_input(x, hooks)  # shared by gate and up
        h = F.silu(self.gate_proj.project(x_q, hooks)) * self.up_proj.project(x_q, hooks)
        return self.down_proj(h, hooks)


EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


class Experts(FP4Weights, nn.Module):
    """Routed experts, weights stacked: gate/up [E, I, H], down [E, H, I].

    FP4 codes per expert (`quantized[name]` is a list of E QTensors; `<name>_dequant`
    [E, out, in]), see `FP4Weights`.

    The forward sorts the flat (token, slot) rows by expert once, runs each expert's GEMMs
    over its contiguous block of rows, sends all down_proj input rows through the `down_in`
    site in one `hooks.act` call (its fake quant is per row) and puts the rows back in
    (token, slot) order. The GEMMs are three `torch._grouped_mm` calls for bf16 on CUDA
    (`use_grouped_mm`), else one GEMM per expert that has rows (the bit-exact reference).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = e
        self.gate_proj = nn.Parameter(torch.empty(e, i, h))
        self.up_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self._init_fp4(SITE_EXPERT_WEIGHTS, EXPERT_PROJS)

    def forward(
        self,
        x: torch.Tensor,  # [N, H] (already through the moe_in site)
        ids: torch.Tensor,  # [N, k]
        weights: torch.Tensor,  # [N, k]
        hooks: Hooks,
        layer: int,
    ) -> torch.Tensor:
        n, k = ids.shape
        if n == 0:
            return x.new_zeros(0, x.shape[1])
        mode = hooks.weight_mode(self.weight_site)
        w = tuple(self.effective_weight(name, mode) for name in EXPERT_PROJS)
        flat_ids = ids.reshape(-1)  # [N*k], row r = token r // k, slot r % k
        # Stable: each expert's rows form one block, in ascending row order.
        order = torch.sort(flat_ids, stable=True).indices  # [N*k] sorted row -> flat row
        inverse = torch.empty_like(order)  # flat row -> sorted row
        inverse[order] = torch.arange(n * k, device=order.device)
        # Rows per expert without a host sync (bincount syncs on CUDA for its output size).
        counts = flat_ids.new_zeros(self.num_experts).scatter_add_(
            0, flat_ids, torch.ones_like(flat_ids)
        )  # [E]
        # Each token's rows from its highest expert id down, the order GatherRows adds their
        # gradients in: the order autograd adds them in for a loop over experts in ascending
        # order, so CPU gradients equal that loop's bit for bit.
        by_rank = torch.sort(ids, dim=1, descending=True, stable=True).indices  # [N, k] slots
        by_rank = inverse.view(n, k).gather(1, by_rank)  # [N, k] sorted rows
        xs = GatherRows.apply(x, order // k, by_rank)  # [N*k, H]
        run = _experts_grouped_mm if use_grouped_mm(x, w[0]) else _experts_per_expert
        ys = run(xs, counts, w, hooks, layer)  # [N*k, H]
        # Back to (token, slot) order. The k slots are then summed in fp32 in slot order, so a
        # token's result does not depend on which other tokens are batched.
        slots = ys.float()[inverse]  # [N*k, H]
        w_slots = weights.reshape(n * k, 1).float()
        return (slots * w_slots).view(n, k, -1).sum(dim=1).to(x.dtype)


class GatherRows(torch.autograd.Function):
    """rows = x[tokens], whose backward adds the k gradient rows of each token one at a time
    in a given order: the same bits on every device and thread count (an indexing backward
    accumulates repeated rows in an order that depends on both)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,  # [N, H]
        tokens: torch.Tensor,  # [N*k] the token of each row
        by_rank: torch.Tensor,  # [N, k] the rows of each token, in the order to add them
    ) -> torch.Tensor:
        ctx.save_for_backward(by_rank)
        return x[tokens]  # [N*k, H]

    @staticmethod
    def backward(ctx: Any, grad_rows: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (by_rank,) = ctx.saved_tensors
        g = grad_rows[by_rank]  # [N, k, H]
        grad_x = g[:, 0]
        for j in range(1, g.shape[1]):
            grad_x = grad_x + g[:, j]
        return grad_x, None, None


def use_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `Experts` runs its GEMMs as `torch._grouped_mm`: bf16 compute (bf16 input and
    weights, or CUDA autocast to bf16) on CUDA, with expert weight rows of a multiple of
    16 bytes (`_grouped_mm` requires 16-byte aligned strides). w: a stacked expert weight."""
    if x.device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    autocast_bf16 = (
        torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
    )
    bf16 = autocast_bf16 or (x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16)
    return bf16 and w.shape[1] % 8 == 0 and w.shape[2] % 8 == 0


def _experts_per_expert(
    xs: torch.Tensor,  # [N*k, H] rows in blocks by expert, ascending expert id
    counts: torch.Tensor,  # [E] rows per expert
    w: tuple[torch.Tensor, ...],  # gate, up [E, I, H]; down [E, H, I]
    hooks: Hooks,
    layer: int,
) -> torch.Tensor:
    """SwiGLU experts, one GEMM per expert with rows and projection -> [N*k, H].

    Each stacked weight is split into its experts once (`unbind`): its gradient is then put
    together by one stack, where indexing `w[e]` per expert would have autograd fill and add
    a zero tensor of the whole stack for every expert used (the same values either way)."""
    wg, wu, wd = (t.unbind(0) for t in w)
    sizes = counts.tolist()  # the one host sync for the block sizes
    experts = [e for e, size in enumerate(sizes) if size]
    blocks = [sizes[e] for e in experts]
    hs = [
        F.silu(xe @ wg[e].T) * (xe @ wu[e].T)  # [n_e, I]
        for e, xe in zip(experts, xs.split(blocks), strict=True)
    ]
    h = hooks.act(layer, ASITE_DOWN_IN, torch.cat(hs))  # [N*k, I]
    return torch.cat([he @ wd[e].T for e, he in zip(experts, h.split(blocks), strict=True)])


def _experts_grouped_mm(
    xs: torch.Tensor,  # [N*k, H] rows in blocks by expert, ascending expert id
    counts: torch.Tensor,  # [E] rows per expert
    w: tuple[torch.Tensor, ...],  # gate, up [E, I, H]; down [E, H, I]
    hooks: Hooks,
    layer: int,
) -> torch.Tensor:
    """The same with one bf16 `torch._grouped_mm` per projection -> [N*k, H] bf16."""
    bf16 = torch.bfloat16
    wg, wu, wd = (t.to(bf16).transpose(-2, -1) for t in w)  # [E, in, out] views
    offs = counts.cumsum(0).to(torch.int32)  # [E] end row of each expert's block
    xs = xs.to(bf16)
    g = torch._grouped_mm(xs, wg, offs=offs)  # [N*k, I]
    u = torch._grouped_mm(xs, wu, offs=offs)
    h = hooks.act(layer, ASITE_DOWN_IN, F.silu(g) * u)
    return torch._grouped_mm(h, wd, offs=offs)  # [N*k, H]


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.gate = Linear(  # router
            cfg.hidden_size,
            cfg.num_experts,
            layer=layer,
            weight_site=SITE_ROUTER_WEIGHTS,
            act_site=GSITE_ROUTER_IN,
        )
        self.experts = Experts(cfg)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(
                cfg.hidden_size,
                cfg.shared_expert_intermediate_size,
                layer=layer,
                weight_site=SITE_SHARED_EXPERT_WEIGHTS,
                act_sites=(GSITE_SHARED_IN, GSITE_SHARED_DOWN_IN),
            )
            # A 1-wide sigmoid gate: no quantization site (ModelOpt and vLLM keep it BF16 too).
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor, hooks: Hooks) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(b * t, h)  # [N, H]
        probs = torch.softmax(self.gate(flat, hooks), dim=-1, dtype=torch.float32)  # [N, E]
        ids = hooks.route(self.layer, probs, self.cfg.top_k)  # [N, k]
        weights = probs.gather(1, ids)  # [N, k] differentiable w.r.t. the router
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        x_q = hooks.act(self.layer, GSITE_MOE_IN, flat)
        out = self.experts(x_q, ids, weights.to(x.dtype), hooks, self.layer)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat, hooks)  # [N, H]
            out = out + shared * torch.sigmoid(self.shared_expert_gate(flat))
        return out.view(b, t, h)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp: nn.Module = (
            SparseMoE(cfg, layer)
            if cfg.is_moe_layer(layer)
            else SwiGLU(
                cfg.hidden_size,
                cfg.intermediate_size,
                layer=layer,
                weight_site=SITE_DENSE_MLP_WEIGHTS,
                act_sites=(GSITE_DENSE_IN, GSITE_DENSE_DOWN_IN),
            )
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, hooks: Hooks, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, hooks, cache)
        return x + self.mlp(self.post_attention_layernorm(x), hooks)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
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
        self.lm_head = Linear(  # its input site is reported as layer num_layers
            cfg.hidden_size,
            cfg.vocab_size,
            layer=cfg.num_layers,
            weight_site=SITE_LM_HEAD_WEIGHTS,
            act_site=ASITE_LM_HEAD_IN,
        )
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Training only (autograd on, no cache): recompute each decoder layer's activations in
        # the backward instead of keeping them (torch.utils.checkpoint, non-reentrant).
        self.activation_checkpointing = False

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
        x = self.model.embed_tokens(input_ids, hooks)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        recompute = self.activation_checkpointing and cache is None and torch.is_grad_enabled()
        for layer in self.model.layers:
            if recompute:
                x = checkpoint(layer, x, cos, sin, mask, hooks, None, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, hooks, cache)
        if cache is not None:
            cache.advance(t)
        return self.lm_head(self.model.norm(x), hooks)
