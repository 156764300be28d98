"""Batched prefill for the CUDA rollout engine: up to `rows` prompt tokens of one sequence
through every layer in one CUDA graph, written into the decode engine's caches (and the
chunk's records left in capture buffers) at the sequence's slot and positions.

The chunk runs on a second `DecodeEngine` of `rows` rows that shares the decode engine's
weights: its row-wise kernels (embedding, add + RMSNorm, the projections, q/k norm + RoPE at
each row's position, the router, the FP4 expert GEMMs with their activation quantizers and
capture) are the decode step's own. Two parts differ:

- K/V: the chunk's K and V rows are quantized by the same per-token NVFP4 quantizer the
  decode append runs (`quant.quantize_rows`, one row per token over all kv heads, capturing
  the compact records) and scattered into the slot's FP4 cache; BF16 K/V are copied.
- attention: the chunk's queries attend (causal by position, fp32) over the slot's cache,
  dequantized, positions 0..`span`-1, where `span` is the smallest captured length that
  holds the chunk's last position (one graph per span length).

Rows past the chunk's tokens are padding: they run at the scratch position (the cache's last,
which no sequence uses), so every shape is static and nothing they write is ever read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trace_common.fp4.constants import NVFP4_BLOCK_SIZE

_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip  # code -> value


def span_lengths(rows: int, positions: int) -> list[int]:
    """The attention spans one graph each is captured for: rows, 2 rows, 4 rows, ... and the
    cache's full length `positions` (scratch included) last."""
    out, n = [], rows
    while n < positions:
        out.append(n)
        n *= 2
    return [*out, positions]


