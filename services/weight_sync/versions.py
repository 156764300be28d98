"""In-memory store of complete policy versions (the last K) with atomic publish.

A push assembles into a private `PendingVersion`; only `VersionStore.publish`, called after
every tensor arrived and matched its CRC-32, makes it visible, under one lock. Readers see
either the whole version or nothing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np

from trace_common.protos_gen.trace.common.v1 import common_pb2
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb
from trace_common.service import (
    ServiceError,
    check_non_negative,
    exhausted,
    failed_precondition,
    invalid,
    not_found,
)
from trace_common.wire import weight_delta as delta
from trace_common.wire.checksum import crc32
from trace_common.wire.chunk_wire import ChunkView, chunk_codec, encode_chunk
from trace_common.wire.tensor_wire import expected_nbytes

_PULL_DECODE, _ = chunk_codec(pb.PullChunk)
# Largest version a push may publish, and so the largest a replica can hold: versions are
# exported as Prometheus samples (float64, exact integers up to 2**53), and with this bound
# `latest - version_held` (ListReplicas' version_lag) always fits its int64.
MAX_POLICY_VERSION = 2**53 - 1


# Rebuilds the tensors of delta pushes while the push streams in (numpy, CRC-32 and the
# copies release the GIL on large tensors).
_REBUILD_POOL = ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="ws-rebuild")

# A pull gets a delta only when it is at most this fraction of the full version's bytes:
# rebuilding costs the puller a pass over its base, which a near-full delta does not repay.
DELTA_WORTH = 0.8
DELTAS_KEPT = 2  # deltas a version keeps, against its most recently asked-for bases


def _views_by_tensor(chunks: list[bytes], count: int) -> list[list[memoryview]]:
    """Each tensor's data views, in order, from PullChunk wire bytes (no copies)."""
    out: list[list[memoryview]] = [[] for _ in range(count)]
    for raw in chunks:
        view = _PULL_DECODE(raw)
        out[view.tensor_index].append(view.data)
    return out


def _joined(views: list[memoryview]) -> tuple[np.ndarray, bool]:
    """One tensor's bytes as a uint8 array, and whether it is a fresh one (a copy, joined from
    several chunks) rather than a read-only view of the one chunk they sit in."""
    if len(views) == 1:
        return np.frombuffer(views[0], dtype=np.uint8), False
    if not views:
        return np.empty(0, dtype=np.uint8), True
    return np.concatenate([np.frombuffer(v, dtype=np.uint8) for v in views]), True


def _chunked(index: int, data: np.ndarray | memoryview, chunk_bytes: int) -> list[bytes]:
    view = memoryview(data).cast("B")
    return [
        encode_chunk(index, off, view[off : off + chunk_bytes])
        for off in range(0, len(view), chunk_bytes)
    ]


@dataclass(slots=True)
class StoredDelta:
    """A version as a delta against `base`: the header (with its deltas) and the payloads
    as PullChunk wire bytes, sent as they are on either pull path."""

    header: pb.VersionHeader
    chunks: list[bytes]
    _views: list[memoryview] | None = field(default=None, repr=False)

    @property
    def wire_bytes(self) -> int:
        return self.header.delta_bytes

    def data_views(self) -> list[memoryview]:
        if self._views is None:
            self._views = [_PULL_DECODE(raw).data for raw in self.chunks]
        return self._views


