"""quant-cache's storage format in Redis, written once and used by both data paths: the
quant-cache service (gRPC) and QuantCacheClient's direct mode (the client reads and writes
Redis itself with the coordinates the service hands out: GetDataPlane).

Layout version 1 (LAYOUT_VERSION; a change to anything below bumps it):

Key: `<prefix>:<run_id>:<policy_version>:<sample_id>` (ids are restricted to
[A-Za-z0-9_.-], so the key never needs escaping and SCAN patterns are exact).
Value: a 16-byte header, then the blob:

    bytes 0..3   magic b"TQC1"
    bytes 4..7   CRC-32 (zlib) of the blob, little-endian
    bytes 8..15  blob length in bytes, little-endian

Every record is SET with the TTL. A read that finds a bad magic, a length that disagrees
with the stored size, or a CRC mismatch reports the record CORRUPT; its bytes are never
returned. Records are read as GETRANGE pieces of at most `piece_bytes` (the first one after
the header), checked to come from one write (RedisRecordStore.get_many).

Counters: the hash `<prefix>:#stats` (`#` never occurs in an id, so it is no record key and
no delete pattern matches it) holds STATS_FIELDS, incremented by every put and get of the
service (a put's in the same pipeline as its SETs); the service exports them as its
Prometheus counters. The direct path does not count (`count=False`): its Redis user may not
write the stats hash, so a client cannot falsify the service's counters.

Server-side bounds: the service sweeps every record key periodically (RedisRecordStore.sweep), so a
direct-path client that ignores the TTL or the size limit is bounded all the same.

Memory bound: Redis `maxmemory` with an eviction policy (default `volatile-ttl`: every
record has a TTL, and the ones closest to expiring, i.e. the oldest, are evicted first; the
stats hash has no TTL, so it is never evicted). An evicted record reads as MISSING. With
`noeviction` a put at the bound fails instead (RESOURCE_EXHAUSTED) and nothing already
stored is lost; reads still work, but Redis refuses the counter updates of gets there too
(they are skipped: the stats undercount while Redis is full).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence, Sized
from dataclasses import dataclass
from enum import Enum

import grpc
import redis

from trace_common.service.errors import (
    LONG_ID_RE,
    ServiceError,
    check_id,
    check_non_negative,
    exhausted,
    invalid,
)
from trace_common.wire.checksum import crc32

LAYOUT_VERSION = 1
MAGIC = b"TQC1"
HEADER = struct.Struct("<4sIQ")  # magic, crc32, length
HEADER_BYTES = HEADER.size  # 16
DELETE_BATCH = 500  # keys per UNLINK while deleting a run or version
DEFAULT_PIECE_BYTES = 1 << 20  # GETRANGE size of get_many (a GetRecords message each)
READ_ATTEMPTS = 3  # get_many re-reads a key whose length changed between its two round trips
# redis-py socket read size for either path: 1 MiB replies read in 64 KiB recv() calls (the
# default) ran at about half the speed (956 vs 1,853-2,093 MB/s measured here).
SOCKET_READ_BYTES = 1 << 20
PUT_FLUSH_BYTES = 8 << 20  # write complete records to Redis in pipelines of about this size
GET_GROUP_BYTES = 8 << 20  # read records with one get_many per about this many bytes
GET_MAX_GROUP = 64  # most keys in one get_many
# Fields of the stats hash (each a Prometheus counter `trace_quant_cache_<field>_total`).
STATS_FIELDS = (
    "records_put",
    "put_bytes",
    "records_got",
    "got_bytes",
    "hits",
    "misses",
    "corrupt_records",
)


class Lookup(Enum):
    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"


@dataclass(slots=True)
class Found:
    status: Lookup
    crc32: int = 0
    detail: str = ""
    parts: list[bytes | memoryview] | None = None  # OK: the blob in pieces of <= piece_bytes

    @property
    def nbytes(self) -> int:
        return 0 if self.parts is None else sum(len(p) for p in self.parts)

    def blob(self) -> bytes:
        """The whole blob as bytes (one copy, none for one piece that is bytes already)."""
        assert self.parts is not None, f"no data in a {self.status.value} lookup"
        if len(self.parts) == 1:
            return bytes(self.parts[0])
        return b"".join(self.parts)


MISSING = Found(Lookup.MISSING, detail="not found (never written, expired or evicted)")
REWRITTEN = f"rewritten with another length while being read, {READ_ATTEMPTS} times"


def record_key(prefix: str, run_id: str, version: int | str, sample_id: str) -> str:
    return f"{prefix}:{run_id}:{version}:{sample_id}"


def stats_key(prefix: str) -> str:
    return f"{prefix}:#stats"


def record_pattern(prefix: str) -> str:
    """The Redis glob of every record key under `prefix`, and of nothing else: a record key's
    first character after the prefix is an id's ([A-Za-z0-9_.-]); the stats hash's is `#`."""
    literal = "".join(f"\\{c}" if c in "*?[]\\^" else c for c in prefix)
    return f"{literal}:[^#]*"


def check_key(run_id: str, version: int, sample_id: str | None = None) -> None:
    """INVALID_ARGUMENT naming the value unless the ids fit the key layout."""
    check_id("run_id", run_id)
    check_non_negative("policy_version", version)
    if sample_id is not None:
        check_id("sample_id", sample_id, LONG_ID_RE)


def check_size(sample_id: str, nbytes: int, max_record_bytes: int) -> None:
    if nbytes > max_record_bytes:
        raise exhausted(
            f"record {sample_id!r} is {nbytes} bytes, over max_record_bytes={max_record_bytes}"
        )


def check_sample_ids(ids: Sequence[str], max_batch: int | None = None) -> None:
    """A GetRecords batch: non-empty, at most max_batch, valid and distinct ids."""
    if not ids:
        raise invalid("sample_ids is empty")
    if max_batch is not None and len(ids) > max_batch:
        raise exhausted(f"{len(ids)} sample_ids in one request, over max_batch={max_batch}")
    for sid in ids:
        check_id("sample_id", sid, LONG_ID_RE)
    if len(set(ids)) != len(ids):
        dup = sorted({s for s in ids if ids.count(s) > 1})
        raise invalid(f"duplicate sample_ids: {dup}")


def encode_header(crc32: int, length: int) -> bytes:
    return HEADER.pack(MAGIC, crc32, length)


def encode_parts(blob: bytes | bytearray | memoryview) -> tuple[bytes, memoryview]:
    """The stored value of `blob` as its two pieces, header and blob (no copy)."""
    view = memoryview(blob).cast("B")
    return encode_header(crc32(view), len(view)), view


def encode(blob: bytes | bytearray | memoryview) -> bytes:
    """The stored value of `blob`: header + blob (one copy)."""
    return b"".join(encode_parts(blob))


def decode(value: bytes) -> Found:
    """Check a whole stored value; OK only if magic, length and CRC all agree."""
    blob = memoryview(value)[HEADER_BYTES:]
    return decode_parts(value[:HEADER_BYTES], [blob] if len(blob) else [])


def decode_parts(header: bytes, pieces: list[bytes | memoryview]) -> Found:
    """Check a stored value read as its header and the blob's GETRANGE pieces; OK only if
    magic, length and CRC all agree. No joining copy: the blob comes back as `parts`."""
    if len(header) < HEADER_BYTES:
        stored = len(header) + sum(map(len, pieces))
        return Found(
            Lookup.CORRUPT, detail=f"stored value is {stored} bytes, shorter than the header"
        )
    magic, crc, length = HEADER.unpack(header)
    if magic != MAGIC:
        return Found(Lookup.CORRUPT, detail=f"bad magic {magic!r}")
    stored = sum(len(p) for p in pieces)
    if stored != length:
        return Found(
            Lookup.CORRUPT, detail=f"truncated: header says {length} bytes, stored {stored}"
        )
    actual = 0
    for piece in pieces:
        actual = crc32(piece, actual)
    if actual != crc:
        return Found(
            Lookup.CORRUPT,
            detail=f"checksum mismatch: stored crc32 {crc:#010x}, data {actual:#010x}",
        )
    return Found(Lookup.OK, crc32=crc, parts=[p for p in pieces if len(p)] or [b""])


def _refusal(*replies: object) -> Found | None:
    """A CORRUPT lookup if Redis answered one of a key's commands with an error reply
    (e.g. WRONGTYPE: something else wrote a hash or list there); connection failures are
    raised by the pipeline itself, for the whole batch."""
    for reply in replies:
        if isinstance(reply, redis.ConnectionError | redis.TimeoutError):
            raise reply
        if isinstance(reply, redis.ResponseError):
            return Found(Lookup.CORRUPT, detail=f"Redis refused the key: {reply}")
    return None


def redis_errors(exc: redis.RedisError) -> ServiceError:
    """Map a Redis failure to a status: OOM at the memory bound -> RESOURCE_EXHAUSTED."""
    text = str(exc)
    if isinstance(exc, redis.exceptions.OutOfMemoryError) or text.startswith("OOM"):
        return exhausted(f"Redis is at its memory bound (maxmemory, noeviction): {text}")
    return ServiceError(grpc.StatusCode.UNAVAILABLE, f"Redis error: {type(exc).__name__}: {text}")


SWEEP_SCAN_COUNT = 1000  # keys per SCAN step and per check script of RedisRecordStore.sweep
SWEEP_ACTIONS = ("ttl_set", "deleted_oversize", "deleted_not_a_string")
# KEYS: record keys; ARGV: the largest stored value in bytes, the TTL in seconds. Returns how
# many keys got the TTL, and how many were deleted as oversize or as not a string.
_SWEEP_SCRIPT = """
local limit, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local fixed, oversize, wrong = 0, 0, 0
for _, key in ipairs(KEYS) do
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'string' then
    if redis.call('STRLEN', key) > limit then
      redis.call('DEL', key)
      oversize = oversize + 1
    else
      local left = redis.call('TTL', key)
      if left == -1 or left > ttl then
        redis.call('EXPIRE', key, ttl)
        fixed = fixed + 1
      end
    end
  elseif kind ~= 'none' then
    redis.call('DEL', key)
    wrong = wrong + 1
  end
