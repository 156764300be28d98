"""The policy-version delta codec: each encoding rebuilds the new bytes exactly, the encoder
picks the smallest, and a wrong base or a corrupted payload is refused by the CRC-32s."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trace_common.clients.tensors import raw_bytes
from trace_common.wire import weight_delta as delta
from trace_common.wire.checksum import crc32

RNG = np.random.default_rng(0)


def _pair(dtype: torch.dtype, n: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Raw bytes of a random tensor and of a copy with `fraction` of its elements changed."""
    g = torch.Generator().manual_seed(int(RNG.integers(1 << 30)))
    if dtype == torch.uint8:
        old = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    else:
        old = (torch.randn(n, generator=g) * 0.02).to(dtype)
    new = old.clone()
    idx = torch.randperm(n, generator=g)[: int(n * fraction)]
    if dtype == torch.uint8:
        new[idx] = new[idx] ^ 0x11  # every picked code changes
    else:  # every byte of each picked element changes (no byte plane is cheaper alone)
        new.view(torch.uint8).view(-1, old.element_size())[idx] ^= 0x11
    return raw_bytes(old).copy(), raw_bytes(new).copy()


def _small_step(dtype: torch.dtype, n: int, rel: float) -> tuple[np.ndarray, np.ndarray]:
    """A weight tensor before and after an Adam-like step: every value moves by about `rel`
    of its size, so low bytes change and sign and exponent seldom do."""
    g = torch.Generator().manual_seed(int(RNG.integers(1 << 30)))
    master = torch.randn(n, generator=g) * 0.02
    moved = master * (1 + rel * torch.randn(n, generator=g))
    return raw_bytes(master.to(dtype)).copy(), raw_bytes(moved.to(dtype)).copy()


def _apply(old: np.ndarray, new: np.ndarray, info, pieces, dtype: str) -> np.ndarray:
    payload = np.concatenate(pieces) if pieces else np.empty(0, np.uint8)
    return delta.apply(
        old, info, payload, dtype=dtype, nbytes=new.nbytes, crc=crc32(memoryview(new)), name="t"
    )


