"""In-memory store of complete policy versions (the last K) with atomic publish.

A push assembles into a private `PendingVersion`; only `VersionStore.publish`, called after
every tensor arrived and matched its CRC-32, makes it visible, under one lock. Readers see
either the whole version or nothing.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc

from trace_common.checksum import crc32
from trace_common.chunk_wire import ChunkView, chunk_codec, encode_chunk
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
from trace_common.tensor_wire import expected_nbytes

_PULL_DECODE, _ = chunk_codec(pb.PullChunk)
# Largest version a push may publish, and so the largest a replica can hold: versions are
# exported as Prometheus samples (float64, exact integers up to 2**53), and with this bound
# `latest - version_held` (ListReplicas' version_lag) always fits its int64.
MAX_POLICY_VERSION = 2**53 - 1


@dataclass(slots=True)
class StoredVersion:
    header: pb.VersionHeader
    # The PullVersion messages after the header, serialized (PullChunk wire bytes), built
    # once at push and shared by every puller: no per-pull copies or serialization; they
    # hold the only copy of the bytes.
    chunks: list[bytes]
    published_at: float = field(default_factory=time.time)
    _views: list[memoryview] | None = field(default=None, repr=False)

    @property
    def version(self) -> int:
        return self.header.version

    def data_views(self) -> list[memoryview]:
        """The tensor bytes of every chunk, in manifest order (views into `chunks`, no
        copies): what the data plane sends. Decoded once, at the first data-plane pull."""
        if self._views is None:
            self._views = [_PULL_DECODE(raw).data for raw in self.chunks]
        return self._views

    def info(self) -> common_pb2.PolicyVersionInfo:
        h = self.header
        return common_pb2.PolicyVersionInfo(
            version=h.version,
            total_bytes=h.total_bytes,
            num_tensors=len(h.tensors),
            metadata_json=h.metadata_json,
            published_at=self.published_at,
        )


class PendingVersion:
    """A version being pushed: validates the manifest, then each chunk, in order."""

    def __init__(self, header: pb.VersionHeader, max_version_bytes: int) -> None:
        check_non_negative("version", header.version)
        if header.version > MAX_POLICY_VERSION:
            raise invalid(
                f"version={header.version} is over the largest version {MAX_POLICY_VERSION}"
            )
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
        self.header = header
        # Received chunks become the PullVersion messages as they are (a pushed chunk's wire
        # bytes are a valid PullChunk: chunk_wire); the CRC-32 of each tensor runs over its chunks.
        self.chunks: list[bytes] = []
        self._index = 0
        self._received = 0
        self._crc = 0
        self._skip_empty()

    def _skip_empty(self) -> None:
        specs = self.header.tensors
        while self._index < len(specs) and self._received == specs[self._index].nbytes:
            self._verify(self._index)
            self._index += 1
            self._received = 0
            self._crc = 0

    def _verify(self, index: int) -> None:
        spec = self.header.tensors[index]
        if self._crc != spec.crc32:
            raise ServiceError(
                grpc.StatusCode.DATA_LOSS,
                f"tensor {spec.name!r}: crc32 {self._crc:#010x} of received bytes != declared {spec.crc32:#010x}",
            )

    def add(self, chunk: pb.TensorChunk | ChunkView, chunk_bytes: int) -> None:
        """Check and keep one chunk (re-cut to at most `chunk_bytes` for pulls).

        A ChunkView (chunk_wire's PushVersion deserializer) of at most `chunk_bytes` is
        kept as the bytes it arrived in, without a copy."""
        specs = self.header.tensors
        if self._index >= len(specs):
            raise invalid(
                f"chunk for tensor {chunk.tensor_index} after all {len(specs)} tensors are complete"
            )
        if chunk.tensor_index != self._index or chunk.offset != self._received:
            raise invalid(
                f"out-of-order chunk: tensor_index={chunk.tensor_index} offset={chunk.offset}, expected tensor {self._index} offset {self._received}"
            )
        data = chunk.data
        n = len(data)
        spec = specs[self._index]
        if self._received + n > spec.nbytes:
            raise invalid(f"tensor {spec.name!r}: chunk overruns nbytes={spec.nbytes}")
        self._crc = crc32(data, self._crc)
        if n and n <= chunk_bytes and isinstance(chunk, ChunkView):
            self.chunks.append(chunk.raw)
        elif n:
            for off in range(0, n, chunk_bytes):
                piece = data if n <= chunk_bytes else data[off : off + chunk_bytes]
                self.chunks.append(encode_chunk(self._index, self._received + off, piece))
        self._received += n
        self._skip_empty()

    def finish(self) -> StoredVersion:
        """The complete, verified version (INVALID_ARGUMENT if the stream stopped early)."""
        specs = self.header.tensors
        if self._index < len(specs):
            spec = specs[self._index]
            raise invalid(
                f"version {self.header.version}: stream ended in tensor {self._index} of {len(specs)} ({spec.name!r}, {self._received} of {spec.nbytes} bytes); not published"
            )
        return StoredVersion(self.header, self.chunks)


class VersionStore:
    """The last `keep` complete versions; `publish` is atomic and notifies waiters."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._versions: OrderedDict[int, StoredVersion] = OrderedDict()
        self._pushing: set[int] = set()
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
            self._cond.notify_all()
            return dropped

    def wait_newer(self, than: int, timeout: float) -> StoredVersion | None:
        """The latest version if newer than `than`, waiting up to `timeout` seconds."""
        with self._cond:
            self._cond.wait_for(
                lambda: self.closed or next(reversed(self._versions), -1) > than, timeout
            )
            latest = next(reversed(self._versions.values()), None)
            return latest if latest is not None and latest.version > than else None

    def close(self) -> None:
        """Wake every waiter (shutdown)."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()
