"""The client side of policy-version deltas (trace_common.wire.weight_delta): the base a client
keeps, encoding a push against it, and rebuilding a pulled version from it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from trace_common.clients.tensors import (
    BytesAssembler,
    TensorAssembler,
    from_raw,
    raw_bytes,
    tensor_to_wire,
)
from trace_common.protos_gen.trace.common.v1 import common_pb2
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb
from trace_common.wire import weight_delta as delta

WORKERS = min(8, os.cpu_count() or 1)  # threads encoding or rebuilding tensors


@dataclass(frozen=True, slots=True)
class DeltaBase:
    """A version a client holds whole: each tensor's spec (with its CRC-32) and raw bytes."""

    version: int
    specs: Mapping[str, common_pb2.TensorSpec]
    raw: Mapping[str, np.ndarray]  # name -> uint8 bytes, never written after this is built

    @classmethod
    def shared(
        cls, version: int, tensors: Mapping[str, torch.Tensor], specs: list[common_pb2.TensorSpec]
    ) -> DeltaBase:
        """A base over `tensors` themselves (CPU, contiguous, as a pull returns them): the
        caller must not write into them."""
        return cls(
            version, {s.name: s for s in specs}, {s.name: raw_bytes(tensors[s.name]) for s in specs}
        )

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.raw.values())


def encode_version(
    version: int,
    tensors: Mapping[str, torch.Tensor],
    metadata_json: str,
    base: DeltaBase | None,
    *,
    keep: bool,
) -> tuple[pb.VersionHeader, list[np.ndarray | memoryview], DeltaBase | None]:
    """A push's header and each tensor's bytes: its raw bytes, or with `base` its delta payload
    against it (header.base_version and deltas set). With `keep`, also the base the next push
    can use: a copy of these tensors' bytes (the trainer may write into what it exported)."""
    header = pb.VersionHeader(version=version, metadata_json=metadata_json)
    if base is not None:
        header.base_version = base.version

    def one(item: tuple[str, torch.Tensor]) -> tuple:
        name, t = item
        spec, view = tensor_to_wire(name, t)
        new = np.frombuffer(view, dtype=np.uint8)
        kept = new.copy() if keep else None
        if base is None:
            return spec, None, view, kept
        old = base.specs.get(name)
        same_layout = old is not None and (old.dtype, list(old.shape)) == (
            spec.dtype,
            list(spec.shape),
        )
        info, payload = delta.encode_tensor(
            base.raw[name] if same_layout else None, new, spec.dtype,
            old.crc32 if same_layout else None,
        )  # fmt: skip
        return spec, info, payload, kept

    # numpy and the CRC release the GIL on large tensors: the tensors are encoded in parallel.
    with ThreadPoolExecutor(WORKERS) as pool:
        encoded = list(pool.map(one, tensors.items()))
    payloads: list[np.ndarray | memoryview] = []
    kept: dict[str, np.ndarray] = {}
    for spec, info, payload, copy in encoded:
        header.tensors.append(spec)
        header.total_bytes += spec.nbytes
        payloads.append(payload)
        if copy is not None:
            kept[spec.name] = copy
        if info is not None:
            header.deltas.append(pb.TensorDelta(**info.fields()))
            header.delta_bytes += info.payload_bytes
    if not keep:
        return header, payloads, None
    return header, payloads, DeltaBase(version, {s.name: s for s in header.tensors}, kept)


def assemblers(header: pb.VersionHeader) -> list[BytesAssembler]:
    """One receiver per tensor of a pulled header: its raw bytes, or its delta payload."""
    if not header.HasField("base_version"):
        return [TensorAssembler(spec) for spec in header.tensors]
    if len(header.deltas) != len(header.tensors):
        raise ValueError(
            f"version {header.version}: {len(header.deltas)} deltas for {len(header.tensors)} tensors"
        )
    return [
        BytesAssembler(s.name, d.payload_bytes)
        for s, d in zip(header.tensors, header.deltas, strict=True)
    ]


def rebuild(
    header: pb.VersionHeader, parts: list[BytesAssembler], base: DeltaBase | None
) -> dict[str, torch.Tensor]:
    """The pulled version's tensors, each checked against its CRC-32: as received, or rebuilt
    from `base` and the delta payloads (DeltaError when the delta is not against `base`, or a
    rebuilt tensor fails its check)."""
    if not header.HasField("base_version"):
        return {p.spec.name: p.tensor() for p in parts}  # type: ignore[attr-defined]
    if base is None or base.version != header.base_version:
        held = None if base is None else base.version
        raise delta.DeltaError(
            f"version {header.version} came as a delta against {header.base_version}; this client holds {held}"
        )
    out: dict[str, torch.Tensor] = {}
    for spec, d, part in zip(header.tensors, header.deltas, parts, strict=True):
        info = delta.TensorDeltaInfo.from_message(d)
        held = base.specs.get(spec.name)
        raw = delta.apply(
            base.raw.get(spec.name), info, part.array(),
            dtype=spec.dtype, nbytes=spec.nbytes, crc=spec.crc32, name=spec.name,
            base_crc=None if held is None else held.crc32,
        )  # fmt: skip
        out[spec.name] = from_raw(torch.from_numpy(raw), spec)
    return out


def push_stats(header: pb.VersionHeader) -> dict[str, object]:
    """What a pushed header sent: its bytes on the wire against the full version's, and for a
    delta the fraction of elements that changed by dtype (uint8: the packed FP4 code bytes,
    float8_e4m3fn: the block scales)."""
    delta_push = header.HasField("base_version")
    out: dict[str, object] = {
        "weight_push_bytes": header.delta_bytes if delta_push else header.total_bytes,
        "weight_push_full_bytes": header.total_bytes,
    }
    if delta_push:
        changed: dict[str, list[int]] = {}
        for spec, d in zip(header.tensors, header.deltas, strict=True):
            width = delta.element_width(spec.dtype, spec.nbytes)
            count = changed.setdefault(spec.dtype, [0, 0])
            count[0] += d.changed
            count[1] += spec.nbytes // width
        out["weight_changed_fraction"] = {k: c / max(n, 1) for k, (c, n) in sorted(changed.items())}
    return out
