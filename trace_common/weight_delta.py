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

The encoder picks the smallest. The receiver rebuilds each tensor from its copy of the base
and checks the full tensor's CRC-32 from the version's manifest, so a corrupted delta, or a
base that is not what the sender thinks, never becomes a version. Torch-free (numpy), like
trace_common.tensor_wire: weight-sync applies deltas without importing torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from trace_common.checksum import crc32
from trace_common.tensor_wire import DTYPE_ITEMSIZE

INDEX_DTYPE = np.dtype("<u4")  # SPARSE element indices
MAX_SPARSE_ELEMENTS = 2**32  # tensors this large or larger use BITMAP or DENSE
_UINT = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


class DeltaKind(enum.IntEnum):
    SAME = 0
    SPARSE = 1
    BITMAP = 2
    DENSE = 3


class DeltaError(ValueError):
    """A delta that cannot be applied: wrong base, bad payload, or a CRC-32 mismatch."""


@dataclass(frozen=True, slots=True)
class TensorDeltaInfo:
    """What the manifest says of one tensor's delta (the TensorDelta message's fields)."""

    kind: DeltaKind
    payload_bytes: int
    changed: int
    base_crc32: int

    @classmethod
    def from_message(cls, msg) -> TensorDeltaInfo:
        return cls(DeltaKind(msg.kind), msg.payload_bytes, msg.changed, msg.base_crc32)

    def fields(self) -> dict[str, int]:
        """The TensorDelta message's fields: `pb.TensorDelta(**info.fields())`."""
        return {
            "kind": int(self.kind),
            "payload_bytes": self.payload_bytes,
            "changed": self.changed,
            "base_crc32": self.base_crc32,
        }


def element_width(dtype: str, nbytes: int) -> int:
    """The width (bytes) elements of `dtype` compare at: the dtype's size, 8 for wider ones."""
    width = min(DTYPE_ITEMSIZE.get(dtype, 1), 8)
    return width if nbytes % width == 0 else 1


def _elements(raw: np.ndarray, width: int) -> np.ndarray:
    return raw.view(_UINT[width])


def payload_size(kind: DeltaKind, elements: int, changed: int, width: int) -> int:
    """Bytes of a payload of `kind` for a tensor of `elements` elements, `changed` of them new."""
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
    candidates = [DeltaKind.BITMAP, DeltaKind.DENSE]
    if n < MAX_SPARSE_ELEMENTS:
        candidates.insert(0, DeltaKind.SPARSE)
    kind = min(candidates, key=lambda k: payload_size(k, n, changed, width))
    size = payload_size(kind, n, changed, width)
    if kind == DeltaKind.SPARSE:
        index = np.flatnonzero(mask)
        pieces = [index.astype(INDEX_DTYPE), new_e[index]]
    elif kind == DeltaKind.BITMAP:
        pieces = [np.packbits(mask, bitorder="little"), new_e[mask]]
    else:
        pieces = [new]
    pieces = [p.view(np.uint8).reshape(-1) for p in pieces]
    return TensorDeltaInfo(kind, size, changed, base_crc), pieces


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
    expected = payload_size(info.kind, n, info.changed, width)
    if info.payload_bytes != expected:
        raise DeltaError(
            f"tensor {name!r}: a {info.kind.name} delta of {info.changed} of {n} elements is "
            f"{expected} bytes, manifest says {info.payload_bytes}"
        )
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
        elements = _elements(out, width)
        if info.kind == DeltaKind.SPARSE:
            split = info.changed * INDEX_DTYPE.itemsize
            index = payload[:split].view(INDEX_DTYPE)
            if info.changed and int(index.max()) >= n:
                raise DeltaError(f"tensor {name!r}: a delta index {int(index.max())} >= {n}")
            elements[index] = payload[split:].view(_UINT[width])
        elif info.kind == DeltaKind.BITMAP:
            split = (n + 7) // 8
            mask = np.unpackbits(payload[:split], count=n, bitorder="little").view(bool)
            if int(np.count_nonzero(mask)) != info.changed:
                raise DeltaError(
                    f"tensor {name!r}: the bitmap sets {int(np.count_nonzero(mask))} elements, "
                    f"manifest says {info.changed}"
                )
            elements[mask] = payload[split:].view(_UINT[width])
    got = crc32(memoryview(out))
    if got != crc:
        raise DeltaError(
            f"tensor {name!r}: rebuilt bytes have crc32 {got:#010x}, manifest says {crc:#010x}"
        )
    return out