end
return {fixed, oversize, wrong}
"""


def _add(counts: dict[str, int], replies: Sequence[int]) -> None:
    for action, n in zip(SWEEP_ACTIONS, replies, strict=True):
        counts[action] += int(n)


class RedisRecordStore:
    """Records in Redis (the layout above); raises ServiceError on Redis failures."""

    def __init__(
        self,
        client: redis.Redis,
        prefix: str,
        ttl_seconds: int,
        piece_bytes: int = DEFAULT_PIECE_BYTES,
        *,
        count: bool = True,
    ) -> None:
        if piece_bytes <= 0:
            raise ValueError(f"piece_bytes must be > 0, got {piece_bytes}")
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds}")
        self.client = client
        self.prefix = prefix
        self.ttl_seconds = ttl_seconds
        self.piece_bytes = piece_bytes
        self.stats_key = stats_key(prefix)
        self.count = count  # puts and gets add to the stats hash

    def key(self, run_id: str, version: int, sample_id: str) -> str:
        return record_key(self.prefix, run_id, version, sample_id)

    def put_many(self, items: Sequence[tuple[str, Sized]]) -> None:
        """SET each (key, stored value) with the TTL, and count them (`count`), in one round
        trip (a pipeline, not a transaction: each record is atomic on its own). A value is bytes, a
        memoryview, or a redis_bulk.Joined(header, blob) on a client with its packer."""
        if not items:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value, ex=self.ttl_seconds)
            if self.count:
                pipe.hincrby(self.stats_key, "records_put", len(items))
                stored = sum(len(v) - HEADER_BYTES for _, v in items)
                pipe.hincrby(self.stats_key, "put_bytes", stored)
            pipe.execute()
        except redis.RedisError as exc:
            raise redis_errors(exc) from exc

    def get_many(self, keys: list[str]) -> list[Found]:
        """Read, check and count the values of `keys`, in pieces of at most `piece_bytes`.

        redis-py reads a multi-MiB bulk reply much slower than the same bytes as ~1 MiB
        replies (4 MiB value: GET 330-420 MB/s, four 1 MiB GETRANGEs 950-2,090 MB/s, measured
        here), and the pieces are the GetRecords messages as they are. Round trip 1: each
        key's STRLEN and its first GETRANGE (header + first piece): a record that fits is
        complete. Round trip 2, for longer ones: the other pieces, then STRLEN and the header
        again; the pieces belong to the write read in round 1 if length and header (which
        holds the CRC) are unchanged, else the key is read again (at most READ_ATTEMPTS
        times, then reported as read). Both are plain pipelines, not MULTI: redis-py buffers
        a whole EXEC reply before parsing it, which halved get throughput here. A third,
        small round trip adds the lookups to the stats hash (`count`).
        """
        found: dict[str, Found] = {}
        todo = list(dict.fromkeys(keys))
        step = self.piece_bytes
        try:
            for attempt in range(READ_ATTEMPTS):
                last = attempt + 1 == READ_ATTEMPTS
                pipe = self.client.pipeline(transaction=False)
                for key in todo:
                    pipe.strlen(key)
                    pipe.getrange(key, 0, HEADER_BYTES + step - 1)
                # A key Redis refuses (WRONGTYPE: not a string) fails that key, not the batch.
                replies = pipe.execute(raise_on_error=False)
                retry: list[str] = []
                long: list[tuple[str, int, bytes]] = []  # key, length, header + first piece
                for key, n, head in zip(todo, replies[::2], replies[1::2], strict=True):
                    refused = _refusal(n, head)
                    if refused is not None:
                        found[key] = refused
                    elif len(head) == n or (last and len(head) < HEADER_BYTES + step):
                        found[key] = decode(head) if head else MISSING
                    elif len(head) == HEADER_BYTES + step and n > len(head):
                        long.append((key, n, head))
                    elif last:
                        found[key] = Found(Lookup.CORRUPT, detail=REWRITTEN)
                    else:
                        retry.append(key)  # rewritten or expired between STRLEN and GETRANGE
                if long:
                    pipe = self.client.pipeline(transaction=False)
                    for key, n, _ in long:
                        for start in range(HEADER_BYTES + step, n, step):
                            pipe.getrange(key, start, min(start + step, n) - 1)
                        pipe.strlen(key)
                        pipe.getrange(key, 0, HEADER_BYTES - 1)
                    rest = iter(pipe.execute(raise_on_error=False))
                    for key, n, head in long:
                        pieces = [next(rest) for _ in range(HEADER_BYTES + step, n, step)]
                        same = next(rest) == n and next(rest) == head[:HEADER_BYTES]
                        refused = _refusal(*pieces)
                        if refused is not None:  # replaced by another type meanwhile
                            found[key] = refused
                        elif same or last:
                            found[key] = decode_parts(
                                head[:HEADER_BYTES], [memoryview(head)[HEADER_BYTES:], *pieces]
                            )
                        else:
                            retry.append(key)
                todo = retry
                if not todo:
                    break
        except redis.RedisError as exc:
            raise redis_errors(exc) from exc
        results = [found[key] for key in keys]
        if self.count:
            self._count_lookups(results)
        return results

    def get_groups(self, keys: list[str]) -> Iterator[tuple[list[str], list[Found]]]:
        """get_many over `keys` in groups: the group grows while records are small, so a
        batch of 64 KiB records costs a few round trips and one of 16 MiB ones stays bounded
        in memory (about GET_GROUP_BYTES per group)."""
        group, i = 1, 0
        while i < len(keys):
            batch = keys[i : i + group]
            founds = self.get_many(batch)
            yield batch, founds
            i += len(batch)
            nbytes = sum(f.nbytes for f in founds)
            group = max(1, min(GET_MAX_GROUP, GET_GROUP_BYTES // max(1, nbytes // len(batch))))

    def _count_lookups(self, results: list[Found]) -> None:
        counts = dict.fromkeys(("hits", "misses", "corrupt_records", "got_bytes"), 0)
        for f in results:
            if f.status is Lookup.OK:
                counts["hits"] += 1
                counts["got_bytes"] += f.nbytes
            else:
                counts["misses" if f.status is Lookup.MISSING else "corrupt_records"] += 1
        counts["records_got"] = counts["hits"]
        pipe = self.client.pipeline(transaction=False)
        for name, value in counts.items():
            if value:
                pipe.hincrby(self.stats_key, name, value)
        try:
            pipe.execute()
        except redis.exceptions.OutOfMemoryError:
            pass  # noeviction at the bound refuses every write, counters too (documented)
        except redis.RedisError as exc:
            raise redis_errors(exc) from exc

    def stats(self) -> dict[str, int]:
        """The counters of both paths (STATS_FIELDS, 0 where never incremented)."""
        try:
            raw = self.client.hgetall(self.stats_key)
        except redis.RedisError as exc:
            raise redis_errors(exc) from exc
        values = {k.decode() if isinstance(k, bytes) else k: int(v) for k, v in raw.items()}
        return {name: values.get(name, 0) for name in STATS_FIELDS}

    def delete(self, run_id: str, version: int | None) -> int:
        """Delete a run's records, or one version's; returns how many were deleted."""
        pattern = record_key(self.prefix, run_id, "*" if version is None else version, "*")
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

    def sweep(self, max_record_bytes: int, scan_count: int = SWEEP_SCAN_COUNT) -> dict[str, int]:
        """Enforce the service's bounds on every record key, whoever wrote it (a direct-path
        client that skips its library's checks): a key without the TTL, or with a longer
        one, gets the TTL; a value over max_record_bytes, or one that is not a string, is
        deleted. Each key is checked and fixed atomically (a script), so a record rewritten
        meanwhile within the bounds is never deleted. Returns the counts by SWEEP_ACTIONS."""
        counts = dict.fromkeys(SWEEP_ACTIONS, 0)
        limit = HEADER_BYTES + max_record_bytes
        try:
            script = self.client.register_script(_SWEEP_SCRIPT)
            batch: list[bytes] = []
            for key in self.client.scan_iter(match=record_pattern(self.prefix), count=scan_count):
                batch.append(key)
                if len(batch) >= scan_count:
                    _add(counts, script(keys=batch, args=[limit, self.ttl_seconds]))
                    batch.clear()
            if batch:
                _add(counts, script(keys=batch, args=[limit, self.ttl_seconds]))
        except redis.RedisError as exc:
            raise redis_errors(exc) from exc
        return counts

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