@pytest.mark.parametrize(
    ("dtype", "fraction", "kind"),
    [
        (torch.uint8, 0.0, delta.DeltaKind.SAME),
        (torch.uint8, 0.01, delta.DeltaKind.SPARSE),
        (torch.uint8, 0.15, delta.DeltaKind.BITMAP),
        (torch.uint8, 0.95, delta.DeltaKind.DENSE),
        (torch.bfloat16, 0.02, delta.DeltaKind.SPARSE),
        (torch.bfloat16, 0.3, delta.DeltaKind.BITMAP),
        (torch.float32, 0.02, delta.DeltaKind.SPARSE),
        (torch.float8_e4m3fn, 0.2, delta.DeltaKind.BITMAP),
    ],
)
def test_each_kind_rebuilds_exactly_and_is_the_smallest(
    dtype: torch.dtype, fraction: float, kind: delta.DeltaKind
) -> None:
    name = str(dtype).removeprefix("torch.")
    old, new = _pair(dtype, 40_000, fraction)
    info, pieces = delta.encode(old, new, name)
    width = delta.element_width(name, new.nbytes)
    n = new.nbytes // width
    assert info.kind == kind
    assert info.changed == int(n * fraction)
    assert info.payload_bytes == sum(p.nbytes for p in pieces)
    sizes = [delta.payload_size(k, n, info.changed, width) for k in delta.PLANE_KINDS[1:]]
    assert info.payload_bytes == (0 if kind == delta.DeltaKind.SAME else min(sizes))
    out = _apply(old, new, info, pieces, name)
    assert out.tobytes() == new.tobytes()
    assert out is not old and not np.shares_memory(out, old)  # the base stays as it was


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_small_step_of_wide_weights_travels_as_byte_planes(dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    old, new = _small_step(dtype, 50_000, 1e-2)
    info, pieces = delta.encode(old, new, name)
    width = delta.element_width(name, new.nbytes)
    n = new.nbytes // width
    assert info.kind == delta.DeltaKind.PLANES and len(info.planes) == width
    assert info.payload_bytes == sum(p.nbytes for p in pieces)
    whole = min(delta.payload_size(k, n, info.changed, width) for k in delta.PLANE_KINDS[1:])
    assert info.payload_bytes < 0.75 * whole, (info, whole)
    low, high = info.planes[0], info.planes[-1]
    assert low[0] in (delta.DeltaKind.BITMAP, delta.DeltaKind.DENSE)
    assert high[0] in (delta.DeltaKind.SAME, delta.DeltaKind.SPARSE) and high[1] < 0.05 * n
    out = _apply(old, new, info, pieces, name)
    assert out.tobytes() == new.tobytes() and not np.shares_memory(out, old)
    payload = np.concatenate(pieces)
    payload[-1] ^= 0x01  # the last plane's last byte
    with pytest.raises(delta.DeltaError, match="rebuilt bytes have crc32"):
        delta.apply(old, info, payload, dtype=name, nbytes=new.nbytes,
                    crc=crc32(memoryview(new)), name="t")  # fmt: skip


def test_malformed_byte_planes_name_the_problem() -> None:
    old, new = _small_step(torch.bfloat16, 1_000, 1e-2)
    info, pieces = delta.encode(old, new, "bfloat16")
    assert info.kind == delta.DeltaKind.PLANES
    payload = np.concatenate(pieces)
    args = {"dtype": "bfloat16", "nbytes": new.nbytes, "crc": 0, "name": "t"}
    one = delta.TensorDeltaInfo(info.kind, info.payload_bytes, info.changed, info.base_crc32,
                                info.planes[:1])  # fmt: skip
    with pytest.raises(delta.DeltaError, match="1 byte planes for 2-byte elements"):
        delta.apply(old, one, payload, **args)
    nested = ((delta.DeltaKind.PLANES, 1), info.planes[1])
    bad = delta.TensorDeltaInfo(info.kind, info.payload_bytes, info.changed, info.base_crc32,
                                nested)  # fmt: skip
    with pytest.raises(delta.DeltaError, match="a byte plane of kind PLANES"):
        delta.apply(old, bad, payload, **args)
    listed = delta.TensorDeltaInfo(delta.DeltaKind.DENSE, new.nbytes, 0, 0, info.planes)
    with pytest.raises(delta.DeltaError, match="a DENSE delta lists byte planes"):
        delta.apply(old, listed, new, **args)


def test_a_flipped_payload_byte_fails_the_crc() -> None:
    old, new = _pair(torch.uint8, 10_000, 0.01)
    info, pieces = delta.encode(old, new, "uint8")
    payload = np.concatenate(pieces)
    payload[-1] ^= 0x40  # a new value, not an index
    with pytest.raises(delta.DeltaError, match=r"tensor 't': rebuilt bytes have crc32"):
        delta.apply(old, info, payload, dtype="uint8", nbytes=new.nbytes,
                    crc=crc32(memoryview(new)), name="t")  # fmt: skip


def test_a_base_that_is_not_the_deltas_is_refused_before_rebuilding() -> None:
    old, new = _pair(torch.bfloat16, 10_000, 0.01)
    info, pieces = delta.encode(old, new, "bfloat16")
    other = old.copy()
    other[0] ^= 1
    with pytest.raises(delta.DeltaError, match="not the delta's base"):
        _apply(other, new, info, pieces, "bfloat16")
    with pytest.raises(delta.DeltaError, match="the base has no such tensor"):
        _apply(None, new, info, pieces, "bfloat16")


def test_malformed_payloads_name_the_problem() -> None:
    old, new = _pair(torch.uint8, 1_000, 0.01)
    info, pieces = delta.encode(old, new, "uint8")
    payload = np.concatenate(pieces)
    with pytest.raises(delta.DeltaError, match="payload is 49 bytes, manifest says 50"):
        delta.apply(old, info, payload[:-1], dtype="uint8", nbytes=new.nbytes, crc=0, name="t")
    bad = payload.copy()
    bad[:4] = np.frombuffer(np.uint32(5_000).tobytes(), np.uint8)  # index past the end
    with pytest.raises(delta.DeltaError, match="a delta index 5000 >= 1000"):
        delta.apply(old, info, bad, dtype="uint8", nbytes=new.nbytes, crc=0, name="t")
    lying = delta.TensorDeltaInfo(info.kind, info.payload_bytes, info.changed + 1, info.base_crc32)
    with pytest.raises(delta.DeltaError, match="SPARSE delta of 11 of 1000 elements is 55 bytes"):
        delta.apply(old, lying, payload, dtype="uint8", nbytes=new.nbytes, crc=0, name="t")


def test_dense_needs_no_base_and_odd_sizes_compare_bytewise() -> None:
    new = RNG.integers(0, 256, 7, dtype=np.uint8)  # 7 bytes of "bfloat16" cannot be pairs
    assert delta.element_width("bfloat16", 7) == 1
    info = delta.TensorDeltaInfo(delta.DeltaKind.DENSE, 7, 0, 0)
    out = delta.apply(
        None, info, new, dtype="bfloat16", nbytes=7, crc=crc32(memoryview(new)), name="t"
    )
    assert out.tobytes() == new.tobytes()
