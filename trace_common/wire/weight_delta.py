"""Policy-version deltas: send only the elements that changed since a version the receiver holds.

Between two RL steps most FP4 codes, block scales and even BF16 weights keep their bits: a
small learning rate moves few values across a rounding boundary. A delta of version v against
base b carries, per tensor, one of four encodings of its elements (the tensor's raw bytes
viewed as unsigned integers of its element width, so a BF16 weight compares as uint16 and a
packed FP4 byte as uint8):

    SAME    nothing: the tensor's bytes equal the base's
    SPARSE  uint32 element indices (ascending), then the new elements      n * (4 + w) bytes
    BITMAP  one bit per element (LSB first, numpy.packbits order), then    ceil(N / 8) + n * w
            the new elements of the set bits, in order
    DENSE   the raw bytes of the new tensor, as a full version sends them  N * w
    PLANES  each byte plane of the elements (plane j: byte j of every     sum of the planes'
            element, little-endian) as its own one-byte delta: SAME,
            SPARSE, BITMAP or DENSE, one after the other

PLANES is what a small update of wide elements needs: Adam moves every fp32 or BF16 weight a
little each step, which rewrites their low bytes but seldom their sign and exponent, so the
high planes travel as SAME or SPARSE. The encoder picks the smallest. The receiver rebuilds each tensor from its copy of the base
and checks the full tensor's CRC-32 from the version's manifest, so a corrupted delta, or a
base that is not what the sender thinks, never becomes a version. Torch-free (numpy), like
trace_common.wire.tensor_wire: weight-sync applies deltas without importing torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from trace_common.wire.checksum import crc32
from trace_common.wire.tensor_wire import DTYPE_ITEMSIZE

INDEX_DTYPE = np.dtype("<u4")  # SPARSE element indices
MAX_SPARSE_ELEMENTS = 2**32  # tensors this large or larger use BITMAP or DENSE
_UINT = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


class DeltaKind(enum.IntEnum):
    SAME = 0
    SPARSE = 1
    BITMAP = 2
    DENSE = 3
    PLANES = 4


PLANE_KINDS = (DeltaKind.SAME, DeltaKind.SPARSE, DeltaKind.BITMAP, DeltaKind.DENSE)


class DeltaError(ValueError):
    """A delta that cannot be applied: wrong base, bad payload, or a CRC-32 mismatch."""


@dataclass(frozen=True, slots=True)
class TensorDeltaInfo:
    """What the manifest says of one tensor's delta (the TensorDelta message's fields)."""

    kind: DeltaKind
    payload_bytes: int
    changed: int
    base_crc32: int
    planes: tuple[tuple[DeltaKind, int], ...] = ()  # PLANES: (kind, changed) per byte plane

    @classmethod
    def from_message(cls, msg) -> TensorDeltaInfo:
        planes = tuple((DeltaKind(p.kind), p.changed) for p in msg.planes)
        return cls(DeltaKind(msg.kind), msg.payload_bytes, msg.changed, msg.base_crc32, planes)

    def fields(self) -> dict[str, object]:
        """The TensorDelta message's fields: `pb.TensorDelta(**info.fields())`."""
        return {
            "kind": int(self.kind),
            "payload_bytes": self.payload_bytes,
            "changed": self.changed,
            "base_crc32": self.base_crc32,
            "planes": [{"kind": int(k), "changed": c} for k, c in self.planes],
        }


def element_width(dtype: str, nbytes: int) -> int:
    """The width (bytes) elements of `dtype` compare at: the dtype's size, 8 for wider ones."""
    width = min(DTYPE_ITEMSIZE.get(dtype, 1), 8)
    return width if nbytes % width == 0 else 1


def _elements(raw: np.ndarray, width: int) -> np.ndarray:
    return raw.view(_UINT[width])


def payload_size(
    kind: DeltaKind,
    elements: int,
    changed: int,
    width: int,
    planes: tuple[tuple[DeltaKind, int], ...] = (),
) -> int:
    """Bytes of a payload of `kind` for a tensor of `elements` elements, `changed` of them new
    (PLANES: the sum of its `planes`' one-byte payloads)."""
    if kind == DeltaKind.PLANES:
        return sum(payload_size(k, elements, c, 1) for k, c in planes)
    if kind == DeltaKind.SAME:
        return 0
    if kind == DeltaKind.SPARSE:
        return changed * (INDEX_DTYPE.itemsize + width)
    if kind == DeltaKind.BITMAP:
        return (elements + 7) // 8 + changed * width
    return elements * width


