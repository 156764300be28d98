"""Batched prefill for the CUDA rollout engine: prompt chunks of several sequences (up to
`rows` tokens in all) through every layer in one pass, written into the decode engine's
caches and record history at each sequence's slot and positions.

The chunk runs on a second `DecodeEngine` of `rows` rows that shares the decode engine's
weights: its row-wise kernels (embedding, add + RMSNorm, the projections, q/k norm + RoPE at
each row's position, the router, the FP4 expert GEMMs with their activation quantizers and
capture) are the decode step's own. Two parts differ:

- K/V: the chunk's K and V rows are quantized by the same per-token NVFP4 quantizer the
  decode append runs (`quant.quantize_rows`, one row per token over all kv heads, capturing
  the compact records), then scattered into the slots' FP4 cache; BF16 K/V are copied.
- attention: per sequence, its rows attend (fp32, causal) over the dequantized cache of its
  slot, positions 0..its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trace_common.fp4.nvfp4 import NVFP4Tensor, dequantize


def slot_kv(cache, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one slot's positions 0..length-1 as fp32 [Hkv, L, D] (FP4 dequantized)."""
    if not cache.fp4:
        kv = cache.values[:, slot, :, :length].float()
        return kv[0], kv[1]
    codes = cache.codes[:, slot, :, :length]  # [2, Hkv, L, D/2]
    two, hkv, n, half = codes.shape
    rows = codes.permute(0, 2, 1, 3).reshape(two, n, hkv * half)  # a row: one token, all heads
    scales = cache.scales[:, slot, :, :length].permute(0, 2, 1, 3).reshape(two, n, -1)
    q = NVFP4Tensor(rows, scales.view(torch.float8_e4m3fn), cache.row_scales[:, slot, :length, None],
                    torch.Size((two, n, hkv * half * 2)), torch.float32, "row")  # fmt: skip
    kv = dequantize(q).reshape(two, n, hkv, half * 2).permute(0, 2, 1, 3)
    return kv[0], kv[1]


def write_kv(cache, kv_new: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
             capture_k=None, capture_v=None) -> None:  # fmt: skip
    """kv_new [2, n, Hkv D] (bf16) into the cache at (slots[i], pos[i]); FP4 through the
    decode append's per-token quantizer, its compact records into the capture buffers."""
    from trace_common.kernels.quant import quantize_rows

    n = kv_new.shape[1]
    if not cache.fp4:
        hkv, d = cache.values.shape[2], cache.values.shape[4]
        for j in range(2):
            cache.values[j][slots, :, pos] = kv_new[j].reshape(n, hkv, d)
        return
    hkv, half = cache.codes.shape[2], cache.codes.shape[4]
    for j, cap in ((0, capture_k), (1, capture_v)):
        codes, scales, g = quantize_rows(kv_new[j], scale_2=None, capture=cap)
        cache.codes[j][slots, :, pos] = codes.reshape(n, hkv, half)
        cache.scales[j][slots, :, pos] = scales.reshape(n, hkv, -1)
        cache.row_scales[j][slots, pos] = g


class Prefill:
    """Chunked prefill on a `rows`-row engine sharing `main`'s weights."""

    def __init__(self, main, rows: int, device: torch.device) -> None:
        from trace_common.kernels.engine import DecodeEngine

        self.main, self.rows, self.device = main, rows, device
        self.eng = DecodeEngine(main.shape, main.w, batch=rows, capacity=16, context=1,
                                guided_layers=tuple(sorted(main.guided)), device=str(device),
                                small_batch=False)  # fmt: skip
        self.eng.attn_out.zero_()

    def run(self, slots: Sequence[int], starts: Sequence[int],
            chunks: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:  # fmt: skip
        """Every chunk through the model; the logits after each chunk's last token [n, V].
        The chunk's rows' records are left in this engine's capture buffers and plans (row
        r of the chunk in row r), for the caller to copy into its history."""
        from trace_common.kernels import attention as attn
        from trace_common.kernels import moe

        e, s, w = self.eng, self.main.shape, self.main.w
        dev = self.device
        tok, pos, slot_of, spans = [], [], [], []
        for slot, start, chunk in zip(slots, starts, chunks, strict=True):
            spans.append((slot, len(tok), len(chunk), start))
            tok += list(chunk)
            pos += range(start, start + len(chunk))
            slot_of += [slot] * len(chunk)
        n = len(tok)
        if not 0 < n <= self.rows:
            raise ValueError(f"prefill chunk of {n} tokens; this engine takes 1..{self.rows}")
        pad = self.rows - n
        e.tokens.copy_(torch.tensor(tok + [pad_id] * pad, dtype=torch.long), non_blocking=False)
        e.pos.copy_(torch.tensor(pos + [0] * pad, dtype=torch.int32))
        slots_t = torch.tensor(slot_of, dtype=torch.long, device=dev)
        pos_t = e.pos[:n].long()
        torch.index_select(w.embed, 0, e.tokens, out=e.resid)
        for li, lw in enumerate(w.layers):
            rec = e.records.get(li) if e.fp4 else None
            attn.add_rmsnorm(None if li == 0 else e.y, e.resid, lw.ln1, e.xn,
                             nsum=0 if li == 0 else s.top_k, eps=s.eps)  # fmt: skip
            torch.mm(e.xn, lw.w_qkv.t(), out=e.qkv)
            attn.qk_norm_rope(e.qkv, lw.norm_qk, e.pos, e.inv_freq, e.q, e.kv_new,
                              q_heads=s.q_heads, kv_heads=s.kv_heads, eps=s.eps)  # fmt: skip
            cache = self.main.caches[li]
            if rec is None:
                write_kv(cache, e.kv_new[:, :n], slots_t, pos_t)
            else:
                kv_rec = rec[1]
                write_kv(cache, e.kv_new[:, :n], slots_t, pos_t,
                         _rows(kv_rec, 0, n), _rows(kv_rec, self.rows, self.rows + n))  # fmt: skip
            for slot, r0, m, start in spans:
                k, v = slot_kv(cache, slot, start + m)  # [Hkv, L, D]
                group = s.q_heads // s.kv_heads
                q = e.q[r0 : r0 + m].float().transpose(0, 1)  # [Hq, m, D]
                keys = torch.arange(start + m, device=dev)
                mask = keys[None, :] <= (start + torch.arange(m, device=dev))[:, None]  # [m, L]
                o = torch.nn.functional.scaled_dot_product_attention(
                    q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), attn_mask=mask
                )  # [Hq, m, D]
                e.attn_out[r0 : r0 + m] = o.transpose(0, 1).reshape(m, -1)
            if pad:
                e.attn_out[n:].zero_()
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
        last = torch.tensor([r0 + m - 1 for _, r0, m, _ in spans], device=dev)
        return e.xn.index_select(0, last) @ w.lm_head.t()  # [n_spans, V]


def _rows(bufs, start: int, stop: int):
    """Rows start..stop of compact capture buffers (contiguous views)."""
    from trace_common.kernels.quant import CompactRecordBuffers

    return CompactRecordBuffers(bufs.mbits[start:stop], bufs.block_scales[start:stop],
                                bufs.row_scales[start:stop])  # fmt: skip
