"""Rollout-guided rounding: the trainer's quantizer that follows the FP4 rollout's records
(`record.GuidanceRecord`; docs/design.md, "Guided rounding").

`guided_quantize(x_train, record)`:
  1. z = clip(x_train / s_rollout, -6, 6), s_rollout = block scale * row scale (fp32, same ops
     as the quantizer, so x_train == x_rollout gives the rollout's z bit for bit);
  2. bracket z by its neighbouring E2M1 grid points lo <= z <= hi (lo == hi when z is a grid
     point);
  3. full: q* = the bracket member nearest the rollout value q_r, i.e. clamp(q_r, lo, hi);
     compact: q* = the bracket member whose mantissa bit equals the rollout's (adjacent grid
     points always differ in it; a degenerate bracket lo == hi is taken as is, = RNE(z));
  4. forward s_rollout * q* (as dequantize computes it) in x_train.dtype, backward identity.

Guarantees (tested): full mode is never farther from q_r than RNE(z); both modes reproduce
the rollout exactly when z is within one grid step of q_r (q_r in the bracket), in
particular on the rollout's own input. Compact mode can pick the farther member when q_r is
two or more grid steps away from z (one bit cannot tell which side q_r lies on).
"""

from __future__ import annotations

import torch

from trace_common.fp4 import nvfp4
from trace_common.fp4._checks import check_finite, check_tensor
from trace_common.fp4.constants import (
    F4_E2M1_MANTISSA_BIT,
    F4_E2M1_MAX,
    MXFP4_BLOCK_SIZE,
    NVFP4_BLOCK_SIZE,
)
from trace_common.fp4.e2m1 import (
    _table,
    e2m1_to_f32,
    f32_to_e2m1,
    rne_magnitude_index,
    unpack_bits,
    unpack_uint4,
)
from trace_common.fp4.fake import straight_through
from trace_common.fp4.fast_path import FastPath, fast_path_for
from trace_common.fp4.mxfp4 import e8m0_to_f32
from trace_common.fp4.record import GuidanceRecord


def record_scaled(x_train: torch.Tensor, record: GuidanceRecord) -> torch.Tensor:
    """z = clip(x_train / s_rollout, -6, 6) in fp32, shape of x_train (grid units)."""
    with torch.no_grad():
        z, _ = _scaled(x_train, record)
    return z.reshape(x_train.shape)


def guided_grid(x_train: torch.Tensor, record: GuidanceRecord) -> torch.Tensor:
    """The guided E2M1 values q* (fp32 grid values, shape of x_train), without the scales."""
    with torch.no_grad():
        q_star, _ = _guided(x_train, record)
    return q_star.reshape(x_train.shape)


def guided_codes(x_train: torch.Tensor, record: GuidanceRecord) -> torch.Tensor:
    """The guided E2M1 codes (uint8, shape of x_train; a guided zero is code 0)."""
    return f32_to_e2m1(guided_grid(x_train, record))


def guided_quantize(x_train: torch.Tensor, record: GuidanceRecord) -> torch.Tensor:
    """Training side: rollout-guided rounding of x_train (see module docstring).

    Forward: s_rollout * q* in x_train.dtype; backward: straight-through to x_train. A
    registered fast path (`fast_path.py`) computes the forward for compact NVFP4 records of
    tensors it accepts, the same values.
    """
    with torch.no_grad():
        path = _guided_fast_path(x_train, record)
        if path is not None:
            y = path.guided_quantize(x_train, record)
        else:
            q_star, factor = _guided(x_train, record)
            y = _apply_scales(q_star, factor, record, x_train)
    return straight_through(x_train, y)


def _guided_fast_path(x_train: torch.Tensor, record: GuidanceRecord) -> FastPath | None:
    if not isinstance(record, GuidanceRecord) or (record.fmt, record.mode) != ("nvfp4", "compact"):
        return None
    return fast_path_for(x_train)


def rtn_with_record_scales(x_train: torch.Tensor, record: GuidanceRecord) -> torch.Tensor:
    """Plain round-to-nearest-even of x_train with the rollout's scales (the baseline that
    guidance improves on), forward only, in x_train.dtype."""
    with torch.no_grad():
        z, factor = _scaled(x_train, record)
        q = e2m1_to_f32(f32_to_e2m1(z))
        return _apply_scales(q, factor, record, x_train)


