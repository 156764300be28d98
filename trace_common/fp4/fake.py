"""Fake quantization for QAT: forward dequantize(quantize(x)) in x.dtype, backward identity.

The backward is the plain straight-through estimator (the gradient passes unchanged, also for
saturated elements), so QAT sees the FP4 forward while the master weights get full gradients.
"""

from __future__ import annotations

from typing import Any

import torch

from trace_common.fp4.fast_path import fast_path_for
from trace_common.fp4.formats import get_format


class StraightThrough(torch.autograd.Function):
    """forward(x, y) -> y (computed without autograd); backward -> (grad, None).

    Used instead of `x + (y - x).detach()`, which is not bit-exact in low precision.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_out, None


def straight_through(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Return y in the forward pass with d(out)/dx = identity in the backward pass."""
    return StraightThrough.apply(x, y.detach())


def fake_quantize(
    x: torch.Tensor, fmt: str = "nvfp4", *, scale_granularity: str = "row", **kwargs: Any
) -> torch.Tensor:
    """Forward: dequantize(quantize(x)) in x.dtype; backward: straight-through.

    fmt: a registered format name ("nvfp4", "mxfp4"). scale_granularity applies to NVFP4 only
    ("row" = per-token second-level scale, the activation convention; "tensor" for weights).
    A registered fast path (`fast_path.py`) computes the NVFP4 forward of tensors it accepts.
    """
    spec = get_format(fmt)
    if spec.name == "nvfp4":
        kwargs["scale_granularity"] = scale_granularity
    with torch.no_grad():
        only_granularity = not kwargs.keys() - {"scale_granularity"}
        path = fast_path_for(x) if spec.name == "nvfp4" and only_granularity else None
        if path is not None:
            y = path.fake_quantize(x, scale_granularity=scale_granularity)
        else:
            y = spec.dequantize(spec.quantize(x, **kwargs), dtype=x.dtype)
    return straight_through(x, y)