@dataclass(slots=True)
class StoredVersion:
    header: pb.VersionHeader
    # The PullVersion messages after the header, serialized (PullChunk wire bytes), built
    # once at push and shared by every puller: no per-pull copies or serialization; they
    # hold the only copy of the bytes.
    chunks: list[bytes]
    published_at: float = field(default_factory=time.time)
    # Deltas of this version against others (base version -> delta), the newest last.
    deltas: OrderedDict[int, StoredDelta] = field(default_factory=OrderedDict)
    _views: list[memoryview] | None = field(default=None, repr=False)
    _by_tensor: list[list[memoryview]] | None = field(default=None, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @property
    def version(self) -> int:
        return self.header.version

    @property
    def wire_bytes(self) -> int:
        return self.header.total_bytes

    def data_views(self) -> list[memoryview]:
        """The tensor bytes of every chunk, in manifest order (views into `chunks`, no
        copies): what the data plane sends. Decoded once, at the first data-plane pull."""
        if self._views is None:
            self._views = [_PULL_DECODE(raw).data for raw in self.chunks]
        return self._views

    def tensor_bytes(self, index: int) -> tuple[np.ndarray, bool]:
        """Tensor `index`'s raw bytes (uint8; a read-only view into the chunks where it fits
        one), and whether the array is a copy the caller may write into."""
        with self._lock:
            if self._by_tensor is None:
                self._by_tensor = _views_by_tensor(self.chunks, len(self.header.tensors))
        return _joined(self._by_tensor[index])

    def delta_against(self, base: StoredVersion, chunk_bytes: int) -> StoredDelta | None:
        """This version as a delta against `base` (computed at the first ask, then kept), or
        None when the delta would not be worth sending (DELTA_WORTH)."""
        with self._lock:
            if base.version in self.deltas:
                self.deltas.move_to_end(base.version)
                return self.deltas[base.version]
            base_index = {spec.name: i for i, spec in enumerate(base.header.tensors)}
            header = pb.VersionHeader()
            header.CopyFrom(self.header)
            header.base_version = base.version
            chunks: list[bytes] = []
            for i, spec in enumerate(self.header.tensors):
                j = base_index.get(spec.name)
                new, _ = self.tensor_bytes(i)
                old_spec = None if j is None else base.header.tensors[j]
                same_layout = old_spec is not None and (old_spec.dtype, old_spec.shape) == (
                    spec.dtype, spec.shape)  # fmt: skip
                info, payload = delta.encode_tensor(
                    base.tensor_bytes(j)[0] if same_layout else None, new, spec.dtype,
                    old_spec.crc32 if same_layout else None,
                )  # fmt: skip
                header.deltas.append(pb.TensorDelta(**info.fields()))
                header.delta_bytes += info.payload_bytes
                if payload.nbytes:
                    chunks.extend(_chunked(i, payload, chunk_bytes))
            if header.delta_bytes > DELTA_WORTH * self.header.total_bytes:
                return None
            stored = StoredDelta(header, chunks)
            self.keep_delta(base.version, stored)
            return stored

    def keep_delta(self, base_version: int, stored: StoredDelta) -> None:
        self.deltas[base_version] = stored
        while len(self.deltas) > DELTAS_KEPT:
            self.deltas.popitem(last=False)

    def info(self) -> common_pb2.PolicyVersionInfo:
        h = self.header
        return common_pb2.PolicyVersionInfo(
            version=h.version,
            total_bytes=h.total_bytes,
            num_tensors=len(h.tensors),
            metadata_json=h.metadata_json,
            published_at=self.published_at,
        )


MAX_DELTA_PLANES = 8  # byte planes of a PLANES delta: one per byte of the widest element


def check_delta_manifest(header: pb.VersionHeader, base: pb.VersionHeader | None) -> None:
    """INVALID_ARGUMENT naming what is wrong with a delta header's deltas (the tensors are
    checked as in a full version); `base` is the base's header, when it is held."""
    if len(header.deltas) != len(header.tensors):
        raise invalid(
            f"version {header.version}: {len(header.deltas)} deltas for {len(header.tensors)} tensors"
        )
    by_name = {} if base is None else {t.name: t for t in base.tensors}
    total = 0
    for spec, d in zip(header.tensors, header.deltas, strict=True):
        known = delta.DeltaKind._value2member_map_
        for k in (d.kind, *(p.kind for p in d.planes)):
            if k not in known:
                raise invalid(f"tensor {spec.name!r}: unknown delta kind {k}")
        if len(d.planes) > MAX_DELTA_PLANES:
            raise invalid(f"tensor {spec.name!r}: {len(d.planes)} byte planes > {MAX_DELTA_PLANES}")
        info = delta.TensorDeltaInfo.from_message(d)
        kind = info.kind
        width = delta.element_width(spec.dtype, spec.nbytes)
        try:
            delta.check_info(info, spec.nbytes // width, width, spec.name)
        except delta.DeltaError as exc:
            raise invalid(str(exc)) from None
        if kind != delta.DeltaKind.DENSE and base is not None:
            old = by_name.get(spec.name)
            if old is None or (old.dtype, list(old.shape)) != (spec.dtype, list(spec.shape)):
                raise invalid(
                    f"tensor {spec.name!r}: a {kind.name} delta, but base version "
                    f"{base.version} has no {spec.dtype}{list(spec.shape)} tensor of that name"
                )
        total += d.payload_bytes
    if total != header.delta_bytes:
        raise invalid(f"delta_bytes={header.delta_bytes} but the deltas sum to {total}")


def check_manifest(header: pb.VersionHeader, max_version_bytes: int) -> None:
    """A push's or an offer's manifest: version in range, metadata a JSON object, tensors
    named once each with sizes that match their dtype and shape (INVALID_ARGUMENT), and the
    whole within `max_version_bytes` (RESOURCE_EXHAUSTED)."""
    check_non_negative("version", header.version)
    if header.version > MAX_POLICY_VERSION:
        raise invalid(f"version={header.version} is over the largest version {MAX_POLICY_VERSION}")
    if not header.tensors:
        raise invalid(f"version {header.version}: the manifest lists no tensors")
    try:
        meta = json.loads(header.metadata_json or "{}")
    except json.JSONDecodeError as exc:
        raise invalid(f"metadata_json is not valid JSON: {exc}") from exc
    if not isinstance(meta, dict):
        raise invalid(f"metadata_json must be a JSON object, got {type(meta).__name__}")
    names: set[str] = set()
    total = 0
    for spec in header.tensors:
        if not spec.name:
            raise invalid("a tensor has an empty name")
        if spec.name in names:
            raise invalid(f"tensor name {spec.name!r} appears twice")
        names.add(spec.name)
        try:
            nbytes = expected_nbytes(spec.dtype, spec.shape)
        except ValueError as exc:
            raise invalid(f"tensor {spec.name!r}: {exc}") from exc
        if nbytes != spec.nbytes:
            raise invalid(
                f"tensor {spec.name!r}: nbytes={spec.nbytes} but {spec.dtype}{list(spec.shape)} is {nbytes} bytes"
            )
        total += nbytes
    if total != header.total_bytes:
        raise invalid(f"total_bytes={header.total_bytes} but the tensors sum to {total}")
    if total > max_version_bytes:
        raise exhausted(
            f"version {header.version} is {total} bytes, over max_version_bytes={max_version_bytes}"
        )


class PendingVersion:
    """A version being pushed: validates the manifest, then each chunk, in order.

    A push whose header sets `base_version` carries each tensor's delta payload against
    `base` (the stored base version); each tensor is rebuilt from it as its payload completes
    and checked against the manifest's CRC-32 (DATA_LOSS otherwise), and the delta is kept
    for pulls from replicas that hold the base."""

    def __init__(
        self,
        header: pb.VersionHeader,
        max_version_bytes: int,
        base: StoredVersion | None = None,
        chunk_bytes: int = 1 << 20,
    ) -> None:
        check_manifest(header, max_version_bytes)
        self.is_delta = header.HasField("base_version")
        if self.is_delta:
            check_delta_manifest(header, None if base is None else base.header)
            if base is None or base.version != header.base_version:
                raise ValueError("a delta push needs its base version")
            if header.delta_bytes > max_version_bytes:
                raise exhausted(
                    f"version {header.version}'s delta is {header.delta_bytes} bytes, over max_version_bytes={max_version_bytes}"
                )
            self._lengths = [d.payload_bytes for d in header.deltas]
            self._base = base
            self._base_index = {t.name: i for i, t in enumerate(base.header.tensors)}
        else:
            if header.deltas or header.delta_bytes:
                raise invalid("deltas are set but base_version is not")
            self._lengths = [spec.nbytes for spec in header.tensors]
        self.header = header
        self.chunk_bytes = chunk_bytes
        # Received chunks become the PullVersion messages as they are (a pushed chunk's wire
        # bytes are a valid PullChunk: chunk_wire); the CRC-32 of each tensor runs over its
        # chunks. A delta push's chunks are its payloads; the rebuilt tensors are re-chunked.
        self.chunks: list[bytes] = []
        self.delta_chunks: list[bytes] = []
        self._payload: list[memoryview] = []
        self._rebuilt: list[Future[list[bytes]]] = []
        self._index = 0
        self._received = 0
        self._crc = 0
        self._skip_empty()

    @property
    def wire_bytes(self) -> int:
        return self.header.delta_bytes if self.is_delta else self.header.total_bytes

    def _skip_empty(self) -> None:
        while self._index < len(self._lengths) and self._received == self._lengths[self._index]:
            self._complete(self._index)
            self._index += 1
            self._received = 0
            self._crc = 0
            self._payload = []

    def _complete(self, index: int) -> None:
        spec = self.header.tensors[index]
        if not self.is_delta:
            if self._crc != spec.crc32:
                raise ServiceError(
                    grpc.StatusCode.DATA_LOSS,
                    f"tensor {spec.name!r}: crc32 {self._crc:#010x} of received bytes != declared {spec.crc32:#010x}",
                )
            return
        # Rebuilt on the pool while the next tensors arrive; finish() collects them in order.
        self._rebuilt.append(_REBUILD_POOL.submit(self._rebuild, index, list(self._payload)))

    def _rebuild(self, index: int, payload: list[memoryview]) -> list[bytes]:
        spec = self.header.tensors[index]
        info = delta.TensorDeltaInfo.from_message(self.header.deltas[index])
        base_i = self._base_index.get(spec.name)
        base, fresh, base_crc = None, False, None
        if base_i is not None:
            base, fresh = self._base.tensor_bytes(base_i)
            base_crc = self._base.header.tensors[base_i].crc32
        try:
            rebuilt = delta.apply(
                base, info, _joined(payload)[0],
                dtype=spec.dtype, nbytes=spec.nbytes, crc=spec.crc32, name=spec.name,
                base_crc=base_crc, in_place=fresh,
            )  # fmt: skip
        except delta.DeltaError as exc:
            raise ServiceError(
                grpc.StatusCode.DATA_LOSS,
                f"delta against version {self._base.version}: {exc}; push the full version",
            ) from exc
        return _chunked(index, rebuilt, self.chunk_bytes) if rebuilt.nbytes else []

    def add(self, chunk: pb.TensorChunk | ChunkView, chunk_bytes: int) -> None:
        """Check and keep one chunk (re-cut to at most `chunk_bytes` for pulls).

        A ChunkView (chunk_wire's PushVersion deserializer) of at most `chunk_bytes` is
        kept as the bytes it arrived in, without a copy."""
        lengths = self._lengths
        if self._index >= len(lengths):
            raise invalid(
                f"chunk for tensor {chunk.tensor_index} after all {len(lengths)} tensors are complete"
            )
        if chunk.tensor_index != self._index or chunk.offset != self._received:
            raise invalid(
                f"out-of-order chunk: tensor_index={chunk.tensor_index} offset={chunk.offset}, expected tensor {self._index} offset {self._received}"
            )
        data = chunk.data
        n = len(data)
        spec = self.header.tensors[self._index]
        if self._received + n > lengths[self._index]:
            what = "payload_bytes" if self.is_delta else "nbytes"
            raise invalid(f"tensor {spec.name!r}: chunk overruns {what}={lengths[self._index]}")
        kept = self.delta_chunks if self.is_delta else self.chunks
        if self.is_delta:
            self._payload.append(memoryview(data))
        else:
            self._crc = crc32(data, self._crc)
        if n and n <= chunk_bytes and isinstance(chunk, ChunkView):
            kept.append(chunk.raw)
        elif n:
            for off in range(0, n, chunk_bytes):
                piece = data if n <= chunk_bytes else data[off : off + chunk_bytes]
                kept.append(encode_chunk(self._index, self._received + off, piece))
        self._received += n
        self._skip_empty()

    def finish(self) -> StoredVersion:
        """The complete, verified version (INVALID_ARGUMENT if the stream stopped early)."""
        specs = self.header.tensors
        if self._index < len(specs):
            spec = specs[self._index]
            raise invalid(
                f"version {self.header.version}: stream ended in tensor {self._index} of {len(specs)} ({spec.name!r}, {self._received} of {self._lengths[self._index]} bytes); not published"
            )
        if not self.is_delta:
            return StoredVersion(self.header, self.chunks)
        for done in self._rebuilt:
            self.chunks.extend(done.result())  # in manifest order; raises DATA_LOSS
        full = pb.VersionHeader()
        full.CopyFrom(self.header)
        full.ClearField("base_version")
        full.ClearField("deltas")
        full.ClearField("delta_bytes")
        stored = StoredVersion(full, self.chunks)
        stored.keep_delta(self._base.version, StoredDelta(self.header, self.delta_chunks))
        return stored


@dataclass(slots=True)
class Offer:
    """A version's bytes offered by the trainer before its push completes: in GPU memory
    over CUDA IPC for replicas on its node (`buffer`), and/or in a broadcast to the members
    of a process group (`broadcast`). The manifest and where the bytes are; weight-sync
    never touches the bytes."""

    header: pb.VersionHeader
    buffer: pb.CudaIpcBuffer | None = None
    broadcast: pb.BroadcastGroup | None = None

    @property
    def ipc_node(self) -> str:
        return "" if self.buffer is None else self.buffer.node_id

    def info(self, *, offer_only: bool) -> common_pb2.PolicyVersionInfo:
        h = self.header
        info = common_pb2.PolicyVersionInfo(
            version=h.version, total_bytes=h.total_bytes, num_tensors=len(h.tensors),
            metadata_json=h.metadata_json, cuda_ipc_node=self.ipc_node, offer_only=offer_only,
        )  # fmt: skip
        if offer_only and self.broadcast is not None:
            # Only while the push runs: once it completes the broadcast is over, whoever
            # joined it, and a member that hears of the version only then pulls it.
            info.broadcast_group_id = self.broadcast.group_id
        return info


# Offers kept beyond the complete versions kept: the versions being pushed behind them.
OFFERS_AHEAD = 2


def notice_rank(info: common_pb2.PolicyVersionInfo) -> int:
    """Order of Subscribe's notices: by version, an offer before the complete version."""
    return 2 * info.version + (0 if info.offer_only else 1)


class VersionStore:
    """The last `keep` complete versions; `publish` is atomic and notifies waiters. Also the
    offers (CUDA IPC, broadcast) of the kept versions and of the few being pushed behind them."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._versions: OrderedDict[int, StoredVersion] = OrderedDict()
        self._pushing: set[int] = set()
        self._offers: OrderedDict[int, Offer] = OrderedDict()
        self._cond = threading.Condition()
        self.closed = False

    def latest(self) -> StoredVersion | None:
        with self._cond:
            return next(reversed(self._versions.values()), None)

    def latest_version(self) -> int:
        latest = self.latest()
        return -1 if latest is None else latest.version

    def get(self, version: int | None) -> StoredVersion:
        with self._cond:
            if version is None:
                if not self._versions:
                    raise not_found("no version has been published yet")
                return next(reversed(self._versions.values()))
            if version not in self._versions:
                raise not_found(f"version {version} is not available; kept: {list(self._versions)}")
            return self._versions[version]

    def find(self, version: int) -> StoredVersion | None:
        """The stored `version`, or None when it is not kept."""
        with self._cond:
            return self._versions.get(version)

    def all(self) -> list[StoredVersion]:
        with self._cond:
            return list(self._versions.values())

    def begin_push(self, version: int) -> None:
        """Reserve `version` for one push; stale or concurrent pushes: FAILED_PRECONDITION."""
        with self._cond:
            latest = next(reversed(self._versions), -1)
            if version <= latest:
                raise failed_precondition(
                    f"version {version} is not newer than the latest published version {latest}"
                )
            if version in self._pushing:
                raise failed_precondition(f"version {version} is already being pushed")
            self._pushing.add(version)

    def abort_push(self, version: int) -> None:
        with self._cond:
            self._pushing.discard(version)

    def publish(self, stored: StoredVersion) -> list[int]:
        """Make `stored` visible; drop the oldest beyond `keep`; return dropped versions."""
        with self._cond:
            self._pushing.discard(stored.version)
            latest = next(reversed(self._versions), -1)
            if stored.version <= latest:
                raise failed_precondition(
                    f"version {stored.version} is not newer than {latest} (published meanwhile)"
                )
            stored.published_at = time.time()
            self._versions[stored.version] = stored
            dropped = []
            while len(self._versions) > self.keep:
                dropped.append(self._versions.popitem(last=False)[0])
            self._trim_offers()
            self._cond.notify_all()
            return dropped

    def offer(self, offer: Offer) -> None:
        """Hold `offer` (replacing one of the same version); FAILED_PRECONDITION when its
        version is older than the latest complete one (a republish offers that one again)."""
        version = offer.header.version
        with self._cond:
            latest = next(reversed(self._versions), -1)
            if version < latest:
                raise failed_precondition(
                    f"version {version} is older than the latest published version {latest}"
                )
            self._offers.pop(version, None)
            self._offers[version] = offer
            self._offers = OrderedDict(sorted(self._offers.items()))
            self._trim_offers()
            self._cond.notify_all()

    def _trim_offers(self) -> None:
        oldest = next(iter(self._versions), -1)
        for v in [v for v in self._offers if v < oldest]:
            del self._offers[v]
        while len(self._offers) > self.keep + OFFERS_AHEAD:
            self._offers.popitem(last=False)

    def offer_for(self, version: int) -> Offer | None:
        with self._cond:
            return self._offers.get(version)

    def _notice(self) -> common_pb2.PolicyVersionInfo | None:
        """What a subscriber should hear of now: the latest complete version (with its
        offer's node), or a newer version only offered so far."""
        latest = next(reversed(self._versions.values()), None)
        offer = next(reversed(self._offers.values()), None)
        if offer is not None and (latest is None or offer.header.version > latest.version):
            return offer.info(offer_only=True)
        if latest is None:
            return None
        info = latest.info()
        held = self._offers.get(latest.version)
        if held is not None:
            info.cuda_ipc_node = held.ipc_node
        return info

    def wait_notice(self, than_rank: int, timeout: float) -> common_pb2.PolicyVersionInfo | None:
        """The current notice if it ranks after `than_rank` (notice_rank), waiting up to
        `timeout` seconds."""

        def newer() -> bool:
            n = self._notice()
            return n is not None and notice_rank(n) > than_rank

        with self._cond:
            self._cond.wait_for(lambda: self.closed or newer(), timeout)
            n = self._notice()
            return n if n is not None and notice_rank(n) > than_rank else None

    def close(self) -> None:
        """Wake every waiter (shutdown)."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()
