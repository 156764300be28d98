"""FP4 numerics: E2M1 elements, the NVFP4 and MXFP4 formats, fake and guided quantization.

Formats are registered behind one interface (`get_format(name)` -> `FP4Format`) and named by
`FP4Format.name` in record and checkpoint metadata, never guessed from a file name.
Plain-PyTorch reference implementation; NVFP4 is bit-identical to NVIDIA ModelOpt.
"""

from __future__ import annotations

from trace_common.fp4.formats import (
    FP4Format,
    QTensor,
    available_formats,
    get_format,
    register_format,
)
from trace_common.fp4.mxfp4 import MXFP4Tensor
from trace_common.fp4.nvfp4 import NVFP4Tensor

__all__ = [
    "FP4Format",
    "MXFP4Tensor",
    "NVFP4Tensor",
    "QTensor",
    "available_formats",
    "get_format",
    "register_format",
]
