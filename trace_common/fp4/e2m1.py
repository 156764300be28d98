"""E2M1 (FP4) element encode/decode and 4-bit / 1-bit packing.

Codes are uint8 values 0..15: bit 3 is the sign, bits 0-2 index the magnitude ladder
0, .5, 1, 1.5, 2, 3, 4, 6 (see `constants.E2M1_MAGNITUDES`). Encoding rounds to nearest,
ties to even mantissa, and saturates at +-6: the thresholds of NVIDIA ModelOpt's
`NVFP4QTensor._cast_fp4`, TransformerEngine, vLLM and PTX `cvt.rn.satfinite.e2m1x2.f32`.

Packing (`pack_uint4`): two codes per byte, element 2i in the low nibble (bits 0-3), element
2i+1 in the high nibble (bits 4-7), as ModelOpt checkpoints and torchao.
Bit packing (`pack_bits`): element i goes to bit i % 8 (little-endian bit order) of byte i // 8.
"""

from __future__ import annotations

import torch

from trace_common.fp4.constants import (
    E2M1_BOUND_TIES_UP,
    E2M1_MAGNITUDES,
    E2M1_RNE_BOUNDS,
    E2M1_VALUES,
    F4_E2M1_NUM_CODES,
)

_BITS_PER_BYTE = 8
_NIBBLE_MASK = 0x0F
_NIBBLE_SHIFT = 4

_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(kind: str, device: torch.device) -> torch.Tensor:
    """Small constant tables, cached per device (fp32 values/magnitudes, uint8 bit weights)."""
    key = (kind, device)
    if key not in _TABLES:
        if kind == "values":
            t = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        elif kind == "magnitudes":
            t = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
        elif kind == "bit_weights":
            t = torch.tensor([1 << i for i in range(_BITS_PER_BYTE)], dtype=torch.uint8)
        else:  # pragma: no cover - internal
            raise AssertionError(kind)
        _TABLES[key] = t.to(device)
    return _TABLES[key]


def f32_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Encode already-scaled values as E2M1 codes (uint8, same shape), RNE with saturation.

    Negative values that round to zero keep their sign (code 0b1000), -0.0 gives code 0, and
    +-Inf saturate to +-6 (`satfinite`). NaN has no encoding: ValueError.
    """
    if not torch.is_floating_point(x):
        raise TypeError(f"f32_to_e2m1 expects a floating tensor, got dtype {x.dtype}")
    x_f32 = x.float()
    if bool(torch.isnan(x_f32).any()):
        idx = tuple(int(i) for i in torch.isnan(x_f32).nonzero()[0])
        raise ValueError(f"f32_to_e2m1: NaN at index {idx} has no E2M1 encoding")
    sign_u8 = (x_f32 < 0).to(torch.uint8)
    return rne_magnitude_index(x_f32.abs()) | (sign_u8 << 3)


def rne_magnitude_index(mag_f32: torch.Tensor) -> torch.Tensor:
    """Index (uint8 0..7) of the E2M1 magnitude nearest to |x| (ties to even, saturating).

    No checks: `mag_f32` must be non-negative and NaN-free (callers validate).
    """
    # Count the boundaries below |x|: a boundary that ties up (0.75, 1.75, 3.5) also counts when
    # |x| sits exactly on it. The count is the magnitude index (0..7), saturating at 7.
    idx_u8 = torch.zeros(mag_f32.shape, dtype=torch.uint8, device=mag_f32.device)
    for bound, ties_up in zip(E2M1_RNE_BOUNDS, E2M1_BOUND_TIES_UP, strict=True):
        idx_u8 += (mag_f32 >= bound) if ties_up else (mag_f32 > bound)
    return idx_u8


def e2m1_to_f32(codes: torch.Tensor) -> torch.Tensor:
    """Decode uint8 E2M1 codes (0..15) to float32 values (code 0b1000 decodes to +0.0)."""
    _check_codes(codes, "e2m1_to_f32")
    return _table("values", codes.device)[codes.long()]


def pack_uint4(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes [..., K] (values < 16, K even) into bytes [..., K/2], even element low."""
    _check_codes(codes, "pack_uint4")
    if codes.ndim == 0 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"pack_uint4 needs an even last dim, got shape {tuple(codes.shape)}")
    return (codes[..., 1::2] << _NIBBLE_SHIFT) | codes[..., 0::2]


def unpack_uint4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes [..., K/2] into uint8 codes [..., K] (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_uint4 expects uint8, got dtype {packed.dtype}")
    if packed.ndim == 0:
        raise ValueError("unpack_uint4 needs at least 1 dim, got a 0-d tensor")
    low = packed & _NIBBLE_MASK
    high = packed >> _NIBBLE_SHIFT
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack 0/1 values [..., K] (K % 8 == 0) into bytes [..., K/8]: element i -> bit i % 8."""
    if bits.dtype not in (torch.uint8, torch.bool):
        raise TypeError(f"pack_bits expects uint8 or bool, got dtype {bits.dtype}")
    if bits.ndim == 0 or bits.shape[-1] % _BITS_PER_BYTE != 0:
        raise ValueError(
            f"pack_bits needs a last dim divisible by 8, got shape {tuple(bits.shape)}"
        )
    bits_u8 = bits.to(torch.uint8)
    if bits.dtype == torch.uint8 and bool((bits_u8 > 1).any()):
        raise ValueError(f"pack_bits expects 0/1 values, got max {int(bits_u8.max())}")
    grouped = bits_u8.reshape(*bits.shape[:-1], bits.shape[-1] // _BITS_PER_BYTE, _BITS_PER_BYTE)
    # Bits are disjoint, so a sum of bit-weighted values is their OR; sum() widens, so narrow back.
    return (grouped * _table("bit_weights", bits.device)).sum(dim=-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes [..., K/8] into uint8 0/1 values [..., K] (bit i % 8 of byte i // 8)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_bits expects uint8, got dtype {packed.dtype}")
    if packed.ndim == 0:
        raise ValueError("unpack_bits needs at least 1 dim, got a 0-d tensor")
    bits = (packed.unsqueeze(-1) & _table("bit_weights", packed.device)) != 0
    return bits.to(torch.uint8).reshape(*packed.shape[:-1], packed.shape[-1] * _BITS_PER_BYTE)


def packed_values(packed: torch.Tensor) -> torch.Tensor:
    """fp32 values of packed codes uint8 [..., K/2] -> [..., K]: `e2m1_to_f32(unpack_uint4(.))`
    without its code check, which waits for the device and cannot fail on nibbles."""
    return _table("values", packed.device)[unpack_uint4(packed).long()]


def _check_codes(codes: torch.Tensor, fn: str) -> None:
    if codes.dtype != torch.uint8:
        raise TypeError(f"{fn} expects uint8 codes, got dtype {codes.dtype}")
    if codes.numel() and int(codes.max()) >= F4_E2M1_NUM_CODES:
        raise ValueError(f"{fn}: code {int(codes.max())} is not a 4-bit E2M1 code (0..15)")


__all__ = [
    "e2m1_to_f32",
    "f32_to_e2m1",
    "pack_bits",
    "pack_uint4",
    "packed_values",
    "rne_magnitude_index",
    "unpack_bits",
    "unpack_uint4",
]
