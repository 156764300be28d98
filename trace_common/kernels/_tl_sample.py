"""Triton kernel that samples one token per logits row by inverse CDF, as
`trace_common.rollout.scheduler.sample_rows` does without top-k/top-p: logits / temperature,
softmax, the first token whose cumulative probability reaches u * total; greedy rows (temperature
<= 0) take the argmax, with the untempered log-prob.

One program per sampled row makes two passes over the vocabulary in blocks: the running max and
the rescaled sum of exponentials, then the cumulative sum up to the token. Only its own row is
read (no index_select copy, no fp32 copies of the logits). The cumulative sums are added in a
different order than `torch.cumsum`, so a u that falls within rounding of a token boundary can
give the neighbouring token: the same distribution, not the same bits.

Imports Triton at module import: load it through `trace_common.kernels.load_kernels`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sample_kernel(
    logits_ptr,  # [*, V] fp32/bf16/fp16, unit stride along V
    row_stride,
    rows_ptr,  # int64 [N]: the logits row of each sample
    temp_ptr,  # fp32 [N]: temperature; <= 0 greedy
    u_ptr,  # fp64 [N]: the draw in (0, 1)
    tok_ptr,  # int64 out [N]
    logp_ptr,  # fp32 out [N]: log-prob of the token under the tempered distribution
    V: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    base = logits_ptr + tl.load(rows_ptr + i) * row_stride
    t = tl.load(temp_ptr + i)
    greedy = t <= 0.0
    t = tl.where(greedy, 1.0, t)
    cols0 = tl.arange(0, BLOCK)
    m = tl.full((), -float("inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    best = tl.full((), -float("inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + cols0
        x = tl.load(base + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        x = tl.math.div_rn(x, tl.zeros_like(x) + t)
        bmax, bidx = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        m_new = tl.maximum(m, bmax)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
        better = bmax > best
        best_idx = tl.where(better, start + bidx, best_idx)
        best = tl.where(better, bmax, best)
    target = (tl.load(u_ptr + i) * s.to(tl.float64)).to(tl.float32)
    c = tl.full((), 0.0, tl.float32)
    tok = tl.full((), V - 1, tl.int32)  # none reached (rounding): the last, as searchsorted
    found = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + cols0
        x = tl.load(base + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        e = tl.exp(tl.math.div_rn(x, tl.zeros_like(x) + t) - m)
        cum = c + tl.cumsum(e, 0)
        first = tl.min(tl.where((cum >= target) & (cols < V), cols, V), 0)
        take = (found == 0) & (first < V)
        tok = tl.where(take, first, tok)
        found = tl.where(first < V, 1, found)
        c += tl.sum(e, 0)
    tok = tl.where(greedy, best_idx, tok)
    x_tok = tl.load(base + tok).to(tl.float32)
    logp = tl.math.div_rn(x_tok, t) - m - tl.log(s)
    tl.store(tok_ptr + i, tok.to(tl.int64))
    tl.store(logp_ptr + i, logp)