def record_values(record: GuidanceRecord) -> torch.Tensor:
    """Full records only: the rollout's dequantized tensor (fp32, record.shape)."""
    if record.mode != "full":
        raise ValueError(f"record_values needs a 'full' record, got mode {record.mode!r}")
    q_r = e2m1_to_f32(unpack_uint4(record.payload))
    _, factor = _factor(record)
    return (q_r.reshape(*factor.shape, -1) * factor.unsqueeze(-1)).reshape(record.shape)


# ------------------------------------------------------------------------------- internals


def _guided(x_train: torch.Tensor, record: GuidanceRecord) -> tuple[torch.Tensor, torch.Tensor]:
    """(q* [R, K/bs, bs] fp32 grid values, factor [R, K/bs] fp32)."""
    z, factor = _scaled(x_train, record)  # z: [R, nb, bs] in [-6, 6]
    if record.payload.device != z.device:  # a record captured elsewhere (e.g. on the CPU)
        record = record.to(z.device)
    grid = _table("magnitudes", z.device)  # [8] ascending
    mag = z.abs()
    # Bracket from the nearest grid point r: the other member lies on z's side of it
    # (r itself when z sits on the grid). Magnitude indices 0..7; their parity is the mantissa.
    r = rne_magnitude_index(mag).long()
    g_r = grid[r]
    above, below = (mag > g_r).long(), (mag < g_r).long()
    negative = z < 0
    if record.mode == "full":
        q_r = e2m1_to_f32(unpack_uint4(record.payload)).reshape(z.shape)
        g_lo, g_hi = grid[r - below], grid[r + above]  # magnitudes: g_lo <= |z| <= g_hi
        lo = torch.where(negative, -g_hi, g_lo)
        hi = torch.where(negative, -g_lo, g_hi)
        q_star = torch.minimum(torch.maximum(q_r, lo), hi)  # clamp(q_r, lo, hi)
    else:
        m_r = unpack_bits(record.payload).reshape(z.shape).long()
        # Adjacent magnitudes differ in their mantissa bit (= index parity): exactly one
        # bracket member carries the rollout's; a degenerate bracket (z on the grid) keeps r.
        other = r + above - below
        idx = torch.where((r & F4_E2M1_MANTISSA_BIT) == m_r, r, other)
        q_star = torch.where(negative, -grid[idx], grid[idx])
    return q_star + 0.0, factor  # + 0.0 turns -0.0 into +0.0, as the decode table


def check_guided_input(x_train: torch.Tensor, record: GuidanceRecord) -> GuidanceRecord:
    """Raise unless x_train can be guided by `record` (a supported float tensor of the
    record's shape, all finite); the record on x_train's device."""
    check_tensor(x_train, "x_train")
    if not isinstance(record, GuidanceRecord):
        raise TypeError(f"record must be a GuidanceRecord, got {type(record).__name__}")
    if tuple(x_train.shape) != record.shape:
        raise ValueError(
            f"x_train has shape {tuple(x_train.shape)} but the guidance record has shape "
            f"{record.shape} (use record.with_shape(...) if only the leading dims differ)"
        )
    check_finite(x_train, "x_train")
    return record.to(x_train.device) if record.payload.device != x_train.device else record


def _scaled(x_train: torch.Tensor, record: GuidanceRecord) -> tuple[torch.Tensor, torch.Tensor]:
    rec = check_guided_input(x_train, record)
    bs, factor = _factor(rec)
    x_blocks = x_train.float().reshape(rec.num_rows, rec.k // bs, bs)
    z = (x_blocks / factor.unsqueeze(-1)).clamp(-F4_E2M1_MAX, F4_E2M1_MAX)
    return z, factor


def _factor(record: GuidanceRecord) -> tuple[int, torch.Tensor]:
    """(block size, fp32 scale block * row [R, K/bs]) computed as the quantizers do."""
    if record.fmt == "nvfp4":
        scale_e4m3 = record.block_scales.view(torch.float8_e4m3fn)
        assert record.row_scales is not None
        return NVFP4_BLOCK_SIZE, nvfp4.effective_block_scale(scale_e4m3, record.row_scales[:, None])
    return MXFP4_BLOCK_SIZE, e8m0_to_f32(record.block_scales)


def _apply_scales(
    q: torch.Tensor, factor: torch.Tensor, record: GuidanceRecord, x_train: torch.Tensor
) -> torch.Tensor:
    return (q * factor.unsqueeze(-1)).reshape(x_train.shape).to(x_train.dtype)
