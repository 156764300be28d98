"""The registry of FP4 formats: one `FP4Format` per format, looked up by name.

A format's `name` is what record and checkpoint metadata store; `fake.fake_quantize(x, name)`
is the fake quantization of any registered format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trace_common.fp4 import mxfp4, nvfp4
from trace_common.fp4.constants import MXFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE
from trace_common.fp4.mxfp4 import MXFP4Tensor
from trace_common.fp4.nvfp4 import NVFP4Tensor

QTensor = NVFP4Tensor | MXFP4Tensor


@dataclass(frozen=True, slots=True)
class FP4Format:
    """One registered FP4 format.

    name:       registry key, recorded in record/checkpoint metadata ("nvfp4", "mxfp4")
    block_size: elements per block scale along the last dim
    """

    name: str
    block_size: int
    _quantize: Callable[..., Any]
    _dequantize: Callable[..., torch.Tensor]

    def quantize(self, x: torch.Tensor, **kwargs: Any) -> QTensor:
        return self._quantize(x, **kwargs)

    def dequantize(self, q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._dequantize(q, dtype=dtype)


_REGISTRY: dict[str, FP4Format] = {}


def register_format(fmt: FP4Format) -> None:
    """Register a format under fmt.name (ValueError if the name is taken)."""
    if fmt.name in _REGISTRY:
        raise ValueError(f"FP4 format {fmt.name!r} is already registered")
    _REGISTRY[fmt.name] = fmt


def get_format(name: str) -> FP4Format:
    """The registered format called `name`; ValueError naming it and the known ones otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown FP4 format {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def available_formats() -> list[str]:
    return sorted(_REGISTRY)


def _mxfp4_quantize(x: torch.Tensor, **kwargs: Any) -> MXFP4Tensor:
    # MXFP4 has no second-level scale; accept and ignore NVFP4's granularity keyword only.
    kwargs.pop("scale_granularity", None)
    if kwargs:
        raise TypeError(f"mxfp4.quantize got unexpected keyword(s) {sorted(kwargs)}")
    return mxfp4.quantize(x)


register_format(FP4Format("nvfp4", NVFP4_BLOCK_SIZE, nvfp4.quantize, nvfp4.dequantize))
register_format(FP4Format("mxfp4", MXFP4_BLOCK_SIZE, _mxfp4_quantize, mxfp4.dequantize))

__all__ = ["FP4Format", "QTensor", "available_formats", "get_format", "register_format"]
