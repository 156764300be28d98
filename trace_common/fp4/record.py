"""Guidance records: what the FP4 rollout's quantizer produced for one tensor, and their bytes.

Rollout side: `capture(x)` (or `make_record(quantize(x))`) returns a `GuidanceRecord` with the
rollout's block scales, its per-row (per-token) fp32 scale, and either its 4-bit codes
("full") or only their mantissa bits ("compact"). The trainer's quantizer that follows a
record is `guided.guided_quantize`.

Byte layout of a record's body (`nbytes`, and `to_bytes` after a header):
  payload      full: K/2 bytes per row, packed codes (even element in the low nibble);
               compact: K/8 bytes per row, mantissa bit of element i at bit i % 8 of byte i // 8
  block scales 1 byte per block per row: e4m3fn bits (nvfp4) or E8M0 biased exponent (mxfp4)
  row scales   nvfp4 only: 4 bytes per row, little-endian fp32 (a per-tensor scale is stored
               once per row, so records of any granularity are row-separable)
So nvfp4 compact = K/8 + K/16 + 4 bytes per row, full = K/2 + K/16 + 4; mxfp4 compact =
K/8 + K/32, full = K/2 + K/32.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from trace_common.fp4 import mxfp4, nvfp4
from trace_common.fp4.constants import F4_E2M1_MANTISSA_BIT, MXFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE
from trace_common.fp4.e2m1 import pack_bits, unpack_uint4
from trace_common.fp4.mxfp4 import MXFP4Tensor
from trace_common.fp4.nvfp4 import NVFP4Tensor

GuidanceMode = Literal["full", "compact"]
GUIDANCE_MODES: tuple[str, ...] = ("full", "compact")

# --- serialized header: magic, version, format id, mode id, ndim, then ndim uint64 dims ---
RECORD_MAGIC = b"TRGR"
RECORD_VERSION = 1
_HEADER = struct.Struct("<4sHBBB")
_DIM = struct.Struct("<Q")
_FORMAT_IDS: dict[str, int] = {"nvfp4": 1, "mxfp4": 2}
_MODE_IDS: dict[str, int] = {"full": 0, "compact": 1}
_BLOCK_SIZES: dict[str, int] = {"nvfp4": NVFP4_BLOCK_SIZE, "mxfp4": MXFP4_BLOCK_SIZE}
_ROW_SCALE_BYTES = 4  # fp32
_E4M3_NAN_BITS = 0x7F  # |bits| == 0x7F is NaN in float8_e4m3fn
_SIGN_MASK_U8 = 0x7F
_E8M0_NAN_BITS = 0xFF
_CODES_PER_BYTE = 2
_BITS_PER_BYTE = 8


@dataclass(slots=True)
class GuidanceRecord:
    """What the rollout's quantizer produced for one tensor, enough to guide the trainer.

    fmt:          "nvfp4" | "mxfp4" (registry name)
    mode:         "full" | "compact"
    shape:        the guided tensor's shape (..., K); its leading dims flatten to R rows
    payload:      uint8 [R, K/2] packed codes (full) or [R, K/8] mantissa bits (compact)
    block_scales: uint8 [R, K/block]: e4m3fn bits (nvfp4) or E8M0 biased exponents (mxfp4)
    row_scales:   float32 [R] second-level scale per row (nvfp4), None for mxfp4
    """

    fmt: str
    mode: str
    shape: tuple[int, ...]
    payload: torch.Tensor
    block_scales: torch.Tensor
    row_scales: torch.Tensor | None

    def __post_init__(self) -> None:
        self.shape = tuple(int(d) for d in self.shape)
        _check_fmt_mode(self.fmt, self.mode)
        expected = _section_shapes(self.fmt, self.mode, self.shape)
        got = (
            tuple(self.payload.shape),
            tuple(self.block_scales.shape),
            None if self.row_scales is None else tuple(self.row_scales.shape),
        )
        if got != expected:
            raise ValueError(
                f"record sections (payload, block_scales, row_scales) have shapes {got}; "
                f"{self.fmt}/{self.mode} with shape {self.shape} needs {expected}"
            )
        for name, t, dtype in (
            ("payload", self.payload, torch.uint8),
            ("block_scales", self.block_scales, torch.uint8),
            ("row_scales", self.row_scales, torch.float32),
        ):
            if t is not None and t.dtype != dtype:
                raise TypeError(f"record {name} has dtype {t.dtype}, expected {dtype}")

    @property
    def num_rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def k(self) -> int:
        return self.shape[-1]

    @property
    def block_size(self) -> int:
        return _BLOCK_SIZES[self.fmt]

    @property
    def nbytes(self) -> int:
        """Body size in bytes (without the serialization header); see the module docstring."""
        return record_nbytes(self.fmt, self.mode, self.shape)

    def to(self, device: torch.device | str) -> GuidanceRecord:
        return GuidanceRecord(
            self.fmt,
            self.mode,
            self.shape,
            self.payload.to(device),
            self.block_scales.to(device),
            None if self.row_scales is None else self.row_scales.to(device),
        )

    def with_shape(self, shape: Sequence[int]) -> GuidanceRecord:
        """The same record for a tensor of another shape with the same rows and last dim."""
        shape = tuple(int(d) for d in shape)
        if not shape or shape[-1] != self.k or math.prod(shape[:-1]) != self.num_rows:
            raise ValueError(
                f"cannot view a record of shape {self.shape} as shape {shape}: needs last dim "
                f"{self.k} and {self.num_rows} rows"
            )
        return GuidanceRecord(
            self.fmt, self.mode, shape, self.payload, self.block_scales, self.row_scales
        )

    def rows(self, start: int, stop: int) -> GuidanceRecord:
        """Rows [start, stop) of the flattened rows, as a record of shape (stop - start, K)."""
        if not (0 <= start <= stop <= self.num_rows):
            raise ValueError(
                f"rows({start}, {stop}) out of range for a record with {self.num_rows} rows"
            )
        return GuidanceRecord(
            self.fmt,
            self.mode,
            (stop - start, self.k),
            self.payload[start:stop],
            self.block_scales[start:stop],
            None if self.row_scales is None else self.row_scales[start:stop],
        )

    def to_bytes(self) -> bytes:
        """Header (magic, version, format, mode, shape) followed by the body sections."""
        header = _HEADER.pack(
            RECORD_MAGIC,
            RECORD_VERSION,
            _FORMAT_IDS[self.fmt],
            _MODE_IDS[self.mode],
            len(self.shape),
        )
        dims = b"".join(_DIM.pack(d) for d in self.shape)
        parts = [header, dims, _u8_bytes(self.payload), _u8_bytes(self.block_scales)]
        if self.row_scales is not None:
            parts.append(self.row_scales.detach().cpu().numpy().astype("<f4").tobytes())
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, buf: bytes | bytearray | memoryview) -> GuidanceRecord:
        """Parse `to_bytes` output; ValueError naming the problem for a bad buffer."""
        buf = bytes(buf)
        if len(buf) < _HEADER.size:
            raise ValueError(
                f"truncated guidance record: {len(buf)} bytes, the header alone needs {_HEADER.size}"
            )
        magic, version, fmt_id, mode_id, ndim = _HEADER.unpack_from(buf, 0)
        check_magic_version("a guidance record", magic, version, RECORD_MAGIC, RECORD_VERSION)
        fmt = _lookup(_FORMAT_IDS, fmt_id, "format id")
        mode = _lookup(_MODE_IDS, mode_id, "mode id")
        if ndim == 0:
            raise ValueError("guidance record header has ndim 0; a record needs at least 1 dim")
        offset = _HEADER.size
        if len(buf) < offset + ndim * _DIM.size:
            raise ValueError(
                f"truncated guidance record: {len(buf)} bytes, the header with {ndim} dims "
                f"needs {offset + ndim * _DIM.size}"
            )
        shape = tuple(_DIM.unpack_from(buf, offset + i * _DIM.size)[0] for i in range(ndim))
        offset += ndim * _DIM.size
        _check_record_shape(fmt, shape)
        body = record_nbytes(fmt, mode, shape)
        if len(buf) - offset != body:
            what = "truncated" if len(buf) - offset < body else "oversized"
            raise ValueError(
                f"{what} guidance record: {fmt}/{mode} shape {shape} needs a body of {body} "
                f"bytes, the buffer has {len(buf) - offset}"
            )
        (pay_shape, scale_shape, row_shape) = _section_shapes(fmt, mode, shape)
        payload, offset = _take_u8(buf, offset, pay_shape)
        block_scales, offset = _take_u8(buf, offset, scale_shape)
        row_scales = None
        if row_shape is not None:
            n = row_shape[0]
            arr = np.frombuffer(buf, dtype="<f4", count=n, offset=offset).astype(np.float32)
            row_scales = torch.from_numpy(arr.copy())
            if n and not bool((torch.isfinite(row_scales) & (row_scales > 0)).all()):
                bad = row_scales[~(torch.isfinite(row_scales) & (row_scales > 0))][0].item()
                raise ValueError(f"guidance record has an invalid row scale {bad} (must be > 0)")
        _check_block_scale_bits(fmt, block_scales)
        return cls(fmt, mode, shape, payload, block_scales, row_scales)


def check_magic_version(
    what: str, magic: bytes, version: int, expected_magic: bytes, expected_version: int
) -> None:
    """Raise ValueError unless a serialized `what` ("a guidance record") starts with the
    expected magic and a version this build reads."""
    if magic != expected_magic:
        raise ValueError(f"not {what}: magic {magic!r}, expected {expected_magic!r}")
    if version != expected_version:
        raise ValueError(
            f"{what}: version {version} is not supported (this build reads version "
            f"{expected_version})"
        )


def record_nbytes(fmt: str, mode: str, shape: Sequence[int]) -> int:
    """Body bytes of a record: rows * (payload + block scales + row scale) per row."""
    _check_fmt_mode(fmt, mode)
    k = int(shape[-1])
    rows = math.prod(int(d) for d in shape[:-1])
    per_row = k // (_CODES_PER_BYTE if mode == "full" else _BITS_PER_BYTE)
    per_row += k // _BLOCK_SIZES[fmt]
    if fmt == "nvfp4":
        per_row += _ROW_SCALE_BYTES
    return rows * per_row


def concat_records(records: Sequence[GuidanceRecord]) -> GuidanceRecord:
    """Concatenate records along rows (tokens) into one of shape (sum of rows, K)."""
    if not records:
        raise ValueError("concat_records needs at least one record, got none")
    first = records[0]
    for i, r in enumerate(records):
        if (r.fmt, r.mode, r.k) != (first.fmt, first.mode, first.k):
            raise ValueError(
                f"record {i} is {r.fmt}/{r.mode} with K={r.k}; record 0 is "
                f"{first.fmt}/{first.mode} with K={first.k}"
            )
    device = first.payload.device
    return GuidanceRecord(
        first.fmt,
        first.mode,
        (sum(r.num_rows for r in records), first.k),
        torch.cat([r.payload.to(device) for r in records]),
        torch.cat([r.block_scales.to(device) for r in records]),
        None if first.row_scales is None else torch.cat([r.row_scales.to(device) for r in records]),  # type: ignore[union-attr]
    )


def make_record(q: NVFP4Tensor | MXFP4Tensor, mode: str = "compact") -> GuidanceRecord:
    """Build the record of a quantized tensor (what the rollout's quantizer produced)."""
    if isinstance(q, NVFP4Tensor):
        fmt = "nvfp4"
    elif isinstance(q, MXFP4Tensor):
        fmt = "mxfp4"
    else:
        raise TypeError(
            f"make_record expects an NVFP4Tensor or MXFP4Tensor, got {type(q).__name__}"
        )
    _check_fmt_mode(fmt, mode)
    shape = tuple(q.shape)
    rows, k = math.prod(shape[:-1]), shape[-1]
    qdata = q.qdata.reshape(rows, k // _CODES_PER_BYTE)
    # full: the packed codes [R, K/2]; compact: their mantissa bits, bit-packed [R, K/8]
    mantissa = unpack_uint4(qdata) & F4_E2M1_MANTISSA_BIT
    payload = qdata if mode == "full" else pack_bits(mantissa)
    if fmt == "nvfp4":
        block_scales = q.scale.view(torch.uint8).reshape(rows, k // NVFP4_BLOCK_SIZE)
        row_scales = q.per_tensor_scale.to(torch.float32).expand(*shape[:-1], 1).reshape(rows)
        row_scales = row_scales.contiguous()
    else:
        block_scales = q.scale.reshape(rows, k // MXFP4_BLOCK_SIZE)
        row_scales = None
    return GuidanceRecord(
        fmt, mode, shape, payload.contiguous(), block_scales.contiguous(), row_scales
    )


def capture(
    x: torch.Tensor, fmt: str = "nvfp4", mode: str = "compact"
) -> tuple[torch.Tensor, GuidanceRecord]:
    """Rollout side: quantize x (NVFP4 with per-row scales, or MXFP4) and record it.

    Returns (dequantized x in x.dtype, record).
    """
    _check_fmt_mode(fmt, mode)
    q = nvfp4.quantize(x, scale_granularity="row") if fmt == "nvfp4" else mxfp4.quantize(x)
    x_q = q.dequantize(x.dtype)
    return x_q, make_record(q, mode)


def _check_fmt_mode(fmt: str, mode: str) -> None:
    if fmt not in _FORMAT_IDS:
        raise ValueError(
            f"unknown FP4 format {fmt!r} for a guidance record; known: {sorted(_FORMAT_IDS)}"
        )
    if mode not in GUIDANCE_MODES:
        raise ValueError(f"unknown guidance mode {mode!r}; expected one of {GUIDANCE_MODES}")


def _check_record_shape(fmt: str, shape: tuple[int, ...]) -> None:
    if not shape or shape[-1] <= 0 or shape[-1] % _BLOCK_SIZES[fmt] != 0:
        raise ValueError(
            f"guidance record shape {shape}: last dim must be a positive multiple of the "
            f"{fmt} block size {_BLOCK_SIZES[fmt]}"
        )


def _section_shapes(
    fmt: str, mode: str, shape: tuple[int, ...]
) -> tuple[tuple[int, int], tuple[int, int], tuple[int] | None]:
    _check_record_shape(fmt, shape)
    rows, k = math.prod(shape[:-1]), shape[-1]
    per_row = k // (_CODES_PER_BYTE if mode == "full" else _BITS_PER_BYTE)
    row_shape = (rows,) if fmt == "nvfp4" else None
    return (rows, per_row), (rows, k // _BLOCK_SIZES[fmt]), row_shape


def _check_block_scale_bits(fmt: str, block_scales: torch.Tensor) -> None:
    if not block_scales.numel():
        return
    if fmt == "nvfp4":
        bad = (block_scales & _SIGN_MASK_U8) == _E4M3_NAN_BITS
    else:
        bad = block_scales == _E8M0_NAN_BITS
    if bool(bad.any()):
        value = int(block_scales[bad][0])
        raise ValueError(f"guidance record has a NaN {fmt} block scale (byte 0x{value:02X})")


def _lookup(table: dict[str, int], value: int, what: str) -> str:
    for name, ident in table.items():
        if ident == value:
            return name
    raise ValueError(f"guidance record has unknown {what} {value}; known: {table}")


def _u8_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().numpy().tobytes()


def _take_u8(buf: bytes, offset: int, shape: tuple[int, int]) -> tuple[torch.Tensor, int]:
    n = shape[0] * shape[1]
    arr = np.frombuffer(buf, dtype=np.uint8, count=n, offset=offset).copy()
    return torch.from_numpy(arr).reshape(shape), offset + n
