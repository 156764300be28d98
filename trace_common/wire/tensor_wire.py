"""How tensors travel as raw bytes (weight-sync): dtype name + shape + bytes + CRC-32.

Torch-free on purpose: the weight-sync service validates manifests without importing torch.
Raw bytes are the tensor's C-contiguous storage in the machine's byte order (little-endian on
every platform we run); FP4 weights arrive as their packed uint8 bytes and FP8 scales as
their float8_e4m3fn bytes, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Element size in bytes of each torch dtype that may travel, by name (no "torch." prefix).
DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,  # two FP4 codes per byte
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


def expected_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor of `dtype` and `shape`; ValueError naming a bad dtype or dimension."""
    if dtype not in DTYPE_ITEMSIZE:
        raise ValueError(f"unsupported dtype {dtype!r}; known: {sorted(DTYPE_ITEMSIZE)}")
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in shape {list(shape)}")
    return math.prod(shape) * DTYPE_ITEMSIZE[dtype]