def encode(
    base: np.ndarray, new: np.ndarray, dtype: str, base_crc: int | None = None
) -> tuple[TensorDeltaInfo, list[np.ndarray]]:
    """The smallest delta rebuilding `new` from `base` (both uint8 arrays of the tensor's raw
    bytes, the same length): its manifest entry and payload pieces (concatenated in order)."""
    if base.nbytes != new.nbytes:
        raise DeltaError(f"base is {base.nbytes} bytes, the new tensor {new.nbytes}")
    width = element_width(dtype, new.nbytes)
    old_e, new_e = _elements(base, width), _elements(new, width)
    mask = old_e != new_e
    changed = int(np.count_nonzero(mask))
    n = new_e.size
    base_crc = crc32(memoryview(base)) if base_crc is None else base_crc
    if changed == 0:
        return TensorDeltaInfo(DeltaKind.SAME, 0, 0, base_crc), []
    kind = _smallest(n, changed, width)
    size = payload_size(kind, n, changed, width)
    if width > 1:
        planes = _plane_changes(old_e ^ new_e, width)
        plane_kinds = tuple((_smallest(n, c, 1), c) for c in planes)
        plane_size = payload_size(DeltaKind.PLANES, n, changed, width, plane_kinds)
        if plane_size < size:
            by_plane = new.reshape(-1, width)
            pieces: list[np.ndarray] = []
            for j, (k, _) in enumerate(plane_kinds):
                old_p, new_p = base.reshape(-1, width)[:, j], by_plane[:, j]
                pieces += _pieces(k, old_p != new_p, new_p, new_p)
            info = TensorDeltaInfo(DeltaKind.PLANES, plane_size, changed, base_crc, plane_kinds)
            return info, [p.view(np.uint8).reshape(-1) for p in pieces]
    pieces = _pieces(kind, mask, new_e, new)
    return TensorDeltaInfo(kind, size, changed, base_crc), [
        p.view(np.uint8).reshape(-1) for p in pieces
    ]


def _smallest(n: int, changed: int, width: int) -> DeltaKind:
    """The kind of the smallest payload for `changed` of `n` elements of `width` bytes."""
    if changed == 0:
        return DeltaKind.SAME
    candidates = [DeltaKind.BITMAP, DeltaKind.DENSE]
    if n < MAX_SPARSE_ELEMENTS:
        candidates.insert(0, DeltaKind.SPARSE)
    return min(candidates, key=lambda k: payload_size(k, n, changed, width))


def _plane_changes(diff: np.ndarray, width: int) -> list[int]:
    """Per byte plane j, how many elements of `diff` (old XOR new) have a nonzero byte j."""
    by_byte = diff.view(np.uint8).reshape(-1, width)
    return [int(np.count_nonzero(by_byte[:, j])) for j in range(width)]


def _pieces(kind: DeltaKind, mask: np.ndarray, new_e: np.ndarray,
            raw: np.ndarray) -> list[np.ndarray]:  # fmt: skip
    """The payload pieces of a SAME / SPARSE / BITMAP / DENSE delta: `mask` marks the changed
    elements of `new_e`; DENSE sends `raw` (the new elements' bytes)."""
    if kind == DeltaKind.SAME:
        return []
    if kind == DeltaKind.SPARSE:
        index = np.flatnonzero(mask)
        return [index.astype(INDEX_DTYPE), new_e[index]]
    if kind == DeltaKind.BITMAP:
        return [np.packbits(mask, bitorder="little"), new_e[mask]]
    return [np.ascontiguousarray(raw)]


def encode_tensor(
    base: np.ndarray | None, new: np.ndarray, dtype: str, base_crc: int | None = None
) -> tuple[TensorDeltaInfo, np.ndarray]:
    """`encode` with the payload as one array; with no base (the receiver's base lacks the
    tensor, or holds it with another dtype or shape) the tensor goes DENSE, every element new."""
    if base is None:
        n = new.nbytes // element_width(dtype, new.nbytes)
        return TensorDeltaInfo(DeltaKind.DENSE, new.nbytes, n, 0), new
    info, pieces = encode(base, new, dtype, base_crc)
    if len(pieces) == 1:
        return info, pieces[0]
    return info, np.concatenate(pieces) if pieces else new[:0]