class Prefill:
    """Chunked prefill of one sequence per call on a `rows`-row engine sharing `main`'s
    weights; `main`'s caches hold `scratch + 1` positions, the last one scratch."""

    def __init__(self, main, rows: int, device: torch.device, *, use_graph: bool = True) -> None:
        from trace_common.kernels.engine import DecodeEngine

        self.main, self.rows, self.device = main, rows, device
        self.eng = e = DecodeEngine(main.shape, main.w, batch=rows, capacity=16, context=1,
                                    guided_layers=tuple(sorted(main.guided)), device=str(device),
                                    small_batch=False)  # fmt: skip
        self.scratch = main.capacity - 1
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.last = torch.zeros(1, dtype=torch.long, device=device)  # the chunk's last row
        self.end = torch.zeros(1, dtype=torch.long, device=device)  # positions written after it
        self.logits = torch.empty(1, main.shape.vocab, dtype=torch.bfloat16, device=device)
        self._lut = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=device)
        self._tok_host = torch.zeros(rows, dtype=torch.long, pin_memory=True)
        self._pos_host = torch.zeros(rows, dtype=torch.int32, pin_memory=True)
        self._ctl_host = torch.zeros(3, dtype=torch.long, pin_memory=True)
        e.attn_out.zero_()
        self.spans = span_lengths(rows, main.capacity)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if use_graph:
            self._capture()

    def _capture(self) -> None:
        e = self.eng
        e.tokens.zero_()
        e.pos.fill_(self.scratch)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for span in self.spans:
                self._forward(span)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for span in self.spans:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._forward(span)
            self.graphs[span] = g
        torch.cuda.synchronize(self.device)

    def run(self, slot: int, start: int, chunk: Sequence[int], pad_id: int) -> torch.Tensor:
        """Prefill `chunk` at positions start.. of `slot`; the logits after its last token
        [1, V]. The chunk's records stay in this engine's capture buffers and plans (row r of
        the chunk in row r) until the next call."""
        n = len(chunk)
        if not 0 < n <= self.rows or start + n > self.scratch:
            raise ValueError(f"prefill chunk of {n} tokens at position {start}: this engine "
                             f"takes 1..{self.rows} tokens below position {self.scratch}")  # fmt: skip
        e = self.eng
        self._tok_host.fill_(pad_id)
        self._tok_host[:n] = torch.tensor(list(chunk), dtype=torch.long)
        self._pos_host.fill_(self.scratch)
        self._pos_host[:n] = torch.arange(start, start + n, dtype=torch.int32)
        self._ctl_host[0], self._ctl_host[1], self._ctl_host[2] = slot, n - 1, start + n
        e.tokens.copy_(self._tok_host, non_blocking=True)
        e.pos.copy_(self._pos_host, non_blocking=True)
        self.slot.copy_(self._ctl_host[:1], non_blocking=True)
        self.last.copy_(self._ctl_host[1:2], non_blocking=True)
        self.end.copy_(self._ctl_host[2:], non_blocking=True)
        span = next(s for s in self.spans if s > start + n - 1)
        if self.graphs:
            self.graphs[span].replay()
        else:
            self._forward(span)
        torch.cuda.current_stream(self.device).synchronize()  # host buffers reused next call
        return self.logits

    def _forward(self, span: int) -> None:
        """The chunk through the model with attention over cache positions 0..span-1."""
        from trace_common.kernels import attention as attn
        from trace_common.kernels import moe

        e, s, w = self.eng, self.main.shape, self.main.w
        pos = e.pos.long()
        slots = self.slot.expand(self.rows)
        torch.index_select(w.embed, 0, e.tokens, out=e.resid)
        for li, lw in enumerate(w.layers):
            rec = e.records.get(li) if e.fp4 else None
            attn.add_rmsnorm(None if li == 0 else e.y, e.resid, lw.ln1, e.xn,
                             nsum=0 if li == 0 else s.top_k, eps=s.eps)  # fmt: skip
            torch.mm(e.xn, lw.w_qkv.t(), out=e.qkv)
            attn.qk_norm_rope(e.qkv, lw.norm_qk, e.pos, e.inv_freq, e.q, e.kv_new,
                              q_heads=s.q_heads, kv_heads=s.kv_heads, eps=s.eps)  # fmt: skip
            cache = self.main.caches[li]
            self._write_kv(cache, slots, pos, rec)
            self._attend(cache, pos, span)
            torch.mm(e.attn_out, lw.w_o.t(), out=e.o)
            attn.add_rmsnorm(e.o, e.resid, lw.ln2, e.xn, nsum=1, eps=s.eps)
            torch.mm(e.xn, lw.router.t(), out=e.rlogits)
            plan = e.plans[li]
            moe.route_align_into(e.rlogits, plan)
            if e.fp4:
                e._experts_fp4(lw, plan, rec)
            else:
                moe.moe_gemm(e.xn, lw.gate_up, plan, gated=True, a_div=s.top_k,
                             mul_route_w=False, out=e.act)  # fmt: skip
                moe.moe_gemm(e.act, lw.down, plan, gated=False, a_div=1, mul_route_w=True,
                             out=e.y)  # fmt: skip
        attn.add_rmsnorm(e.y, e.resid, w.final_norm, e.xn, nsum=s.top_k, eps=s.eps)
        torch.mm(e.xn.index_select(0, self.last), w.lm_head.t(), out=self.logits)

    def _write_kv(self, cache, slots: torch.Tensor, pos: torch.Tensor, rec) -> None:
        """The chunk's K/V rows into the slot's cache at their positions: FP4 through the
        decode append's per-token quantizer (its compact records into the capture buffers)."""
        from trace_common.kernels.quant import CompactRecordBuffers, quantize_rows

        e, r = self.eng, self.rows
        if not cache.fp4:
            hkv, d = cache.values.shape[2], cache.values.shape[4]
            for j in range(2):
                cache.values[j][slots, :, pos] = e.kv_new[j].view(r, hkv, d)
            return
        hkv, half = cache.codes.shape[2], cache.codes.shape[4]
        for j in range(2):
            cap = None
            if rec is not None:  # rows [2R, Hkv D]: K rows, then V rows
                b = rec[1]
                rows = slice(j * r, (j + 1) * r)
                cap = CompactRecordBuffers(b.mbits[rows], b.block_scales[rows], b.row_scales[rows])
            codes, scales, g = quantize_rows(e.kv_new[j], scale_2=None, capture=cap)
            cache.codes[j][slots, :, pos] = codes.view(r, hkv, half)
            cache.scales[j][slots, :, pos] = scales.view(r, hkv, -1)
            cache.row_scales[j][slots, pos] = g

    def _slot_kv(self, cache, span: int) -> torch.Tensor:
        """The slot's K and V at positions 0..span-1: fp32 [2, Hkv, span, D]. Positions the
        sequence has not written (at or past `end`) hold whatever was there; they are masked
        out of the attention, but a NaN or a huge value there would still poison it (0 * NaN
        in P @ V, inf - inf in the scores), so they read as 0."""
        written = (torch.arange(span, device=self.device) < self.end)[None, None, :, None]
        if not cache.fp4:
            kv = cache.values.index_select(1, self.slot)[:, 0, :, :span].float()
            return torch.where(written, kv, torch.zeros((), device=self.device))
        codes = cache.codes.index_select(1, self.slot)[:, 0, :, :span]  # [2, Hkv, L, D/2]
        scales = cache.scales.index_select(1, self.slot)[:, 0, :, :span]  # [2, Hkv, L, D/16]
        rs = cache.row_scales.index_select(1, self.slot)[:, 0, :span]  # [2, L]
        two, hkv, n, half = codes.shape
        lo, hi = codes & 0xF, codes >> 4  # the even element in the low nibble
        vals = self._lut[torch.stack([lo, hi], dim=-1).long()].view(two, hkv, n, -1,
                                                                    NVFP4_BLOCK_SIZE)  # fmt: skip
        vals = vals * scales.view(torch.float8_e4m3fn).float()[..., None]
        vals = vals.view(two, hkv, n, half * 2) * rs[:, None, :, None]
        return torch.where(written, vals, torch.zeros((), device=self.device))

    def _attend(self, cache, pos: torch.Tensor, span: int) -> None:
        e, s = self.eng, self.main.shape
        kv = self._slot_kv(cache, span)  # [2, Hkv, L, D]
        group = s.q_heads // s.kv_heads
        q = e.q.transpose(0, 1)[None].float()  # [1, Hq, R, D]; fp32 as the decode attention
        k = kv[0].repeat_interleave(group, dim=0)[None]
        v = kv[1].repeat_interleave(group, dim=0)[None]
        keys = torch.arange(span, device=self.device)
        mask = (keys[None, :] <= pos[:, None])[None, None]  # [1, 1, R, L]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        e.attn_out.copy_(o[0].transpose(0, 1).reshape(self.rows, -1))  # to bf16
