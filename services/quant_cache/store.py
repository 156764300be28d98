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
import zlib
from dataclasses import dataclass
from enum import Enum

import grpc
import redis

from trace_common.service.errors import ServiceError, exhausted

MAGIC = b"TQC1"
HEADER = struct.Struct("<4sIQ")  # magic, crc32, length
HEADER_BYTES = HEADER.size  # 16
DELETE_BATCH = 500  # keys per UNLINK while deleting a run or version


class Lookup(Enum):
    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"


@dataclass(slots=True)
class Found:
    status: Lookup
    blob: memoryview | None = None
    crc32: int = 0
    detail: str = ""


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
    actual = zlib.crc32(blob)
    if actual != crc:
        return Found(
            Lookup.CORRUPT,
            detail=f"checksum mismatch: stored crc32 {crc:#010x}, data {actual:#010x}",
        )
    return Found(Lookup.OK, blob=blob, crc32=crc)


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

    def get_many(self, keys: list[str]) -> list[Found]:
        """One MGET; each value checked."""
        try:
            values = self.client.mget(keys) if len(keys) > 1 else [self.client.get(keys[0])]
        except redis.RedisError as exc:
            raise redis_errors(exc) from exc
        return [MISSING if v is None else decode(v) for v in values]

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
