"""Guidance records: size formula, byte round trip, bad buffers, row slicing/concatenation."""

from __future__ import annotations

import struct

import pytest
import torch

from trace_common.fp4 import nvfp4
from trace_common.fp4.guided import guided_quantize, record_values
from trace_common.fp4.record import (
    RECORD_MAGIC,
    GuidanceRecord,
    capture,
    concat_records,
    make_record,
    record_nbytes,
)

HEADER_BYTES = struct.calcsize("<4sHBBB")
DIM_BYTES = 8


@pytest.mark.parametrize(
    ("fmt", "mode", "k", "per_row"),
    [
        ("nvfp4", "compact", 2048, 2048 // 8 + 2048 // 16 + 4),  # 388 bytes per 2048-element row
        ("nvfp4", "full", 2048, 2048 // 2 + 2048 // 16 + 4),
        ("nvfp4", "compact", 16, 2 + 1 + 4),
        ("mxfp4", "compact", 64, 64 // 8 + 64 // 32),
        ("mxfp4", "full", 64, 64 // 2 + 64 // 32),
    ],
)
def test_nbytes_formula(fmt: str, mode: str, k: int, per_row: int) -> None:
    x = torch.randn(3, 2, k)
    _, rec = capture(x, fmt, mode)
    assert rec.nbytes == 6 * per_row == record_nbytes(fmt, mode, (3, 2, k))
    assert len(rec.to_bytes()) == HEADER_BYTES + 3 * DIM_BYTES + rec.nbytes


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("mode", ["full", "compact"])
@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (2, 3, 128)])
def test_bytes_round_trip(fmt: str, mode: str, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, dtype=torch.bfloat16)
    x_q, rec = capture(x, fmt, mode)
    back = GuidanceRecord.from_bytes(rec.to_bytes())
    assert (back.fmt, back.mode, back.shape) == (fmt, mode, shape)
    assert torch.equal(back.payload, rec.payload)
    assert torch.equal(back.block_scales, rec.block_scales)
    if fmt == "nvfp4":
        assert torch.equal(back.row_scales.view(torch.int32), rec.row_scales.view(torch.int32))
    else:
        assert back.row_scales is None
    assert torch.equal(guided_quantize(x, back), x_q)


def test_compact_payload_is_the_mantissa_bits_in_documented_order() -> None:
    # Scale 1 (global amax 2688, block amax 6): element i is the grid value we chose.
    vals = [6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.5]
    x = torch.tensor([[2688.0] + [0.0] * 15 + vals])
    rec = make_record(nvfp4.quantize(x), "compact")
    # mantissa bits of block 1: 1,1,0,1,0,1,0,1 | 1,0,0,0,0,0,0,1 ; element i -> bit i % 8
    assert rec.payload[0, 2:].tolist() == [0b1010_1011, 0b1000_0001]
    full = make_record(nvfp4.quantize(x), "full")
    assert full.payload[0, 8].item() == 0b0001_0111  # codes 6.0 (0b0111), 0.5 (0b0001)
    assert torch.equal(record_values(full), nvfp4.dequantize(nvfp4.quantize(x)))


def test_tensor_granularity_record_stores_scale_per_row() -> None:
    q = nvfp4.quantize(torch.randn(4, 32), scale_granularity="tensor")
    rec = make_record(q, "compact")
    assert rec.row_scales.shape == (4,)
    assert (rec.row_scales == q.per_tensor_scale).all()


def test_rows_and_concat_equal_per_token_capture() -> None:
    # Per-row scales make records token-separable: capturing tokens one by one and
    # concatenating equals capturing the whole sequence at once.
    x = torch.randn(6, 64) * torch.logspace(-1, 1, 6).unsqueeze(-1)
    for fmt in ("nvfp4", "mxfp4"):
        _, whole = capture(x, fmt, "compact")
        parts = [capture(x[t : t + 1], fmt, "compact")[1] for t in range(6)]
        joined = concat_records(parts)
        assert joined.to_bytes() == whole.to_bytes()
        sliced = whole.rows(2, 5)
        assert sliced.shape == (3, 64)
        assert sliced.to_bytes() == concat_records(parts[2:5]).to_bytes()
        assert whole.rows(3, 3).num_rows == 0


def test_rows_and_concat_errors() -> None:
    _, a = capture(torch.randn(2, 32), "nvfp4", "compact")
    _, b = capture(torch.randn(2, 32), "nvfp4", "full")
    _, c = capture(torch.randn(2, 64), "nvfp4", "compact")
    with pytest.raises(ValueError, match="out of range"):
        a.rows(1, 3)
    with pytest.raises(ValueError, match="none"):
        concat_records([])
    with pytest.raises(ValueError, match="record 1 is nvfp4/full"):
        concat_records([a, b])
    with pytest.raises(ValueError, match="K=64"):
        concat_records([a, c])


def _buf() -> bytes:
    return capture(torch.randn(2, 32), "nvfp4", "compact")[1].to_bytes()


def test_truncated_buffer() -> None:
    buf = _buf()
    with pytest.raises(ValueError, match=r"truncated.*needs a body of 20 bytes, the buffer has 19"):
        GuidanceRecord.from_bytes(buf[:-1])
    with pytest.raises(ValueError, match=r"truncated.*header alone"):
        GuidanceRecord.from_bytes(buf[:5])
    with pytest.raises(ValueError, match="oversized"):
        GuidanceRecord.from_bytes(buf + b"\0")


def test_bad_magic_version_format_mode() -> None:
    buf = bytearray(_buf())
    with pytest.raises(ValueError, match="magic b'XXXX'"):
        GuidanceRecord.from_bytes(b"XXXX" + bytes(buf[4:]))
    bad = bytearray(buf)
    bad[4:6] = (9).to_bytes(2, "little")
    with pytest.raises(ValueError, match="version 9 is not supported"):
        GuidanceRecord.from_bytes(bad)
    bad = bytearray(buf)
    bad[6] = 7
    with pytest.raises(ValueError, match="unknown format id 7"):
        GuidanceRecord.from_bytes(bad)
    bad = bytearray(buf)
    bad[7] = 5
    with pytest.raises(ValueError, match="unknown mode id 5"):
        GuidanceRecord.from_bytes(bad)
    assert bytes(buf[:4]) == RECORD_MAGIC


def test_bad_contents() -> None:
    _, rec = capture(torch.randn(2, 32), "nvfp4", "compact")
    nan_scale = GuidanceRecord(
        "nvfp4", "compact", rec.shape, rec.payload, rec.block_scales.clone(), rec.row_scales
    )
    nan_scale.block_scales[1, 0] = 0x7F
    with pytest.raises(ValueError, match="NaN nvfp4 block scale"):
        GuidanceRecord.from_bytes(nan_scale.to_bytes())
    neg = GuidanceRecord(
        "nvfp4", "compact", rec.shape, rec.payload, rec.block_scales, -rec.row_scales
    )
    with pytest.raises(ValueError, match="invalid row scale -"):
        GuidanceRecord.from_bytes(neg.to_bytes())
    with pytest.raises(ValueError, match="sections"):
        GuidanceRecord("nvfp4", "full", rec.shape, rec.payload, rec.block_scales, rec.row_scales)
    with pytest.raises(ValueError, match="unknown FP4 format 'int4'"):
        GuidanceRecord("int4", "full", rec.shape, rec.payload, rec.block_scales, None)
    with pytest.raises(ValueError, match="unknown guidance mode 'half'"):
        capture(torch.randn(2, 32), "nvfp4", "half")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_empty_record_round_trip(fmt: str) -> None:
    _, rec = capture(torch.randn(3, 64), fmt, "compact")
    empty = rec.rows(1, 1)
    assert empty.nbytes == 0
    back = GuidanceRecord.from_bytes(empty.to_bytes())
    assert back.shape == (0, 64) and back.num_rows == 0
    assert concat_records([empty, rec]).to_bytes() == rec.to_bytes()
