"""Sampling one token per logits row on the GPU (`_tl_sample.sample_kernel`): what
`trace_common.rollout.scheduler.sample_rows` computes for rows without top-k or top-p, reading
each row once per pass instead of through several full-vocabulary fp32 copies."""

from __future__ import annotations

import torch

from trace_common.kernels import load_kernels

BLOCK = 4096  # vocabulary entries per step of a row's passes
WARPS = 8


def sample_rows_unfiltered(
    logits: torch.Tensor,  # [*, V]
    rows: torch.Tensor,  # int64 [N]: the logits row of each sample
    temperature: torch.Tensor,  # fp32 [N]; <= 0 greedy
    u: torch.Tensor,  # fp64 [N] in (0, 1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token int64 [N], log-prob fp32 [N]): inverse-CDF sampling of logits / temperature
    with draw u, greedy rows the argmax with the untempered log-prob."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, V] with unit stride along V, got "
                         f"{tuple(logits.shape)} strides {logits.stride()}")  # fmt: skip
    n = rows.numel()
    for name, t, dtype in (("rows", rows, torch.int64), ("temperature", temperature, torch.float32),
                           ("u", u, torch.float64)):  # fmt: skip
        if t.dtype != dtype or t.shape != (n,) or t.device != logits.device:
            raise ValueError(f"{name}: expected {dtype} [{n}] on {logits.device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")  # fmt: skip
    tok = torch.empty(n, dtype=torch.int64, device=logits.device)
    logp = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        k = load_kernels("_tl_sample")
        k.sample_kernel[(n,)](logits, logits.stride(0), rows.contiguous(),
                              temperature.contiguous(), u.contiguous(), tok, logp,
                              V=logits.shape[1], BLOCK=BLOCK, num_warps=WARPS)  # fmt: skip
    return tok, logp


__all__ = ["sample_rows_unfiltered"]