def check_info(info: TensorDeltaInfo, elements: int, width: int, name: str) -> None:
    """DeltaError naming `name` unless the delta's kind, counts and payload size agree with a
    tensor of `elements` elements of `width` bytes."""
    if info.changed > elements:
        raise DeltaError(f"tensor {name!r}: changed={info.changed} > its {elements} elements")
    if info.kind == DeltaKind.PLANES:
        if len(info.planes) != width:
            raise DeltaError(f"tensor {name!r}: {len(info.planes)} byte planes for "
                             f"{width}-byte elements")  # fmt: skip
        for kind, changed in info.planes:
            if kind not in PLANE_KINDS or changed > elements:
                raise DeltaError(f"tensor {name!r}: a byte plane of kind {kind.name} with "
                                 f"changed={changed} of {elements} elements")  # fmt: skip
    elif info.planes:
        raise DeltaError(f"tensor {name!r}: a {info.kind.name} delta lists byte planes")
    expected = payload_size(info.kind, elements, info.changed, width, info.planes)
    if info.payload_bytes != expected:
        raise DeltaError(
            f"tensor {name!r}: a {info.kind.name} delta of {info.changed} of {elements} "
            f"elements is {expected} bytes, payload_bytes={info.payload_bytes}"
        )


def _update(elements: np.ndarray, kind: DeltaKind, changed: int, payload: np.ndarray,
            name: str) -> None:  # fmt: skip
    """Write a SAME / SPARSE / BITMAP / DENSE payload's new values into `elements` (a view:
    the tensor's elements, or one byte plane of them)."""
    n, values_dtype = elements.size, elements.dtype
    if kind == DeltaKind.SPARSE:
        split = changed * INDEX_DTYPE.itemsize
        index = payload[:split].view(INDEX_DTYPE)
        if changed and int(index.max()) >= n:
            raise DeltaError(f"tensor {name!r}: a delta index {int(index.max())} >= {n}")
        elements[index] = payload[split:].view(values_dtype)
    elif kind == DeltaKind.BITMAP:
        split = (n + 7) // 8
        mask = np.unpackbits(payload[:split], count=n, bitorder="little").view(bool)
        if int(np.count_nonzero(mask)) != changed:
            raise DeltaError(
                f"tensor {name!r}: the bitmap sets {int(np.count_nonzero(mask))} elements, "
                f"manifest says {changed}"
            )
        elements[mask] = payload[split:].view(values_dtype)
    elif kind == DeltaKind.DENSE:
        elements[:] = payload.view(values_dtype)


def apply(
    base: np.ndarray | None,
    info: TensorDeltaInfo,
    payload: np.ndarray,
    *,
    dtype: str,
    nbytes: int,
    crc: int,
    name: str,
    base_crc: int | None = None,
    in_place: bool = False,
) -> np.ndarray:
    """The new tensor's raw bytes (an array of `nbytes`) from `base` (None: the base lacks
    the tensor, so only DENSE applies) and one tensor's delta payload, checked against the
    full tensor's CRC-32 `crc`; DeltaError naming `name` when the base is not the delta's,
    the payload is malformed, or the result fails its CRC.

    `base_crc` is the base's CRC-32 as the caller knows it (its manifest; computed from the
    bytes when None). With `in_place` the changes are written into `base` itself (a buffer
    the caller owns and gives up) instead of into a copy."""
    width = element_width(dtype, nbytes)
    n = nbytes // width
    if payload.nbytes != info.payload_bytes:
        raise DeltaError(
            f"tensor {name!r}: delta payload is {payload.nbytes} bytes, manifest says {info.payload_bytes}"
        )
    check_info(info, n, width, name)
    if info.kind == DeltaKind.DENSE:
        out = payload.copy()
    else:
        if base is None or base.nbytes != nbytes:
            held = "no such tensor" if base is None else f"{base.nbytes} bytes"
            raise DeltaError(f"tensor {name!r}: a {info.kind.name} delta, but the base has {held}")
        held = crc32(memoryview(base)) if base_crc is None else base_crc
        if held != info.base_crc32:
            raise DeltaError(f"tensor {name!r}: the base held is not the delta's base (CRC-32)")
        out = base if in_place else base.copy()
        if info.kind == DeltaKind.PLANES:
            by_plane, offset = out.reshape(-1, width), 0
            for j, (kind, changed) in enumerate(info.planes):
                size = payload_size(kind, n, changed, 1)
                _update(by_plane[:, j], kind, changed, payload[offset : offset + size], name)
                offset += size
        else:
            _update(_elements(out, width), info.kind, info.changed, payload, name)
    got = crc32(memoryview(out))
    if got != crc:
        raise DeltaError(
            f"tensor {name!r}: rebuilt bytes have crc32 {got:#010x}, manifest says {crc:#010x}"
        )
    return out
