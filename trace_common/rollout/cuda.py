"""The CUDA rollout engine: the CUDA-graph decode engine (`trace_common.kernels.engine`)
serving generate requests through continuous batching (`trace_common.rollout.scheduler`).

One decode step for all `max_batch` slots is one CUDA graph: the engine's step (every layer,
FP4 experts and FP4 KV or BF16), then the step's records (the compact guidance records of the
guided layers' `moe_in`, `k` and `v` rows, written by the quantize kernels, and every MoE
layer's top-k expert ids) gathered into one byte slab and scattered into a per-slot history
at each slot's position. Prompts are prefilled in chunks (`trace_common.rollout.prefill`) that
write the same caches and history; the other completions of a prompt copy its positions from
the slot that prefilled it (`DecodeBackend.copy_prefix`). When a sequence finishes, its
history rows are serialized as the same `SampleRecords` bytes the PyTorch engine writes.

Weights: a pushed FP4 version is loaded as pushed (the ModelOpt codes and scales are laid out
for the expert GEMM, never re-quantized), into the buffers the graph reads, so a new version
needs no re-capture. In-flight requests finish on the old version first (the scheduler's
admission barrier); requests that arrive meanwhile wait and run on the new one.

What the engine runs (`unsupported_reason` names what it refuses): routed-expert MoE layers
only (no dense MLP layers, no shared expert, no attention bias), normalized top-k weights,
a power-of-two expert count, FP4 as NVFP4 at the paper's sites (routed experts W4A4 + KV) or
no FP4 at all (the BF16 engine), guidance at `moe_in`/`k`/`v` in compact mode. Anything else
runs on the PyTorch engine. MXFP4 has no CUDA kernels here and also runs on the PyTorch engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from trace_common.fp4.record import GuidanceRecord
from trace_common.kernels.settings import KernelSettings
from trace_common.model.config import (
    DEFAULT_QUANT_SITES,
    GSITE_K,
    GSITE_MOE_IN,
    GSITE_V,
    GuidanceConfig,
    ModelConfig,
    QuantConfig,
)
from trace_common.model.quant import policy_configs
from trace_common.model.records import SampleRecords
from trace_common.rollout.meta import PolicyMeta
from trace_common.rollout.scheduler import SlotScheduler
from trace_common.rollout.types import GeneratedSample, SamplingConfig

log = logging.getLogger(__name__)

CAPTURED_SITES = (GSITE_MOE_IN, GSITE_K, GSITE_V)  # what the step's quantize kernels record
EXPERT_K_MULTIPLE = 64  # the FP4 expert GEMM's K group (moe_layout.K_GROUP)
PREFILL_TOKENS = 256  # prompt tokens per prefill chunk (the router's graph-captured maximum)


def unsupported_reason(cfg: ModelConfig, quant: QuantConfig,
                       guidance: GuidanceConfig | None) -> str | None:  # fmt: skip
    """Why the CUDA engine cannot serve this policy, or None when it can."""
    from trace_common.kernels.engine_model import EngineShape

    try:
        EngineShape.from_model_config(cfg)
    except ValueError as exc:
        return str(exc)
    widths = {"hidden_size": cfg.hidden_size, "moe_intermediate_size": cfg.moe_intermediate_size}
    narrow = {k: v for k, v in widths.items() if v % EXPERT_K_MULTIPLE}
    if quant.sites and narrow:
        return (f"expert GEMM widths {narrow}: the FP4 expert kernels read K in groups of "
                f"{EXPERT_K_MULTIPLE}")  # fmt: skip
    if quant.sites and (quant.format != "nvfp4" or quant.sites != DEFAULT_QUANT_SITES):
        return (f"FP4 {quant.format} at sites {sorted(quant.sites)}: the CUDA engine runs "
                f"NVFP4 at {sorted(DEFAULT_QUANT_SITES)} or no FP4 at all")  # fmt: skip
    if guidance is not None:
        if not quant.sites:
            return "guidance needs FP4 sites; the policy has none"
        extra = sorted(set(guidance.sites) - set(CAPTURED_SITES))
        if extra:
            return f"guidance at sites {extra}: the CUDA engine records {list(CAPTURED_SITES)}"
        if guidance.mode != "compact":
            return f"guidance mode {guidance.mode!r}: the CUDA engine records compact guidance"
    return None


def _take(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return tensors[name]
    except KeyError:
        raise ValueError(f"pushed policy lacks tensor {name!r}") from None


class PolicyWeights:
    """Reads a pushed version (`export_quantized_state_dict` layout) into the engine's."""

    def __init__(self, cfg: ModelConfig, quant: QuantConfig, device: torch.device) -> None:
        self.cfg, self.fp4, self.device = cfg, bool(quant.sites), device

    def _bf(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=torch.bfloat16).contiguous()

    def top(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """(embed, lm_head, final_norm), BF16 on the device."""
        embed = _take(tensors, "model.embed_tokens.weight")
        lm = embed if self.cfg.tie_word_embeddings else _take(tensors, "lm_head.weight")
        return self._bf(embed), self._bf(lm), self._bf(_take(tensors, "model.norm.weight"))

    def layer(self, tensors: dict[str, torch.Tensor], li: int):  # -> engine_model.LayerWeights
        from trace_common.kernels import fp4_gemm_impl, moe_layout
        from trace_common.kernels.engine_model import LayerWeights

        p = f"model.layers.{li}."
        t = lambda name: _take(tensors, p + name)  # noqa: E731
        qkv = torch.cat([t(f"self_attn.{n}_proj.weight") for n in "qkv"])
        norm_qk = torch.stack([t("self_attn.q_norm.weight"), t("self_attn.k_norm.weight")])
        e_n = self.cfg.num_experts
        ex = p + "mlp.experts."
        if self.fp4:
            gate_up = self._fp4_experts(tensors, ex, ("gate_proj", "up_proj"), li)
            down = self._fp4_experts(tensors, ex, ("down_proj",), li)
            if fp4_gemm_impl() == "cuda":
                gate_up.pack_for_cuda_()
                down.pack_for_cuda_()
        else:
            gu = torch.stack([torch.cat([_take(tensors, f"{ex}{e}.gate_proj.weight"),
                                         _take(tensors, f"{ex}{e}.up_proj.weight")])
                              for e in range(e_n)])  # fmt: skip
            dn = torch.stack([_take(tensors, f"{ex}{e}.down_proj.weight") for e in range(e_n)])
            gate_up = moe_layout.ExpertWeights(n=gu.shape[1], k=gu.shape[2], bf16=self._bf(gu))
            down = moe_layout.ExpertWeights(n=dn.shape[1], k=dn.shape[2], bf16=self._bf(dn))
        return LayerWeights(
            self._bf(t("input_layernorm.weight")), self._bf(t("post_attention_layernorm.weight")),
            self._bf(qkv), self._bf(t("self_attn.o_proj.weight")), self._bf(norm_qk),
            self._bf(t("mlp.gate.weight")), gate_up, down,
        )  # fmt: skip

    def _fp4_experts(self, tensors: dict[str, torch.Tensor], prefix: str,
                     projs: tuple[str, ...], li: int):  # fmt: skip
        """One projection of all experts as pushed: codes [E, N, K/2], e4m3 scales [E, N, K/16]
        (gate rows above up rows for the fused gate_up), one fp32 scale_2 per expert (gate and
        up share it, as one fused GEMM reads them)."""
        from trace_common.kernels import moe_layout

        e_n = self.cfg.num_experts

        def rows(suffix: str, as_: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
            """[E, rows of every projection, ...]: each expert's projections one above the
            other, in one concatenation (a few kernels per layer, no host sync per expert)."""
            parts = [
                as_(_take(tensors, f"{prefix}{e}.{n}.{suffix}")) for e in range(e_n) for n in projs
            ]
            return torch.cat(parts).reshape(e_n, -1, parts[0].shape[-1]).to(self.device)

        c = rows("weight", lambda t: t)
        scales = rows("weight_scale", lambda t: t.view(torch.uint8))
        g = rows("weight_scale_2", lambda t: t.reshape(1)).float()[:, :, 0]  # [E, projections]
        differs = (g != g[:, :1]).any(dim=1)
        if bool(differs.any()):
            e = int(differs.nonzero()[0, 0])
            raise ValueError(
                f"layer {li} expert {e}: {projs} have different weight_scale_2 "
                f"{g[e].tolist()}; the fused GEMM needs one"
            )
        return moe_layout.ExpertWeights(
            n=c.shape[1], k=c.shape[2] * 2, codes=c.contiguous(),
            scales=scales.contiguous(), scale_2=g[:, 0].contiguous(),
        )  # fmt: skip


def _copy_experts_(dst, src) -> None:  # moe_layout.ExpertWeights
    for name in ("bf16", "codes", "scales", "scale_2"):
        d, s = getattr(dst, name), getattr(src, name)
        if (d is None) != (s is None):
            raise ValueError(f"expert weights differ in layout ({name})")
        if d is not None:
            d.copy_(s)
    if (dst.packed is None) != (src.packed is None):
        raise ValueError("expert weights differ in layout (packed)")
    if dst.packed is not None:
        dst.packed.words.copy_(src.packed.words)
        dst.packed.scales.copy_(src.packed.scales)


def record_layout(engine, cfg: ModelConfig, guided_layers: Sequence[int]):
    """Where one row's records live in an engine's capture buffers: (the buffers as flat
    bytes, in slab order; the sections (key, part, row bytes); the byte index [R, row bytes]
    of each engine row's record in the slab built from those buffers)."""
    r = engine.batch
    parts: list[torch.Tensor] = []
    placed: dict[int, tuple[int, int]] = {}  # id(buffer) -> (slab offset, row bytes)
    sections: list[tuple[object, str, int]] = []
    index: list[torch.Tensor] = []
    offset = 0
    rows = torch.arange(r, dtype=torch.long)

    def add(key: object, part: str, buf: torch.Tensor, row0: int) -> None:
        nonlocal offset
        if id(buf) not in placed:
            flat = buf.view(torch.uint8).reshape(buf.shape[0], -1)
            placed[id(buf)] = (offset, flat.shape[1])
            parts.append(flat.reshape(-1))
            offset += flat.numel()
        start, rb = placed[id(buf)]
        sections.append((key, part, rb))
        index.append(start + (rows + row0)[:, None] * rb + torch.arange(rb)[None, :])

    for li in guided_layers:
        moe_in, kv = engine.records[li]  # rows [R, H] and [2R, Hkv D] (K rows, then V rows)
        for part in ("mbits", "block_scales", "row_scales"):
            add((li, GSITE_MOE_IN), part, getattr(moe_in, part), 0)
        for site, row0 in ((GSITE_K, 0), (GSITE_V, r)):
            for part in ("mbits", "block_scales", "row_scales"):
                add((li, site), part, getattr(kv, part), row0)
    for li in cfg.moe_layers:
        add(("routing", li), "ids", engine.plans[li].topk_ids, 0)
    return parts, sections, torch.cat(index, dim=1)


class DecodeBackend:
    """`StepBackend` on the CUDA-graph decode engine for one policy shape.

    Record history: `hist` [B * positions, row bytes] holds, per slot and position, the
    records of the token fed there; the decode graph gathers each slot's row from the step's
    capture buffers into it, the prefill copies its chunk's rows."""

    def __init__(self, cfg: ModelConfig, quant: QuantConfig, guidance: GuidanceConfig | None,
                 tensors: dict[str, torch.Tensor], *, batch: int, capacity: int,
                 device: torch.device, prefill_tokens: int = 256, pad_id: int = 0,
                 use_graph: bool = True, kernels: KernelSettings | None = None) -> None:  # fmt: skip
        from trace_common.kernels.engine import DecodeEngine, EngineShape, EngineWeights
        from trace_common.rollout.prefill import Prefill

        self.cfg, self.quant, self.device = cfg, quant, device
        self.batch, self.capacity, self.vocab = batch, capacity, cfg.vocab_size
        self.pad_id = pad_id
        self.guided = tuple(guidance.resolve(cfg, quant)) if guidance is not None else ()
        self.guided_layers = tuple(sorted({li for li, _ in self.guided}))
        self.mode = guidance.mode if guidance is not None else ""
        self._reader = PolicyWeights(cfg, quant, device)
        w = EngineWeights(*self._reader.top(tensors))
        for li in range(cfg.num_layers):
            w.layers.append(self._reader.layer(tensors, li))
        # one position more than a sequence may use: the prefill's scratch position
        self.positions = capacity + 1
        self.engine = DecodeEngine(
            EngineShape.from_model_config(cfg), w, batch=batch, capacity=self.positions,
            context=min(capacity - 1, 1024), guided_layers=self.guided_layers, device=str(device),
            settings=kernels,
        )  # fmt: skip
        self._parts, self.sections, index = record_layout(self.engine, cfg, self.guided_layers)
        self.slab = torch.empty(sum(p.numel() for p in self._parts), dtype=torch.uint8,
                                device=device)  # fmt: skip
        self.slot_index = index.to(device)  # [B, row bytes]
        self.row_bytes = self.slot_index.shape[1]
        self.hist = torch.empty(batch * self.positions, self.row_bytes, dtype=torch.uint8,
                                device=device)  # fmt: skip
        self._hist_rows = torch.zeros(batch, dtype=torch.long, device=device)
        self._hist_rows_host = torch.zeros(batch, dtype=torch.long, pin_memory=True)
        self._slot_base = torch.arange(batch, dtype=torch.long) * self.positions
        self._lens_host = torch.zeros(batch, dtype=torch.int32, pin_memory=True)
        self.prefill_tokens = prefill_tokens
        self._prefill = None
        if prefill_tokens:
            self._prefill = Prefill(self.engine, prefill_tokens, device, use_graph=use_graph)
            pparts, _, pindex = record_layout(self._prefill.eng, cfg, self.guided_layers)
            self._pre_parts = pparts
            self._pre_slab = torch.empty(sum(p.numel() for p in pparts), dtype=torch.uint8,
                                         device=device)  # fmt: skip
            self._pre_index = pindex.to(device)  # [rows, row bytes]
        self.graph: torch.cuda.CUDAGraph | None = None
        if use_graph:
            self._capture()

    def _body(self) -> None:
        self.engine.step()
        torch.cat(self._parts, out=self.slab)
        self.hist.index_copy_(0, self._hist_rows, self.slab[self.slot_index])

    def _capture(self) -> None:
        e = self.engine
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                e.pos.zero_()
                e.lens.fill_(1)
                self._body()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._body()
        torch.cuda.synchronize(self.device)

    def step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        e = self.engine
        torch.add(pos, 1, out=self._lens_host)
        torch.add(self._slot_base, pos, out=self._hist_rows_host)
        e.tokens.copy_(tokens, non_blocking=True)
        e.pos.copy_(pos, non_blocking=True)
        e.lens.copy_(self._lens_host, non_blocking=True)
        self._hist_rows.copy_(self._hist_rows_host, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()
        return e.logits

    def prefill(self, slots: Sequence[int], starts: Sequence[int],
                chunks: Sequence[Sequence[int]]) -> torch.Tensor:  # fmt: skip
        """One prefill graph per sequence's chunk; its records into the slot's history."""
        assert self._prefill is not None
        out = []
        for slot, start, chunk in zip(slots, starts, chunks, strict=True):
            out.append(self._prefill.run(slot, start, chunk, self.pad_id).clone())
            n = len(chunk)
            rows = torch.arange(start, start + n, device=self.device) + slot * self.positions
            torch.cat(self._pre_parts, out=self._pre_slab)
            self.hist.index_copy_(0, rows, self._pre_slab[self._pre_index[:n]])
        return torch.cat(out)

    def copy_prefix(self, src: int, dsts: Sequence[int], n: int) -> None:
        """Positions 0..n-1 of slot `src` (every layer's K/V, the record history) into each
        slot of `dsts`: a group's shared prompt."""
        to = torch.tensor(list(dsts), dtype=torch.long, device=self.device)
        for cache in self.engine.caches:
            cache.copy_prefix_(src, to, n)
        hist = self.hist.view(self.batch, self.positions, self.row_bytes)
        hist[to, :n] = hist[src : src + 1, :n]

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def records(self, slot: int, rows: int, tokens: Sequence[int], prompt_len: int) -> bytes:
        n = rows
        assert n == len(tokens) - 1, f"{n} record rows for {len(tokens)} tokens"
        base = slot * self.positions
        got = self.hist[base : base + n].cpu().numpy()  # [n, row bytes]
        cols: dict[tuple[object, str], np.ndarray] = {}
        c = 0
        for key, part, rb in self.sections:
            cols[(key, part)] = got[:, c : c + rb]
            c += rb

        def u8(key: object, part: str) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(cols[(key, part)]))

        guidance = {}
        for li, site in self.guided:
            k = self.cfg.act_width(site)
            row_scales = np.ascontiguousarray(cols[((li, site), "row_scales")]).view("<f4")
            guidance[(li, site)] = GuidanceRecord(
                "nvfp4", "compact", (n, k), u8((li, site), "mbits"),
                u8((li, site), "block_scales"), torch.from_numpy(row_scales.reshape(n).copy()),
            )  # fmt: skip
        routing = np.stack(
            [np.ascontiguousarray(cols[(("routing", li), "ids")]).view("<i4")
             for li in self.cfg.moe_layers], axis=1)  # fmt: skip  # [n, n_moe, k]
        rec = SampleRecords(
            tokens=torch.tensor(list(tokens), dtype=torch.long), prompt_len=prompt_len,
            fmt=self.quant.format, mode=self.mode if guidance else "", guidance=guidance,
            moe_layers=self.cfg.moe_layers, routing=torch.from_numpy(routing.astype(np.int64)),
        )  # fmt: skip
        rec.validate(self.cfg)
        return rec.to_bytes()

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """A new version into the buffers the graph reads, layer by layer (the next replay
        uses it; the caller makes sure no step runs meanwhile)."""
        w = self.engine.w
        for dst, src in zip((w.embed, w.lm_head, w.final_norm), self._reader.top(tensors),
                            strict=True):  # fmt: skip
            dst.copy_(src)
        for li, lw in enumerate(w.layers):
            fresh = self._reader.layer(tensors, li)
            for name in ("ln1", "ln2", "w_qkv", "w_o", "norm_qk", "router"):
                getattr(lw, name).copy_(getattr(fresh, name))
            _copy_experts_(lw.gate_up, fresh.gate_up)
            _copy_experts_(lw.down, fresh.down)
        torch.cuda.synchronize(self.device)


class CudaEngine:
    """`RolloutEngine` on the CUDA decode engine; one object serves every version."""

    name = "cuda"
    cancellable = True  # generate() takes `cancelled` and frees the caller's slots

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str], version: int,
                 *, device: torch.device | str = "cuda", max_batch: int = 64,
                 max_context: int = 4096, prefill_tokens: int = PREFILL_TOKENS,
                 use_graph: bool = True, kernels: KernelSettings | None = None) -> None:  # fmt: skip
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"the CUDA engine needs a CUDA device, got {self.device}")
        self.cfg, self.quant = policy_configs(metadata)
        meta = PolicyMeta.parse(metadata)
        reason = unsupported_reason(self.cfg, self.quant, meta.guidance)
        if reason is not None:
            raise ValueError(f"the CUDA engine cannot serve this policy: {reason}")
        if max_context > self.cfg.max_position_embeddings:
            max_context = self.cfg.max_position_embeddings
        self.meta = meta
        if self.device.index is not None:  # Triton kernels launch on the current device
            torch.cuda.set_device(self.device)
        self.backend = DecodeBackend(self.cfg, self.quant, meta.guidance, tensors,
                                     batch=max_batch, capacity=max_context, device=self.device,
                                     prefill_tokens=prefill_tokens, pad_id=meta.pad_id,
                                     use_graph=use_graph, kernels=kernels)  # fmt: skip
        self.scheduler = SlotScheduler(self.backend, eos_id=meta.eos_id, pad_id=meta.pad_id,
                                       device=self.device, version=version)  # fmt: skip

    @property
    def version(self) -> int:
        return self.scheduler.version

    def load_version(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                     version: int) -> CudaEngine:  # fmt: skip
        """Swap to `version` once in-flight requests have finished on the current one."""
        cfg, quant = policy_configs(metadata)
        meta = PolicyMeta.parse(metadata)
        if cfg != self.cfg or quant != self.quant or meta != self.meta:
            raise ValueError(
                f"version {version} changes the policy's shape, quantization, guidance or "
                f"special tokens ({cfg.diff(self.cfg) if cfg != self.cfg else 'configs'}); "
                "the CUDA engine loads new weights of the same policy only"
            )
        self.scheduler.swap(lambda: self.backend.load(tensors), version)
        return self

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        group_size: int,
        sampling: SamplingConfig,
        *,
        with_records: bool,
        cancelled: Callable[[], bool] | None = None,
    ) -> list[GeneratedSample]:
        samples, _ = self.scheduler.generate(prompts, group_size, sampling,
                                             with_records=with_records, cancelled=cancelled)  # fmt: skip
        return samples

    def stats(self) -> dict[str, float]:
        return self.scheduler.stats()

    def cached_kv(self, layer: int, slot: int, n: int, which: str) -> tuple[torch.Tensor, ...]:
        """The FP4 K (`which="k"`) or V the rollout stored for positions 0..n-1 of `slot` at
        `layer`, as (values, E2M1 grid values), each [n, kv_heads * head_dim] fp32: what the
        trainer's guided forward must reproduce at that site. FP4 KV caches only."""
        from trace_common.fp4.e2m1 import e2m1_to_f32, unpack_uint4

        cache = self.backend.engine.caches[layer]
        if not hasattr(cache, "codes"):
            raise ValueError("cached_kv reads FP4 KV caches; this policy's KV is high precision")
        j = {"k": 0, "v": 1}[which]
        codes = cache.codes[j, slot, :, :n].permute(1, 0, 2).reshape(n, -1)  # [n, W/2]
        grid = e2m1_to_f32(unpack_uint4(codes))  # [n, W]
        bs = cache.scales[j, slot, :, :n].permute(1, 0, 2).reshape(n, -1)
        bs = bs.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
        return grid * bs * cache.row_scales[j, slot, :n, None], grid

    def close(self) -> None:
        self.scheduler.close()


__all__ = ["CAPTURED_SITES", "CudaEngine", "DecodeBackend", "PolicyWeights",
           "unsupported_reason"]  # fmt: skip
