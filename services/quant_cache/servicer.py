"""quant-cache gRPC servicer: validation, chunk assembly, checksum checks, metrics, and the
direct data path's coordinates (GetDataPlane)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2 as pb
from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2_grpc as pb_grpc
from trace_common.service import (
    Metrics,
    ServiceError,
    check_id,
    check_non_negative,
    failed_precondition,
    invalid,
)
from trace_common.stores.quant_cache_store import (
    HEADER_BYTES,
    LAYOUT_VERSION,
    PUT_FLUSH_BYTES,
    STATS_FIELDS,
    Found,
    Lookup,
    RedisRecordStore,
    check_key,
    check_sample_ids,
    check_size,
    encode_header,
)
from trace_common.wire.checksum import crc32
from trace_common.wire.chunk_wire import bytes_field_codec, with_bytes_field

log = logging.getLogger(__name__)

PUT_DATA_FIELD = pb.PutRecordsChunk.DESCRIPTOR.fields_by_name["data"].number  # 4
GET_DATA_FIELD = pb.GetRecordsChunk.DESCRIPTOR.fields_by_name["data"].number  # 6
PUT_DESERIALIZE, _ = bytes_field_codec(pb.PutRecordsChunk, PUT_DATA_FIELD)
_, GET_SERIALIZE = bytes_field_codec(pb.GetRecordsChunk, GET_DATA_FIELD)
# PutRecords data arrives as a view into the received message (no protobuf copies) and
# GetRecords sends messages serialized by _send: GrpcServer.add(codecs=CODECS).
CODECS = {
    "PutRecords": {"request_deserializer": PUT_DESERIALIZE},
    "GetRecords": {"response_serializer": GET_SERIALIZE},
}

_STATUS = {
    Lookup.OK: pb.RECORD_STATUS_OK,
    Lookup.MISSING: pb.RECORD_STATUS_MISSING,
    Lookup.CORRUPT: pb.RECORD_STATUS_CORRUPT,
}


_STATS_HELP = {
    "records_put": "records stored (the gRPC path)",
    "put_bytes": "record bytes stored (the gRPC path)",
    "records_got": "records returned (the gRPC path)",
    "got_bytes": "record bytes returned (the gRPC path)",
    "hits": "lookups that found a valid record (the gRPC path)",
    "misses": "lookups that found no record (the gRPC path)",
    "corrupt_records": "lookups that found a corrupt record (the gRPC path)",
}


class _RedisCollector:
    """At scrape time: the record counters from the stats hash in Redis (incremented by the
    gRPC path of every quant-cache replica; direct-path clients count their own traffic) and
    Redis's own memory and eviction counters. Every replica exports the same Redis-wide
    values."""

    def __init__(self, metrics: Metrics, store: RedisRecordStore) -> None:
        self._name = metrics.name
        self._store = store

    def collect(self) -> Iterator[object]:
        try:
            stats = self._store.stats()
            info = self._store.info()
        except ServiceError:
            return
        for field in STATS_FIELDS:
            yield CounterMetricFamily(self._name(field), _STATS_HELP[field], value=stats[field])
        yield CounterMetricFamily(
            self._name("redis_evicted_keys"),
            "keys Redis evicted at its memory bound",
            value=info.get("evicted_keys", 0),
        )
        yield CounterMetricFamily(
            self._name("redis_expired_keys"),
            "keys Redis expired (TTL)",
            value=info.get("expired_keys", 0),
        )
        yield GaugeMetricFamily(
            self._name("redis_used_memory_bytes"),
            "Redis used_memory",
            value=info.get("used_memory", 0),
        )
        yield GaugeMetricFamily(
            self._name("redis_maxmemory_bytes"),
            "Redis maxmemory (0 = unbounded)",
            value=info.get("maxmemory", 0),
        )


class QuantCacheServicer(pb_grpc.QuantCacheServicer):
    """Implements trace.quantcache.v1.QuantCache over a RedisRecordStore."""

    def __init__(
        self,
        store: RedisRecordStore,
        metrics: Metrics,
        *,
        max_record_bytes: int,
        max_batch: int,
        data_plane_url: str | None = None,
    ) -> None:
        """`store.piece_bytes` is the GetRecords message size; `data_plane_url` is the Redis
        URL GetDataPlane hands out (None: the direct path is off, FAILED_PRECONDITION)."""
        self.store = store
        self.max_record_bytes = max_record_bytes
        self.max_batch = max_batch
        self.data_plane_url = data_plane_url
        m = metrics
        # Record counters live in Redis (the gRPC path of every replica counts there):
        # _RedisCollector.
        self.redis_errors = m.counter("redis_errors", "Redis calls that failed")
        self.put_seconds = m.histogram(
            "put_seconds", "time to receive and store one PutRecords stream (gRPC path)"
        )
        self.get_seconds = m.histogram(
            "get_seconds", "time to read, verify and send one group of records (gRPC path)"
        )
        m.registry.register(_RedisCollector(metrics, store))

    # -- PutRecords ---------------------------------------------------------------------
    def PutRecords(
        self, request_iterator: Iterable[pb.PutRecordsChunk], context: grpc.ServicerContext
    ) -> pb.PutRecordsResponse:
        start = time.perf_counter()
        pending: list[tuple[str, memoryview]] = []  # complete records not yet written
        pending_bytes = 0
        totals = [0, 0]  # records, bytes stored
        current: _Assembly | None = None
        try:
            for chunk in request_iterator:
                if chunk.HasField("key"):
                    if current is not None:
                        pending.append(current.finish(self.store))
                        pending_bytes += current.total
                    current = self._start(chunk)
                elif current is None:
                    raise invalid("the first PutRecords message has no key")
                current.add(chunk.data)
                if pending_bytes >= PUT_FLUSH_BYTES:
                    self._flush(pending, totals)
                    pending_bytes = 0
            if current is None:
                raise invalid(
                    "empty PutRecords stream: the first message must carry key, total_bytes, crc32"
                )
            pending.append(current.finish(self.store))
        except BaseException:
            # Records completed before the failing one are kept (documented in the proto).
            with contextlib.suppress(ServiceError):
                self._flush(pending, totals)
            raise
        self._flush(pending, totals)
        self.put_seconds.observe(time.perf_counter() - start)
        return pb.PutRecordsResponse(
            records=totals[0], stored_bytes=totals[1], ttl_seconds=self.store.ttl_seconds
        )

    def _start(self, chunk: pb.PutRecordsChunk) -> _Assembly:
        key = chunk.key
        check_key(key.run_id, key.policy_version, key.sample_id)
        check_size(key.sample_id, chunk.total_bytes, self.max_record_bytes)
        return _Assembly(key, chunk.total_bytes, chunk.crc32)

    def _flush(self, pending: list[tuple[str, memoryview]], totals: list[int]) -> None:
        if not pending:
            return
        self._redis(lambda: self.store.put_many(pending))
        nbytes = sum(len(v) - HEADER_BYTES for _, v in pending)
        totals[0] += len(pending)
        totals[1] += nbytes
        pending.clear()

    # -- GetRecords ---------------------------------------------------------------------
    def GetRecords(
        self, request: pb.GetRecordsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GetRecordsChunk | bytes]:
        check_key(request.run_id, request.policy_version)
        ids = list(request.sample_ids)
        check_sample_ids(ids, self.max_batch)
        sample_of = {self.store.key(request.run_id, request.policy_version, s): s for s in ids}
        groups = self.store.get_groups(list(sample_of))
        while True:
            start = time.perf_counter()
            group = self._redis(lambda: next(groups, None))
            if group is None:
                return
            for key, found in zip(*group, strict=True):
                yield from self._send(request, sample_of[key], found)
            self.get_seconds.observe(time.perf_counter() - start)

    def _send(
        self, request: pb.GetRecordsRequest, sid: str, found: Found
    ) -> Iterator[pb.GetRecordsChunk | bytes]:
        if found.status is not Lookup.OK:
            if found.status is Lookup.CORRUPT:
                log.error(
                    "corrupt record",
                    extra={
                        "run_id": request.run_id,
                        "policy_version": request.policy_version,
                        "sample_id": sid,
                        "detail": found.detail,
                    },
                )
            yield pb.GetRecordsChunk(
                sample_id=sid, status=_STATUS[found.status], detail=found.detail
            )
            return
        parts = found.parts
        assert parts is not None  # get_many reads records as pieces of <= piece_bytes
        total = found.nbytes
        # Serialized here (GET_SERIALIZE passes bytes through): the record piece is joined
        # once onto the small fields instead of copied into a message and again out of it.
        first = pb.GetRecordsChunk(
            sample_id=sid, status=pb.RECORD_STATUS_OK, total_bytes=total, crc32=found.crc32
        )
        yield with_bytes_field(first.SerializeToString(), GET_DATA_FIELD, parts[0])
        offset = len(parts[0])
        for part in parts[1:]:
            rest = pb.GetRecordsChunk(sample_id=sid, offset=offset).SerializeToString()
            yield with_bytes_field(rest, GET_DATA_FIELD, part)
            offset += len(part)

    # -- Delete / Stats -------------------------------------------------------------------
    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteResponse:
        check_id("run_id", request.run_id)
        version = request.policy_version if request.HasField("policy_version") else None
        if version is not None:
            check_non_negative("policy_version", version)
        deleted = self._redis(lambda: self.store.delete(request.run_id, version))
        log.info(
            "deleted records",
            extra={"run_id": request.run_id, "policy_version": version, "deleted": deleted},
        )
        return pb.DeleteResponse(deleted_records=deleted)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        info = self._redis(self.store.info)
        counts = self._redis(self.store.stats)
        return pb.StatsResponse(
            records_put_total=counts["records_put"],
            bytes_put_total=counts["put_bytes"],
            records_got_total=counts["records_got"],
            bytes_got_total=counts["got_bytes"],
            hits_total=counts["hits"],
            misses_total=counts["misses"],
            corrupt_total=counts["corrupt_records"],
            redis_used_memory_bytes=int(info.get("used_memory", 0)),
            redis_maxmemory_bytes=int(info.get("maxmemory", 0)),
            redis_maxmemory_policy=str(info.get("maxmemory_policy", "")),
            redis_evicted_keys_total=int(info.get("evicted_keys", 0)),
            redis_expired_keys_total=int(info.get("expired_keys", 0)),
            redis_keys=int(info.get("keys", 0)),
            ttl_seconds=self.store.ttl_seconds,
            max_record_bytes=self.max_record_bytes,
        )

    def GetDataPlane(
        self, request: pb.GetDataPlaneRequest, context: grpc.ServicerContext
    ) -> pb.GetDataPlaneResponse:
        if request.layout_version == 0:
            raise invalid(
                f"layout_version=0: set the storage layout the client implements "
                f"(this service: {LAYOUT_VERSION})"
            )
        if self.data_plane_url is None:
            raise failed_precondition(
                "the direct data path is off on this service (TRACE_DATA_PLANE_ENABLED=false): "
                "use PutRecords / GetRecords"
            )
        if request.layout_version != LAYOUT_VERSION:
            raise failed_precondition(
                f"layout_version={request.layout_version} but this service stores layout "
                f"{LAYOUT_VERSION}: use PutRecords / GetRecords"
            )
        return pb.GetDataPlaneResponse(
            redis_url=self.data_plane_url,
            key_prefix=self.store.prefix,
            ttl_seconds=self.store.ttl_seconds,
            max_record_bytes=self.max_record_bytes,
            layout_version=LAYOUT_VERSION,
            piece_bytes=self.store.piece_bytes,
        )

    # -- helpers ----------------------------------------------------------------------------
    def _redis(self, call):
        try:
            return call()
        except ServiceError as err:
            if err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                self.redis_errors.inc()
            raise


class _Assembly:
    """One record being received: header space + blob, grown as the data arrives.

    Memory follows the bytes received, never the declared total_bytes: a client that
    declares a large record and sends little holds little (the declared size is checked
    against max_record_bytes first, and data past it is refused)."""

    def __init__(self, key: pb.RecordKey, total: int, crc32: int) -> None:
        self.key = key
        self.total = total
        self.crc32 = crc32
        self.buffer = bytearray(HEADER_BYTES)
        self.received = 0

    def add(self, data: bytes) -> None:
        n = len(data)
        if self.received + n > self.total:
            raise invalid(f"record {self.key.sample_id!r}: more data than total_bytes={self.total}")
        self.buffer += data
        self.received += n

    def finish(self, store: RedisRecordStore) -> tuple[str, memoryview]:
        """Check length and CRC-32; return (redis key, header + blob)."""
        sid = self.key.sample_id
        if self.received != self.total:
            raise invalid(
                f"record {sid!r}: stream ended after {self.received} of total_bytes={self.total}"
            )
        value = memoryview(self.buffer)
        actual = crc32(value[HEADER_BYTES:])
        if actual != self.crc32:
            raise ServiceError(
                grpc.StatusCode.DATA_LOSS,
                f"record {sid!r}: crc32 {actual:#010x} of received data != declared {self.crc32:#010x}",
            )
        value[:HEADER_BYTES] = encode_header(actual, self.total)
        return store.key(self.key.run_id, self.key.policy_version, sid), value
