"""Redis storage of record blobs with a per-record checksum.

Key: `<prefix>:<run_id>:<policy_version>:<sample_id>` (ids are restricted to
[A-Za-z0-9_.-], so the key never needs escaping and SCAN patterns are exact).
Value: a 16-byte header, then the blob:

    bytes 0..3   magic b"TQC1"
    bytes 4..7   CRC-32 (zlib) of the blob, little-endian
    bytes 8..15  blob length in bytes, little-endian

A read that finds a bad magic, a length that disagrees with the stored size, or a CRC
mismatch reports the record CORRUPT; its bytes are never returned.

Memory bound: Redis `maxmemory` with an eviction policy (default `volatile-ttl`: every
record has a TTL, and the ones closest to expiring, i.e. the oldest, are evicted first).
An evicted record reads as MISSING. With `noeviction` a put at the bound fails instead
(RESOURCE_EXHAUSTED) and nothing already stored is lost.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import Enum

import grpc
import redis

from trace_common.checksum import crc32
from trace_common.service.errors import ServiceError, exhausted

MAGIC = b"TQC1"
HEADER = struct.Struct("<4sIQ")  # magic, crc32, length
HEADER_BYTES = HEADER.size  # 16
DELETE_BATCH = 500  # keys per UNLINK while deleting a run or version
DEFAULT_PIECE_BYTES = 1 << 20  # GETRANGE size of get_many (a GetRecords message each)
READ_ATTEMPTS = 3  # get_many re-reads a key whose length changed between its two round trips
# redis-py socket read size for the service: 1 MiB replies read in 64 KiB recv() calls (the
# default) ran at about half the speed (956 vs 1,853-2,093 MB/s measured here).
SOCKET_READ_BYTES = 1 << 20


class Lookup(Enum):
    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"


@dataclass(slots=True)
class Found:
    status: Lookup
    blob: memoryview | None = None  # the whole blob (decode), or None when read in parts
    crc32: int = 0
    detail: str = ""
    parts: list[bytes | memoryview] | None = None  # get_many: the blob in <= piece_bytes pieces

    @property
    def nbytes(self) -> int:
        if self.parts is not None:
            return sum(len(p) for p in self.parts)
        return 0 if self.blob is None else len(self.blob)


MISSING = Found(Lookup.MISSING, detail="not found (never written, expired or evicted)")


def encode_header(crc32: int, length: int) -> bytes:
    return HEADER.pack(MAGIC, crc32, length)


def decode(value: bytes) -> Found:
    """Check a stored value; OK only if magic, length and CRC all agree."""
    if len(value) < HEADER_BYTES:
        return Found(
            Lookup.CORRUPT, detail=f"stored value is {len(value)} bytes, shorter than the header"
        )
    magic, crc, length = HEADER.unpack_from(value)
    if magic != MAGIC:
        return Found(Lookup.CORRUPT, detail=f"bad magic {magic!r}")
    blob = memoryview(value)[HEADER_BYTES:]
    if len(blob) != length:
        return Found(
            Lookup.CORRUPT, detail=f"truncated: header says {length} bytes, stored {len(blob)}"
        )
    actual = crc32(blob)
    if actual != crc:
        return Found(
            Lookup.CORRUPT,
            detail=f"checksum mismatch: stored crc32 {crc:#010x}, data {actual:#010x}",
        )
    return Found(Lookup.OK, blob=blob, crc32=crc)


def decode_parts(pieces: list[bytes]) -> Found:
    """Check a stored value read as GETRANGE pieces (the first one holds the header and
    the blob's first piece); OK only if magic, length and CRC all agree. No joining copy:
    the blob comes back as `parts`, the pieces themselves (the first one as a view)."""
    if not pieces or len(pieces[0]) < HEADER_BYTES:
        return decode(b"".join(pieces))  # too short for a header: decode names the problem
    magic, crc, length = HEADER.unpack_from(pieces[0])
    if magic != MAGIC:
        return Found(Lookup.CORRUPT, detail=f"bad magic {magic!r}")
    parts: list[bytes | memoryview] = [memoryview(pieces[0])[HEADER_BYTES:], *pieces[1:]]
    stored = sum(len(p) for p in parts)
    if stored != length:
        return Found(
            Lookup.CORRUPT, detail=f"truncated: header says {length} bytes, stored {stored}"
        )
    actual = 0
    for part in parts:
        actual = crc32(part, actual)
    if actual != crc:
        return Found(
            Lookup.CORRUPT,
            detail=f"checksum mismatch: stored crc32 {crc:#010x}, data {actual:#010x}",
        )
    return Found(Lookup.OK, parts=[p for p in parts if len(p)] or [parts[0]], crc32=crc)


def redis_errors(exc: redis.RedisError) -> ServiceError:
    """Map a Redis failure to a status: OOM at the memory bound -> RESOURCE_EXHAUSTED."""
    text = str(exc)
    if isinstance(exc, redis.exceptions.OutOfMemoryError) or text.startswith("OOM"):
        return exhausted(f"Redis is at its memory bound (maxmemory, noeviction): {text}")
    return ServiceError(grpc.StatusCode.UNAVAILABLE, f"Redis error: {type(exc).__name__}: {text}")


class RecordStore:
    """The Redis side of quant-cache; raises ServiceError on Redis failures."""

    def __init__(self, client: redis.Redis, prefix: str, ttl_seconds: int) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_seconds = ttl_seconds

    def key(self, run_id: str, version: int, sample_id: str) -> str:
        return f"{self.prefix}:{run_id}:{version}:{sample_id}"

    def put(self, key: str, value: memoryview) -> None:
        """`value` is header + blob (built by the caller to avoid another copy)."""
        try:
            self.client.set(key, value, ex=self.ttl_seconds)
        except redis.RedisError as exc:
            raise redis_errors(exc) from exc

    def put_many(self, items: list[tuple[str, memoryview]]) -> None:
        """Several SETs in one round trip (a pipeline, not a transaction: each record is
        atomic on its own)."""
        if len(items) == 1:
            self.put(*items[0])
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value, ex=self.ttl_seconds)
            pipe.execute()
        except redis.RedisError as exc:
            raise redis_errors(exc) from exc

    def get(self, key: str) -> Found:
        return self.get_many([key])[0]

    def get_many(self, keys: list[str], piece_bytes: int = DEFAULT_PIECE_BYTES) -> list[Found]:
        """Read and check the values of `keys`, each as pieces of at most `piece_bytes`.

        redis-py reads a multi-MiB bulk reply much slower than the same bytes as ~1 MiB
        replies (4 MiB value: GET 330-420 MB/s, four 1 MiB GETRANGEs 950-2,090 MB/s, measured
        here), and the pieces are the GetRecords messages as they are. Two round trips: the
        lengths (STRLEN), then one MULTI/EXEC with each key's GETRANGEs and its STRLEN again,
        so a record's pieces all come from one write; a key rewritten with another length in
        between is read again (at most READ_ATTEMPTS times, then reported as it was read).
        """
        if piece_bytes <= 0:
            raise ValueError(f"piece_bytes must be > 0, got {piece_bytes}")
        found: dict[str, Found] = {}
        todo = list(dict.fromkeys(keys))
        try:
            for attempt in range(READ_ATTEMPTS):
                pipe = self.client.pipeline(transaction=False)
                for key in todo:
                    pipe.strlen(key)
                lengths = pipe.execute()
                pipe = self.client.pipeline(transaction=True)
                cuts: list[list[int]] = []
                for key, n in zip(todo, lengths, strict=True):
                    starts = [0, *range(HEADER_BYTES + piece_bytes, n, piece_bytes)] if n else []
                    cuts.append(starts)
                    pipe.strlen(key)
                    for i, start in enumerate(starts):
                        end = starts[i + 1] if i + 1 < len(starts) else n
                        pipe.getrange(key, start, end - 1)
                replies = iter(pipe.execute())
                retry = []
                for key, n, starts in zip(todo, lengths, cuts, strict=True):
                    now = next(replies)
                    pieces = [next(replies) for _ in starts]
                    if now != n and attempt + 1 < READ_ATTEMPTS:
                        retry.append(key)  # rewritten or expired since STRLEN: read it again
                    elif now == 0:
                        found[key] = MISSING
                    else:
                        found[key] = decode_parts(pieces)
                todo = retry
                if not todo:
                    break
        except redis.RedisError as exc:
            raise redis_errors(exc) from exc
        return [found[key] for key in keys]

    def delete(self, run_id: str, version: int | None) -> int:
        """Delete a run's records, or one version's; returns how many were deleted."""
        pattern = f"{self.prefix}:{run_id}:{'*' if version is None else version}:*"
        deleted = 0
        try:
            batch: list[bytes] = []
            for key in self.client.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= DELETE_BATCH:
                    deleted += self.client.unlink(*batch)
                    batch.clear()
            if batch:
                deleted += self.client.unlink(*batch)
        except redis.RedisError as exc:
            raise redis_errors(exc) from exc
        return deleted

    def info(self) -> dict[str, object]:
        try:
            info = self.client.info("memory") | self.client.info("stats")
            info["keys"] = self.client.dbsize()
        except redis.RedisError as exc:
            raise redis_errors(exc) from exc
        return info

    def ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.RedisError:
            return False

    def configure_memory(self, maxmemory_bytes: int, policy: str) -> None:
        """Apply the memory bound to the server (needs CONFIG rights; managed Redis may refuse)."""
        try:
            self.client.config_set("maxmemory", maxmemory_bytes)
            self.client.config_set("maxmemory-policy", policy)
        except redis.RedisError as exc:
            raise redis_errors(exc) from exc
