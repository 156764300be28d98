"""Where a faster, bit-identical implementation of FP4 ops plugs into the reference.

This package is the plain-PyTorch reference and imports nothing above it. A fast path (the
Triton kernels of `trace_common.kernels.quant`) registers itself here when its module is
imported; `fake.fake_quantize` and `guided.guided_quantize` then hand it the tensors it
accepts and compute everything else themselves. The model's quantization hooks
(`trace_common.model.runtime`) import the kernels' module, so every process that runs the
QAT or rollout forward gets the fast path where it applies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trace_common.fp4.record import GuidanceRecord


@dataclass(frozen=True, slots=True)
class FastPath:
    """Forward-only versions of two reference ops, equal to them bit for bit.

    name:            what the fast path is, for messages ("triton")
    accepts:         whether it may run on tensor x (e.g. CUDA with Triton installed)
    fake_quantize:   nvfp4 dequantize(quantize(x, scale_granularity=...)) in x.dtype
    guided_quantize: guided rounding of x_train by a compact nvfp4 record, in x_train.dtype
    """

    name: str
    accepts: Callable[[torch.Tensor], bool]
    fake_quantize: Callable[..., torch.Tensor]
    guided_quantize: Callable[[torch.Tensor, GuidanceRecord], torch.Tensor]


_registered: FastPath | None = None


def register_fast_path(path: FastPath | None) -> FastPath | None:
    """Install `path` (None: the reference everywhere); returns the one it replaces."""
    global _registered
    previous, _registered = _registered, path
    return previous


def fast_path_for(x: torch.Tensor) -> FastPath | None:
    """The registered fast path if it accepts x, else None (compute with the reference)."""
    path = _registered
    return path if path is not None and path.accepts(x) else None


__all__ = ["FastPath", "fast_path_for", "register_fast_path"]
